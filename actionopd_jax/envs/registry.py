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


REGISTRY: dict[str, Callable[..., Environment]] = {"bfcl": _bfcl, "tau2_": _tau2, "mcp": _mcp}


def make_environment(env_name: str, **options: Any) -> Environment:
    """Build a fresh environment for `Task.env` names: "bfcl", "tau2_airline", "tau2_retail",
    "tau2_telecom". tau2 environments need `user_sim=` (a `UserSimulator`)."""
    for name, build in REGISTRY.items():
        if env_name == name or (name.endswith("_") and env_name.startswith(name)):
            return build(env_name, **options)
    raise ValueError(f"unknown environment '{env_name}'; expected bfcl, tau2_airline, tau2_retail, tau2_telecom or mcp")


def default_env_factory(env_options: dict[str, dict[str, Any]] | None = None) -> EnvFactory:
    """A fresh environment per task start, built by `make_environment` with per-env
    options (e.g. {"tau2_airline": {"user_sim": sim}})."""
    options = dict(env_options or {})

    def make(task: Task) -> Environment:
        return make_environment(task.env, **options.get(task.env, {}))

    return make


def _pools(env: EnvConfig) -> set[str]:
    from actionopd_jax.envs.mixture import mixture_entries

    try:
        return {pool for pool, _ in mixture_entries(env)}
    except ValueError as err:
        raise ConfigError(str(err)) from None


def env_factory_from(env: EnvConfig, *, concurrency: int | None = None,
                     judge: dict[str, Any] | None = None) -> EnvFactory:
    """The environment factory of the `env` section: tau2 gets its user simulator; mcp one
    server pool of env.mcp_pool_size (0: `concurrency`, the collector's episodes in flight);
    awm its runtime (envs/awm/factory.py), whose SQL verifier asks `judge` (the run's judge
    spec, teacher.specs.judge_spec; None: such tasks score judge_error)."""
    if env.name == "mcp":
        from actionopd_jax.envs.mcp.factory import mcp_env_factory

        return mcp_env_factory(env, concurrency=concurrency)
    if env.name == "awm" and _pools(env) == {"awm"}:
        from actionopd_jax.envs.awm.factory import awm_env_factory

        return awm_env_factory(env, concurrency=concurrency, judge=judge)
    if env.name in ("awm", "envscaler"):
        # envscaler tasks load, audit and mix, but their episodes are not built yet: refuse here
        # (the run and --check both come through this), never fail later inside collection
        raise ConfigError(f"env.name={env.name} with env.mixture={list(env.mixture)}: training episodes on the "
                          "envscaler pool are not available yet (its tasks, audit and mixture are: `actionopd envs "
                          "audit`); train on awm, bfcl, tau2 or mcp")
    if env.name != "tau2":
        return default_env_factory()
    from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator

    if not env.user_model or not env.user_base_url:
        raise ConfigError("env.name=tau2 needs a user simulator: set env.user_model and env.user_base_url")
    sim = UserSimulator(UserSimConfig(base_url=env.user_base_url, model=env.user_model,
                                      api_key_env=env.user_api_key_env or None, temperature=env.user_temperature,
                                      max_tokens=env.user_max_tokens))
    return default_env_factory({f"tau2_{d}": {"user_sim": sim} for d in env.domains})
