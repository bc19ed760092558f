"""Offline knowledge distillation (KD) baseline, paper B.4 "successful teacher-trajectory imitation".

1. `teacher_trajectories`: run a teacher (any eval `Agent`: an OpenAI-compatible endpoint, a
   backend in process, the privileged reference policy) through the environments with the
   evaluation harness, recording each episode's public conversation; keep the successful ones
   (reward >= 1, or the environment's verifier verdict `success` where it has one: AWM). Outcome labels filter demonstrations; they are never a reward.
2. `kd_examples`: every assistant turn of a kept trajectory is one example: the prompt is the
   public history before it rendered with the chat template within the context budget (the
   same `PromptBuilder` the collector uses, so KD prompts look exactly like ActionOPD states),
   the target is the turn's own tokens as the student would generate them after that prompt:
   reasoning (when thinking is on), the message / tool call, and the end-of-turn token. User
   turns and tool observations are context only.
3. `run_kd`: cross-entropy on target tokens through the trainer's own machinery
   (`train.loop.Trainer` with `train.loss=kd`: same mesh, sharding, length buckets, microbatch
   accumulation, optimizer, checkpoints); the loss is the mean over the target tokens of the
   whole minibatch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actionopd_jax.config import Config
from actionopd_jax.config.method import check_method
# a budget stop lets the requests in flight finish (paid for); shared with `actionopd eval`
from actionopd_jax.paid_calls import IN_FLIGHT_WAIT_S, finishing_in_flight  # noqa: F401
from actionopd_jax.train.sources import StepIndexedSource
from actionopd_jax.types import Candidate, ChatMessage, Message, StateGroup, Task, ToolSchema

log = logging.getLogger(__name__)

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class KDExample:
    """One demonstrated assistant turn: the student's prompt and the tokens to imitate."""

    prompt_ids: np.ndarray  # int32, the rendered public history (ends with the generation prompt)
    target_ids: np.ndarray  # int32, the turn's tokens up to and including the end-of-turn token
    task_id: str = ""
    trial: int = 0
    message_index: int = 0  # index of the assistant message in the trajectory's conversation


# --- 1. teacher trajectories --------------------------------------------------------------------

def is_successful(record: dict[str, Any], min_reward: float = 1.0) -> bool:
    """The episode's own verdict where its environment gives one (`score.success`: AWM's
    verifier, so a judge error or an unverified faulted episode is never kept), else its reward
    against `min_reward` (BFCL, tau2)."""
    score = record.get("score") or {}
    if isinstance(score.get("success"), bool):
        return score["success"]
    reward = score.get("reward")
    return isinstance(reward, (int, float)) and float(reward) >= min_reward


async def teacher_trajectories(agent: Any, tasks: Sequence[Task], make_env: Any, *, trials: int = 1,
                               concurrency: int = 8, keep_successful: bool = True, min_reward: float = 1.0,
                               max_actions: int = 200, out_jsonl: str | Path | None = None,
                               progress: bool = False, unavailable: list[str] | None = None) -> list[dict[str, Any]]:
    """Run `agent` on every (task, trial) and return the episode records with their public
    conversations (`messages`, `tools`, `tool_sets`, `turns`; see `eval.runner.run_episode`),
    in task order then trial order. With `keep_successful`, only episodes whose
    score reward >= `min_reward` (paper: successful ones) are returned.

    `out_jsonl`: keep the records there (resumable: finished episodes are not rerun);
    default a temporary file. Episodes whose agent or user endpoint became unavailable are not
    recorded (a rerun plays them): they are logged, counted apart, and appended to `unavailable`
    (eval.runner.EpisodeFailure lines naming the endpoint) for the caller's outage decision.
    """
    from actionopd_jax.eval.runner import run_eval

    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    with tempfile.TemporaryDirectory(prefix="kd-traj-") as tmp:
        path = Path(out_jsonl) if out_jsonl is not None else Path(tmp) / "trajectories.jsonl"
        records, errors = await finishing_in_flight(run_eval(
            agent, list(tasks), make_env, path, trials=trials, concurrency=concurrency, max_actions=max_actions,
            progress=progress, record_conversation=True))
    for e in errors:
        log.warning("teacher episode not finished: %s", e)
    if unavailable is not None:
        unavailable.extend(errors)
    wanted = {(t.task_id, t.env): i for i, t in enumerate(tasks)}
    records = [r for r in records if (r["task_id"], r["env"]) in wanted]
    missing = [r["task_id"] for r in records if "messages" not in r]
    if missing:
        raise ValueError(f"{out_jsonl} holds episodes recorded without their conversation ({missing[:3]} ...); "
                         "use a fresh file for teacher trajectories")
    records.sort(key=lambda r: (wanted[(r["task_id"], r["env"])], r["trial"]))
    successful = sum(1 for r in records if is_successful(r, min_reward))
    kept = [r for r in records if is_successful(r, min_reward)] if keep_successful else records
    # one line whose counts agree with any later stop (issue 46 item 4 read "13 episodes, 13 kept",
    # then "none succeeded": every finished episode was "kept" when the caller filters itself)
    from actionopd_jax.eval.runner import unavailable_summary

    usage = getattr(agent, "usage", None) or getattr(getattr(agent, "inner", None), "usage", None)
    log.info("teacher trajectories: %d finished, %d successful (reward >= %s), %d returned; %d not finished%s%s",
             len(records), successful, min_reward, len(kept), len(errors),
             f" ({unavailable_summary(errors)})" if unavailable_summary(errors) else "",
             f"; the endpoint: {usage.http_calls} request(s), {usage.transport_retries} retried, "
             f"{usage.malformed_replies} malformed bod(ies)" if usage is not None else "")
    return kept


