"""`actionopd compare [--config configs/compare/compare_tiny.yaml] [key=value ...]`: the equal-budget
comparison of ActionOPD, KD and the ablations (compare_plan.py says what is compared and how
the budget is held equal; compare_runner.py runs it; compare_report.py writes compare.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from actionopd_jax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd compare", description=__doc__)
    p.add_argument("--config", help="compare preset: a run config with a compare: section "
                                    "(e.g. configs/compare/compare_tiny.yaml; default: the main job's defaults)")
    p.add_argument("overrides", nargs="*", help="compare.key=value (methods, seeds, updates, ...) or any "
                                                "section.key=value of the run config")
    p.add_argument("--run-dir", help="run directory (default runs/<utc>-<compare.name>)")
    p.add_argument("--check", action="store_true",
                   help="validate the preset and print the plan (the main job's, with its prompt room, and the "
                        "comparison's methods and budget); runs nothing, writes nothing")
    p.add_argument("--devices", type=int, default=0, help="with --check: plan for this many devices")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        from actionopd_jax.experiment.compare_plan import load_compare

        cfg, settings = load_compare(args.config, args.overrides)
        if args.check:
            return check(cfg, settings, devices=args.devices)
        return compare(cfg, settings, args, command="actionopd compare " + shlex.join(argv))
    except ConfigError as e:
        print(f"actionopd compare: config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"actionopd compare: {e}", file=sys.stderr)
        return 2


def check(cfg, settings, *, devices: int = 0) -> int:
    """`actionopd compare --check`: every run of the comparison starts from the main job's warm
    start and trains on its split under its prompt budget (compare_runner.py), so the main
    job's check (experiment/check.py: the plan, the tasks, the prompt room) is the runs' check;
    then what the comparison adds."""
    from actionopd_jax.experiment import teacher as teacher_lib
    from actionopd_jax.experiment.check import check_main_job
    from actionopd_jax.experiment.compare_plan import METHODS, eval_name, not_runnable

    code = check_main_job(cfg, devices)  # load_compare holds experiment.enabled=true
    privileged = teacher_lib.teacher_mode(cfg) == "reference"
    skipped = {m: why for m in settings.methods if (why := not_runnable(METHODS[m], privileged_teacher=privileged))}
    runs = [m for m in settings.methods if m not in skipped]
    print(f"compare    {len(runs)} method(s) x {len(settings.seeds)} seed(s) = {len(runs) * len(settings.seeds)} "
          f"run(s) of {settings.updates} update(s) each (at most {settings.step_cap} collection steps): "
          f"{', '.join(runs) or 'none'}; held-out evaluations: "
          f"{', '.join(eval_name(t) for t in settings.eval_user_turns)}")
    for m, why in skipped.items():
        print(f"compare    {m}: not run here: {why}")
    if not runs:
        print("config valid, but no method of compare.methods can run in this setting (see above)")
        return 1
    return code


def compare(cfg, settings, args, *, command: str) -> int:
    import dataclasses
    import json
    import logging

    from actionopd_jax.compile_cache import enable_compile_cache
    from actionopd_jax.experiment import compare_report
    from actionopd_jax.experiment import teacher as teacher_lib
    from actionopd_jax.experiment.compare_runner import run_compare
    from actionopd_jax.train.reporting import new_run_dir, setup_logging, write_config

    run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(cfg.run.root, settings.name, int(time.time()))
    teacher_lib.check_endpoint_settings(cfg)
    teacher_lib.require_secrets(cfg)
    setup_logging(run_dir, primary=True)
    for chatty in ("httpx", "httpx2", "openai", "aiohttp.access"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    write_config(run_dir, cfg.to_yaml())
    (run_dir / "compare_settings.json").write_text(json.dumps(dataclasses.asdict(settings), indent=1))
    enable_compile_cache(cfg.run.compile_cache_dir)  # as every train / eval / serve
    summary = run_compare(cfg, settings, run_dir)
    print("\n[compare 4/4] report", file=sys.stderr, flush=True)
    path = compare_report.write(summary, run_dir, command=command)
    print(compare_report.summary_text(summary), flush=True)
    print(f"report: {path}", flush=True)
    ok = [r for r in summary["results"] if r.get("status") == "ok"]
    return 0 if ok else 1
