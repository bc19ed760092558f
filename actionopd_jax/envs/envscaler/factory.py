"""The `env` section -> a factory of EnvScaler environments: one sandbox for every episode (each
episode's class instance is its own contained process), and the user simulator when any task
the run can start is conversational."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment, EpisodeConfig
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.types import Task


def envscaler_env_factory(env: EnvConfig, tasks: Sequence[Task] | None, *,
                          user_sim_from: Callable[[EnvConfig], Any]) -> Callable[[Task], EnvScalerEnvironment]:
    """`tasks`: what the run can start (None: unknown, so the simulator is built when configured).
    `user_sim_from(env)` builds the run's user simulator (envs/registry.py, shared with tau2)."""
    conversational = [t.task_id for t in tasks or () if (t.payload or {}).get("conversational")]
    user_sim = None
    if conversational or (tasks is None and env.user_model):
        if not env.user_model or not env.user_base_url:
            raise ConfigError(f"{len(conversational)} EnvScaler task(s) are conversational (e.g. {conversational[0]}): "
                              "they need a user simulator; set env.user_model and env.user_base_url (paper table 8: "
                              "DeepSeek-V4-Flash, thinking off, T=1)")
        user_sim = user_sim_from(env)
    sandbox = SubprocessSandbox()
    config = EpisodeConfig(call_timeout_s=env.mcp_call_timeout_s)

    def make(task: Task) -> EnvScalerEnvironment:
        if task.env != "envscaler":
            raise ValueError(f"the EnvScaler environment factory got a {task.env!r} task ({task.task_id})")
        return EnvScalerEnvironment(sandbox, user_sim=user_sim, config=config)

    return make