def load_trajectories(path: str | Path, *, keep_successful: bool = True, min_reward: float = 1.0) -> list[dict]:
    """Trajectory records from a JSONL file (as written by `teacher_trajectories(out_jsonl=...)`)."""
    from actionopd_jax.eval.runner import load_finished

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"KD trajectories file {p} does not exist")
    records = [r for r in load_finished(p) if "messages" in r]
    return [r for r in records if is_successful(r, min_reward)] if keep_successful else records


# --- 2. examples --------------------------------------------------------------------------------

def _assistant_turns(record: dict[str, Any]) -> list[tuple[int, list[ToolSchema]]]:
    """(message index, tools seen) of each assistant turn that holds an action. Invalid
    replies (an empty assistant turn: the raw text is not in the conversation) are skipped."""
    messages = record["messages"]
    if "turns" in record and "tool_sets" in record:
        return [(t["index"], record["tool_sets"][t["tools"]]) for t in record["turns"] if t.get("kind") != "Invalid"]
    tools = record.get("tools") or []
    return [(i, tools) for i, m in enumerate(messages)
            if m.get("role") == "assistant" and (m.get("content") or m.get("tool_calls"))]


def _target_message(message: ChatMessage, enable_thinking: bool) -> ChatMessage:
    out = dict(message)
    if not enable_thinking:
        # a student prompted without thinking starts after an empty reasoning block: the
        # teacher's reasoning cannot be part of what it generates
        out.pop("reasoning_content", None)
    return out


def kd_examples(trajectories: Sequence[dict[str, Any]], tokenizer: Any, *, max_prompt_tokens: int,
                enable_thinking: bool = False, end_of_turn: str = END_OF_TURN) -> list[KDExample]:
    """One example per assistant turn (see the module docstring). Turns whose protected
    context does not fit `max_prompt_tokens` are skipped (counted in the log)."""
    from actionopd_jax.chat import render_text
    from actionopd_jax.chat.prompt import PromptBuilder

    builder = PromptBuilder(tokenizer, max_prompt_tokens=max_prompt_tokens, enable_thinking=enable_thinking)
    out: list[KDExample] = []
    too_long = 0
    for record in trajectories:
        messages = record["messages"]
        for index, tools in _assistant_turns(record):
            prompt = builder.build(messages[:index], tools)
            if prompt is None:
                too_long += 1
                continue
            turn = _target_message(messages[index], enable_thinking)
            prompt_text = render_text(tokenizer, prompt.messages, tools, add_generation_prompt=True,
                                      enable_thinking=enable_thinking)
            full_text = render_text(tokenizer, prompt.messages + [turn], tools, add_generation_prompt=False,
                                    enable_thinking=enable_thinking)
            if not full_text.startswith(prompt_text):
                raise ValueError(
                    f"{record['task_id']} message {index}: the chat template does not render the assistant turn "
                    "as a continuation of the generation prompt, so its tokens are not what the student would "
                    "generate; KD needs a template whose history rendering extends the prompt")
            target_text = full_text[len(prompt_text):]
            end = target_text.find(end_of_turn)
            if end < 0:
                raise ValueError(f"{record['task_id']} message {index}: rendered turn has no {end_of_turn!r}")
            target_text = target_text[: end + len(end_of_turn)]
            target = np.asarray(tokenizer.encode(target_text, add_special_tokens=False), np.int32)
            out.append(KDExample(prompt_ids=np.asarray(prompt.ids, np.int32), target_ids=target,
                                 task_id=record["task_id"], trial=int(record.get("trial", 0)), message_index=index))
    if too_long:
        log.warning("KD: %d assistant turn(s) skipped: protected context over %d tokens", too_long, max_prompt_tokens)
    return out


