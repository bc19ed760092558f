"""A teacher wrapped with the persistent cache and single-flight de-duplication.

- Cache hit: the stored samples come back (marked `from_cache`), no provider call.
- Single flight: identical requests in flight at the same time share one provider call
  (the first caller does the work; the others await its result).
- Only complete answers are stored (`TeacherBatch.cacheable`): samples lost to transport
  errors would otherwise be frozen into every later run. An answer whose every slot was
  invalid after regeneration IS stored (as an empty multiset): it is what the teacher
  produced for this state, and a warm rerun must reproduce the same "no supervision".
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from actionopd_jax.teacher.base import Teacher, TeacherBatch, UsageReport
from actionopd_jax.teacher.cache import PersistentCache, teacher_cache_key
from actionopd_jax.types import ChatMessage, TeacherSample, ToolSchema


class CachedTeacher:
    def __init__(self, inner: Teacher, cache: PersistentCache | None):
        self.inner = inner
        self.cache = cache
        self._in_flight: dict[str, asyncio.Future[TeacherBatch]] = {}
        self._hits = UsageReport()

    @property
    def identity(self) -> dict[str, Any]:
        return self.inner.identity

    async def aclose(self) -> None:
        """Close the provider's HTTP client on the running loop (where it has one)."""
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()

    @property
    def usage(self) -> UsageReport:
        """Provider usage plus this wrapper's cache hits / misses / joins."""
        return self.inner.usage.add(self._hits)

    def key(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, key_info: dict[str, Any] | None) -> str:
        return teacher_cache_key(messages=messages, tools=tools, identity=self.identity, k=k, key_info=key_info)

    async def sample(
        self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *, key_info: dict[str, Any] | None = None
    ) -> list[TeacherSample]:
        return (await self.sample_detailed(messages, tools, k, key_info=key_info)).samples

    async def sample_detailed(
        self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *, key_info: dict[str, Any] | None = None
    ) -> TeacherBatch:
        key = self.key(messages, tools, k, key_info)
        if self.cache is not None:
            stored = self.cache.get_samples(key)
            if stored is not None:
                self._hits.cache_hits += 1
                return TeacherBatch(samples=stored, requested=k)
        pending = self._in_flight.get(key)
        if pending is not None:
            self._hits.single_flight_joins += 1
            batch = await asyncio.shield(pending)
            return _copy_batch(batch)
        self._hits.cache_misses += 1
        future: asyncio.Future[TeacherBatch] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            batch = await self.inner.sample_detailed(messages, tools, k, key_info=key_info)
            if self.cache is not None and batch.cacheable:
                ident = self.identity
                self.cache.put_samples(key, batch.samples, provider=str(ident.get("provider", "")),
                                       model=str(ident.get("model", "")))
            future.set_result(batch)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as err:
            future.set_exception(err)
            future.exception()  # mark retrieved: joiners re-raise it; no "never retrieved" warning
            raise
        finally:
            del self._in_flight[key]
        return batch


def _copy_batch(batch: TeacherBatch) -> TeacherBatch:
    # Joiners get their own sample objects, so a caller mutating one cannot affect another.
    return TeacherBatch(samples=[copy.copy(s) for s in batch.samples], requested=batch.requested,
                        transport_failures=batch.transport_failures, invalid_replies=batch.invalid_replies,
                        regenerations=batch.regenerations, invalid_reasons=list(batch.invalid_reasons),
                        transport_error=batch.transport_error)
