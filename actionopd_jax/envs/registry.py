"""Which environment answers a `Task.env` name: one factory per benchmark family, and the
per-run environment factory the `env` config section asks for.

The registry sits above the environments (bfcl.py, tau2_env.py import base.py, never this
module), so adding a benchmark is one entry here and no environment imports another.
"""

from __future__ import annotations

from typing import Any, Callable

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.base import Environment
from actionopd_jax.types import Task

EnvFactory = Callable[[Task], Environment]


def _bfcl(env_name: str, **options: Any) -> Environment:
    from actionopd_jax.envs.bfcl import BFCLEnv

    return BFCLEnv(**options)


def _tau2(env_name: str, **options: Any) -> Environment:
    from actionopd_jax.envs.tau2_env import Tau2Env

    return Tau2Env(domain=env_name[len("tau2_"):], **options)


# Task.env name (or a "<prefix>_" family) -> builder(env_name, **options)
def _mcp(env_name: str, **options: Any) -> Environment:
    from actionopd_jax.envs.mcp.env import McpEnv

    return McpEnv(**options)  # needs pool= (an McpPool); env_factory_from builds one


def _envscaler(env_name: str, **options: Any) -> Environment:
    from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment
    from actionopd_jax.envs.sandbox import SubprocessSandbox

    options.setdefault("sandbox", SubprocessSandbox())
    return EnvScalerEnvironment(**options)  # conversational tasks need user_sim=


REGISTRY: dict[str, Callable[..., Environment]] = {"bfcl": _bfcl, "tau2_": _tau2, "mcp": _mcp,
                                                   "envscaler": _envscaler}


def make_environment(env_name: str, **options: Any) -> Environment:
    """Build a fresh environment for `Task.env` names: "bfcl", "tau2_airline", "tau2_retail",
    "tau2_telecom". tau2 environments need `user_sim=` (a `UserSimulator`)."""
    for name, build in REGISTRY.items():
        if env_name == name or (name.endswith("_") and env_name.startswith(name)):
            return build(env_name, **options)
    raise ValueError(f"unknown environment '{env_name}'; expected bfcl, tau2_airline, tau2_retail, tau2_telecom, mcp or envscaler")


def default_env_factory(env_options: dict[str, dict[str, Any]] | None = None) -> EnvFactory:
    """A fresh environment per task start, built by `make_environment` with per-env
    options (e.g. {"tau2_airline": {"user_sim": sim}})."""
    options = dict(env_options or {})

    def make(task: Task) -> Environment:
        return make_environment(task.env, **options.get(task.env, {}))

    return make


def user_sim_config(env: EnvConfig):
    """The user simulator's settings from env.user_* (tau2, conversational EnvScaler): every sampling
    setting is sent; user_max_tokens 0 sends no limit (table 8 gives none for EnvScaler's user)."""
    from actionopd_jax.envs.user_sim import UserSimConfig

    return UserSimConfig(base_url=env.user_base_url, model=env.user_model, api_key_env=env.user_api_key_env or None,
                         provider=env.user_provider or "openai", temperature=env.user_temperature,
                         top_p=env.user_top_p, top_k=env.user_top_k or None, thinking=env.user_enable_thinking,
                         max_tokens=env.user_max_tokens or None)


def user_sim_from(env: EnvConfig):
    """The run's user simulator from env.user_* (tau2 and conversational EnvScaler tasks)."""
    from actionopd_jax.envs.user_sim import UserSimulator

    return UserSimulator(user_sim_config(env))


def pool_env_factory(env: EnvConfig, *, concurrency: int | None = None, judge: dict[str, Any] | None = None,
                     tasks: list[Task] | None = None) -> EnvFactory:
    """One factory for every pool env.mixture draws from (or env.name's pool): a task start is
    built by its own pool's factory (Task.env), so one collection step mixes AWM and EnvScaler
    episodes. `tasks`: the tasks the run can start (default: the manifest's training tasks).
    It exposes the pools' `tool_evidence(tasks)`, `warm(tasks)`, `prefetch(tasks)` and `close()`
    (AWM's servers)."""
    from actionopd_jax.envs.mixture import mixture_entries, mixture_pool_tasks

    pools = [p for p, _ in mixture_entries(env)]
    if tasks is not None:
        by_pool = {p: [t for t in tasks if t.env == p] for p in pools}
    else:  # AWM's factory reads its own manifest entry; EnvScaler needs its tasks (conversational?)
        by_pool = mixture_pool_tasks(env) if "envscaler" in pools else {}
    factories: dict[str, EnvFactory] = {}
    for pool in pools:
        if pool == "envscaler":
            from actionopd_jax.envs.envscaler.factory import envscaler_env_factory

            factories[pool] = envscaler_env_factory(env, by_pool.get(pool, []), user_sim_from=user_sim_from)
        else:
            from actionopd_jax.envs.awm.factory import awm_env_factory

            factories[pool] = awm_env_factory(env, concurrency=concurrency, judge=judge)

    if len(factories) == 1:
        return next(iter(factories.values()))  # one pool: its own factory (AWM's exposes its runtime)

    def make(task: Task) -> Environment:
        build = factories.get(task.env)
        if build is None:
            raise ValueError(f"task {task.task_id} is from {task.env!r}, not a pool of env.mixture {pools}")
        return build(task)

    def each(name: str):
        return [f for f in (getattr(g, name, None) for g in factories.values()) if callable(f)]

    def tool_evidence(tasks: list[Task]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for f in each("tool_evidence"):
            out.update(f(tasks))
        return out

    make.factories = factories
    make.tool_evidence = tool_evidence
    make.warm = lambda tasks: [f(tasks) for f in each("warm")]
    make.prefetch = lambda tasks: [f(tasks) for f in each("prefetch")]
    make.close = lambda: [f() for f in each("close")]
    return make


def close_env_factory(make: Any) -> None:
    """End a factory's pools now (AWM's and MCP's servers, with their directories) instead of at
    the process's exit, which a test worker or a notebook reaches late and a killed worker
    never. The rule: whoever built a factory closes it; one passed in is its caller's."""
    close = getattr(make, "close", None)
    if callable(close):
        close()


def env_factory_from(env: EnvConfig, *, concurrency: int | None = None,
                     judge: dict[str, Any] | None = None) -> EnvFactory:
    """The environment factory of the `env` section: tau2 gets its user simulator; mcp one
    server pool of env.mcp_pool_size (0: `concurrency`, the collector's episodes in flight);
    the AWM / EnvScaler pools one factory per pool of the mixture (pool_env_factory; AWM's
    runtime, envs/awm/factory.py, asks `judge`, the run's judge spec, for its SQL verifiers)."""
    if env.name == "mcp":
        from actionopd_jax.envs.mcp.factory import mcp_env_factory

        return mcp_env_factory(env, concurrency=concurrency)
    if env.name in ("awm", "envscaler"):
        return pool_env_factory(env, concurrency=concurrency, judge=judge)
    if env.name != "tau2":
        return default_env_factory()
    if not env.user_model or not env.user_base_url:
        raise ConfigError("env.name=tau2 needs a user simulator: set env.user_model and env.user_base_url")
    sim = user_sim_from(env)
    return default_env_factory({f"tau2_{d}": {"user_sim": sim} for d in env.domains})
