"""Collector settings as plain data, with the paper's variants as presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from actionopd_jax.collect.group import CommitMode
from actionopd_jax.rewards import RewardConfig

Variant = Literal["actionopd", "validity", "binary", "random_commit"]
VARIANTS: tuple[str, ...] = ("actionopd", "validity", "binary", "random_commit")


@dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    seed: int                              # root of every PRNG key of collection (required)
    # Student sampling: required, with no defaults here. The run config's `collect` section
    # (config/schema.py) is the one source of these values, through
    # collect.source.collector_config_from; a second set of defaults here once disagreed with
    # it (paper table 8's 0.6/0.95/20 here against the tiny job's 1.0/1.0/0 there).
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    enable_thinking: bool
    n: int = 4                             # student candidates per state (paper N)
    reward: RewardConfig = field(default_factory=RewardConfig)   # K, lambda, reward mode
    commit: CommitMode = "argmax"          # "random": the random-commit ablation
    truncated_is_invalid: bool = True      # a reply cut at max_new_tokens is not an action
    max_prompt_tokens: int = 32768         # context budget of the rendered prompt
    # concurrency and batching
    max_trajectories_in_flight: int = 64
    max_states_per_call: int = 64          # states in one device call (the sampler chunks further)
    sampler_coalesce_s: float = 0.005      # keep gathering states that arrive this close together ...
    sampler_max_wait_s: float = 0.05       # ... for at most this long before a device call
    # the sampler splits a call's states into device calls that fit this many cache-token
    # equivalents (sampling/budget.py): "auto" = from the accelerator's free memory at each
    # call (none on CPU); an int: that budget; None: by the sampler's buckets only
    sampler_token_budget: int | str | None = "auto"
    # per-trajectory decision caps by environment-name prefix (paper: tau2 20; BFCL keeps
    # its native per-turn limit of 20 inside the environment, so no total cap: None)
    decision_limits: tuple[tuple[str, int | None], ...] = (("tau2_", 20), ("bfcl", None))
    default_decision_limit: int = 40
    # timeouts around external calls (seconds); they bound every wait, so nothing hangs
    teacher_timeout_s: float = 1800.0
    matcher_timeout_s: float = 900.0
    env_timeout_s: float = 600.0
    progress: bool = True                  # tqdm bar over this process's trajectories

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"CollectorConfig.seed must be a non-negative int, got {self.seed!r}")
        if self.n < 1:
            raise ValueError(f"n (candidates per state) must be >= 1, got {self.n}")
        if self.commit not in ("argmax", "random"):
            raise ValueError(f"commit must be 'argmax' or 'random', got {self.commit!r}")
        if self.max_trajectories_in_flight < 1 or self.max_states_per_call < 1:
            raise ValueError("max_trajectories_in_flight and max_states_per_call must be >= 1")
        if self.default_decision_limit < 1:
            raise ValueError("default_decision_limit must be >= 1")
        for prefix, limit in self.decision_limits:
            if limit is not None and limit < 1:
                raise ValueError(f"decision limit for '{prefix}' must be >= 1 or None, got {limit}")
        tb = self.sampler_token_budget
        if not (tb is None or tb == "auto" or (isinstance(tb, int) and not isinstance(tb, bool) and tb > 0)):
            raise ValueError(f"sampler_token_budget must be 'auto', None or a positive int, got {tb!r}")
        if self.sampler_coalesce_s < 0 or self.sampler_max_wait_s < 0:
            raise ValueError("sampler_coalesce_s and sampler_max_wait_s must be >= 0")
        for name in ("teacher_timeout_s", "matcher_timeout_s", "env_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def k(self) -> int:
        return self.reward.k

    def decision_limit(self, env_name: str) -> int | None:
        """Cap on decisions of one trajectory in `env_name`; None: the environment's own limits."""
        for prefix, limit in self.decision_limits:
            if env_name.startswith(prefix):
                return limit
        return self.default_decision_limit

    def with_variant(self, variant: Variant) -> "CollectorConfig":
        """The paper's ablations (B.4) on top of this config."""
        if variant == "actionopd":
            return dataclasses.replace(self, reward=dataclasses.replace(self.reward, mode="actionopd"), commit="argmax")
        if variant == "validity":
            return dataclasses.replace(self, reward=dataclasses.replace(self.reward, mode="validity"), commit="argmax")
        if variant == "binary":
            return dataclasses.replace(self, reward=dataclasses.replace(self.reward, mode="binary"), commit="argmax")
        if variant == "random_commit":
            return dataclasses.replace(self, reward=dataclasses.replace(self.reward, mode="actionopd"), commit="random")
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
