"""The `env` section -> a factory of EnvScaler environments: one sandbox for every episode (each
episode's class instance is its own contained process), and the user simulator when any task
the run can start is conversational. `conversational_summary` is the `train --check` line on
the same decision: how many scenarios play with the simulator, and which simulator."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from actionopd_jax.config import ConfigError, EnvConfig
from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment, EpisodeConfig
from actionopd_jax.envs.sandbox import SubprocessSandbox
from actionopd_jax.types import Task


def _conversational(tasks: Sequence[Task] | None) -> list[str]:
    return [t.task_id for t in tasks or () if (t.payload or {}).get("conversational")]


def _why(tasks: Sequence[Task]) -> str:
    """Why these tasks are conversational, counted (envs/envscaler/mode.py)."""
    counts = Counter((t.payload or {}).get("conversational_by") or "the caller" for t in tasks)
    return ", ".join(f"{n} by {why}" for why, n in counts.most_common())


def user_sim_label(env: EnvConfig) -> str:
    """The simulator every conversational task is played with: model, endpoint, sampling."""
    thinking = {True: "thinking on", False: "thinking off", None: "no thinking switch"}[env.user_enable_thinking]
    return (f"{env.user_model} at {env.user_base_url} (T={env.user_temperature:g}, top_p={env.user_top_p:g}, "
            f"top_k={env.user_top_k}, {thinking})")


def require_user_sim(env: EnvConfig, conversational: list[str], tasks: Sequence[Task]) -> None:
    """Refuse conversational tasks without a user simulator endpoint: they would otherwise
    be refused one by one at every start (and never silently run as one-turn tasks)."""
    if conversational and not (env.user_model and env.user_base_url):
        convs = [t for t in tasks if t.task_id in set(conversational)]
        raise ConfigError(f"{len(conversational)} EnvScaler task(s) are conversational ({_why(convs)}; e.g. "
                          f"{conversational[0]}): they are played with a user simulator, and none is configured. Set "
                          "env.user_model and env.user_base_url (paper table 8: DeepSeek-V4-Flash, thinking off, "
                          "T=1), or set env.envscaler_conversational (none, or the ids to play with a user) to play "
                          "the others as one-turn tasks")


def conversational_summary(env: EnvConfig, tasks: Sequence[Task]) -> str:
    """'envscaler  6 training scenarios: 1 conversational (...), each played with the user
    simulator M at U (...); 5 one-turn' for `train --check`."""
    conv = sorted(_conversational(tasks))
    one_turn = len(tasks) - len(conv)
    line = f"envscaler  {len(tasks)} training scenario(s): {len(conv)} conversational"
    if conv:
        convs = [t for t in tasks if t.task_id in set(conv)]
        named = f"{', '.join(conv[:5])}{', ...' if len(conv) > 5 else ''}; {_why(convs)}"
        sim = user_sim_label(env) if env.user_model and env.user_base_url else "NO user simulator configured"
        line += f" ({named}), each played with the user simulator {sim}"
    return line + f"; {one_turn} one-turn (the task text is the only user turn)"


def envscaler_env_factory(env: EnvConfig, tasks: Sequence[Task] | None, *,
                          user_sim_from: Callable[[EnvConfig], Any]) -> Callable[[Task], EnvScalerEnvironment]:
    """`tasks`: what the run can start (None: unknown, so the simulator is built when configured).
    `user_sim_from(env)` builds the run's user simulator (envs/registry.py, shared with tau2)."""
    conversational = _conversational(tasks)
    require_user_sim(env, conversational, tasks or ())
    user_sim = None
    if conversational or (tasks is None and env.user_model):
        if not env.user_base_url:
            raise ConfigError("env.user_model is set without env.user_base_url: set the user simulator's endpoint")
        user_sim = user_sim_from(env)
    sandbox = SubprocessSandbox()
    config = EpisodeConfig(call_timeout_s=env.mcp_call_timeout_s)

    def make(task: Task) -> EnvScalerEnvironment:
        if task.env != "envscaler":
            raise ValueError(f"the EnvScaler environment factory got a {task.env!r} task ({task.task_id})")
        return EnvScalerEnvironment(sandbox, user_sim=user_sim, config=config)

    return make
