"""The training loop: collect -> advantages -> one PPO epoch of updates -> metrics -> checkpoint.

Step s (0-based) collects with the current parameters (one behaviour snapshot), computes
the behaviour log-probabilities of every row with the trainer's own forward before any
update (paper A.4: old and new policies are scored the same way), then walks the
minibatches once. A checkpoint labelled k holds the state after k completed steps, so a
resumed run continues with step k. Every random choice of the loop is drawn from
(run.seed, step), never from wall-clock or arrival order, so a resumed run retraces an
uninterrupted one.
"""

from __future__ import annotations

import copy
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from tqdm import tqdm

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.schema import experiment_changes
from actionopd_jax import paid_calls
from actionopd_jax.train import budget as run_budget
from actionopd_jax.train.spend_report import progress_fields
from actionopd_jax.train import distributed
from actionopd_jax.train.advantages import assign_advantages
from actionopd_jax.train.batching import (bucket_length, pack_minibatch, pack_shared_minibatch, plan_minibatches,
                                          rows_from_groups, share_prompts, update_microbatches)
from actionopd_jax.checkpoint import Checkpointer, CheckpointError
from actionopd_jax.train.preflight import check_batch_layout
from actionopd_jax.train.reporting import MetricsWriter
from actionopd_jax.checkpoint import record_tokenizer
from actionopd_jax.train.setup import build_mesh, build_train_step, initial_params, model_config
from actionopd_jax.train.sources import GroupSource, Policy, SourceContext

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM: "stopped early, state saved"
BUDGET_EXIT_CODE = run_budget.BUDGET_EXIT_CODE   # run.budget_*: the next request batch would pass the cap; saved


