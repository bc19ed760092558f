"""AWM server starts under churn: many distinct scenarios, so most task starts of a step need a
new server (the paper's pool has 794 AWM environments; a step draws 59 starts from them), with
and without prefetching the next step's servers while the device runs the update.

    PYTHONPATH=. python benchmarks/awm_churn.py [--awm tests/data/awm_mini] [--scenarios 794]
        [--starts 64] [--pool 64] [--steps 3] [--update-s 20]

The pool directory's scenarios are copied under distinct names (`<name>_d<i>`, a temp dir) until
there are `--scenarios` of them; each step draws `--starts` code-verified tasks with replacement
(seeded) and plays their reference solutions, all at once, as a collection step does. Mode
"cold": nothing started ahead (each step's new scenarios start when their episodes reset).
Mode "prefetch": after each step the next step's draws are prefetched (`make.prefetch`, what
collect/source.py does) and the device update is stood in for by `--update-s` seconds of sleep
(the trainer host's CPUs are free while the accelerator works). Prints per mode: server start,
episode reset (the lease as the episode sees it), tool call, score, and how long each
prefetch took to have every server up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.mcp_env import play_reference, row  # noqa: E402

from actionopd_jax.envs.awm.layout import FILES, SOLUTIONS_FILE  # noqa: E402


def distinct_copy(src: Path, dst: Path, n: int) -> None:
    """`dst`: the pool of `src` with its scenarios repeated under distinct names to `n` in all."""
    names = [json.loads(line)["name"] for line in (src / FILES["scenarios"]).read_text().splitlines() if line.strip()]
    copies = {base: [f"{base}_d{i}" for i in range(n) if names[i % len(names)] == base] for base in names}
    dst.mkdir(parents=True, exist_ok=True)
    for fname in list(FILES.values()) + [SOLUTIONS_FILE]:
        if not (src / fname).is_file():
            continue
        out = []
        for line in (src / fname).read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            field = "name" if fname == FILES["scenarios"] else "scenario"
            for name in copies.get(rec[field], []):
                out.append(json.dumps({**rec, field: name}))
        (dst / fname).write_text("\n".join(out) + "\n")


async def play(make, tasks: list, out: dict[str, list[float]], reset_key: str) -> None:
    """Every task start at once, each playing its reference solution to its verifier's score."""
    from actionopd_jax.envs.reference import reference_policy

    async def one(task) -> None:
        times = await play_reference(make(task), reference_policy(task), task)
        for kind, xs in times.items():
            out[reset_key if kind == "reset" else kind].extend(xs)

    await asyncio.gather(*(one(t) for t in tasks))


def run_mode(a, awm_dir: str, cache: str, tasks: list, draws: list[list], prefetch: bool) -> dict:
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.factory import awm_env_factory

    make = awm_env_factory(EnvConfig(name="awm", awm_dir=awm_dir, mcp_pool_size=a.pool, mcp_call_timeout_s=120),
                           cache_dir=cache)
    make.runtime.start_timeout_s = 600
    pool = make.runtime.pool
    out: dict[str, list[float]] = {k: [] for k in ("reset", "reset_next", "call", "score", "success", "ready",
                                                    "step", "step_next")}
    try:
        for s, step_tasks in enumerate(draws):
            t = time.perf_counter()
            asyncio.run(play(make, step_tasks, out, "reset" if s == 0 else "reset_next"))
            out["step" if s == 0 else "step_next"].append(time.perf_counter() - t)
            print(f"{'prefetch' if prefetch else 'cold'} step {s + 1}: {len(step_tasks)} episodes in "
                  f"{time.perf_counter() - t:.1f}s, {pool.stats.starts} starts so far", flush=True)
            if s + 1 < len(draws):
                time.sleep(0.5)  # the step's releases (database resets) finish
                if prefetch:
                    t = time.perf_counter()
                    future = make.prefetch(draws[s + 1])
                    future.add_done_callback(lambda _f, t=t: out["ready"].append(time.perf_counter() - t))
                time.sleep(a.update_s)  # the device's update step
                if prefetch and not future.done():
                    print(f"  prefetch not done after the {a.update_s}s update", flush=True)
        stats = pool.stats
        return {**out, "start": list(stats.start_s), "starts": stats.starts, "evicted": stats.evicted,
                "prefetched": getattr(stats, "prefetched", 0)}
    finally:
        make.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--awm", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" / "awm_mini"))
    p.add_argument("--scenarios", type=int, default=794)
    p.add_argument("--starts", type=int, default=64)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--update-s", type=float, default=20.0)
    p.add_argument("--modes", default="cold,prefetch")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    from actionopd_jax.envs.awm.layout import load_awm

    with tempfile.TemporaryDirectory(prefix="awm-churn-") as tmp:
        awm_dir = str(Path(tmp) / "pool")
        distinct_copy(Path(a.awm), Path(awm_dir), a.scenarios)
        data = load_awm(awm_dir)
        tasks = [t for t in data.tasks() if t.payload.get("reference_solution")
                 and data.scenario_of(t).verifier(t.payload["task_idx"], "code") is not None]
        rng = np.random.default_rng(a.seed)
        draws = [[tasks[int(i)] for i in rng.integers(0, len(tasks), size=a.starts)] for _ in range(a.steps)]
        distinct = [len({t.payload["scenario"] for t in d}) for d in draws]
        print(f"{len(data.scenarios)} scenarios, {len(tasks)} code-verified tasks; distinct scenarios per step "
              f"{distinct}", flush=True)
        results = {m: run_mode(a, awm_dir, str(Path(tmp) / "db"), tasks, draws, m == "prefetch")
                   for m in a.modes.split(",")}
    print(f"\nAWM under churn: {a.scenarios} scenarios, {a.starts} task starts a step, pool {a.pool}, "
          f"{a.steps} steps, update stood in by {a.update_s:g}s (ms)\n")
    print("| mode | what | n | p50 | p99 | max |\n|---|---|---|---|---|---|")
    for mode, r in results.items():
        for name, key in (("server start", "start"), ("episode reset (lease), step 1", "reset"),
                          ("episode reset (lease), steps 2+", "reset_next"), ("tool call", "call"),
                          ("score (verifier)", "score"), ("prefetch: all next-step servers up", "ready"),
                          ("collection step wall, step 1", "step"), ("collection step wall, steps 2+", "step_next")):
            print(row(f"{mode} | {name}", r[key]))
    for mode, r in results.items():
        print(f"{mode}: starts {r['starts']} (prefetched {r['prefetched']}), evicted {r['evicted']}, "
              f"verifier success {np.mean(r['success']):.2f}")


if __name__ == "__main__":
    main()
