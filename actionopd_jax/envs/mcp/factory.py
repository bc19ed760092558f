"""The `env` section (env.name=mcp) -> one server pool and a per-task-start `McpEnv` factory."""

from __future__ import annotations

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.mcp.client import ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.pool import McpPool, parse_reset

DEFAULT_POOL_SIZE = 8  # when neither env.mcp_pool_size nor the collector's concurrency is known


def server_spec(env: EnvConfig) -> ServerSpec:
    if bool(env.mcp_command) == bool(env.mcp_url) and not any("{port}" in a for a in env.mcp_command):
        raise ConfigError("env.name=mcp needs exactly one of env.mcp_command (stdio) and env.mcp_url "
                          "(streamable HTTP), or both with a '{port}' argument in the command")
    try:
        parse_reset(env.mcp_reset)
        return ServerSpec(command=tuple(env.mcp_command), url=env.mcp_url, call_timeout_s=env.mcp_call_timeout_s)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def mcp_env_factory(env: EnvConfig, *, concurrency: int | None = None):
    """A factory building `McpEnv`s over one shared pool (started lazily, closed at exit)."""
    spec = server_spec(env)
    size = env.mcp_pool_size or concurrency or DEFAULT_POOL_SIZE
    try:
        pool = McpPool(spec, size=size, reset=env.mcp_reset)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    def make(task) -> McpEnv:
        return McpEnv(pool)

    make.pool = pool  # for callers that want stats or an early close
    return make
