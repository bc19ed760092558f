"""`actionopd compare`: the shared setup and warm start, then one run per (method, seed).

1. setup (as the main job): the task split (training tasks cut to `compare.train_user_turns`
   user turns, 0: whole; held-out tasks once per entry of `compare.eval_user_turns`, through
   the BFCL payload max_turns), the tokenizer, the random-init student, the embedded
   privileged reference teacher over HTTP;
2. ONE warm start (pretraining + KD, experiment/warm_start.py) shared by every run, cached
   under the main job's cache directory by a hash of everything it depends on, and evaluated
   once on the held-out tasks ("warm start only");
3. per method and seed (seed by seed, every method within a seed, so that methods share the
   host's spells of load), from that warm start, `compare.updates` optimizer updates
   (compare_plan: the budget), then the held-out evaluations of the final policy
   (experiment/heldout.py: BFCL accuracy with the official checker + per-decision agreement),
   one per held-out task set (whole tasks, first user turn).
   A run that fails is recorded (error.txt, result.json status "failed") and the next runs;
4. compare.md, compare.png, compare.json (compare_report.py) and the summary table.

Run directory runs/<utc>-<name>/: config.yaml, compare_settings.json, train.log,
warm_start.json, warm_start_eval/, runs/<method>-s<seed>/ (config, metrics.jsonl, checkpoints/,
student_final/, eval/, result.json), compare.md, compare.png, compare.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.load import replace_keys
from actionopd_jax.experiment.compare_plan import (CompareSettings, Method, UpdateBudget, eval_name, not_runnable,
                                                   resolve_method)
from actionopd_jax.types import Task

log = logging.getLogger("actionopd_jax.compare")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Shared:
    """What every run starts from."""

    cfg: Config
    teacher_cfg: Config  # cfg pointed at the teacher endpoint
    teacher_over: dict[str, Any]
    settings: CompareSettings
    train: list[Task]
    heldout: dict[str, list[Task]]  # evaluation name ("whole", "first1") -> its held-out tasks
    tokenizer: Any
    tokenizer_dir: Path
    start_dir: Path  # the warm-started student (HF directory)
    trajectories: Path  # the teacher's trajectories of the training tasks (JSONL)
    privileged: bool

    @property
    def lr(self) -> float:
        return self.settings.lr or self.cfg.experiment.opd_lr or self.cfg.train.lr


def cut_tasks(tasks: list[Task], max_turns: int) -> list[Task]:
    if not max_turns:
        return list(tasks)
    return [dataclasses.replace(t, payload={**(t.payload or {}), "max_turns": int(max_turns)}) for t in tasks]


# --- the shared warm start -------------------------------------------------------------------------

def warm_start_key(cfg: Config, train: list[Task], student_dir: Path) -> str:
    """Everything the warm start depends on: the config without run.*, the tasks, the student."""
    tree = cfg.to_dict()
    tree.pop("run", None)
    tree.get("experiment", {}).get("reference", {}).pop("latency_s", None)   # delays answers, changes none
    weights = hashlib.sha256((student_dir / "model.safetensors").read_bytes()).hexdigest()
    blob = json.dumps({"cfg": tree, "tasks": [(t.task_id, t.payload) for t in train], "student": weights},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shared_warm_start(cfg: Config, teacher_cfg: Config, *, train: list[Task], tokenizer: Any, tokenizer_dir: Path,
                      student_dir: Path, progress: bool) -> dict[str, Any]:
    """The warm start of every run, from the cache when an identical one finished before."""
    from actionopd_jax.baselines.wiring import endpoint_agent
    from actionopd_jax.experiment.assets import cache_root
    from actionopd_jax.experiment.job import warm_start_summary
    from actionopd_jax.experiment.warm_start import warm_start

    root = cache_root(cfg.experiment) / "compare_warm_start" / warm_start_key(cfg, train, student_dir)
    done = root / "warm_start.json"
    if done.is_file():
        ws = json.loads(done.read_text())
        if Path(ws["hf_dir"]).is_dir():
            ws["cached"] = True
            say(f"  shared warm start from the cache: {root}")
            return ws
    if root.exists():  # an unfinished earlier attempt: its trainers' checkpoints would collide
        import shutil

        shutil.rmtree(root)
    ws = warm_start(teacher_cfg, agent=endpoint_agent(teacher_cfg), tasks=train, tokenizer=tokenizer,
                    tokenizer_dir=tokenizer_dir, student_dir=student_dir, run_dir=root, progress=progress)
    ws["summary"] = warm_start_summary(ws, cfg.experiment)
    ws["trajectories_jsonl"] = str(root / "teacher_trajectories.jsonl")
    done.write_text(json.dumps(ws, indent=1))
    ws["cached"] = False
    return ws


def deterministic_reference(cfg: Config) -> Config:
    """`cfg` with a deterministic reference teacher (`cfg` itself when it already is one)."""
    r = cfg.experiment.reference
    if not (r.alternative or r.wrong):
        return cfg
    return replace_keys(cfg, **{"experiment.reference.alternative": 0.0, "experiment.reference.wrong": 0.0,
                                "experiment.reference.seed": 0})


def setup(cfg: Config, settings: CompareSettings, run_dir: Path, opened: list[Any]) -> tuple[Shared, dict[str, Any]]:
    from actionopd_jax.chat import load_tokenizer
    from actionopd_jax.experiment import assets
    from actionopd_jax.experiment import teacher as teacher_lib
    from actionopd_jax.experiment.tasks import job_tasks

    exp = cfg.experiment
    split = job_tasks(exp)
    train = cut_tasks(split.train, settings.train_user_turns)
    heldout = {eval_name(n): cut_tasks(split.heldout, n) for n in settings.eval_user_turns}
    tok_dir = assets.tokenizer_dir(cfg, split.train + split.heldout)
    tokenizer = load_tokenizer(tok_dir)
    student_dir = assets.initial_student(cfg, tokenizer, run_dir / "student_init")
    endpoint = teacher_lib.start_teacher(cfg, train)
    opened.append(endpoint)
    over = teacher_lib.teacher_overrides(cfg, endpoint)
    teacher_cfg = replace_keys(cfg, **over)
    say(f"  teacher: {endpoint.label}; tasks: {len(train)} training ("
        f"{eval_name(settings.train_user_turns)}), {len(split.heldout)} held out, evaluated as {list(heldout)} "
        f"(BFCL {exp.bfcl_category} {list(exp.bfcl_classes)})")
    # The warm start's demonstrations come from the deterministic reference teacher even when
    # the methods' teacher disagrees with itself (experiment.reference): it is every run's
    # shared start, not a method under comparison, and a noisy teacher would only thin it.
    ws_cfg, ws_teacher_cfg = deterministic_reference(cfg), teacher_cfg
    if endpoint.privileged and ws_cfg is not cfg:
        ws_endpoint = teacher_lib.start_teacher(ws_cfg, train)
        opened.append(ws_endpoint)
        ws_teacher_cfg = replace_keys(ws_cfg, **teacher_lib.teacher_overrides(ws_cfg, ws_endpoint))
    ws = shared_warm_start(ws_cfg, ws_teacher_cfg, train=train, tokenizer=tokenizer, tokenizer_dir=tok_dir,
                           student_dir=student_dir, progress=cfg.run.progress)
    (run_dir / "warm_start.json").write_text(json.dumps(ws, indent=1))
    shared = Shared(cfg=cfg, teacher_cfg=teacher_cfg, teacher_over=over, settings=settings, train=train,
                    heldout=heldout, tokenizer=tokenizer, tokenizer_dir=tok_dir, start_dir=Path(ws["hf_dir"]),
                    trajectories=Path(ws["trajectories_jsonl"]), privileged=endpoint.privileged)
    info = {"teacher": endpoint.label, "train": [t.task_id for t in train], "heldout": [t.task_id for t in split.heldout],
            "train_user_turns": settings.train_user_turns, "evals": list(heldout), "warm_start": ws.get("summary", ""),
            "warm_start_cached": ws["cached"], "warm_start_dir": str(Path(ws["hf_dir"]))}
    return shared, info


# --- one run -----------------------------------------------------------------------------------------

def _updates_done(trainer: Any) -> int:
    from actionopd_jax.train.loop import host_scalar

    return int(host_scalar(trainer.state["step"]))


@dataclasses.dataclass
class Spent:
    """What `train_to_budget` reports of a run."""

    updates: int = 0
    http_calls: float = 0.0
    step_s: list[float] = dataclasses.field(default_factory=list)  # each trainer step's wall clock
    async_sums: dict[str, float] = dataclasses.field(default_factory=dict)  # collect/async/* summed over steps


ASYNC_SUMMED = ("stale_dropped", "wait_s", "swap_wait_s")  # plus staleness_<age>: groups trained at that age


def train_to_budget(trainer: Any, source: Any, s: CompareSettings, describe: Callable[[], str]) -> Spent:
    """Trainer steps until `s.updates` optimizer updates are done (or the step cap). An
    asynchronous source's draws still in flight are then stopped (their thread joined), before
    the save: they would never be trained on, and would take the CPU from the save and export
    that the run's wall clock includes."""
    out = Spent()
    try:
        while out.updates < s.updates and trainer.step < s.step_cap:
            source.remaining = s.updates - out.updates
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            out.step_s.append(round(time.perf_counter() - t0, 3))
            trainer.writer.write(trainer.step, metrics)
            out.http_calls += float(metrics.get("collect/teacher/http_calls", 0.0))
            for key, value in metrics.items():
                short = key.removeprefix("collect/async/")
                if short != key and (short in ASYNC_SUMMED or short.startswith("staleness_")):
                    out.async_sums[short] = out.async_sums.get(short, 0.0) + float(value)
            out.updates = _updates_done(trainer)
            say(f"    step {trainer.step}: {int(metrics.get('updates', 0))} update(s), {out.updates}/{s.updates} done; "
                f"{describe()}")
    finally:
        getattr(source, "stop_background", lambda: None)()
    trainer.save()
    trainer.ckpt.wait()
    return out


