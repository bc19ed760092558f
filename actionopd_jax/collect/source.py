"""The trainer's group source backed by the collector (`collect.kind: actionopd`).

`build_group_source(cfg, ctx)` is what the job layer's source builder imports. It wires the
run config's sections to the parts other modules own -- the task stream (envs.task_sets), the
teacher (teacher.specs, teacher.factory) and the matcher (matching.build), environments
(envs.registry), the sampler (sampling.Sampler) -- and adds no policy of its own.

Per step, `collect(step, policy)`:
- takes the step's global list of task starts from the task stream (every process draws the
  same list; each collects its own share);
- loads the step's rollout copy of the behaviour snapshot into the sampler
  (sampling.rollout.load_behaviour: bf16 on accelerators, resharded on device; with several
  processes the only cross-process operation, before collection starts, at the same point
  of every process's step);
- runs the collector and returns this process's groups (advantages are the trainer's job).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from actionopd_jax.collect.collector import Collector, CollectResult, local_task_starts
from actionopd_jax.collect.config import CollectorConfig
from actionopd_jax.collect.engine_worker import EngineSampling
from actionopd_jax.collect.sampler_worker import SamplingSettings, sampler_fn
from actionopd_jax.collect.spend import SpendMeters
from actionopd_jax.config import Config, ConfigError
from actionopd_jax.config.rollout import rollout_sampler
from actionopd_jax.envs.registry import close_env_factory, env_factory_from
from actionopd_jax.envs.task_sets import stream_tasks, task_stream_from, training_tasks_summary
from actionopd_jax.rewards import RewardConfig
from actionopd_jax.sampling.budget import parse_token_budget
from actionopd_jax.sampling.rollout import load_behaviour
from actionopd_jax.train.setup import rollout_devices
from actionopd_jax.train.sources import RunStop
from actionopd_jax.train.update_reserve import update_reserve_bytes
from actionopd_jax.types import StateGroup

log = logging.getLogger(__name__)


def collector_config_from(cfg: Config) -> CollectorConfig:
    """The collector's settings from the run config's `collect` section."""
    c = cfg.collect
    return CollectorConfig(
        seed=int(cfg.run.seed), n=c.num_candidates,
        reward=RewardConfig(k=c.teacher_samples, lam=c.freq_bonus, mode=c.reward), commit=c.commit,
        max_new_tokens=c.max_response_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
        enable_thinking=c.enable_thinking, max_prompt_tokens=c.max_prompt_tokens,
        max_trajectories_in_flight=c.concurrency, max_states_per_call=c.concurrency,
        sampler_token_budget=token_budget_setting(getattr(c, "sampler_token_budget", "auto")),
        # the per-trajectory cap applies to every environment; BFCL also keeps its native
        # per-turn limit of 20 inside the environment
        decision_limits=(), default_decision_limit=c.max_decisions,
        teacher_timeout_s=max(cfg.teacher.timeout_s * 4, 60.0), matcher_timeout_s=max(cfg.matcher.timeout_s * 4, 60.0),
        progress=cfg.run.progress)


def build_engine(cfg: Config, model_config: Any, eos: int, mesh: Any = None):
    """The continuous-batching engine of `collect.sampler = "engine"` (weights come by
    load_policy each step, as for the static sampler): a slot holds the longest prompt plus a
    reply. The pool is sized at the first load_policy, on the rollout copy's mesh, from the
    devices' free memory then (the trainer's parameters and optimizer state, the rollout copy),
    less what an update allocates beside the pool, which stays resident (train/update_reserve.py
    on the training `mesh`; nothing with mesh.rollout_devices: the update runs on other chips)."""
    from actionopd_jax.engine import Engine
    from actionopd_jax.engine.aot import engine_shapes

    return Engine(None, model_config, eos_ids=[eos], config=engine_shapes(cfg.collect), dtype=cfg.model.dtype,
                  reserve_bytes=0.0 if cfg.mesh.rollout_devices else update_reserve_bytes(cfg, model_config, mesh))


def token_budget_setting(value: Any) -> int | str | None:
    """`collect.sampler_token_budget` of the run config, read by `sampling.budget.parse_token_budget`."""
    try:
        return parse_token_budget(value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def train_task_stream(cfg: Config):
    """The run's task stream: `env` tasks, collect.task_starts_per_step a step, seeded by run.seed."""
    return task_stream_from(cfg.env, per_step=cfg.collect.task_starts_per_step, seed=cfg.run.seed)


