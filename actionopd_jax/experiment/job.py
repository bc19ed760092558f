"""The main job, phase by phase (what `actionopd train` runs with experiment.enabled=true).

1. setup: the task subset and its train / held-out split, the tokenizer, the starting
   student (random init, or model.hf_path), and the teacher: the embedded privileged
   reference teacher (teacher.kind=none) or the configured remote endpoint;
2. warm start on the teacher's trajectories of the training tasks: next-token pretraining on
   the whole conversations, then KD on the teacher's turns (experiment/warm_start.py);
3. evaluation of the warm-started student on the held-out tasks ("before");
4. ActionOPD steps on the training tasks, then one collection with the final policy;
5. evaluation of the final student (exported from the ActionOPD checkpoint) ("after");
6. report.md + PNG plots, and a summary table printed at the end.

Run directory `runs/<utc>-<name>/`: config.yaml (resolved), train.log, metrics.jsonl + tb/ +
checkpoints/ (ActionOPD), actionopd_config.yaml, warm_start/ (pretrain/ and kd/ runs), eval/,
report.md, report/*.png, report/summary.json.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.load import replace_keys

log = logging.getLogger("actionopd_jax.main_job")

PHASES = ("setup", "warm start (pretraining + KD)", "evaluation before ActionOPD", "ActionOPD", "evaluation after ActionOPD",
          "report")


def _phase(index: int) -> None:
    print(f"\n[main job {index + 1}/{len(PHASES)}] {PHASES[index]}", file=sys.stderr, flush=True)


def run_dir_for(cfg: Config, args: Any) -> Path:
    from actionopd_jax.train.reporting import new_run_dir

    if getattr(args, "resume", None) is not None:
        raise ConfigError("the main job runs from start to end and does not resume; rerun it (the teacher "
                          "cache and compile cache make a rerun cheaper), or resume a plain trainer run "
                          "with experiment.enabled=false")
    explicit = getattr(args, "run_dir", None) or cfg.run.dir
    if explicit:
        used = [d for d in ("checkpoints", "warm_start") if (Path(explicit) / d).is_dir()]
        if used:  # refused before any phase runs: its trainers would collide with the saved steps
            raise ConfigError(f"{explicit} already holds a main-job run ({', '.join(used)}/); the main job does "
                              "not resume: pass a new --run-dir (or remove that directory)")
    return Path(explicit) if explicit else new_run_dir(cfg.run.root, cfg.run.name, int(time.time()))


def student_description(cfg: Config, student_dir: Path) -> str:
    import json

    hf = json.loads((student_dir / "config.json").read_text())
    shape = (f"hidden {hf['hidden_size']}, {hf['num_hidden_layers']} layers, {hf['num_attention_heads']} head(s) x "
             f"{hf['head_dim']}, vocab {hf['vocab_size']}")
    if cfg.model.hf_path:
        return f"checkpoint {cfg.model.hf_path} ({shape})"
    return f"random-init Qwen3 ({shape}; init seed {cfg.experiment.student.init_seed})"


def warm_start_summary(ws: dict[str, Any], exp: Any) -> str:
    parts = [f"{ws['kept']}/{ws['trajectories']} teacher trajectories succeeded"]
    for key, what in (("pretrain", "conversations"), ("kd", "teacher turns")):
        stage = ws.get(key)
        if stage:
            losses = stage["losses"]
            parts.append(f"{'pretraining' if key == 'pretrain' else 'KD'}: {stage['examples']} {what}, "
                         f"{stage['steps']} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else key)
    return "; ".join(parts) + f" (lr {exp.kd_lr:g}, {exp.kd_examples_per_step} examples per update)"


def run_main_job(cfg: Config, args: Any) -> int:
    from actionopd_jax.experiment import teacher as teacher_lib

    t_total = time.perf_counter()
    run_dir = run_dir_for(cfg, args)
    teacher_lib.check_endpoint_settings(cfg)
    teacher_lib.require_secrets(cfg)  # before anything is built: a missing key fails in a second
    from actionopd_jax.train.reporting import setup_logging, write_config

    setup_logging(run_dir, primary=True)
    for chatty in ("httpx", "httpx2", "openai", "aiohttp.access"):  # one line per HTTP request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    write_config(run_dir, cfg.to_yaml())
    log.info("main job: run directory %s", run_dir)
    timings: dict[str, float] = {}
    opened: list[Any] = []  # the teacher endpoint, closed whatever happens
    try:
        summary = _run_phases(cfg, run_dir, timings, opened)
    finally:
        for resource in opened:
            resource.close()
    timings["total"] = time.perf_counter() - t_total
    summary["timings"] = {k: round(v, 1) for k, v in timings.items()}
    _phase(5)
    from actionopd_jax.experiment.report import summary_text, write_report

    t0 = time.perf_counter()
    paths = write_report(run_dir, summary)
    summary["timings"]["report"] = round(time.perf_counter() - t0, 1)
    text = summary_text(summary)
    (run_dir / "report" / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    print(f"report: {paths['markdown']}", flush=True)
    return 0


def _run_phases(cfg: Config, run_dir: Path, timings: dict[str, float], opened: list[Any]) -> dict[str, Any]:
    """Phases 1-5; returns the summary dict. The teacher endpoint is appended to `opened`."""
    from actionopd_jax.chat import load_tokenizer
    from actionopd_jax.experiment import assets, heldout, phases
    from actionopd_jax.experiment import teacher as teacher_lib
    from actionopd_jax.experiment.tasks import job_tasks

    exp, progress = cfg.experiment, cfg.run.progress
    # 1. setup
    _phase(0)
    t0 = time.perf_counter()
    split = job_tasks(exp)
    tok_dir = assets.tokenizer_dir(cfg, split.train + split.heldout)
    tokenizer = load_tokenizer(tok_dir)
    student_dir = assets.initial_student(cfg, tokenizer, run_dir / "student_init")
    endpoint = teacher_lib.start_teacher(cfg, split.train)
    opened.append(endpoint)
    matching = teacher_lib.matching_label(cfg, endpoint.privileged)
    log.info("teacher: %s; matching: %s", endpoint.label, matching)
    log.info("tasks: %d training %s, %d held out %s", len(split.train), [t.task_id for t in split.train],
             len(split.heldout), [t.task_id for t in split.heldout])
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "teacher": {"label": endpoint.label, "privileged": endpoint.privileged, "base_url": endpoint.base_url,
                    "model": endpoint.model, "matching": matching},
        "tasks": {"category": exp.bfcl_category, "classes": list(exp.bfcl_classes), "pool": split.pool_size,
                  "train": [t.task_id for t in split.train], "heldout": [t.task_id for t in split.heldout]},
        "student": {"description": student_description(cfg, student_dir), "initial_dir": str(student_dir),
                    "tokenizer": str(tok_dir)},
    }
    teacher_cfg = replace_keys(cfg, **teacher_lib.teacher_overrides(cfg, endpoint))
    timings["setup"] = time.perf_counter() - t0

    # 2. warm start: pretraining + KD on the teacher's trajectories of the training tasks
    _phase(1)
    t0 = time.perf_counter()
    if exp.kd_epochs > 0 or exp.pretrain_epochs > 0:
        from actionopd_jax.baselines.wiring import endpoint_agent
        from actionopd_jax.experiment.warm_start import warm_start

        ws = warm_start(teacher_cfg, agent=endpoint_agent(teacher_cfg), tasks=split.train, tokenizer=tokenizer,
                        tokenizer_dir=tok_dir, student_dir=student_dir, run_dir=run_dir / "warm_start",
                        progress=progress)
        ws["summary"] = warm_start_summary(ws, exp)
        summary["warm_start"] = ws
        start_dir = Path(ws["hf_dir"])
    else:
        summary["warm_start"] = None
        start_dir = student_dir
    timings["warm_start"] = time.perf_counter() - t0

    # 3. held-out evaluation before ActionOPD
    _phase(2)
    t0 = time.perf_counter()
    before = heldout.evaluate_student(start_dir, tok_dir, split.heldout, run_dir / "eval" / "before", cfg=cfg,
                                      label="student before ActionOPD", progress=progress)
    timings["eval_before"] = time.perf_counter() - t0

    # 4. ActionOPD
    _phase(3)
    t0 = time.perf_counter()
    pcfg = phases.opd_phase_config(teacher_cfg, student_dir=start_dir, tokenizer_dir=tok_dir, run_dir=run_dir,
                                   train_tasks=split.train, heldout_tasks=split.heldout,
                                   teacher=teacher_lib.teacher_overrides(cfg, endpoint))
    phases.write_phase_config(pcfg, run_dir / "actionopd_config.yaml",
                              f"ActionOPD phase, teacher: {endpoint.label}")
    opd = phases.actionopd_phase(pcfg, train_tasks=split.train, run_dir=run_dir, progress=progress)
    final_dir = phases.export_final_student(run_dir, opd["checkpoint_step"], run_dir / "student_final", tok_dir)
    opd["final_student"] = str(final_dir)
    summary["actionopd"] = opd
    from actionopd_jax.train.spend_report import spend_history

    spent = spend_history(run_dir / "metrics.jsonl")   # the paid models' totals (collect/spend.py)
    summary["spend"] = spent[-1] if spent else {}
    from actionopd_jax.train.async_report import ages, async_history

    overlapped = async_history(run_dir / "metrics.jsonl")   # collect.max_staleness >= 1 (issue 44)
    if overlapped:
        summary["async"] = {"max_staleness": int(pcfg.collect.max_staleness), "trained_by_staleness": ages(overlapped),
                            "dropped": sum(h.get("stale_dropped", 0.0) for h in overlapped),
                            "update_waited_s": sum(h.get("wait_s", 0.0) for h in overlapped)}
    summary["teacher"]["requests"] = endpoint.requests
    timings["actionopd"] = time.perf_counter() - t0

    # 5. held-out evaluation after ActionOPD
    _phase(4)
    t0 = time.perf_counter()
    after = heldout.evaluate_student(final_dir, tok_dir, split.heldout, run_dir / "eval" / "after", cfg=cfg,
                                     label="student after ActionOPD", progress=progress)
    timings["eval_after"] = time.perf_counter() - t0
    summary["eval"] = {"before": before, "after": after}
    return summary
