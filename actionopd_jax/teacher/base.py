"""The `Teacher` protocol and the sampling rule every provider shares (paper appendix A.3).

A teacher returns up to K *valid* samples for one state, in slot order. Each requested
slot may be regenerated at most `max_regenerations` (= 2) times when the reply does not
parse to a valid action (parser or schema violation); a valid reply is kept as it is.
No valid sample at all means "no supervision" for that state: an empty list, never an
exception and never a failure label. Transport failures (the retry budget is exhausted) drop
the affected slots too, but they are recorded separately so a cache never stores them.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence, runtime_checkable

from actionopd_jax import paid_calls
from actionopd_jax.teacher.transport import TransportGaveUp
from actionopd_jax.types import ChatMessage, Invalid, TeacherSample, ToolSchema

MAX_REGENERATIONS = 2


@dataclass
class UsageReport:
    """What the teacher cost in this process: requests made, cache use, tokens."""

    http_calls: int = 0          # HTTP attempts sent (successful or not)
    transport_retries: int = 0   # attempts repeated after 429 / 5xx / timeout / bad body
    transport_failures: int = 0  # slots lost because the retry budget ran out
    malformed_replies: int = 0   # HTTP 200 bodies that were no usable completion (each retried as a transport fault)
    cache_hits: int = 0
    cache_misses: int = 0
    single_flight_joins: int = 0  # requests answered by an identical request already in flight
    regenerations: int = 0       # replies requested again because the previous one was invalid
    invalid_replies: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the vendor read from its prompt cache (cheaper)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: "UsageReport") -> "UsageReport":
        return UsageReport(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


@dataclass
class TeacherBatch:
    """The detailed answer for one state: valid samples in slot order plus what happened."""

    samples: list[TeacherSample]
    requested: int
    transport_failures: int = 0   # slots lost to transport errors (not cacheable)
    invalid_replies: int = 0
    regenerations: int = 0
    invalid_reasons: list[str] = field(default_factory=list)
    transport_error: str = ""     # the last slot's transport failure (error class and message), for the outage log

    @property
    def unanswered(self) -> bool:
        """Every slot lost to transport errors: the teacher did not answer (an outage), as
        opposed to answering with invalid replies."""
        return self.requested > 0 and self.transport_failures >= self.requested

    @property
    def cacheable(self) -> bool:
        """Only an answer where every slot reached a verdict (valid, or invalid after all
        regenerations) is a property of the state; transport losses are not."""
        return self.transport_failures == 0


@runtime_checkable
class Teacher(Protocol):
    @property
    def identity(self) -> dict[str, Any]:
        """Provider, model, prompt version and decoding settings: part of every cache key.
        Never holds secrets."""
        ...

    @property
    def usage(self) -> UsageReport: ...

    async def sample(
        self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *, key_info: dict[str, Any] | None = None
    ) -> list[TeacherSample]:
        """Up to k valid samples for the state, in slot order; [] = no supervision."""
        ...

    async def sample_detailed(
        self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *, key_info: dict[str, Any] | None = None
    ) -> TeacherBatch: ...


# A provider's generator: ask for `m` replies to the same request; return exactly m entries,
# each a parsed TeacherSample or the exception that lost that reply after transport retries.
GenerateFn = Callable[[int], Awaitable[Sequence["TeacherSample | BaseException"]]]


async def sample_with_regeneration(
    generate: GenerateFn, k: int, *, max_regenerations: int = MAX_REGENERATIONS
) -> TeacherBatch:
    """Fill k slots: round 0 asks for k replies, each later round re-asks only for the slots
    whose reply was Invalid, at most `max_regenerations` rounds. A slot lost to a transport
    error is not retried here (the transport layer already spent its retry budget)."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (teacher samples per state) must be a positive integer, got {k!r}")
    if max_regenerations < 0:
        raise ValueError(f"max_regenerations must be >= 0, got {max_regenerations}")
    slots: list[TeacherSample | None] = [None] * k
    pending = list(range(k))
    batch = TeacherBatch(samples=[], requested=k)
    for round_index in range(max_regenerations + 1):
        if not pending:
            break
        if round_index > 0:
            batch.regenerations += len(pending)
        try:
            replies = list(await generate(len(pending)))
        except TransportGaveUp as err:  # one batched (n > 1) request lost: all its slots
            replies = [err] * len(pending)
        if len(replies) != len(pending):
            raise RuntimeError(f"generator returned {len(replies)} replies for {len(pending)} requested")
        still_invalid: list[int] = []
        for slot, reply in zip(pending, replies):
            if isinstance(reply, BaseException):
                batch.transport_failures += 1
                batch.transport_error = f"{type(reply).__name__}: {reply}"
            elif isinstance(reply.action, Invalid):
                batch.invalid_replies += 1
                batch.invalid_reasons.append(reply.action.reason)
                still_invalid.append(slot)
            else:
                slots[slot] = reply
        pending = still_invalid
    batch.samples = [s for s in slots if s is not None]
    return batch


