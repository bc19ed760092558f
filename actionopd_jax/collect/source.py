"""The trainer's group source backed by the collector (`collect.kind: actionopd`).

`build_group_source(cfg, ctx)` is what `train.sources.build_source` imports. It wires the
run config to the parts other modules own -- the task stream (envs.tasks), the teacher and
matcher factories (teacher.factory), environments (envs.base.make_environment, the tau2 user
simulator), the sampler (sampling.Sampler) -- and adds no policy of its own.

Per step, `collect(step, policy)`:
- takes the step's global list of task starts from the task stream (every process draws the
  same list; each collects its own share);
- puts the behaviour snapshot (policy.params) where this process can sample with it: the
  rollout copy (`rollout_params`), bf16 on accelerators, resharded on device (one jitted
  identity with out_shardings, never through host memory) tensor-parallel over this
  process's local devices and replicated over processes; on a single CPU process the
  training placement as it is. With several processes that reshard is the only
  cross-process operation, and it happens before collection starts, at the same point of
  every process's step;
- runs the collector and returns this process's groups (advantages are the trainer's job).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from actionopd_jax.collect.collector import Collector, CollectResult, default_env_factory
from actionopd_jax.collect.config import CollectorConfig
from actionopd_jax.collect.sampler_worker import SamplingSettings, sampler_fn
from actionopd_jax.config.errors import ConfigError
from actionopd_jax.rewards import RewardConfig
from actionopd_jax.sampling.budget import parse_token_budget
from actionopd_jax.types import StateGroup

log = logging.getLogger(__name__)


def collector_config_from(cfg: Any) -> CollectorConfig:
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


def token_budget_setting(value: Any) -> int | str | None:
    """`collect.sampler_token_budget` of the run config, read by `sampling.budget.parse_token_budget`."""
    try:
        return parse_token_budget(value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def teacher_spec(cfg: Any) -> dict[str, Any]:
    """teacher.* as a `teacher.factory.build_teacher` spec. kind=local is an HF directory sampled
    in-process: `local_teacher_from` builds it (it needs the run's mesh and tokenizer)."""
    t = cfg.teacher
    if t.kind == "none":
        raise ConfigError("collect.kind=actionopd needs a teacher: set teacher.kind (openai | vertex | local) "
                            "with teacher.model (and teacher.base_url for openai)")
    if t.kind == "self":
        raise ConfigError("teacher.kind=self is Self-ActionOPD: its source is baselines.self_opd "
                            "(`actionopd train` picks it from the config); it has no endpoint spec")
    if t.kind == "local":
        return {"provider": "local", "model": t.model}
    if t.kind == "vertex":
        if t.provider not in ("", "vertex"):
            raise ConfigError(f"teacher.kind=vertex with teacher.provider={t.provider!r}: leave provider empty")
        return {"provider": "vertex", "model": t.model}
    spec: dict[str, Any] = {"provider": t.provider or "openai", "model": t.model}
    spec.update(base_url=t.base_url, api_key_env=t.api_key_env or None, temperature=t.temperature,
                top_p=t.top_p, top_k=t.top_k or None, max_tokens=t.max_tokens, thinking=t.enable_thinking,
                reasoning_effort=t.reasoning_effort or None, max_regenerations=t.retries,
                request_timeout_s=t.timeout_s, max_concurrency=t.concurrency)
    return spec


def judge_spec(cfg: Any) -> dict[str, Any] | None:
    m = cfg.matcher
    if m.kind == "rules":
        return None
    return {"provider": m.provider or "openai", "model": m.model, "base_url": m.base_url,
            "api_key_env": m.api_key_env or None, "temperature": m.temperature, "top_p": m.top_p,
            "top_k": m.top_k or None, "max_tokens": m.max_tokens, "request_timeout_s": m.timeout_s,
            "max_concurrency": m.concurrency}


def task_set_names(cfg: Any, *, needed_by: str) -> list[tuple[str, str]]:
    """The (environment, split) task sets the `env` section names: BFCL categories or tau2
    domains. One reading of env.* for the collector and the baselines; `needed_by` names the
    caller in the error for an unsupported env.name."""
    e = cfg.env
    if e.name == "bfcl":
        return [("bfcl", d) for d in (e.domains or ("all",))]
    if e.name == "tau2":
        if not e.domains:
            raise ConfigError("env.name=tau2 needs env.domains (airline, retail, telecom)")
        return [(f"tau2_{d}", e.split) for d in e.domains]
    raise ConfigError(f"{needed_by} needs env.name bfcl or tau2, got {e.name!r}")


def training_task_sets(cfg: Any, *, needed_by: str) -> list[tuple[str, list]]:
    """(name, tasks) of every task set `env.*` names, narrowed to env.task_ids when given; training
    on tasks evaluation scores is refused unless env.allow_eval_overlap (envs/splits.py)."""
    from actionopd_jax.envs.splits import check_eval_overlap, select_task_ids
    from actionopd_jax.envs.tasks import load_task_set

    sets = [(f"{env}:{split}", load_task_set(env, split)) for env, split in task_set_names(cfg, needed_by=needed_by)]
    every = select_task_ids([t for _, tasks in sets for t in tasks], cfg.env.task_ids)
    keep = {(t.env, t.task_id) for t in every}
    sets = [(name, [t for t in tasks if (t.env, t.task_id) in keep]) for name, tasks in sets]
    sets = [(name, tasks) for name, tasks in sets if tasks]
    check_eval_overlap(cfg.env, every)
    return sets


def task_stream_from(cfg: Any):
    """Every process builds the same stream (same seed): the same global list per step."""
    from actionopd_jax.envs.tasks import TaskSource, TaskStream

    per_step = cfg.collect.task_starts_per_step
    sets = training_task_sets(cfg, needed_by="collect.kind=actionopd")
    if per_step < len(sets):
        raise ConfigError(f"collect.task_starts_per_step={per_step} is smaller than the {len(sets)} task sources")
    quotas = [per_step // len(sets) + (i < per_step % len(sets)) for i in range(len(sets))]
    sources = [(TaskSource(name, tasks), q) for (name, tasks), q in zip(sets, quotas)]
    return TaskStream(sources, seed=int(cfg.run.seed))


def check_training_tasks(cfg: Any) -> str | None:
    """For `train --check`: one line on the run's training tasks and their overlap with what
    evaluation scores (envs/splits.overlap_summary); raises the run's own ConfigError when the
    run would refuse them. None when the run draws no tasks from env.* (synthetic groups,
    recorded KD trajectories)."""
    from actionopd_jax.envs.splits import overlap_summary

    if cfg.collect.kind == "synthetic" or (cfg.collect.kind == "kd" and cfg.kd.trajectories):
        return None
    tasks = [t for _, ts in training_task_sets(cfg, needed_by=f"collect.kind={cfg.collect.kind}") for t in ts]
    return f"tasks      {overlap_summary(cfg.env, tasks)}"


def stream_tasks(stream: Any) -> list | None:
    """Every task a stream can start, when it says (envs.tasks.TaskStream, or a wrapper of one
    with `.stream`); None for other streams (test doubles)."""
    for s in (stream, getattr(stream, "stream", None)):
        tasks = getattr(s, "tasks", None)
        if isinstance(tasks, list):
            return tasks
    return None


def tool_evidence_from(cfg: Any, tasks: list | None) -> dict[str, dict[str, str]] | None:
    """Per environment, each tool's implementation evidence for the judge (matcher.tool_evidence)."""
    if not cfg.matcher.tool_evidence or cfg.matcher.kind == "rules" or not tasks:
        return None
    from actionopd_jax.envs.evidence import tool_evidence

    out = {}
    for env in sorted({t.env for t in tasks}):
        evidence = tool_evidence(env)
        if evidence is not None:
            out[env] = evidence
    return out


def env_factory_from(cfg: Any):
    e = cfg.env
    if e.name != "tau2":
        return default_env_factory()
    from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator

    if not e.user_model or not e.user_base_url:
        raise ConfigError("env.name=tau2 needs a user simulator: set env.user_model and env.user_base_url")
    sim = UserSimulator(UserSimConfig(base_url=e.user_base_url, model=e.user_model,
                                      api_key_env=e.user_api_key_env or None, temperature=e.user_temperature,
                                      max_tokens=e.user_max_tokens))
    return default_env_factory({f"tau2_{d}": {"user_sim": sim} for d in e.domains})


def rollout_dtype(platform: str) -> Any:
    """dtype of the sampler's rollout copy: bfloat16 on accelerators (the sampler computes in
    bf16 and its HBM goes to the KV cache); None (the parameters' own dtype) on CPU, where
    the float32 "checked" LM head needs the float32 weights (so CPU samples stay identical)."""
    return None if platform == "cpu" else jnp.bfloat16


def _rollout_specs(graphdef: Any, params: Any, mesh: Any) -> Any:
    """The sampler's layout of every parameter on `mesh` (pure dict of NamedShardings): the
    model's logical rules, so on a (process x local) mesh whose axes are ("data", "tensor")
    the weights are tensor-parallel over a host's local chips and replicated over hosts."""
    from flax import nnx

    from actionopd_jax.model.sharding import param_shardings

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = nnx.state(nnx.merge(graphdef, abstract))
    return nnx.to_pure_dict(param_shardings(state, mesh))


def _cast_fn(dtype: Any):
    def cast(tree):
        if dtype is None:
            return tree
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    return cast


_RESHARD: dict[Any, Any] = {}


def _reshard(params: Any, target: Any, dtype: Any) -> Any:
    """jit(cast, out_shardings=target)(params), the jitted function kept per (dtype, target)
    so a step's reshard reuses the program compiled for the first step."""
    leaves, treedef = jax.tree.flatten(target)
    key = (None if dtype is None else jnp.dtype(dtype).name, treedef, tuple(leaves))
    fn = _RESHARD.get(key)
    if fn is None:
        fn = _RESHARD[key] = jax.jit(_cast_fn(dtype), out_shardings=target)
    return fn(params)


def rollout_params(params: Any, graphdef: Any, *, platform: str | None = None,
                   dtype: Any = "auto") -> tuple[Any, Any]:
    """(the sampler's rollout copy of `params`, the mesh to trace under), made on device.

    The copy is tensor-parallel over this process's local devices (mesh {"tensor": local}),
    in `dtype` ("auto": `rollout_dtype` of the platform: bfloat16 on accelerators, the
    parameters' own dtype on CPU). It is a new array (the trainer donates `params` to the
    update that follows collection).

    One process on CPU: the training placement as it is, None (unchanged behaviour: the
    float32 "checked" head samples the float32 weights on the training mesh).
    Otherwise one jitted identity (plus the cast) with out_shardings on a global mesh
    (processes x local devices, axes ("data", "tensor"); the parameters only name "tensor",
    so they are replicated over processes) moves the weights device to device -- XLA's
    collectives over ICI/DCN, never through host memory, and every process runs it at the
    same point of its step. Each process then wraps its own shards as arrays on its local
    mesh (`jax.make_array_from_single_device_arrays`, zero copy), so sampling needs no
    cross-process operation."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    leaves = jax.tree.leaves(params)
    single = all(getattr(x, "is_fully_addressable", True) for x in leaves)
    devices = jax.devices()
    platform = platform or devices[0].platform
    if isinstance(dtype, str) and dtype == "auto":
        dtype = rollout_dtype(platform)
    if single and platform == "cpu" and dtype is None:
        return params, None
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    n_proc = jax.process_count()
    by_process = [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in range(n_proc)]
    if any(len(row) != len(local) for row in by_process):
        raise ValueError("rollout_params needs the same number of devices in every process")
    local_mesh = Mesh(np.array(by_process[jax.process_index()]), ("tensor",), axis_types=(AxisType.Auto,))
    if n_proc == 1:
        target = _rollout_specs(graphdef, params, local_mesh)
        return _reshard(params, target, dtype), local_mesh
    global_mesh = Mesh(np.array(by_process), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    target = _rollout_specs(graphdef, params, global_mesh)
    placed = _reshard(params, target, dtype)

    def to_local(x):
        spec = x.sharding.spec
        shards = [s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(local_mesh, spec), shards)

    return jax.tree.map(to_local, placed), local_mesh


def tokenizer_from(ctx: Any, *, needed_by: str) -> Any:
    """The run's tokenizer (ctx.tokenizer_path), with one clear error when none is configured;
    shared by the collector's and the baselines' sources. `needed_by` names the caller."""
    if not ctx.tokenizer_path:
        raise ConfigError(f"{needed_by} needs a tokenizer: set model.tokenizer (or model.hf_path)")
    from actionopd_jax.chat import load_tokenizer

    return load_tokenizer(ctx.tokenizer_path)


def behaviour_model(policy: Any, ctx: Any) -> tuple[Any, Any]:
    """(the step's behaviour snapshot as a model this process can sample with, the mesh to
    trace under): the rollout copy (`rollout_params`: bf16 on accelerators, resharded on
    device tensor-parallel over this process's devices); on a single CPU process the
    training placement as it is. Shared by every source that samples the student."""
    from flax import nnx

    params, mesh = rollout_params(policy.params, policy.graphdef)
    return nnx.merge(policy.graphdef, params), (ctx.mesh if mesh is None else mesh)


class ActionOPDGroupSource:
    """`train.sources.GroupSource` over the collector."""

    def __init__(self, cfg: Any, ctx: Any, *, teacher: Any = None, matcher: Any = None, stream: Any = None,
                 env_factory: Any = None, tokenizer: Any = None, buckets: Any = None):
        """Parts passed in replace the ones the config would build (tests, custom setups);
        `buckets`: the sampler's shape buckets (sampling.Buckets)."""
        from actionopd_jax.sampling import Sampler

        self.cfg = collector_config_from(cfg)
        self.ctx = ctx
        if tokenizer is None:
            tokenizer = tokenizer_from(ctx, needed_by="collect.kind=actionopd")
        self.tokenizer = tokenizer
        run_dir = Path(ctx.run_dir)
        if teacher is None:
            from actionopd_jax.teacher.factory import build_teacher

            cache_dir = Path(cfg.teacher.cache_dir or run_dir / "cache" / "teacher")
            cache_dir.mkdir(parents=True, exist_ok=True)
            # one SQLite file per process: no cross-host locking on shared file systems
            cache = cache_dir / f"teacher-p{ctx.process_index}.sqlite"
            spec = teacher_spec(cfg)
            if spec["provider"] == "local":
                from actionopd_jax.teacher.hf_local import build_hf_local_teacher

                teacher = build_teacher(spec, cache=cache,
                                        local=build_hf_local_teacher(cfg, ctx, tokenizer, buckets=buckets))
            else:
                teacher = build_teacher(spec, cache=cache)
        self.stream = stream if stream is not None else task_stream_from(cfg)  # the latter checks the overlap
        tasks = stream_tasks(self.stream)
        if tasks is not None:
            from actionopd_jax.envs.splits import check_eval_overlap, record_train_tasks

            if stream is not None:  # a stream passed in obeys the same rule
                check_eval_overlap(cfg.env, tasks)
            if ctx.process_index == 0:
                record_train_tasks(run_dir, tasks)
        if matcher is None:
            from actionopd_jax.teacher.factory import build_matcher

            cache_dir = Path(cfg.matcher.cache_dir or run_dir / "cache" / "matcher")
            cache_dir.mkdir(parents=True, exist_ok=True)
            matcher = build_matcher(judge_spec(cfg), cache=cache_dir / f"verdicts-p{ctx.process_index}.sqlite",
                                    evidence_by_env=tool_evidence_from(cfg, tasks))
        eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.sampler = Sampler(None, ctx.model_config, eos_ids=[eos], buckets=buckets,
                               token_budget=self.cfg.sampler_token_budget)
        settings = SamplingSettings(n=self.cfg.n, max_new_tokens=self.cfg.max_new_tokens,
                                    temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k)
        self.collector = Collector(self.cfg, tokenizer=tokenizer, teacher=teacher, matcher=matcher,
                                   sample_fn=sampler_fn(self.sampler, settings), eos_ids=[eos],
                                   env_factory=env_factory or env_factory_from(cfg))
        self.last: CollectResult | None = None

    def collect(self, step: int, policy: Any) -> list[StateGroup]:
        tasks = self.stream.next_step()
        # One behaviour snapshot for the whole step: the sampler reads this model only.
        self.sampler.model, self.sampler.mesh = behaviour_model(policy, self.ctx)
        self.last = self.collector.collect(tasks, step=step, process_index=self.ctx.process_index,
                                           process_count=self.ctx.process_count)
        return self.last.groups

    def state_dict(self) -> dict[str, Any]:
        return self.stream.get_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)

    def metrics(self) -> dict[str, float]:
        if self.last is None:
            return {}
        return {k.removeprefix("collect/"): float(v) for k, v in self.last.metrics.as_dict().items()}


def build_group_source(cfg: Any, ctx: Any) -> ActionOPDGroupSource:
    return ActionOPDGroupSource(cfg, ctx)