def method_config(shared: Shared, method: Method, seed: int, rdir: Path) -> Config:
    """The run config of one (method, seed): the main job's ActionOPD phase config (same
    optimizer, minibatch, lr, task starts) with the method's overrides."""
    from actionopd_jax.experiment import phases

    s = shared.settings
    pcfg = phases.opd_phase_config(shared.teacher_cfg, student_dir=shared.start_dir, tokenizer_dir=shared.tokenizer_dir,
                                   run_dir=rdir, train_tasks=shared.train,
                                   heldout_tasks=next(iter(shared.heldout.values())),
                                   teacher=shared.teacher_over)
    starts = {"collect.task_starts_per_step": s.task_starts_per_step} if s.task_starts_per_step else {}
    return replace_keys(pcfg, **{**method.overrides, **starts, "run.seed": seed, "train.lr": shared.lr,
                                 "train.steps": s.step_cap, "checkpoint.every_steps": 0})


def run_collector_method(shared: Shared, method: Method, seed: int, rdir: Path) -> dict[str, Any]:
    """ActionOPD or one of its ablations: collection steps until the update budget is spent."""
    from actionopd_jax.experiment import phases
    from actionopd_jax.train.loop import Trainer

    pcfg = method_config(shared, method, seed, rdir)
    phases.write_phase_config(pcfg, rdir / "config.yaml", f"compare: {method.label}, seed {seed}")
    job = phases.actionopd_source(pcfg, tasks=shared.train, run_dir=rdir, name="bfcl:compare-train")
    source = UpdateBudget(job, minibatch_rows=pcfg.train.minibatch_rows, seed=seed)
    trainer = Trainer(pcfg, run_dir=rdir, source=source)
    try:
        spent = train_to_budget(trainer, source, shared.settings, lambda: (
            f"reward {job.history[-1]['reward_mean']:.3f}, match {job.history[-1]['match_rate']:.3f}, "
            f"partial match (0 < c < K) {job.history[-1]['partial_match_rate']:.3f}"))
        steps = trainer.step
    finally:
        trainer.close()
        job.close()
    final = phases.export_final_student(rdir, steps, rdir / "student_final", shared.tokenizer_dir)
    K = pcfg.collect.teacher_samples
    out = {"final_dir": str(final), "updates": spent.updates, "steps": steps, "lr": shared.lr,
           "teacher_samples": int(K * sum(h["groups"] for h in job.history)), "teacher_requests": int(spent.http_calls),
           "groups_over_budget": source.trimmed_groups, "step_s": spent.step_s, "history": job.history,
           "max_staleness": pcfg.collect.max_staleness}
    if spent.async_sums:
        out["async"] = spent.async_sums
    return out


