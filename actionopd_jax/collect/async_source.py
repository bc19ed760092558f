"""The trainer's group source with asynchronous collection (issue 44, collect.max_staleness = eta
>= 1): episodes keep running while the trainer updates, within a staleness bound.

`collect(step, policy)`:
1. copies the step's weights for the sampler (a real copy: `policy.params` are donated to the
   update that follows) and swaps them in between device calls (the static sampler,
   async_scheduler.VersionedSampling) or between engine steps (collect.sampler = "engine",
   async_scheduler.EngineVersions: running rows carry on under the new weights), without
   draining the trajectories in flight; the swap returns once the sampler holds the copy;
2. admits the draws (task starts of one trainer step each) up to step + eta;
3. waits for draw `step`, the oldest admitted one, to finish, and returns its groups, less any
   whose policy version is more than eta steps old (counted; their teacher samples stay in the
   teacher cache, written when paid). With admission at the swap no group can be that old; the
   filter is the guarantee, not the schedule.

The update weights a group sampled by an older policy with the decoupled, truncated
correction (train/losses.py `offpolicy_weights`, train/loop.py): behaviour = the sampler's
recorded log-probs, proximal = the trainer's recomputation under the weights being updated.

Resume: `state_dict()` holds the task stream as it was before the oldest draw not yet trained
on, so a resumed run draws the in-flight task starts again (only their episodes are lost; their
teacher answers come from the cache). `stop_background()` (also on a budget stop, at
`load_state_dict` and at close) stops the loop, joins its thread and gives the in-flight draws
back to the stream. One process only for now (multi-host admission would need every process's
draws in lockstep).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import jax
import numpy as np

from actionopd_jax.collect.async_scheduler import AsyncCollector, AsyncScheduler, EngineVersions, VersionedSampling
from actionopd_jax.collect.collector import CollectResult, local_task_starts
from actionopd_jax.collect.metrics import StepMetrics
from actionopd_jax.collect.source import ActionOPDGroupSource
from actionopd_jax.collect.supervision import record_usage, usage_snapshot
from actionopd_jax.config import Config, ConfigError
from actionopd_jax.sampling.rollout import rollout_params
from actionopd_jax.types import StateGroup


def _buffers(x: Any) -> set:
    """What identifies `x`'s device memory: its object, and each addressable shard's buffer
    pointer where the backend gives one (a reshard or no-op cast may return a new Array object
    over the same buffers)."""
    out = {("id", id(x))}
    for shard in getattr(x, "addressable_shards", ()):
        try:
            out.add(("ptr", shard.data.unsafe_buffer_pointer()))
        except Exception:  # noqa: BLE001 - a backend without pointers: the object identity stands
            pass
    return out


def own_copy(params: Any, donated: Any) -> Any:
    """`params` where no leaf shares memory with `donated` (the trainer donates those to the
    update while the sampler keeps sampling): a device copy of every leaf that aliases one."""
    taken = set().union(*(_buffers(x) for x in jax.tree.leaves(donated)))
    out = jax.tree.map(lambda x: x.copy() if _buffers(x) & taken else x, params)
    return jax.block_until_ready(out)


class AsyncActionOPDGroupSource(ActionOPDGroupSource):
    """`ActionOPDGroupSource` whose collection runs across trainer steps (module docstring)."""

    collector_class = AsyncCollector

    def __init__(self, cfg: Config, ctx: Any, **parts: Any):
        self.max_staleness = int(cfg.collect.max_staleness)
        if self.max_staleness < 1:
            raise ConfigError(f"the asynchronous source needs collect.max_staleness >= 1, got {self.max_staleness}")
        if ctx.process_count > 1:
            raise ConfigError(f"collect.max_staleness={self.max_staleness} runs on one process only (this run has "
                              f"{ctx.process_count}); set collect.max_staleness=0 for a multi-host run")
        super().__init__(cfg, ctx, **parts)
        c = self.cfg
        if self.sampler_kind == "engine":   # the loop runs an EngineWorker; swaps go through its thread
            self.sampling = EngineVersions(lambda: self.scheduler.worker)
            worker_kwargs = dict(stats=self.sampling.stats)
        else:
            self.sampling = VersionedSampling(self.collector.sample_fn)
            self.collector.sample_fn = self.sampling
            worker_kwargs = dict(max_states_per_call=c.max_states_per_call, max_queued=c.max_trajectories_in_flight,
                                 coalesce_s=c.sampler_coalesce_s, max_wait_s=c.sampler_max_wait_s)
        self.scheduler = AsyncScheduler(self.collector, concurrency=c.max_trajectories_in_flight,
                                        worker_kwargs=worker_kwargs)
        self.collector.scheduler = self.scheduler
        self._draw_states: dict[int, dict] = {}   # the stream's state before each admitted, untrained draw
        self._next_draw: int | None = None
        self._marks: tuple[float, float, Any] | None = None   # (time, sampler busy s, usage) at the last return
        self._async: dict[str, float] = {}
        self._calls = (0, 0)   # the sampler worker's (calls, states) at the last return

    # --- one step ------------------------------------------------------------------------------
    def collect(self, step: int, policy: Any) -> list[StateGroup]:
        t0 = time.perf_counter()
        if self._marks is None:
            self._marks = (t0, self.sampling.busy_s, usage_snapshot(self.collector.teacher, self.collector.matcher))
        try:
            params, mesh = rollout_params(policy.params, policy.graphdef, devices=self.rollout_devices)
            params = own_copy(params, policy.params)
            mesh = self.ctx.mesh if mesh is None else mesh
            swap_wait = self.sampling.swap(lambda **kw: self.sampler.load_policy(policy.graphdef, params, mesh, **kw),
                                           step)
            if self._next_draw is None or step not in self._draw_states and step != self._next_draw:
                self.stop_background()    # first step, or a step out of order: draw afresh from here
                self._next_draw = step
            self.scheduler.start()
            while self._next_draw <= step + self.max_staleness:   # admission control
                self._admit(self._next_draw)
            self._prefetch_next()
            t_wait = time.perf_counter()
            draw = self.scheduler.wait(step)
            waited = time.perf_counter() - t_wait
            self.last = self._result(step, draw)
            self._async.update(wait_s=waited, swap_wait_s=swap_wait)
            self._after_collect(step)
            self._draw_states.pop(step, None)   # trained from here on (a stop above gives the draw back)
        except BaseException:
            self.stop_background()   # a budget stop, a run stop, a failed device call: no loop left running
            raise
        return self.last.groups

    def _admit(self, d: int) -> None:
        self._draw_states[d] = copy.deepcopy(self.stream.get_state())
        tasks = self.stream.next_step()
        starts = [(i, tasks[i]) for i in local_task_starts(len(tasks), self.ctx.process_index, self.ctx.process_count)]
        self.collector.prefetch([t for _, t in starts])
        self.scheduler.admit(d, starts)
        self._next_draw = d + 1

    def _result(self, step: int, draw: Any) -> CollectResult:
        eta = self.max_staleness
        ages = np.zeros(eta + 1, np.int64)
        kept, dropped = [], 0
        for start, group, counts in sorted(draw.outcomes, key=lambda o: (o[0], o[1].decision_index)):
            age = step - group.policy_version
            if group.policy_version < 0 or not 0 <= age <= eta:
                dropped += 1     # sampled by a policy more than eta updates old: never trained on
                continue
            kept.append((start, group, counts))
            ages[age] += group.retained
        now = time.perf_counter()
        t_mark, busy_mark, usage_mark = self._marks
        usage_now = usage_snapshot(self.collector.teacher, self.collector.matcher)
        self._marks = (now, self.sampling.busy_s, usage_now)
        metrics = StepMetrics()
        metrics.wall_s = now - t_mark
        metrics.sampler_busy_s = self.sampling.busy_s - busy_mark
        worker = self.scheduler.worker
        calls = (worker.stats.calls, worker.stats.states) if worker is not None else (0, 0)
        metrics.sampler_calls, metrics.sampler_states = (max(calls[0] - self._calls[0], 0),
                                                         max(calls[1] - self._calls[1], 0))
        self._calls = calls
        record_usage(metrics, usage_mark, usage_now)
        self._async = {f"staleness_{a}": float(n) for a, n in enumerate(ages)}
        self._async.update(stale_dropped=float(dropped), max_staleness=float(eta),
                           # (a device call is counted when it ends: one running at the last mark
                           # adds its earlier part to this interval)
                           sampler_busy_frac=min(metrics.sampler_busy_s / max(metrics.wall_s, 1e-9), 1.0),
                           teacher_in_flight=float(self.collector.teacher_in_flight),
                           trajectories_in_flight=float(self.scheduler.running_trajectories),
                           draws_ahead=float(sum(d > step for d in self._draw_states)))
        records = sorted(draw.records, key=lambda r: r.task_start)
        return CollectResult.assemble(step, kept, records, metrics)

    # --- lifecycle and resume ------------------------------------------------------------------
    def stop_background(self) -> None:
        """Stop the loop (joining its thread) and give the draws not yet trained on back to the
        stream: the next collect draws them again."""
        self.scheduler.stop()
        if self._draw_states:
            self.stream.set_state(self._draw_states[min(self._draw_states)])
        self._draw_states.clear()
        self._next_draw = None

    # close(): ActionOPDGroupSource's: the collector (AsyncCollector.close stops the loop first),
    # then the env pools this source built

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._draw_states:   # a resumed run draws the in-flight task starts again
            state.update(copy.deepcopy(self._draw_states[min(self._draw_states)]))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.stop()
        self._draw_states.clear()
        self._next_draw = None
        super().load_state_dict(state)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({f"async/{k}": v for k, v in self._async.items()})
        return out


__all__ = ["AsyncActionOPDGroupSource", "own_copy"]
