"""Warm start of the student on the teacher's trajectories of the training tasks.

1. Teacher trajectories through the eval harness (baselines KD API, `teacher_trajectories`);
   the successful ones are kept (paper B.4).
2. Pretraining (experiment.pretrain_epochs > 0): next-token prediction over each kept
   conversation rendered whole (tool schemas, user turns, tool results and the teacher's own
   turns), one training row per conversation. Why: a random-init tiny student sees ~2.5k
   tokens of identical tool schemas in every prompt and must find the few tokens that say
   what to do next (the user's request, or a tool result just before the generation prompt).
   With KD alone it learns one reply for every state (measured: the same first-token
   distribution, 0.64 "Done" / 0.34 "<tool_call>", at every state after 180 KD updates);
   the dense next-token signal over whole conversations teaches it to use its context, and
   costs one row per conversation instead of one per assistant turn. It is a random student's
   stand-in for the pretraining a real student has; the data are the training tasks' public
   conversations only.
3. KD (experiment.kd_epochs > 0): cross-entropy on each assistant turn after its own prompt,
   rendered exactly like a generation prompt (baselines `kd_examples`), which aligns the
   student with how it is prompted at collection and evaluation time.
Both stages train through the one KD run (`baselines.kd.run_kd`: the trainer with the KD loss
over a `KDGroupSource`), each with its own
run directory (`<run>/warm_start/pretrain`, `<run>/warm_start/kd`: config.yaml, metrics.jsonl,
tb/, a final checkpoint, student_hf/).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np

from actionopd_jax.config import Config
from actionopd_jax.config.load import replace_keys
from actionopd_jax.experiment.phases import context_overrides, kd_phase_config, read_metric, write_phase_config
from actionopd_jax.types import Task


def conversation_examples(records: list[dict[str, Any]], tokenizer: Any, *, max_tokens: int) -> list:
    """One pretraining example per conversation: its first token is the "prompt", every later
    token (up to `max_tokens` in all) a target."""
    from actionopd_jax.baselines.kd import KDExample
    from actionopd_jax.chat import render_ids

    out = []
    for r in records:
        ids = np.asarray(render_ids(tokenizer, r["messages"], r["tools"], add_generation_prompt=False), np.int32)
        ids = ids[:max_tokens]
        out.append(KDExample(prompt_ids=ids[:1], target_ids=ids[1:], task_id=r["task_id"],
                             trial=int(r.get("trial", 0))))
    return out


def train_examples(cfg: Config, examples: list, *, student_dir: Path, tokenizer_dir: Path, run_dir: Path,
                   epochs: int, lr: float, note: str) -> dict[str, Any]:
    """`epochs` passes over `examples` with the KD cross-entropy; returns
    {"hf_dir", "steps", "losses", "examples", "target_tokens"}."""
    from actionopd_jax.baselines.kd import run_kd

    per_step = cfg.experiment.kd_examples_per_step
    steps = epochs * math.ceil(len(examples) / per_step)
    longest = max(len(e.prompt_ids) + len(e.target_ids) for e in examples)
    kcfg = kd_phase_config(cfg, student_dir=student_dir, tokenizer_dir=tokenizer_dir, run_dir=run_dir, steps=steps)
    kcfg = replace_keys(kcfg, **{"train.lr": lr, "train.max_seq_len": max(kcfg.train.max_seq_len, longest)})
    write_phase_config(kcfg, run_dir / "config.yaml", f"{note}: {len(examples)} examples, {steps} steps")
    hf_dir = run_kd(kcfg, examples, run_dir=run_dir, examples_per_step=per_step, export_hf=run_dir / "student_hf",
                    tokenizer_dir=tokenizer_dir).hf_dir
    return {"hf_dir": str(hf_dir), "steps": steps, "losses": read_metric(run_dir / "metrics.jsonl", "loss"),
            "examples": len(examples), "target_tokens": int(sum(e.target_ids.size for e in examples))}


def warm_start(cfg: Config, *, agent: Any, tasks: list[Task], tokenizer: Any, tokenizer_dir: Path,
               student_dir: Path, run_dir: Path, progress: bool) -> dict[str, Any]:
    """Trajectories -> pretraining -> KD (see the module docstring); the returned "hf_dir" is
    the warm-started student."""
    from actionopd_jax.baselines.kd import kd_examples, teacher_trajectories
    from actionopd_jax.envs.registry import make_environment

    exp = cfg.experiment
    run_dir.mkdir(parents=True, exist_ok=True)
    from actionopd_jax.train.sources import RunStop

    from actionopd_jax.train.budget import phase_ledger

    unavailable: list[str] = []
    # the teacher's episodes are paid: metered and capped by run.budget_* (train/budget.py); the
    # job's ActionOPD trainer counts on from these totals
    with phase_ledger(cfg, run_dir, "warm start (teacher trajectories)"):
        records = asyncio.run(teacher_trajectories(
            agent, tasks, lambda task: make_environment(task.env), concurrency=exp.eval_concurrency,
            keep_successful=False, out_jsonl=run_dir / "teacher_trajectories.jsonl", progress=progress,
            unavailable=unavailable))
    if unavailable:
        # an episode the endpoint could not finish is neither a demonstration nor a failure: stop,
        # naming it, rather than imitate what is left (issue 46 items 4-5: 8 of 13 were lost silently)
        from actionopd_jax.eval.runner import unavailable_summary

        raise RunStop(f"warm start: {unavailable_summary(unavailable) or f'{len(unavailable)} episode(s) not finished'}"
                      f" of {len(records) + len(unavailable)} teacher episodes (last error: {unavailable[-1]}). The "
                      f"{len(records)} finished ones are kept in {run_dir / 'teacher_trajectories.jsonl'}: fix the "
                      "endpoint and rerun the command, only the unfinished episodes are asked again")
    kept = [r for r in records if float(r["score"].get("reward", 0.0)) >= 1.0]
    if not kept:
        from collections import Counter

        ends = Counter(str(r.get("end_reason") or "?") for r in records)
        raise RunStop(f"warm start: none of the {len(records)} teacher trajectories succeeded (their ends: "
                      f"{', '.join(f'{k} x{v}' for k, v in ends.most_common())}), so there is nothing to imitate; "
                      f"{run_dir / 'teacher_trajectories.jsonl'} holds them. Check the teacher, or set "
                      "experiment.kd_epochs=0 and experiment.pretrain_epochs=0")
    out: dict[str, Any] = {"trajectories": len(records), "kept": len(kept),
                           "teacher_success": float(np.mean([float(r["score"].get("reward", 0.0)) for r in records]))}
    current = student_dir
    budget = context_overrides(cfg)["collect.max_prompt_tokens"]
    if exp.pretrain_epochs > 0:
        convs = conversation_examples(kept, tokenizer, max_tokens=budget + cfg.collect.max_response_tokens)
        out["pretrain"] = train_examples(cfg, convs, student_dir=current, tokenizer_dir=tokenizer_dir,
                                         run_dir=run_dir / "pretrain", epochs=exp.pretrain_epochs, lr=exp.kd_lr,
                                         note="next-token pretraining on the teacher's conversations")
        current = Path(out["pretrain"]["hf_dir"])
    if exp.kd_epochs > 0:
        turns = kd_examples(kept, tokenizer, max_prompt_tokens=budget, enable_thinking=cfg.collect.enable_thinking)
        out["kd"] = train_examples(cfg, turns, student_dir=current, tokenizer_dir=tokenizer_dir,
                                   run_dir=run_dir / "kd", epochs=exp.kd_epochs, lr=exp.kd_lr, note="KD on the teacher's turns")
        current = Path(out["kd"]["hf_dir"])
    out["hf_dir"] = str(current)
    return out