class RegeneratingSampler:
    """The `Teacher` sampling methods of the HTTP providers (OpenAI-compatible, Vertex): the
    slot/regeneration rule over the provider's `_generate(messages, tools, m)`, with what it
    cost (regenerations, invalid replies, slots lost to transport) added to the provider's
    usage. One copy so both providers count alike. The provider sets `cfg.max_regenerations`
    and `_usage` (a UsageReport)."""

    cfg: Any
    _usage: UsageReport

    async def _generate(self, messages: list[ChatMessage], tools: list[ToolSchema], m: int
                        ) -> list[TeacherSample | BaseException]:
        raise NotImplementedError

    async def sample_detailed(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                              key_info: dict[str, Any] | None = None) -> TeacherBatch:
        batch = await sample_with_regeneration(lambda m: self._generate(messages, tools, m), k,
                                               max_regenerations=self.cfg.max_regenerations)
        self._usage.regenerations += batch.regenerations
        self._usage.invalid_replies += batch.invalid_replies
        self._usage.transport_failures += batch.transport_failures
        return batch

    async def sample(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                     key_info: dict[str, Any] | None = None) -> list[TeacherSample]:
        return (await self.sample_detailed(messages, tools, k, key_info=key_info)).samples


async def batched_or_single_replies(request: Callable[[int], Awaitable[list[TeacherSample]]], m: int, *,
                                    batched: bool) -> list[TeacherSample | BaseException]:
    """m replies to one prompt: with `batched` (the API takes n / candidate_count) one request
    for m, topped up with single requests when the server returned fewer; else m single
    requests. Shared by the HTTP providers so a server that ignores n is handled the same."""
    if m > 1 and batched:
        got: list[TeacherSample | BaseException] = list((await request(m))[:m])
        if len(got) < m:
            got += await gather_replies(lambda: request(1), m - len(got))
        return got
    return await gather_replies(lambda: request(1), m)


async def paid_replies(request: Callable[[int], Awaitable[list[TeacherSample]]], m: int, *, batched: bool,
                       messages: Any, tools: Any, max_tokens: int | None) -> list[TeacherSample | BaseException]:
    """batched_or_single_replies under one reservation on the installed ledger (paid_calls.py):
    the state's m replies are reserved together against run.budget_* before any is sent, so a
    batch is paid whole or not at all (its samples then reach the teacher cache): m prompts (a
    server returning fewer than n choices is topped up with single requests) and m replies of
    max_tokens. Without a ledger, nothing is metered."""
    ledger = paid_calls.current()
    if ledger is None:
        return await batched_or_single_replies(request, m, batched=batched)
    with ledger.holding("teacher", paid_calls.prompt_token_bound(messages, tools), replies=m, requests=m,
                        max_tokens=max_tokens):
        return await batched_or_single_replies(request, m, batched=batched)


async def gather_replies(one: Callable[[], Awaitable[list[TeacherSample]]], m: int) -> list[TeacherSample | BaseException]:
    """m concurrent single-reply requests (for providers without `n`). A request whose
    transport retries ran out stays in place as its exception; any other error (a permanent
    4xx, a bug) propagates, because it is not a property of the state."""
    results = await asyncio.gather(*(one() for _ in range(m)), return_exceptions=True)
    out: list[TeacherSample | BaseException] = []
    for r in results:
        if isinstance(r, TransportGaveUp):
            out.append(r)
        elif isinstance(r, BaseException):
            raise r
        else:
            out.extend(r[:1] or [TransportGaveUp("provider returned no choices")])
    return out