def save_examples(examples: Sequence[KDExample], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for e in examples:
            f.write(json.dumps({"prompt_ids": e.prompt_ids.tolist(), "target_ids": e.target_ids.tolist(),
                                "task_id": e.task_id, "trial": e.trial, "message_index": e.message_index}) + "\n")


def load_examples(path: str | Path) -> list[KDExample]:
    out = []
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(KDExample(np.asarray(d["prompt_ids"], np.int32), np.asarray(d["target_ids"], np.int32),
                                     d.get("task_id", ""), int(d.get("trial", 0)), int(d.get("message_index", 0))))
    return out


# --- 3. training through the trainer --------------------------------------------------------------

class KDGroupSource(StepIndexedSource):
    """`train.sources.GroupSource` over fixed KD examples: step s trains on positions
    [s*E, (s+1)*E) of an endless stream of seeded per-epoch shuffles of the examples (E =
    examples_per_step), so the data of a step depends on (seed, step) only and a resumed
    run retraces an uninterrupted one. Each process takes every process_count-th example of
    the step. An example is a one-candidate group whose candidate is the demonstration."""

    pays = False   # fixed examples: no paid call, so run.budget_* has nothing to check (train/budget.py)

    def __init__(self, examples: Sequence[KDExample], *, examples_per_step: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if not examples:
            raise ValueError("KD needs at least one example (no successful teacher trajectory was kept?)")
        if examples_per_step < 1:
            raise ValueError(f"examples_per_step must be >= 1, got {examples_per_step}")
        self.examples = list(examples)
        self.per_step = int(examples_per_step)
        self.seed = int(seed)
        super().__init__()
        self.process_index, self.process_count = process_index, process_count

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 0x4B44]).permutation(len(self.examples))

    def step_indices(self, step: int) -> list[int]:
        """Example indices of `step` (all processes together)."""
        n = len(self.examples)
        out = []
        for pos in range(step * self.per_step, (step + 1) * self.per_step):
            out.append(int(self._epoch_order(pos // n)[pos % n]))
        return out

    def collect(self, step: int, policy: Any = None) -> list[StateGroup]:
        mine = self.step_indices(step)[self.process_index::self.process_count]
        groups = []
        for i in mine:
            ex = self.examples[i]
            cand = Candidate(token_ids=ex.target_ids, logprobs=np.zeros(ex.target_ids.size, np.float32),
                             text="", action=Message(""), reward=0.0)
            groups.append(StateGroup(task_id=ex.task_id, decision_index=ex.message_index, prompt_ids=ex.prompt_ids,
                                     candidates=[cand], teacher_samples=[], committed_index=0, retained=True))
        self.next_step = step + 1
        self._last = {"examples": float(len(groups)),
                      "target_tokens": float(sum(self.examples[i].target_ids.size for i in mine))}
        return groups


def kd_config(cfg: Config, *, steps: int | None = None) -> Config:
    """The run config KD trains under: loss kd, behaviour logprobs not recomputed (KD has no
    ratio), the KD source."""
    train = dataclasses.replace(cfg.train, loss="kd", old_logprobs="sampler",
                                **({} if steps is None else {"steps": int(steps)}))
    out = dataclasses.replace(cfg, train=train, collect=dataclasses.replace(cfg.collect, kind="kd"))
    check_method(out)  # only the method changed: the pairing is all there is to re-check
    return out


@dataclass
class KDResult:
    steps: int
    metrics: list[dict[str, float]]  # one dict per training step (the trainer's step metrics)
    params: Any  # trained pure-dict parameters on the run's mesh
    graphdef: Any
    model_config: Any  # actionopd_jax.model.Qwen3Config
    run_dir: Path
    hf_dir: Path | None = None
    checkpoint_step: int | None = None
    updates: int = 0  # optimizer updates done by the end (the optimizer's own step count)

    @property
    def losses(self) -> list[float]:
        return [m.get("loss", float("nan")) for m in self.metrics]

    def model(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.params)


def run_kd(cfg: Config, examples: Sequence[KDExample], *, run_dir: str | Path, steps: int | None = None,
           examples_per_step: int | None = None, export_hf: str | Path | None = None,
           tokenizer_dir: str | Path | None = None) -> KDResult:
    """THE KD training run (the KD baseline, the main job's warm start and compare all train
    through it): the student of `cfg` (model, mesh, optimizer, batching sections) on
    `examples` with the KD cross-entropy, `steps` steps (default cfg.train.steps) of
    `examples_per_step` examples each (default cfg.kd.examples_per_step, else
    cfg.train.minibatch_rows: one optimizer update per step). Each step is one pass of
    minibatch updates over its examples; the run is `Trainer.run` (progress bar, metrics.jsonl /
    TensorBoard in `run_dir`, checkpoints per checkpoint.*, the final state saved).

    With `export_hf`, the trained student is also written as an HF directory (config.json +
    safetensors, plus the tokenizer files of `tokenizer_dir`) that a later run can start from
    (model.hf_path). A run stopped early (SIGTERM) raises after saving.
    """
    import jax

    from actionopd_jax.train.loop import Trainer, host_scalar

    kcfg = kd_config(cfg, steps=steps)
    per_step = examples_per_step or getattr(getattr(cfg, "kd", None), "examples_per_step", 0) or kcfg.train.minibatch_rows
    source = KDGroupSource(examples, examples_per_step=per_step, seed=kcfg.run.seed,
                           process_index=jax.process_index(), process_count=jax.process_count())
    history: list[dict[str, float]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        history.append(metrics)
        log.info("KD step %d: loss %.4f over %d target tokens", step, metrics.get("loss", float("nan")),
                 int(metrics.get("tokens", 0)))

    trainer = Trainer(kcfg, run_dir=run_dir, source=source)
    try:
        code = trainer.run(on_step)
        if code != 0:   # SIGTERM / preemption or a budget stop: its state is saved, no traceback
            from actionopd_jax.train.sources import StoppedEarly

            why = getattr(trainer, "stop_message", "") or "SIGTERM / preemption"
            raise StoppedEarly(f"the KD trainer in {run_dir} stopped early at step {trainer.step} ({why}); its state "
                               "is saved there", code)
        result = KDResult(steps=trainer.step, metrics=history, params=trainer.state["params"],
                          graphdef=trainer.graphdef, model_config=trainer.qcfg, run_dir=Path(run_dir),
                          checkpoint_step=trainer.step, updates=int(host_scalar(trainer.state["step"])))
    finally:
        trainer.close()
    if export_hf is not None:
        result.hf_dir = export_student(result, export_hf, tokenizer_dir=tokenizer_dir)
    return result


def export_student(result: KDResult, out_dir: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Write the trained student as an HF directory (and copy the tokenizer files next to it)."""
    import shutil

    from actionopd_jax.model.weights import save_hf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(result.model(), result.model_config, out)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name not in ("config.json",) and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
    return out


def collect_examples(agent: Any, tasks: Sequence[Task], make_env: Any, tokenizer: Any, *, max_prompt_tokens: int,
                     trials: int = 1, concurrency: int = 8, enable_thinking: bool = False,
                     out_jsonl: str | Path | None = None) -> tuple[list[dict], list[KDExample]]:
    """teacher_trajectories + kd_examples in one call (synchronous)."""
    records = asyncio.run(teacher_trajectories(agent, tasks, make_env, trials=trials, concurrency=concurrency,
                                               out_jsonl=out_jsonl))
    return records, kd_examples(records, tokenizer, max_prompt_tokens=max_prompt_tokens,
                                enable_thinking=enable_thinking)
