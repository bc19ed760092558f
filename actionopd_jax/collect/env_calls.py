"""The environment side of one trajectory, as the collector calls it.

Every call into an environment runs under `collect.env_timeout_s` and turns any failure into
`EnvFailure` carrying an end reason (an environment may name its own, e.g. MCP's
`mcp_timeout`), so one broken episode ends with a reason instead of sinking the step; ending
and scoring an episode never raise either (a scorer bug must not lose the collected groups).
These rules live apart from collector.py because both schedules share them: the async
collector and the sequential baseline (naive.py) end and score episodes the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from actionopd_jax.collect.metrics import TrajectoryRecord
from actionopd_jax.envs.base import Environment
from actionopd_jax.types import Observation, Task

log = logging.getLogger("actionopd_jax.collect.collector")   # the collector's log, as before the split


class EnvFailure(Exception):
    """An environment call failed or timed out; `reason` is the trajectory's end reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


async def env_call(coro, timeout_s: float, rec: TrajectoryRecord) -> Observation:
    """Await an environment's reset/step under `timeout_s`, adding its latency to `rec.env_s`;
    returns the observation (a step's (observation, info) tuple is unwrapped)."""
    t0 = time.perf_counter()
    try:
        result = await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise EnvFailure("env_timeout", f"environment call exceeded {timeout_s}s") from None
    except Exception as err:  # noqa: BLE001
        # an environment may name its failure (e.g. MCP's mcp_timeout / mcp_connection_lost)
        reason = getattr(err, "end_reason", None)
        raise EnvFailure(reason if isinstance(reason, str) and reason else "env_error",
                         f"{type(err).__name__}: {err}") from err
    finally:
        rec.env_s += time.perf_counter() - t0
    return result[0] if isinstance(result, tuple) else result


def prefetch(env_factory: Any, tasks: Sequence[Task]) -> None:
    """Ask the environment factory to start these task starts' servers in the background, where
    it can (`env_factory.prefetch`, e.g. AWM); a failure is logged, never raised."""
    start = getattr(env_factory, "prefetch", None)
    if callable(start) and tasks:
        try:
            start(list(tasks))
        except Exception as err:  # noqa: BLE001 - a missed prefetch only costs a cold start
            log.warning("environment prefetch failed (%s: %s)", type(err).__name__, err)


def safe_end(env: Environment | None, reason: str) -> None:
    # Tell the environment the episode is over so its score names the reason; an
    # environment broken enough to fail here is scored as it stands.
    if env is None:
        return
    try:
        env.end(reason)
    except Exception as err:  # noqa: BLE001
        log.debug("env.end(%r) failed: %s", reason, err)


def safe_score(env: Environment, end_reason: str) -> dict[str, Any]:
    try:
        return dict(env.score())
    except Exception as err:  # noqa: BLE001 - a scorer bug must not lose the collected groups
        log.warning("scoring failed (%s: %s)", type(err).__name__, err)
        return {"reward": float("nan"), "end_reason": end_reason, "score_error": f"{type(err).__name__}: {err}"}
