"""The `env` section (env.name=mcp) -> one server pool and a per-task-start `McpEnv` factory,
with the matcher's tool evidence read from the server (`tool_evidence(tasks)`)."""

from __future__ import annotations

import json
from pathlib import Path

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


def load_tool_sources(path: str) -> dict[str, str]:
    """env.mcp_tool_sources: tool name -> implementation source. A value with a line break is
    the source itself; any other value names a file, relative to the mapping file."""
    if not path:
        return {}
    where = f"env.mcp_tool_sources={path}"
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err.strerror or err}); give a JSON or YAML file mapping "
                          "each tool name to its source file or source text, or leave it empty") from None
    kind = "JSON" if file.suffix.lower() == ".json" else "YAML"
    try:
        if kind == "JSON":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # noqa: BLE001 - json's and yaml's parse errors
        raise ConfigError(f"{where}: not valid {kind}: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.strip()
                                             for k, v in data.items()):
        raise ConfigError(f"{where}: expected a mapping of tool name -> source file path or source text "
                          f"(non-empty strings), got {type(data).__name__}")
    out = {}
    for name, value in data.items():
        if "\n" in value.strip():
            out[name] = value.strip("\n")
            continue
        src = (file.parent / value).resolve()
        try:
            out[name] = src.read_text(encoding="utf-8").strip("\n")
        except OSError as err:
            raise ConfigError(f"{where}: tool {name!r}: cannot read its source file {src} ({err.strerror or err}); "
                              "paths are relative to the mapping file; inline source text must span "
                              "several lines") from None
    return out


def mcp_env_factory(env: EnvConfig, *, concurrency: int | None = None):
    """A factory building `McpEnv`s over one shared pool (started lazily, closed at exit)."""
    spec = server_spec(env)
    sources = load_tool_sources(env.mcp_tool_sources)
    size = env.mcp_pool_size or concurrency or DEFAULT_POOL_SIZE
    try:
        pool = McpPool(spec, size=size, reset=env.mcp_reset)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    def make(task) -> McpEnv:
        return McpEnv(pool)

    def tool_evidence(tasks) -> dict[str, dict[str, str]]:
        """Evidence scope (the tasks' env, "mcp") -> tool name -> description + input schema
        (+ the configured source), read from one server's tool list; the reset tool, hidden
        from the agent, is left out."""
        from actionopd_jax.envs.evidence import evidence_scope

        scopes = sorted({evidence_scope(t) for t in tasks if t.env == "mcp"})
        if not scopes:
            return {}
        evidence = pool.evidence(sources)
        if pool.reset_kind == "tool":
            evidence.pop(pool.reset_arg, None)
        unknown = sorted(set(sources) - set(evidence))
        if unknown:
            raise ConfigError(f"env.mcp_tool_sources={env.mcp_tool_sources} gives sources for {unknown}, which the "
                              f"server does not list (its tools: {sorted(evidence)}); fix the names")
        return {scope: dict(evidence) for scope in scopes}

    make.pool = pool  # for callers that want stats or an early close
    make.tool_evidence = tool_evidence
    make.warm = lambda tasks: pool.warm()
    make.close = pool.close
    return make