def run_kd_method(shared: Shared, method: Method, seed: int, rdir: Path) -> dict[str, Any]:
    """KD as paper B.4 runs it (baselines/kd_fresh.py): every step, kd.trials fresh teacher
    episodes per task start (the training tasks, started as ActionOPD starts them), the
    successful ones' teacher turns trained with ActionOPD's optimizer settings and minibatch
    rows, until the same update budget is spent."""
    from actionopd_jax.baselines.kd import kd_config
    from actionopd_jax.baselines.kd_fresh import FreshKDSource
    from actionopd_jax.baselines.wiring import endpoint_agent
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.envs.tasks import TaskSource, TaskStream
    from actionopd_jax.experiment import phases
    from actionopd_jax.train.loop import Trainer

    kcfg = kd_config(method_config(shared, method, seed, rdir))
    phases.write_phase_config(kcfg, rdir / "config.yaml", f"compare: {method.label}, seed {seed}")
    stream = TaskStream([(TaskSource("bfcl:compare-train", shared.train), kcfg.collect.task_starts_per_step)],
                        seed=seed)
    inner = FreshKDSource(lambda: endpoint_agent(kcfg), stream, lambda task: make_environment(task.env),
                          shared.tokenizer, out_dir=rdir / "kd", trials=kcfg.kd.trials, min_reward=kcfg.kd.min_reward,
                          max_prompt_tokens=kcfg.collect.max_prompt_tokens,
                          enable_thinking=kcfg.collect.enable_thinking, concurrency=shared.cfg.experiment.eval_concurrency)
    source = UpdateBudget(inner, minibatch_rows=kcfg.train.minibatch_rows, seed=seed)
    trainer = Trainer(kcfg, run_dir=rdir, source=source)
    try:
        spent = train_to_budget(trainer, source, shared.settings, lambda: (
            f"{int(inner.metrics()['kd/episodes_kept'])}/{int(inner.metrics()['kd/episodes'])} fresh teacher "
            f"episodes successful, {int(inner.metrics()['kd/examples'])} teacher turns"))
        steps = trainer.step
    finally:
        trainer.close()
    final = phases.export_final_student(rdir, steps, rdir / "student_final", shared.tokenizer_dir)
    return {"final_dir": str(final), "updates": spent.updates, "steps": steps, "lr": shared.lr,
            "step_s": spent.step_s, "teacher_samples": inner.teacher_samples, "teacher_requests": inner.teacher_samples,
            "groups_over_budget": source.trimmed_groups,
            "note": f"{inner.episodes} fresh teacher episodes ({kcfg.kd.trials} per task start per step), "
                    "successful ones trained on"}


