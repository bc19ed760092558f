"""How a run is kept and capped: the `checkpoint:` and `run:` (with `run.distributed:`) sections.

A leaf of the config package (config.schema assembles `Config` from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1
    keep: int = 3
    async_save: bool = True
    save_on_sigterm: bool = True
    dir: str = ""  # default: <run dir>/checkpoints


@dataclass(frozen=True)
class DistributedConfig:
    mode: str = "auto"  # "auto" (initialize on a TPU pod / when an address is given) | "on" | "off"
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    initialization_timeout_s: int = 300


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny_cpu"
    root: str = "runs"
    dir: str = ""  # explicit run directory (default: <root>/<utc>-<name>)
    seed: int = 0  # every PRNG key of the run is folded from this
    log_every: int = 1
    tensorboard: bool = True
    wandb_project: str = ""  # W&B logging when set and wandb is installed
    progress: bool = True
    # JAX's persistent compile cache ("": JAX_COMPILATION_CACHE_DIR if set, else
    # ~/.cache/actionopd_jax/jax_compile; "none": off); see actionopd_jax/compile_cache.py
    compile_cache_dir: str = ""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # caps over the whole run (resumes included); 0: none. budget_usd: the money of every priced
    # role (teacher.price, matcher.price, env.user_price); budget_<role>_tokens: that role's
    # prompt + completion tokens (the judge is the matcher's). Checked before each step against
    # what the last step took: the run stops at a step boundary, saved, exit 3; raise and rerun
    budget_usd: float = 0.0
    budget_teacher_tokens: int = 0
    budget_matcher_tokens: int = 0
    budget_user_tokens: int = 0