def host_scalar(x) -> float:
    """A replicated device scalar as a float (works when the array spans several processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(np.asarray(x))


SourceFactory = Callable[[SourceContext], GroupSource]


class Trainer:
    """The collect -> update loop over the group source its caller chooses.

    `source` is a built `GroupSource`, or a factory called once with this run's
    `SourceContext` (model config, mesh, run directory), after the parameters are placed and
    before a resumed task-iterator state is loaded into it; a source built so is the trainer's,
    and `close()` closes it. Picking one from the config (`collect.kind`) is the caller's
    business (actionopd_jax.baselines.wiring.build_source)."""

    def __init__(self, cfg: Config, *, run_dir: str | Path, source: GroupSource | SourceFactory,
                 resume: str | int | None = None, force: bool = False, allow_unverified: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.primary = distributed.is_primary()
        self.mesh = build_mesh(cfg)
        self._check_batch_layout()
        ckpt_dir = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.ckpt = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save,
                                 allow_unverified=allow_unverified)
        self.base_key = jax.random.key(cfg.run.seed)
        self._stop_requested = False
        self._last_saved: int | None = None

        if resume is None and self.ckpt.steps():
            # a fresh run here would train from step 0 and then collide with the saved steps
            raise CheckpointError(
                f"{self.ckpt.directory} already holds checkpoints (steps {self.ckpt.steps()}): resume them "
                f"(`actionopd train ... --resume`, the default when the run directory has checkpoints), or "
                f"start a new run in another run directory / checkpoint.dir")
        saved_meta = self._resume_meta(resume, force) if resume is not None else None
        self.qcfg = model_config(cfg, saved_meta["model_config"] if saved_meta else None)
        self.step_fn = build_train_step(cfg, self.qcfg, self.mesh)
        self.graphdef = self.step_fn.graphdef
        data_state = None
        if saved_meta is not None:
            requested = None if resume == "latest" else int(resume)
            restored = self.ckpt.restore(self.step_fn.abstract_state(), requested)
            # newer steps (skipped as unreadable, or an explicit older STEP) are set aside so
            # the resumed run can save those step numbers again
            self.ckpt.set_aside_after(restored.step)
            self.state = {"params": restored.params, "opt_state": restored.opt_state,
                          "step": jax.device_put(np.int32(restored.meta["updates"]), self.step_fn.replicated)}
            self.step = restored.step
            self._last_saved = restored.step
            data_states = restored.meta.get("data") or []
            data_state = self._pick_data_state(data_states)
            log.info("resumed from step %d of %s", restored.step, self.ckpt.directory)
        else:
            self.state = self.step_fn.init_state(initial_params(cfg, self.qcfg, self.mesh))
            self.step = 0

        ctx = SourceContext(model_config=self.qcfg, run_dir=str(self.run_dir),
                            tokenizer_path=cfg.model.tokenizer or cfg.model.hf_path,
                            process_index=jax.process_index(), process_count=jax.process_count(),
                            mesh=self.mesh)
        if self.primary:  # the run directory alone is then enough to evaluate or serve a checkpoint
            record_tokenizer(self.run_dir, ctx.tokenizer_path)
        built = not hasattr(source, "collect")   # a factory (class docstring)
        self.source = source(ctx) if built else source
        self._own_source = self.source if built else None
        if data_state is not None:
            self.source.load_state_dict(data_state)
        # every paid call's ledger and run.budget_* as a hard cap (paid_calls.py, train/budget.py)
        self.ledger = run_budget.ledger_from(cfg)
        self._load_ledger(saved_meta)
        self.writer = MetricsWriter(self.run_dir, enabled=self.primary, tensorboard=cfg.run.tensorboard,
                                    wandb_project=cfg.run.wandb_project, run_name=self.run_dir.name,
                                    config=cfg.to_dict())

    # ---- set-up helpers --------------------------------------------------------------------
    def _check_batch_layout(self) -> None:
        check_batch_layout(self.cfg, dict(self.mesh.shape), jax.process_count())  # also run by --check

    def _resume_meta(self, resume, force: bool) -> dict[str, Any]:
        steps = self.ckpt.steps()
        if not steps:
            raise CheckpointError(f"--resume: no finished checkpoint in {self.ckpt.directory}")
        candidates = list(reversed(steps)) if resume == "latest" else [int(resume)]
        meta, errors = None, []
        for s in candidates:
            try:
                meta = self.ckpt.read_meta(s)
                break
            except Exception as e:  # noqa: BLE001 - unreadable record: try the previous step
                errors.append(f"step {s}: {type(e).__name__}")
        if meta is None:
            raise CheckpointError(f"no readable checkpoint record in {self.ckpt.directory} ({errors}); "
                                  f"available steps: {steps}")
        changes = experiment_changes(meta.get("config", {}), self.cfg.to_dict())
        if changes and not force:
            raise ConfigError("the config differs from the checkpoint's in ways that change the "
                              "experiment:\n  " + "\n  ".join(changes) +
                              "\nrestore the original values, or pass --force to resume anyway")
        if changes:
            log.warning("resuming with --force despite config changes: %s", "; ".join(changes))
        return meta

    def _load_ledger(self, meta: dict | None) -> None:
        saved = (meta or {}).get("paid_calls") or []
        if saved:
            self.ledger.load(saved[jax.process_index() % len(saved)])
        elif meta is not None and getattr(self.source, "meters", None) is not None:
            # a checkpoint from before the ledger: the collector's meters held the spend
            for role, m in self.source.meters.by_role.items():
                t = self.ledger.totals[role]
                t.requests, t.prompt_tokens, t.completion_tokens = m.requests, m.prompt_tokens, m.completion_tokens
                t.cached_prompt_tokens, t.spend_usd = m.cached_prompt_tokens, m.spend_usd

    def _pick_data_state(self, states: list) -> dict | None:
        if not states:
            return None
        i = jax.process_index()
        if len(states) != jax.process_count():
            log.warning("checkpoint holds task-iterator states of %d processes, this run has %d; "
                        "process %d takes state %d", len(states), jax.process_count(), i, i % len(states))
        return states[i % len(states)]

    # ---- the loop --------------------------------------------------------------------------
    def run(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> int:
        """Train to train.steps (saving, logging, stopping on SIGTERM); `on_step(step, metrics)`
        sees every step's metrics. Returns 0, or SIGTERM_EXIT_CODE when stopped early."""
        cfg = self.cfg
        restore_handler = self._install_sigterm_handler()
        bar = tqdm(total=cfg.train.steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.primary and cfg.run.progress), dynamic_ncols=True)
        code = 0
        self.stop_message = ""   # why the run stopped early (run.budget_*), for the CLI
        previous_ledger = paid_calls.install(self.ledger)
        try:
            while self.step < cfg.train.steps:
                reason = run_budget.step_refusal(cfg, self.ledger, self.step, pays=self._pays())
                if reason:
                    code = self._budget_stop(reason)
                    break
                self.ckpt.record_finished()   # the last save's manifest, once it is final
                before = copy.deepcopy(self.source.state_dict())
                try:
                    metrics = self.train_step()
                except paid_calls.BudgetReached as e:
                    # the step is given up: the source goes back to where the step began (a resumed
                    # run retraces it; the paid-for teacher samples come from the teacher cache)
                    # and its meters count what the step's requests cost
                    self.source.load_state_dict(before)
                    run_budget.meter_partial_step(self.source, self.ledger)
                    code = self._budget_stop(str(e))
                    break
                if on_step is not None:
                    on_step(self.step, metrics)
                every = cfg.checkpoint.every_steps
                stop = distributed.any_process(self._stop_requested) or self.ckpt.reached_preemption(self.step)
                if stop or (every and self.step % every == 0) or self.step == cfg.train.steps:
                    self.save()
                if self.step % max(cfg.run.log_every, 1) == 0 or self.step == cfg.train.steps:
                    self.writer.write(self.step, metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}",
                                tok_s=f"{metrics.get('train_tokens_per_s', 0.0):.0f}", **progress_fields(metrics))
                if stop:
                    log.warning("stop requested (SIGTERM / preemption): saved step %d, exiting", self.step)
                    code = SIGTERM_EXIT_CODE
                    break
        finally:   # asynchronous collection (issue 44): no episode runs on, unmetered, after the run
            getattr(self.source, "stop_background", lambda: None)()
            paid_calls.install(previous_ledger)
            bar.close()
            self.ckpt.wait()
            restore_handler()
        return code

    def _budget_stop(self, reason: str) -> int:
        """Save, log the spend so far (metrics.jsonl: spend.md reads it) and say why."""
        self.save()
        self.stop_message = reason
        self.writer.write(self.step, {"budget_stop": 1.0, **self._spend_metrics()})
        log.error("%s", reason)
        return BUDGET_EXIT_CODE

    def _collect_within_budget(self, step: int, policy: Policy):
        """The step's collection; when any process's next request batch would pass its share of
        run.budget_*, every process gives the step up together (none goes on into the update's
        collectives alone)."""
        refused = None
        try:
            groups = self.source.collect(step, policy)
        except paid_calls.BudgetReached as e:
            refused = e
        if self.ledger.capped and distributed.any_process(refused is not None):
            raise refused or paid_calls.BudgetReached(
                f"budget: another process's next request batch would pass its share of run.budget_*, so the run "
                f"stops within step {step}. Saved at step {step}; raise the cap and rerun the same command",
                role="teacher", spent_usd=self.ledger.spend_usd, reserve_usd=0.0)
        return groups

    def _pays(self) -> bool:
        """Whether this run's source asks a paid model (KD on fixed examples does not)."""
        return run_budget.calls_paid_models(self.cfg) and getattr(self.source, "pays", True)

    def _spend_metrics(self) -> dict[str, float]:
        return run_budget.spend_metrics(self.source, self.ledger)

    def train_step(self) -> dict[str, float]:
        """One collection step and its updates; returns the step's metrics."""
        step = self.step
        t0 = time.perf_counter()
        policy = Policy(self.graphdef, self.state["params"], self.qcfg, step,
                        key=jax.random.fold_in(self.base_key, step))
        groups = self._collect_within_budget(step, policy)
        t_collect = time.perf_counter() - t0
        adv_stats = assign_advantages(groups, loss=self.cfg.train.loss)
        rows = rows_from_groups(groups, need_teacher_logp=self.cfg.train.loss == "opd", step=step)  # + stale rows
        t1 = time.perf_counter()
        upd = self.update_epoch(step, rows)
        t_update = time.perf_counter() - t1
        self.step = step + 1
        source_metrics = getattr(self.source, "metrics", lambda: {})()
        out = {**{f"collect/{k}": v for k, v in source_metrics.items()}, **adv_stats, **upd,
               "time_collect_s": t_collect, "time_update_s": t_update,
               "step_s": time.perf_counter() - t0}
        out["train_tokens_per_s"] = upd.get("real_tokens", 0.0) / max(t_update, 1e-9)
        if getattr(self.source, "meters", None) is None and self._pays():
            out.update(self._spend_metrics())   # KD / OPD: the ledger is their meter
        return out

    def update_epoch(self, step: int, rows) -> dict[str, float]:
        """One PPO epoch over `rows` (this process's share) in minibatch updates."""
        t, fn = self.cfg.train, self.step_fn
        procs = jax.process_count()
        too_long = [r for r in rows if r.length > t.max_seq_len]
        if too_long:
            log.warning("dropping %d row(s) longer than train.max_seq_len=%d", len(too_long), t.max_seq_len)
            rows = [r for r in rows if r.length <= t.max_seq_len]
        local_b = t.microbatch_rows // procs
        shared = fn.settings.shared_prompt  # N candidates per packed row, or 0
        stale = self.cfg.collect.max_staleness >= 1   # asynchronous collection: mark stale rows
        units = share_prompts(rows) if shared else rows
        micro = update_microbatches(self.cfg)   # shared = collect.num_candidates where train.shared_prompt
        resp_multiple = t.logits_chunk if t.logits_chunk > 0 else 16
        if shared and t.logits_chunk > 0:  # N regions together must be whole logits chunks
            resp_multiple = max(16, t.logits_chunk // math.gcd(t.logits_chunk, shared))
        rng = np.random.default_rng([self.cfg.run.seed, step, 1])
        chunks = plan_minibatches(units, minibatch_rows=micro * local_b, sort_by_length=t.sort_by_length, rng=rng,
                                  regions=shared, multiples=(t.bucket_multiple, resp_multiple))

        # every process must run the same number of updates with the same shapes
        n_global = int(distributed.allgather(np.asarray([len(chunks)]))[:, 0].max())
        widths = np.zeros((n_global, 2), np.int64)
        for i, chunk in enumerate(chunks):
            if shared:  # (prompt region, response region)
                widths[i] = (bucket_length(max(len(units[j].prompt) for j in chunk), t.bucket_multiple),
                             bucket_length(max(units[j].longest_response for j in chunk), resp_multiple))
            else:
                widths[i] = (bucket_length(max(rows[j].length for j in chunk), t.bucket_multiple),
                             bucket_length(max(len(rows[j].response) for j in chunk), resp_multiple))
        widths = distributed.allgather(widths).max(axis=0)
        row_counts = distributed.allgather(np.array([len(rows), len(too_long)])).sum(axis=0)
        stats = {"rows": float(row_counts[0]), "rows_too_long": float(row_counts[1]), "updates": 0.0}
        if n_global == 0:
            log.info("step %d: no active groups, update skipped (paper A.4)", step)
            return stats

        order = np.random.default_rng([self.cfg.run.seed, step, 2]).permutation(n_global)
        batches, counts = [], np.zeros(4)
        for i in order:
            chunk = chunks[i] if i < len(chunks) else []
            if shared:
                mb = pack_shared_minibatch(units, chunk, microbatches=micro, microbatch_rows=local_b, count=shared,
                                           prompt_len=int(widths[i][0]), resp_len=int(widths[i][1]), with_stale=stale)
            else:
                mb = pack_minibatch(rows, chunk, microbatches=micro, microbatch_rows=local_b,
                                    seq_len=int(widths[i][0]), resp_len=int(widths[i][1]), with_stale=stale)
            m, b, seq, resp = mb.shape
            counts += (mb.real_tokens, m * b * seq, mb.real_resp_tokens, m * b * resp)
            batches.append(fn.put_batch(mb.arrays))
        counts = distributed.allgather(counts).sum(axis=0)

        mismatch = np.zeros(3)
        for batch in batches:  # behaviour logprobs before any update of this epoch
            if t.old_logprobs == "recompute":
                batch["old_logp"], mm = fn.old_logprobs(self.state["params"], batch)
                mismatch += (host_scalar(mm["abs_diff_sum"]), host_scalar(mm["tokens"]), 0)
                mismatch[2] = max(mismatch[2], host_scalar(mm["abs_diff_max"]))
            else:
                batch["old_logp"] = batch["sampler_logp"]
            if stale:   # the off-policy correction's behaviour log-probs (train/losses.py)
                fn.add_behaviour(batch)

        per_update = []
        for _ in range(t.ppo_epochs):
            for batch in batches:
                self.state, m = fn.update(self.state, batch)
                per_update.append(m)
        per_update = [{k: host_scalar(v) for k, v in m.items()} for m in per_update]
        tokens = np.array([m["tokens"] for m in per_update])
        weights = tokens / max(tokens.sum(), 1.0)
        for key in ("loss", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "approx_kl"):
            stats[key] = float(sum(w * m[key] for w, m in zip(weights, per_update)))
        stats.update(
            updates=float(len(per_update)),
            tokens=float(tokens.sum() / t.ppo_epochs),
            grad_norm=float(np.mean([m["grad_norm"] for m in per_update])),
            grad_norm_max=float(np.max([m["grad_norm"] for m in per_update])),
            real_tokens=float(counts[0]),
            padding_waste=float(1.0 - counts[0] / max(counts[1], 1.0)),
            resp_padding_waste=float(1.0 - counts[2] / max(counts[3], 1.0)),
        )
        if t.old_logprobs == "recompute" and mismatch[1] > 0:
            stats["logp_mismatch_mean"] = float(mismatch[0] / mismatch[1])
            stats["logp_mismatch_max"] = float(mismatch[2])
        return stats

    # ---- checkpoints and signals -----------------------------------------------------------
    def save(self) -> None:
        if self._last_saved == self.step:
            return
        meta = {
            "updates": int(host_scalar(self.state["step"])),
            "rng_key_data": np.asarray(jax.random.key_data(self.base_key)).tolist(),
            "data": distributed.allgather_json(self.source.state_dict()),
            "paid_calls": distributed.allgather_json(self.ledger.state()),   # run.budget_* counts on after a resume
            "config": self.cfg.to_dict(),
            "model_config": self.qcfg.to_hf_dict(),
            "process_count": jax.process_count(),
            "mesh": {k: int(v) for k, v in self.mesh.shape.items()},
            "saved_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        log.info("saving checkpoint step %d", self.step)
        self.ckpt.save(self.step, self.state, meta)
        self._last_saved = self.step

    def _install_sigterm_handler(self):
        if not self.cfg.checkpoint.save_on_sigterm or threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_term(signum, frame):
            log.warning("SIGTERM received: finishing step %d, then saving", self.step)
            self._stop_requested = True

        previous = signal.signal(signal.SIGTERM, on_term)
        return lambda: signal.signal(signal.SIGTERM, previous)

    def close(self) -> None:
        try:
            self.ckpt.wait()
            self.ckpt.close()
            self.writer.close()
        finally:   # its clients and env pools end with the run, not at the process's exit
            getattr(self._own_source, "close", lambda: None)()
            self._own_source = None
