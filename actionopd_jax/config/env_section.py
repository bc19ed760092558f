"""The environment the student acts in: the `env:` section of the run config (benchmarks, task
pools, the training user simulator, MCP servers).

A leaf of the config package (config.schema assembles `Config` from it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvConfig:
    name: str = "synthetic"  # "bfcl" | "tau2" | "mcp" | "awm" | "envscaler" | "synthetic"
    domains: tuple[str, ...] = ()
    split: str = "train"  # tau2: official "train" (178 tasks) | "test" (100) | "base"; BFCL has no splits
    # explicit training tasks (ids of the env's tasks; empty: all of domains/split) and the tasks
    # this run's own evaluation scores; an explicit disjoint pair is the way to train on BFCL
    task_ids: tuple[str, ...] = ()
    heldout_task_ids: tuple[str, ...] = ()
    # training on tasks `eval` scores (all of BFCL, tau2's test split) is refused unless this is set
    allow_eval_overlap: bool = False
    user_model: str = ""
    user_base_url: str = ""
    user_api_key_env: str = ""
    user_temperature: float = 0.7
    user_top_p: float = 0.8
    user_top_k: int = 20
    user_max_tokens: int = 8192
    user_provider: str = ""  # as teacher.provider ("": openai): how top_k and the thinking switch are sent
    user_enable_thinking: bool | None = False  # paper table 8: user simulator thinking off; null: no switch
    user_price: tuple[float, ...] = ()  # as teacher.price
    # env.name=mcp: any MCP tool server (actionopd_jax/envs/mcp). The server is a sandboxed
    # stdio command (mcp_command, an argv; an argument "{port}" makes it an HTTP server on a
    # free loopback port) or an existing streamable-HTTP endpoint (mcp_url). Tasks come from a
    # JSON-lines file (tasks_file; env.split selects a split, "all" every task).
    mcp_command: tuple[str, ...] = ()
    mcp_url: str = ""
    mcp_reset: str = "fresh"  # between episodes: "fresh" (new server) | "tool:NAME" | "command:ARGV"
    mcp_call_timeout_s: float = 30.0  # per tools/call (then the server is replaced), per EnvScaler method call
    mcp_pool_size: int = 0  # servers at most; 0: collect.concurrency (a url-only server shares its
    # state across sessions unless it keeps state per session: give it a pool of 1)
    # matcher evidence (paper A.3) beyond each tool's description + input schema: a JSON / YAML
    # file mapping tool name -> its implementation's source, as a file path (relative to the
    # mapping file) or the source text itself (several lines); "" = schemas only
    mcp_tool_sources: str = ""
    tasks_file: str = ""
    # AWM / EnvScaler pools (docs/formats.md): directories in the published layouts, the manifest of
    # admitted task ids `actionopd envs audit` writes, and the per-step mixture as "<pool>:<count>"
    # entries (paper: ["awm:59", "envscaler:5"]; empty: the whole step from env.name's pool)
    awm_dir: str = ""
    envscaler_dir: str = ""
    manifest: str = ""
    mixture: tuple[str, ...] = ()
    # paper B.1: the pools' training tasks must carry current feasibility-screen records in
    # env.manifest (`actionopd envs screen`). true: refuse to train otherwise (the paper recipes);
    # false: the explicit way out, a warning every run; null (unset): the same warning
    require_screening: bool | None = None
    # which EnvScaler scenarios are played with the user simulator (env.user_*): "all", "none", or
    # task ids (exactly those); empty: each record's own "conversational" mark, else conversational,
    # as the paper plays the pool (the published records carry no mode: envs/envscaler/mode.py)
    envscaler_conversational: tuple[str, ...] = ()