RUNNERS: dict[str, Callable[[Shared, Method, int, Path], dict[str, Any]]] = {
    "actionopd": run_collector_method, "kd": run_kd_method}


def evaluate_all(shared: Shared, student_dir: Path, out_dir: Path, label: str) -> dict[str, dict[str, float]]:
    """Every held-out evaluation of one student: {evaluation name: metrics}."""
    from actionopd_jax.experiment.heldout import evaluate_student

    return {name: evaluate_student(student_dir, shared.tokenizer_dir, tasks, out_dir / name, cfg=shared.cfg,
                                   label=f"{label} ({name})", progress=shared.cfg.run.progress)
            for name, tasks in shared.heldout.items()}


def headline(evals: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{name}: agreement {ev['agreement_rate']:.3f}, BFCL accuracy {ev['bfcl_accuracy']:.3f}"
                     for name, ev in evals.items())


def run_one(shared: Shared, method: Method, seed: int, rdir: Path) -> dict[str, Any]:
    """Train, export, evaluate; a failure anywhere is recorded, never raised."""
    rdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"method": method.name, "label": method.label, "seed": seed, "dir": str(rdir)}
    t0 = time.perf_counter()
    try:
        runner = RUNNERS.get(method.kind)
        if runner is None:
            raise ConfigError(f"no runner for method kind {method.kind!r}")
        out.update(runner(shared, method, seed, rdir))
        out["train_s"] = round(time.perf_counter() - t0, 1)
        t1 = time.perf_counter()
        out["eval"] = evaluate_all(shared, Path(out["final_dir"]), rdir / "eval", f"{method.name} seed {seed}")
        out["eval_s"] = round(time.perf_counter() - t1, 1)
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one failing run must not lose the others
        out["status"] = "failed"
        out["error"] = f"{type(e).__name__}: {e}"
        (rdir / "error.txt").write_text(traceback.format_exc())
        log.exception("compare run %s seed %d failed", method.name, seed)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    (rdir / "result.json").write_text(json.dumps({k: v for k, v in out.items() if k != "history"}, indent=1,
                                                 default=str))
    return out