def check_training_tasks(cfg: Config) -> str | None:
    """For `train --check`: one line on the run's training tasks and their overlap with what
    evaluation scores (a second on an EnvScaler pool's conversational scenarios); raises the
    run's own ConfigError when the run would refuse them. None when the run draws no tasks
    from env.* (synthetic groups, recorded KD trajectories)."""
    if cfg.collect.kind == "synthetic" or (cfg.collect.kind == "kd" and cfg.kd.trajectories):
        return None
    return training_tasks_summary(cfg.env, needed_by=f"collect.kind={cfg.collect.kind}")


def check_prompt_room(cfg: Config, tokenizer: Any = None) -> str | None:
    """For `train --check`: the first prompts of the run's training tasks, measured
    (envs/prompt_room.py) against collect.max_prompt_tokens. Raises ConfigError naming how many
    do not fit and the longest (a task whose first prompt does not fit is skipped at every
    start: a budget below them all trains nothing); else one line for the plan. None where the
    run draws no tasks, or the pools are not on this host (the tasks line says so)."""
    return prompt_room(cfg, tokenizer)[0]


def prompt_room(cfg: Config, tokenizer: Any = None) -> tuple[str | None, tuple[int, int, int] | None, str]:
    """check_prompt_room's line, and the first prompts' (shortest, task-weighted mean, longest)
    with where they come from (train/cost_estimate.py), or None where not measured."""
    line, stats = _prompt_room(cfg, tokenizer)
    if stats is None:
        return line, None, "not measured: collect.max_prompt_tokens"
    lo, mean, hi, n = stats
    return line, (lo, mean, hi), f"measured ({n} tasks: {lo:,} / mean {mean:,} / {hi:,} tokens)"


def _prompt_room(cfg: Config, tokenizer: Any = None):
    from actionopd_jax.envs.admission import read_manifest
    from actionopd_jax.envs.mixture import POOLS, missing_pool_files
    from actionopd_jax.envs.prompt_room import measure
    from actionopd_jax.envs.task_sets import training_task_sets

    if cfg.collect.kind == "synthetic" or (cfg.collect.kind == "kd" and cfg.kd.trajectories):
        return None, None
    if cfg.env.name in POOLS and missing_pool_files(cfg.env):
        return None, None
    counts = {}
    if cfg.env.name in POOLS:
        counts = {pool: dict(m.get("prompt_tokens") or {}) for pool, m in read_manifest(cfg.env.manifest)["pools"].items()}
    how = ""
    if tokenizer is None:
        tokenizer, how = _check_tokenizer(cfg)
    sets = training_task_sets(cfg.env, needed_by=f"collect.kind={cfg.collect.kind}")
    lengths, unmeasured = measure(sets, tokenizer, counts)
    budget = cfg.collect.max_prompt_tokens
    skipped = f"; not measured: {', '.join(unmeasured)}" if unmeasured else ""
    if not lengths:
        return f"prompts    not measured ({', '.join(unmeasured) or 'no tasks'}){how}", None
    longest = max(lengths, key=lambda x: x.tokens)
    total = sum(x.tasks for x in lengths)
    over = [x for x in lengths if x.tokens > budget]
    if over:
        n = sum(x.tasks for x in over)
        shown = "; ".join(f"{x.label}: {'at least ' if x.floor else ''}{x.tokens:,}" for x in
                          sorted(over, key=lambda x: -x.tokens)[:3])
        raise ConfigError(
            f"collect.max_prompt_tokens={budget:,} cannot hold the first prompt of {n} of {total} training tasks "
            f"(longest first: {shown} tokens{how}): each of them ends with context_overflow before its first "
            f"decision, so {'the run trains nothing' if n == total else 'they are never trained on'}. Raise "
            f"collect.max_prompt_tokens (paper B.5: 24,576) and train.max_seq_len with it (B.5: 32,768), or "
            f"train on tasks whose prompts fit{skipped}")
    stats = (min(x.tokens for x in lengths), round(sum(x.tokens * x.tasks for x in lengths) / total), longest.tokens,
             total)
    return (f"prompts    the first prompts of {total} training tasks fit collect.max_prompt_tokens={budget:,}: "
            f"longest {'at least ' if longest.floor else ''}{longest.tokens:,} tokens ({longest.label}){how}{skipped}",
            stats)


