"""Transport retries for OpenAI-compatible calls: exponential backoff with jitter, Retry-After,
bounded attempts and bounded total time. Shared by teacher providers, the LLM judge, the eval
agent and the tau2 user simulator.

Retried: 429, 408, 409, 5xx, timeouts, connection errors, and replies whose body is not a
valid completion (malformed JSON). Not retried: other 4xx (bad request, auth, not found):
they are raised at once as `PermanentRequestError`, because repeating them only costs money.
Error messages carry the status and the server's message, never request headers (the API
key lives only in the client's Authorization header).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


def _openai_error(err: BaseException, *names: str) -> bool:
    """Whether `err` is one of the openai SDK's errors `names`. The SDK is not imported here: an
    error of it exists only where a client has loaded it, and importing the transport must
    not need it (the device check runs the trainer where the client is not installed)."""
    sdk = sys.modules.get("openai")
    return sdk is not None and isinstance(err, tuple(getattr(sdk, n) for n in names))


class TransportGaveUp(Exception):
    """The retry budget (attempts or total time) ran out; the request produced no answer."""


class PermanentRequestError(Exception):
    """A 4xx that repeating will not fix (bad request, authentication, unknown model)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class MalformedResponse(Exception):
    """HTTP 200 whose body is not a usable chat completion."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6          # total attempts, first one included
    base_delay_s: float = 1.0      # backoff before retry r (1-based) is base * 2**(r-1) ...
    max_delay_s: float = 60.0      # ... capped here, then jittered into [cap/2, cap]
    max_total_s: float = 600.0     # wall-clock bound over all attempts and waits
    max_retry_after_s: float = 300.0  # a longer Retry-After than this gives up at once

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0 or self.max_total_s <= 0:
            raise ValueError("RetryPolicy delays must be >= 0 and max_total_s > 0")


@dataclass
class RetryStats:
    attempts: int = 0
    retries: int = 0


def retry_after_seconds(headers: Any) -> float | None:
    """Parse `retry-after-ms` or `Retry-After` (seconds or an HTTP date); None if absent/bad."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def classify(err: BaseException) -> tuple[bool, float | None]:
    """(retryable, retry_after_seconds) for an exception raised by one attempt."""
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)) or _openai_error(err, "APITimeoutError", "APIConnectionError"):
        return True, None
    if _openai_error(err, "APIStatusError"):
        status = err.status_code
        headers = getattr(err.response, "headers", None)
        if status in (408, 409, 429) or status >= 500:
            return True, retry_after_seconds(headers)
        return False, None
    if isinstance(err, (MalformedResponse, json.JSONDecodeError)) or _openai_error(err, "APIResponseValidationError"):
        return True, None
    return False, None


def describe(err: BaseException) -> str:
    """A short, secret-free description of a failed attempt, naming its error class (an outage
    message says what kind of failure it was: a closed port, a timeout, a 5xx)."""
    if _openai_error(err, "APIStatusError"):
        return f"{type(err).__name__} HTTP {err.status_code}: {str(err.message)[:300]}"
    return f"{type(err).__name__}: {str(err)[:300]}"


def backoff_delay(retry_number: int, policy: RetryPolicy, rng: random.Random) -> float:
    """Equal-jitter exponential backoff: cap = min(max, base * 2**(r-1)); uniform in [cap/2, cap]."""
    cap = min(policy.max_delay_s, policy.base_delay_s * (2 ** (retry_number - 1)))
    return cap / 2 + rng.uniform(0, cap / 2)


async def call_with_retries(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    rng: random.Random,
    stats: RetryStats | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    classify_error: Callable[[BaseException], tuple[bool, float | None]] = classify,
) -> T:
    """Run `attempt` until it succeeds, a permanent error occurs, or the budget runs out.

    Each attempt runs under the remaining total-time budget, so the whole call is bounded by
    `policy.max_total_s` even if the server hangs.
    """
    stats = stats if stats is not None else RetryStats()
    start = time.monotonic()
    last = "no attempt made"
    for attempt_index in range(policy.max_attempts):
        remaining = policy.max_total_s - (time.monotonic() - start)
        if remaining <= 0:
            break
        stats.attempts += 1
        try:
            return await asyncio.wait_for(attempt(), timeout=remaining)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - classified below, re-raised if not transport
            retryable, retry_after = classify_error(err)
            if not retryable:
                if _openai_error(err, "APIStatusError"):
                    raise PermanentRequestError(err.status_code, str(err.message)[:500]) from None
                status = getattr(err, "code", None)  # google-genai APIError
                if isinstance(status, int) and 400 <= status < 500:
                    raise PermanentRequestError(status, str(getattr(err, "message", err))[:500]) from None
                raise
            last = describe(err)
        if attempt_index + 1 >= policy.max_attempts:
            break
        delay = backoff_delay(attempt_index + 1, policy, rng)
        if retry_after is not None:
            if retry_after > policy.max_retry_after_s:
                last += f" (Retry-After {retry_after:.0f}s exceeds the {policy.max_retry_after_s:.0f}s limit)"
                break
            delay = max(delay, retry_after)
        if time.monotonic() - start + delay >= policy.max_total_s:
            last += " (next wait would exceed the total time budget)"
            break
        stats.retries += 1
        await sleep(delay)
    elapsed = time.monotonic() - start
    raise TransportGaveUp(f"gave up after {stats.attempts} attempt(s) in {elapsed:.1f}s; last error: {last}")
