"""Synchronous against asynchronous ActionOPD (issue 44, collect.max_staleness) in miniature on
CPU: wall-clock of a few real trainer steps at each eta, with the staleness histogram.

    python benchmarks/async_cpu.py [--steps 5] [--etas 0,1] [--latency 0.3] [--json OUT]

What is real: the trainer (tiny Qwen3, real updates with the off-policy correction at eta >= 1),
the collector and its schedules, the small toy environment, the teacher and judge as
OpenAI-compatible HTTP servers on 127.0.0.1 through the real `openai` client. Stand-ins: the
teacher answers after `--latency` seconds (a paid API's latency; the paper's median is 12 s),
and the student writes fixed texts per state (tests/_collect_fixtures.py), so rewards do not
depend on the weights: reward and agreement are the same at every eta by construction, and
only the schedule's wall clock is measured. The first step (compiles) is left out of the means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from tests._collect_fixtures import (A, B, BAD, C, ListTaskStream, Script, ToyEnv, fixed_text_sample_fn,  # noqa: E402
                                     judge_backend, make_matcher, make_teacher, serve, teacher_backend, toy_task)


def run(eta: int, steps: int, latency: float, root: Path) -> dict:
    from actionopd_jax.baselines.wiring import collector_source_class
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
    from actionopd_jax.config.load import from_dict, replace_keys
    from actionopd_jax.sampling import Buckets
    from actionopd_jax.serve.scripted import ScriptedBackend
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    tok = load_tokenizer(build_tiny_tokenizer(root / "tok"))
    per_step = 4
    script = Script(teacher={}, student={(f"b{i}", d): [A, B, C, BAD] for i in range(per_step * (steps + 2))
                                         for d in range(4)})
    tasks = [toy_task(f"t{i}", f"b{i}") for i in range(per_step * (steps + 2))]
    plain = teacher_backend(script)

    async def slow(req):   # a remote teacher's latency
        await asyncio.sleep(latency)
        return plain._reply(req)

    teacher = ScriptedBackend("teacher", slow)
    c = {"kind": "actionopd", "num_candidates": 4, "teacher_samples": 3, "max_response_tokens": 16,
         "max_prompt_tokens": 1024, "task_starts_per_step": per_step, "concurrency": 2 * per_step, "max_decisions": 3,
         "sampler": "static", "max_staleness": eta}
    cfg = from_dict({"collect": c, "model": {"preset": "tiny"}, "train": {"steps": steps, "max_seq_len": 2048},
                     "run": {"seed": 3, "progress": False, "tensorboard": False},
                     "teacher": {"kind": "openai", "provider": "vllm", "model": "teacher",
                                 "base_url": "http://127.0.0.1:9/v1"},
                     "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}})
    run_dir = root / f"eta{eta}"
    cfg = replace_keys(cfg, **{"run.dir": str(run_dir), "checkpoint.every_steps": 0, "checkpoint.async_save": False})
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(run_dir), tokenizer_path="", process_index=0,
                        process_count=1, mesh=build_mesh(cfg))
    with serve(teacher, judge_backend()) as server:
        source = collector_source_class(cfg)(
            cfg, ctx, teacher=make_teacher(server, request_timeout_s=30.0), matcher=make_matcher(server),
            stream=ListTaskStream(tasks, per_step=per_step), env_factory=lambda task: ToyEnv(), tokenizer=tok,
            buckets=Buckets(prompt_len=(1024,), prompts=(8,), samples=(4,), max_new=(16,), max_rows=32))
        fixed = fixed_text_sample_fn(tok, script, tok.convert_tokens_to_ids("<|im_end|>"))
        if eta:
            source.sampling.sample_fn = fixed
        else:
            source.collector.sample_fn = fixed
        trainer = Trainer(cfg, run_dir=run_dir, source=source)
        history, t0 = [], time.perf_counter()
        try:
            trainer.run(on_step=lambda s, m: history.append({**m, "t": time.perf_counter() - t0}))
        finally:
            trainer.close()
            getattr(source, "close", source.collector.close)()
    later = history[1:]
    out = {"eta": eta, "steps": steps, "latency_s": latency, "wall_s": history[-1]["t"],
           "wall_after_step_1_s": history[-1]["t"] - history[0]["t"],
           "step_s_mean": float(np.mean([m["step_s"] for m in later])),
           "update_s_mean": float(np.mean([m["time_update_s"] for m in later])),
           "collect_s_mean": float(np.mean([m["time_collect_s"] for m in later])),
           "groups_kept_mean": float(np.mean([m["collect/groups_kept"] for m in history])),
           "match_rate_mean": float(np.mean([m["collect/match_rate"] for m in history])),
           "loss_last": history[-1].get("loss", float("nan"))}
    if eta:
        out["staleness"] = {a: sum(m.get(f"collect/async/staleness_{a}", 0.0) for m in history) for a in range(eta + 1)}
        out["stale_dropped"] = sum(m.get("collect/async/stale_dropped", 0.0) for m in history)
        out["sampler_busy_frac_mean"] = float(np.mean([m["collect/async/sampler_busy_frac"] for m in later]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--etas", default="0,1")
    p.add_argument("--latency", type=float, default=0.3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for eta in (int(x) for x in args.etas.split(",")):
            rows.append(run(eta, args.steps, args.latency, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["wall_after_step_1_s"]
    for r in rows:
        print(f"eta={r['eta']}: {r['wall_after_step_1_s']:.1f} s for steps 2..{r['steps']} "
              f"({base / r['wall_after_step_1_s']:.2f}x eta={rows[0]['eta']}), step {r['step_s_mean']:.2f} s "
              f"(collect {r['collect_s_mean']:.2f} + update {r['update_s_mean']:.2f}), "
              f"match rate {r['match_rate_mean']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
