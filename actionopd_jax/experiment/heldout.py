"""Evaluation of a student on the held-out tasks, greedy, through the eval harness.

Two measurements, both from the same student directory:

1. Episodes (`eval.run_eval` with a `BackendAgent` over our `ModelBackend`): the student plays
   each held-out task to the end; BFCL's official checker scores it (accuracy). A tiny
   student is expected to score 0 here; that number is reported as it is.
2. Decisions at reference states (finer; it can move when accuracy cannot): the privileged
   reference policy plays each held-out task, and at every state on its path the student
   is asked for its next action (greedy). Per decision:
     valid      the reply is one valid action (a schema-valid tool call or a message);
     same_tool  it is the same kind of action as the reference (and, for a tool call, the
                same tool name);
     agreement  it matches the reference action under the matcher's rules (same tool and
                canonically equal arguments, or a normalised-equal message).
   The reported rates are means over all decisions of all held-out tasks. The reference
   states are the same for every student, so before/after numbers compare like with like.
   Also from the episodes: `episode_valid_rate`, the fraction of the student's own actions
   that were valid.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from actionopd_jax.config import Config
from actionopd_jax.types import Action, Invalid, Message, Observation, Task, ToolCall

log = logging.getLogger(__name__)

MAX_REFERENCE_DECISIONS = 200


async def reference_states(task: Task) -> list[tuple[Observation, Action]]:
    """(observation, reference action) at every decision of the reference path of `task`."""
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.envs.reference import reference_policy

    env = make_environment(task.env)
    policy = reference_policy(task)
    obs = await env.reset(task)
    states: list[tuple[Observation, Action]] = []
    while not obs.done and len(states) < MAX_REFERENCE_DECISIONS:
        action = policy.next_action(obs)
        states.append((obs, action))
        obs, _ = await env.step(action)
    return states


def _same_tool(student: Action, reference: Action) -> bool:
    if isinstance(student, ToolCall) and isinstance(reference, ToolCall):
        return student.name == reference.name
    return isinstance(student, Message) and isinstance(reference, Message)


def _describe(action: Action) -> str:
    if isinstance(action, ToolCall):
        return f"{action.name}({json.dumps(action.arguments, sort_keys=True)})"
    if isinstance(action, Message):
        return f"message: {action.text[:80]}"
    return f"invalid: {getattr(action, 'reason', '')[:80]}"


async def decision_agreement(agent: Any, tasks: list[Task], *, concurrency: int, out_jsonl: Path,
                             progress: bool) -> dict[str, float]:
    from tqdm.auto import tqdm

    from actionopd_jax.eval.agents import ContextTooLong
    from actionopd_jax.matching import Matcher

    matcher = Matcher(None)  # rules only (see the module docstring)
    per_task = await asyncio.gather(*(reference_states(t) for t in tasks))
    items = [(t, i, obs, ref) for t, states in zip(tasks, per_task) for i, (obs, ref) in enumerate(states)]
    sem = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(total=len(items), desc="eval decisions", unit="dec", disable=not progress, leave=False)

    async def one(task: Task, index: int, obs: Observation, ref: Action) -> dict[str, Any]:
        async with sem:
            try:
                student = await agent.act(obs, task=task, trial=0)
            except ContextTooLong as e:
                student = Invalid(f"context too long: {e}")
            verdict = await matcher.verdict(student, ref, messages=obs.messages, tools=obs.tools)
            bar.update(1)
            return {"task_id": task.task_id, "decision": index, "reference": _describe(ref),
                    "student": _describe(student), "valid": not isinstance(student, Invalid),
                    "same_tool": _same_tool(student, ref), "agreement": verdict == "match"}

    rows = await asyncio.gather(*(one(*it) for it in items))
    bar.close()
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    out_jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = max(len(rows), 1)
    return {"decisions": float(len(rows)), "valid_rate": sum(r["valid"] for r in rows) / n,
            "same_tool_rate": sum(r["same_tool"] for r in rows) / n,
            "agreement_rate": sum(r["agreement"] for r in rows) / n}


class StudentAgent:
    """The student, greedy, through our model backend in process: the request `BackendAgent`
    makes, read with the collector's rule that a reply cut at max_tokens is not an action
    (Invalid), so a student that rambles until the token limit is not credited with a
    "message"."""

    def __init__(self, backend: Any, *, max_tokens: int):
        self._backend, self._max_tokens = backend, max_tokens
        self.name = backend.model_name

    async def act(self, obs: Observation, *, task: Task, trial: int) -> Action:
        from actionopd_jax.chat import action_from_openai_message
        from actionopd_jax.eval.agents import backend_choice

        choice = await backend_choice(self._backend, self.name, obs, temperature=0.0, max_tokens=self._max_tokens,
                                      seed=trial)
        if choice.finish_reason == "length":
            return Invalid(f"reply cut at max_tokens={self._max_tokens}")
        message = {"role": "assistant", "content": choice.content, "tool_calls": choice.tool_calls}
        return action_from_openai_message(message, obs.tools, role="student")


def episode_numbers(records: list[dict[str, Any]]) -> dict[str, float]:
    kinds = [t.get("kind") for r in records for t in r.get("turns", [])]
    n = max(len(records), 1)
    return {
        "episodes": float(len(records)),
        "bfcl_accuracy": sum(float(r["score"].get("official", r["score"].get("reward", 0.0))) for r in records) / n,
        "bfcl_strict_accuracy": sum(float(r["score"].get("strict", 0.0)) for r in records) / n,
        "episode_actions": float(len(kinds)),
        "episode_valid_rate": (sum(k != "Invalid" for k in kinds) / len(kinds)) if kinds else float("nan"),
    }


def evaluate_student(student_dir: Path, tokenizer_dir: Path, tasks: list[Task], out_dir: Path, *, cfg: Config,
                     label: str, progress: bool) -> dict[str, float]:
    """Both measurements for the student in `student_dir`; outputs under `out_dir`
    (episodes.jsonl, decisions.jsonl, and the harness's results.json / report.md / scores.png)."""
    from actionopd_jax.chat import load_tokenizer
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.eval.metrics import summarize
    from actionopd_jax.eval.report import write_report
    from actionopd_jax.eval.runner import run_eval
    from actionopd_jax.experiment.phases import sampler_buckets
    from actionopd_jax.model.weights import load_hf
    from actionopd_jax.sampling import Sampler
    from actionopd_jax.sampling.loading import end_token_ids
    from actionopd_jax.serve.model_backend import ModelBackend

    exp = cfg.experiment
    tokenizer = load_tokenizer(tokenizer_dir)
    qcfg, model = load_hf(student_dir)
    sampler = Sampler(model, qcfg, eos_ids=end_token_ids(tokenizer),
                      buckets=sampler_buckets(cfg, 1, exp.eval_max_new_tokens))
    backend = ModelBackend(sampler, tokenizer, model_name=label, max_context=qcfg.max_position_embeddings,
                           default_max_tokens=exp.eval_max_new_tokens, max_batch_requests=8,
                           enable_thinking=cfg.collect.enable_thinking)
    agent = StudentAgent(backend, max_tokens=exp.eval_max_new_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    episodes_path = out_dir / "episodes.jsonl"
    if episodes_path.exists():
        episodes_path.unlink()  # each evaluation of the job is a fresh measurement

    async def both():
        records, errors = await run_eval(agent, tasks, lambda t: make_environment(t.env), episodes_path,
                                         concurrency=exp.eval_concurrency, progress=progress,
                                         record_conversation=True)
        agreement = await decision_agreement(agent, tasks, concurrency=exp.eval_concurrency,
                                             out_jsonl=out_dir / "decisions.jsonl", progress=progress)
        return records, errors, agreement

    try:
        records, errors, agreement = asyncio.run(both())
    finally:
        backend.batcher.close()
    write_report(out_dir, summarize(records, ks=(1,)), agent=label, errors=errors)
    out = {**episode_numbers(records), **agreement, "episode_errors": float(len(errors))}
    (out_dir / "summary.json").write_text(json.dumps(out, indent=2))
    log.info("evaluation of %s on %d held-out tasks: %s", label, len(tasks),
             ", ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out