def run_compare(cfg: Config, settings: CompareSettings, run_dir: Path) -> dict[str, Any]:
    """Every phase; returns the summary (also written as compare.json by the report)."""
    t_total = time.perf_counter()
    if cfg.train.ppo_epochs != 1:
        raise ConfigError("compare counts one optimizer update per minibatch: set train.ppo_epochs=1")
    methods = [resolve_method(m, settings) for m in settings.methods]
    opened: list[Any] = []
    results: list[dict[str, Any]] = []
    try:
        say("\n[compare 1/4] setup and the shared warm start")
        shared, info = setup(cfg, settings, run_dir, opened)
        say("\n[compare 2/4] held-out evaluation of the warm start (every run starts here)")
        start_eval = evaluate_all(shared, shared.start_dir, run_dir / "warm_start_eval", "warm start")
        say(f"  warm start: {headline(start_eval)}")
        runnable = [m for m in methods if not not_runnable(m, privileged_teacher=shared.privileged)]
        total = len(runnable) * len(settings.seeds)
        say(f"\n[compare 3/4] {total} runs: {[m.name for m in runnable]} x seeds {list(settings.seeds)}, "
            f"{settings.updates} optimizer updates each, lr {shared.lr:g}")
        for m in methods:
            reason = not_runnable(m, privileged_teacher=shared.privileged)
            if reason:
                results.append({"method": m.name, "label": m.label, "status": "not run", "reason": reason})
                say(f"  {m.name}: not run ({reason})")
        # seed by seed, every method within a seed: each method's runs meet the same spells of
        # load on a shared host, so their wall clocks compare (the report's wall-clock ratio)
        for i, (seed, m) in enumerate(((seed, m) for seed in settings.seeds for m in runnable), start=1):
            say(f"  [{i}/{total}] {m.name} seed {seed} ...")
            r = run_one(shared, m, seed, run_dir / "runs" / f"{m.name}-s{seed}")
            results.append(r)
            if r["status"] == "ok":
                say(f"  [{i}/{total}] {m.name} seed {seed}: {r['updates']} updates; held out {headline(r['eval'])} "
                    f"({r['wall_s']:.0f} s)")
            else:
                say(f"  [{i}/{total}] {m.name} seed {seed}: FAILED: {r['error']} (see {r['dir']}/error.txt)")
        order = {m.name: i for i, m in enumerate(methods)}   # the report lists methods in compare.methods' order
        results.sort(key=lambda r: order[r["method"]])   # stable: seeds stay in their order
    finally:
        for resource in opened:
            resource.close()
    return {"run_dir": str(run_dir), "settings": dataclasses.asdict(settings), "info": info,
            "warm_start_eval": start_eval, "results": results, "lr": shared.lr,
            "minibatch_rows": cfg.train.minibatch_rows, "teacher_samples_per_state": cfg.collect.teacher_samples,
            "wall_s": round(time.perf_counter() - t_total, 1)}