def _check_tokenizer(cfg: Config) -> tuple[Any, str]:
    """The run's tokenizer where it is on this host, else the offline Qwen3 one (every preset
    is a Qwen3 model: one vocabulary and template), with a note saying so."""
    from actionopd_jax.chat.tokenizer import build_qwen3_tokenizer, load_tokenizer

    path = cfg.model.tokenizer or cfg.model.hf_path
    if path and Path(path).exists():
        return load_tokenizer(path), ""
    built = build_qwen3_tokenizer(Path.home() / ".cache" / "actionopd_jax" / "qwen3_tokenizer")
    where = f" ({path} is not on this host)" if path else ""
    return load_tokenizer(built), f"; counted with the offline Qwen3 tokenizer{where}"


TEACHER_FAILURES = ("teacher_error", "teacher_timeout")


def step_ends(result: CollectResult) -> np.ndarray:
    """[task starts, starts that overflowed before their first decision, starts that got no
    teacher answer at all] of this process's share of a step (summed over processes by the
    caller, so every process takes the same decision)."""
    recs = result.trajectories
    return np.asarray([len(recs),
                       sum(1 for r in recs if r.end_reason == "context_overflow" and r.decisions == 0),
                       sum(1 for r in recs if r.end_reason in TEACHER_FAILURES and r.groups == 0)], np.int64)


def overflow_stop(step: int, ends: np.ndarray, budget: int) -> str | None:
    """The message that stops a run when more than half of a step's task starts ended with
    context_overflow before their first decision (their first prompt over the budget): such a
    run would go on collecting nothing from them, silently. `ends`: step_ends, global."""
    starts, at_start = int(ends[0]), int(ends[1])
    if not starts or at_start * 2 <= starts:
        return None
    return (f"step {step}: {at_start} of {starts} task starts ended before their first decision because "
            f"their first prompt is over collect.max_prompt_tokens={budget:,}; the run stops rather than train "
            "on what is left. Raise collect.max_prompt_tokens (and train.max_seq_len), or train on tasks whose "
            "prompts fit: `actionopd train --config ... --check` measures them")


def tokenizer_from(ctx: Any, *, needed_by: str) -> Any:
    """The run's tokenizer (ctx.tokenizer_path), with one clear error when none is configured;
    shared by the collector's and the baselines' sources. `needed_by` names the caller."""
    if not ctx.tokenizer_path:
        raise ConfigError(f"{needed_by} needs a tokenizer: set model.tokenizer (or model.hf_path)")
    from actionopd_jax.chat import load_tokenizer

    return load_tokenizer(ctx.tokenizer_path)


