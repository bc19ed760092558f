"""The two training phases of the main job, each a run of the ordinary trainer.

The config of each phase is derived from the job's config by a few explicit replacements
(`kd_phase_config`, `opd_phase_config`) and written next to its outputs, so what ran is on
disk. Everything else (N, K, lambda, clip, optimizer, batching, checkpoints) is the job's
train.* / collect.* as configured.

- warm start (warm_start.py): next-token pretraining and KD on the teacher's trajectories, run
  dir `<run>/kd/`, the result exported as an HF directory the ActionOPD phase starts from.
- ActionOPD: `Trainer` over the state-group collector (`collect.ActionOPDGroupSource`) fed
  with the job's training tasks, in the run directory itself (metrics.jsonl, tb/,
  checkpoints/). `JobSource` records, per step, the mean reward, match rate and invalid
  rate of the step's candidates for the report.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from actionopd_jax.config import Config
from actionopd_jax.config.load import replace_keys
from actionopd_jax.types import Invalid, StateGroup, Task

log = logging.getLogger(__name__)


def context_overrides(cfg: Config) -> dict[str, Any]:
    budget = cfg.experiment.max_prompt_tokens or cfg.collect.max_prompt_tokens
    need = budget + cfg.collect.max_response_tokens
    return {"collect.max_prompt_tokens": budget, "train.max_seq_len": max(cfg.train.max_seq_len, need)}


def kd_phase_config(cfg: Config, *, student_dir: Path, tokenizer_dir: Path, run_dir: Path, steps: int) -> Config:
    from actionopd_jax.baselines.kd import kd_config

    per_step = cfg.experiment.kd_examples_per_step
    micro = math.gcd(per_step, cfg.train.microbatch_rows)
    over = {"model.hf_path": str(student_dir), "model.tokenizer": str(tokenizer_dir), "train.lr": cfg.experiment.kd_lr,
            "train.minibatch_rows": per_step, "train.microbatch_rows": micro, "kd.examples_per_step": per_step,
            "run.dir": str(run_dir), "checkpoint.dir": "", "checkpoint.every_steps": 0,
            "experiment.enabled": False, **context_overrides(cfg)}
    return kd_config(replace_keys(cfg, **over), steps=steps)


def opd_phase_config(cfg: Config, *, student_dir: Path, tokenizer_dir: Path, run_dir: Path, train_tasks: list[Task],
                     heldout_tasks: list[Task], teacher: dict[str, Any]) -> Config:
    """The job's config for the ActionOPD phase. Its tasks are an explicit disjoint split
    (env.task_ids / env.heldout_task_ids), so the written config trains on the job's training
    tasks only, and the BFCL eval-overlap rule (envs/splits.py) accepts it without the opt-in."""
    over = {"model.hf_path": str(student_dir), "model.tokenizer": str(tokenizer_dir),
            "collect.kind": "actionopd", "train.loss": "actionopd", "env.name": "bfcl",
            "env.domains": [cfg.experiment.bfcl_category], "collect.task_starts_per_step": len(train_tasks),
            "env.task_ids": [t.task_id for t in train_tasks], "env.heldout_task_ids": [t.task_id for t in heldout_tasks],
            "run.dir": str(run_dir), "experiment.enabled": False, **context_overrides(cfg), **teacher}
    if cfg.experiment.opd_lr > 0:
        over["train.lr"] = cfg.experiment.opd_lr
    return replace_keys(cfg, **over)


def write_phase_config(cfg: Config, path: Path, note: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {note}\n# Written by the main job (actionopd_jax/experiment); a record of what ran.\n"
                    + cfg.to_yaml())


def sampler_buckets(cfg: Config, samples: int, max_new: int):
    from actionopd_jax.sampling.buckets import Buckets

    prompts = (1, 2, 4, 8)
    s = 1 << (max(1, samples) - 1).bit_length()
    return Buckets(prompt_len=tuple(cfg.experiment.prompt_buckets), prompts=prompts, samples=(s,),
                   max_new=(max_new,), max_rows=prompts[-1] * s)


def read_metric(path: Path, key: str) -> list[float]:
    import json

    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if key in rec:
                out.append(float(rec[key]))
    return out


# --- ActionOPD -------------------------------------------------------------------------------------

def step_stats(groups: list[StateGroup]) -> dict[str, float]:
    """Per-step numbers of the report, over the candidates of every group whose supervision
    was usable (masked "unavailable" groups carry no reward):
    reward_mean   mean r_lambda of all candidates (invalid -1, valid no match 0, matches >= 1);
    match_rate    fraction of candidates matching at least one teacher sample;
    invalid_rate  fraction of candidates that are not one valid action;
    partial_match_rate  fraction of candidates matching some but not all teacher samples
                  (0 < c < M: where the frequency bonus lambda changes the reward);
    committed_reward_mean  mean reward of the committed (environment-advancing) candidates;
    unavailable_rate  fraction of groups masked for unavailable supervision (paper A.3);
    truncated_rate  fraction of all candidates cut at the response limit (Invalid)."""
    scored = [g for g in groups if g.drop_reason != "unavailable"]
    cands = [c for g in scored for c in g.candidates]
    committed = [g.candidates[g.committed_index].reward for g in scored if g.committed_index >= 0]
    n = max(len(cands), 1)
    return {
        "groups": float(len(groups)),
        "groups_retained": float(sum(g.retained for g in groups)),
        "candidates": float(len(cands)),
        "reward_mean": float(sum(c.reward for c in cands) / n) if cands else float("nan"),
        "match_rate": float(sum(any(v == "match" for v in c.verdicts) for c in cands) / n) if cands else float("nan"),
        "invalid_rate": float(sum(isinstance(c.action, Invalid) for c in cands) / n) if cands else float("nan"),
        "partial_match_rate": float(sum(0 < sum(v == "match" for v in c.verdicts) < len(c.verdicts)
                                        for c in cands) / n) if cands else float("nan"),
        "committed_reward_mean": float(np.mean(committed)) if committed else float("nan"),
        "unavailable_rate": float(len(groups) - len(scored)) / len(groups) if groups else float("nan"),
        "truncated_rate": float(np.mean([c.finish_reason == "length" for g in groups for c in g.candidates]))
        if groups else float("nan"),
    }


class JobSource:
    """The collector source with the job's per-step statistics (`history`, one dict per
    collection, in step order) added to the trainer's metrics under job/."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.history: list[dict[str, float]] = []

    def collect(self, step: int, policy: Any) -> list[StateGroup]:
        groups = self.inner.collect(step, policy)
        stats = {"step": float(step), **step_stats(groups)}
        last = getattr(self.inner, "last", None)
        if last is not None and last.trajectories:
            rewards = [float(t.score.get("reward", 0.0)) for t in last.trajectories]
            stats["episode_success"] = float(np.nanmean(rewards))
            stats["decisions_per_episode"] = float(np.mean([t.decisions for t in last.trajectories]))
        self.history.append(stats)
        log.info("ActionOPD collection at step %d: reward %.3f, match %.3f, invalid %.3f over %d candidates",
                 step, stats["reward_mean"], stats["match_rate"], stats["invalid_rate"], int(stats["candidates"]))
        return groups

    @property
    def meters(self) -> Any:
        """The collector's spend meters (the trainer's budget stop counts a given-up step on them)."""
        return getattr(self.inner, "meters", None)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def stop_background(self) -> None:
        """An asynchronous collector's loop stopped, its thread joined (issue 44): the trainer's
        run end and compare's budget stop call it, and without it here they reached nothing, so
        draws ahead ran on, unmetered, until close."""
        getattr(self.inner, "stop_background", lambda: None)()

    def metrics(self) -> dict[str, float]:
        out = dict(self.inner.metrics())
        if self.history:
            out.update({f"job/{k}": v for k, v in self.history[-1].items() if k != "step"})
        return out

    def close(self) -> None:
        """The inner source's close: its collector, then the env pools it built."""
        self.inner.close()