class ActionOPDGroupSource:
    """`train.sources.GroupSource` over the collector."""

    collector_class = Collector   # the asynchronous source's adds policy versions (async_source.py)
    reference_server: Any = None  # an embedded teacher server to stop on close (wiring.reference_teacher_source)

    def __init__(self, cfg: Config, ctx: Any, *, teacher: Any = None, matcher: Any = None, stream: Any = None,
                 env_factory: Any = None, tokenizer: Any = None, buckets: Any = None):
        """Parts passed in replace the ones the config would build (tests, custom setups);
        `buckets`: the sampler's shape buckets (sampling.Buckets)."""
        self.cfg = collector_config_from(cfg)
        self.ctx = ctx
        self.rollout_devices = rollout_devices(cfg)   # the sampler's own (mesh.rollout_devices), else ()
        if tokenizer is None:
            tokenizer = tokenizer_from(ctx, needed_by="collect.kind=actionopd")
        self.tokenizer = tokenizer
        run_dir = Path(ctx.run_dir)
        if teacher is None:
            from actionopd_jax.teacher.factory import build_teacher
            from actionopd_jax.teacher.specs import teacher_spec

            cache_dir = Path(cfg.teacher.cache_dir or run_dir / "cache" / "teacher")
            cache_dir.mkdir(parents=True, exist_ok=True)
            # one SQLite file per process: no cross-host locking on shared file systems
            cache = cache_dir / f"teacher-p{ctx.process_index}.sqlite"
            spec = teacher_spec(cfg.teacher)
            if spec["provider"] == "local":
                from actionopd_jax.teacher.hf_local import build_hf_local_teacher

                local = build_hf_local_teacher(cfg.teacher, tokenizer, mesh=ctx.mesh, process_count=ctx.process_count,
                                               seed=cfg.run.seed, max_prompt_tokens=cfg.collect.max_prompt_tokens,
                                               buckets=buckets)
                teacher = build_teacher(spec, cache=cache, local=local)
            else:
                teacher = build_teacher(spec, cache=cache)
        self.stream = stream if stream is not None else train_task_stream(cfg)  # the latter checks the overlap
        tasks = stream_tasks(self.stream)
        if tasks is not None:
            from actionopd_jax.envs.splits import check_eval_overlap, record_train_tasks

            if stream is not None:  # a stream passed in obeys the same rule
                check_eval_overlap(cfg.env, tasks)
            if ctx.process_index == 0:
                record_train_tasks(run_dir, tasks)
        from actionopd_jax.teacher.specs import judge_spec

        # the env pools this source builds it closes (close()); a factory passed in is its caller's
        self._own_envs = None
        if env_factory is None:  # the run's judge also grades AWM's SQL verifiers
            env_factory = self._own_envs = env_factory_from(cfg.env, concurrency=cfg.collect.concurrency,
                                                            judge=judge_spec(cfg.matcher))
        try:
            self._build(cfg, ctx, teacher, matcher, env_factory, tokenizer, tasks, buckets)
        except BaseException:   # a refused start leaves no servers running until exit
            close_env_factory(self._own_envs)
            raise

    def _build(self, cfg: Config, ctx: Any, teacher: Any, matcher: Any, env_factory: Any, tokenizer: Any,
               tasks: Any, buckets: Any) -> None:
        """The matcher, the sampler and the collector over `env_factory` (__init__'s second half)."""
        from actionopd_jax.sampling import Sampler
        from actionopd_jax.teacher.specs import judge_spec

        run_dir = Path(ctx.run_dir)
        if matcher is None:
            from actionopd_jax.matching.build import build_matcher, tool_evidence_from

            cache_dir = Path(cfg.matcher.cache_dir or run_dir / "cache" / "matcher")
            cache_dir.mkdir(parents=True, exist_ok=True)
            matcher = build_matcher(judge_spec(cfg.matcher), cache=cache_dir / f"verdicts-p{ctx.process_index}.sqlite",
                                    evidence_by_env=tool_evidence_from(cfg.matcher, tasks, env_factory),
                                    execution=cfg.matcher.execution)
        # servers of a pool that can prefetch start for each step's own draws (_prefetch_next);
        # others start now, so no episode (nor a device step) waits for a cold one
        prefetches = callable(getattr(self.stream, "peek_step", None)) and callable(getattr(env_factory, "prefetch", None))
        warm = getattr(env_factory, "warm", None)
        if not prefetches and callable(warm) and tasks is not None:
            warm(tasks)
        eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        settings = SamplingSettings(n=self.cfg.n, max_new_tokens=self.cfg.max_new_tokens,
                                    temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k)
        platform = ctx.mesh.devices.flat[0].platform if ctx.mesh is not None else jax.default_backend()
        self.sampler_kind = rollout_sampler(cfg.collect.sampler, platform)
        log.info("rollout sampler: %s (collect.sampler=%s on %s)", self.sampler_kind, cfg.collect.sampler, platform)
        if self.sampler_kind == "engine":
            self.sampler = build_engine(cfg, ctx.model_config, eos, mesh=ctx.mesh)
            sample_fn = EngineSampling(self.sampler, settings)
        else:
            # asynchronous collection: the update runs beside the calls (not on rollout devices of their own)
            beside = cfg.collect.max_staleness >= 1 and not cfg.mesh.rollout_devices
            self.sampler = Sampler(None, ctx.model_config, eos_ids=[eos], buckets=buckets,
                                   token_budget=self.cfg.sampler_token_budget,
                                   reserve_bytes=update_reserve_bytes(cfg, ctx.model_config, ctx.mesh) if beside else 0.0)
            sample_fn = sampler_fn(self.sampler, settings)
        from actionopd_jax.matching.judged_log import JudgedLog

        # every judged pair, for `actionopd audit-matcher` (one file per process, as the caches)
        self.collector = self.collector_class(self.cfg, tokenizer=tokenizer, teacher=teacher, matcher=matcher,
                                   sample_fn=sample_fn, eos_ids=[eos], env_factory=env_factory,
                                   judged_log=JudgedLog(run_dir, ctx.process_index))
        if prefetches:
            self._prefetch_next()  # the first step's servers start in the background, while the programs compile
        self.last: CollectResult | None = None
        self.max_outage_steps = cfg.collect.max_outage_steps
        # each paid role's requests, tokens and money (spend.py)
        self.meters = SpendMeters({"teacher": cfg.teacher.price, "matcher": cfg.matcher.price, "user": cfg.env.user_price})
        self._meter_step: dict[str, float] = {}
        self._outage_steps = 0      # consecutive steps without one teacher answer (_watch_teacher)

    def close(self) -> None:
        """The collector's clients and loop (an asynchronous one's loop stops first), then the
        env pools this source built, and its embedded teacher server. The trainer calls it for a
        source it built itself."""
        try:
            self.collector.close()
        finally:
            close_env_factory(self._own_envs)
            self._own_envs = None
            if self.reference_server is not None:
                self.reference_server.stop()

    def collect(self, step: int, policy: Any) -> list[StateGroup]:
        tasks = self.stream.next_step()
        # One behaviour snapshot for the whole step: the sampler reads these weights only.
        load_behaviour(self.sampler, policy, self.ctx.mesh, self.rollout_devices)
        self.last = self.collector.collect(tasks, step=step, process_index=self.ctx.process_index,
                                           process_count=self.ctx.process_count)
        self._after_collect(step)
        self._prefetch_next()  # while the device runs this step's update
        return self.last.groups

    def _after_collect(self, step: int) -> None:
        """The spend meters and the run's stops (prompts over budget, a teacher outage) on
        self.last, the step's result."""
        m = self.last.metrics
        self._meter_step = self.meters.add({"teacher": m.teacher, "matcher": m.judge, "user": m.user},
                                           saved={"matcher": int(m.matcher.get("judge_calls_saved", 0))})
        ends = step_ends(self.last)
        if self.ctx.process_count > 1:    # one decision on every process (they stop together)
            from actionopd_jax.train import distributed

            ends = distributed.allgather(ends).sum(axis=0)
        stop = overflow_stop(step, ends, self.cfg.max_prompt_tokens)
        if stop:
            raise ConfigError(stop)
        self._watch_teacher(step, ends)

    def _watch_teacher(self, step: int, ends: np.ndarray) -> None:
        """A step in which no task start got one teacher answer trains nothing: said loudly
        each time, and after collect.max_outage_steps such steps in a row the run stops (issue
        34: a teacher answering 503 to everything read as a healthy run that exited 0)."""
        starts, failed = int(ends[0]), int(ends[2])
        if not starts or failed < starts:
            self._outage_steps = 0
            return
        self._outage_steps += 1
        limit = self.max_outage_steps
        from actionopd_jax.collect.supervision import teacher_where

        # the endpoint, the error class and the counts (issue 46 item 5: the stop named none of them)
        where = teacher_where(self.collector.teacher)
        usage = self.last.metrics.teacher
        counts = (f"{usage.http_calls} request(s) this step, {usage.transport_failures} sample(s) lost past the "
                  f"transport retries, {usage.malformed_replies} malformed repl(ies); last error: "
                  f"{self.collector.last_teacher_error or 'none recorded'}")
        log.error("step %d: none of %d task starts got an answer from %s (%s): the step trains nothing (%d such "
                  "step(s) in a row%s)", step, starts, where, counts, self._outage_steps,
                  f"; the run stops at {limit}" if limit else "")
        if limit and self._outage_steps >= limit:
            raise RunStop(f"the {where} answered none of the task starts of {self._outage_steps} steps in a row "
                          f"(last: step {step}, {starts} starts; {counts}): it is down, or teacher.base_url / "
                          f"teacher.model / its API key are wrong. Fix it and rerun the command: the run resumes "
                          "from its last checkpoint (collect.max_outage_steps sets the patience)")

    def _prefetch_next(self) -> None:
        """The next step's draws are known before it (envs/mixture.py): have the environment
        start this process's servers for them in the background, so the collection begins with
        them warm and no device step waits for a server start (docs/measurements_cpu.md)."""
        peek = getattr(self.stream, "peek_step", None)
        if callable(peek):
            upcoming = peek()
            self.collector.prefetch([upcoming[i] for i in local_task_starts(len(upcoming), self.ctx.process_index,
                                                                            self.ctx.process_count)])

    def budget_figures(self) -> list[float]:
        return self.meters.budget_figures()

    def state_dict(self) -> dict[str, Any]:
        # the spend meter's totals ride along, so a resumed run counts on (spend.py)
        return {**self.stream.get_state(), **self.meters.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.meters.load({"meter": state.pop("meter", {}), "meters": state.pop("meters", {})})
        self.stream.set_state(state)

    def metrics(self) -> dict[str, float]:
        if self.last is None:
            return {}
        out = {k.removeprefix("collect/"): float(v) for k, v in self.last.metrics.as_dict().items()}
        return {**out, **self._meter_step}


def build_group_source(cfg: Config, ctx: Any) -> ActionOPDGroupSource:
    return ActionOPDGroupSource(cfg, ctx)