def actionopd_source(pcfg: Config, *, tasks: list[Task], run_dir: Path, name: str) -> JobSource:
    """The ActionOPD phase's source (the main job's and compare's): the state-group collector
    over `tasks` in a stream seeded by run.seed, with the job's sampler buckets and per-step
    statistics (`JobSource`)."""
    from actionopd_jax.baselines.wiring import collector_source_class
    from actionopd_jax.envs.tasks import TaskSource, TaskStream
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    ctx = SourceContext(model_config=model_config(pcfg), run_dir=str(run_dir), tokenizer_path=pcfg.model.tokenizer,
                        process_index=0, process_count=1, mesh=build_mesh(pcfg))
    stream = TaskStream([(TaskSource(name, tasks), pcfg.collect.task_starts_per_step)], seed=pcfg.run.seed)
    inner = collector_source_class(pcfg)(pcfg, ctx, stream=stream,
                                 buckets=sampler_buckets(pcfg, pcfg.collect.num_candidates,
                                                         pcfg.collect.max_response_tokens))
    return JobSource(inner)


def actionopd_phase(pcfg: Config, *, train_tasks: list[Task], run_dir: Path, progress: bool) -> dict[str, Any]:
    """ActionOPD steps with the collector, then one more collection with the final policy (no
    update) so the curve ends with the trained student. Returns {"history", "checkpoint_step",
    "checkpoint_dir"}."""
    import jax

    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.sources import Policy

    source = actionopd_source(pcfg, tasks=train_tasks, run_dir=run_dir, name="bfcl:job-train")
    trainer = Trainer(pcfg, run_dir=run_dir, source=source)
    from actionopd_jax.train.budget import carry_phase_spend

    carry_phase_spend(trainer.ledger, run_dir / "warm_start")   # its teacher episodes count against run.budget_*
    try:
        code = trainer.run()
        if code != 0:   # SIGTERM / preemption or a budget stop: its state is saved, no traceback
            from actionopd_jax.train.sources import StoppedEarly

            why = getattr(trainer, "stop_message", "") or "SIGTERM / preemption"
            raise StoppedEarly(f"the ActionOPD trainer in {run_dir} stopped early at step {trainer.step} ({why}); "
                               "its state is saved there", code)
        final = Policy(trainer.graphdef, trainer.state["params"], trainer.qcfg, trainer.step,
                       key=jax.random.fold_in(trainer.base_key, trainer.step))
        measure_within_budget(pcfg, trainer, source, final)  # measurement only: no update follows
        return {"history": source.history, "checkpoint_step": trainer.step,
                "checkpoint_dir": str(trainer.ckpt.directory)}
    finally:
        trainer.close()
        source.close()


def measure_within_budget(pcfg: Config, trainer: Any, source: Any, final: Any) -> None:
    """The collection with the final policy, its teacher and judge calls on the run's ledger
    like every step's (run.budget_*, train/budget.py); a cap it would pass ends the curve at the
    last training step instead (the trained student is saved either way)."""
    from actionopd_jax import paid_calls
    from actionopd_jax.train import budget as run_budget

    why = run_budget.step_refusal(pcfg, trainer.ledger, trainer.step, pays=True)
    previous = paid_calls.install(trainer.ledger)
    try:
        if why is None:
            source.collect(trainer.step, final)
    except paid_calls.BudgetReached as e:
        why = str(e)
    finally:
        paid_calls.install(previous)
    if why:
        log.warning("the final policy's measurement collection is skipped (the curve ends at step %d): %s",
                    trainer.step, why)


def export_final_student(run_dir: Path, step: int, out_dir: Path, tokenizer_dir: Path) -> Path:
    """The ActionOPD checkpoint (read back from disk) as an HF directory with its tokenizer."""
    import shutil

    from actionopd_jax.train.export_cli import export

    export(run_dir, out_dir, step)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out_dir / f.name)
    return out_dir
