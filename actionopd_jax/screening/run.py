"""Screening a pool's tasks: each task's verdict from the cache when its key is there, else from
the judge (all uncached tasks in flight at once, the endpoint's concurrency bounding them), each
verdict stored the moment it arrives. The result is the manifest's screening records.

`progress(counts)` is called after every task with the running counts; the command prints it.
When the endpoint itself fails (`api:` errors: refused, unreachable after its retries) for
`stop_after_api_errors` tasks in a row, the tasks not yet sent are not sent: a wrong URL, model
or key would otherwise be tried once per task of a pool of thousands.
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

from actionopd_jax.envs.task_sources import TaskSource
from actionopd_jax.screening.cache import ScreenCache, screen_key
from actionopd_jax.screening.judge import ScreenJudge, ScreenOutcome
from actionopd_jax.screening.prompt import PROMPT_VERSION, build_prompt

DEFAULT_MAX_CHARS = 120_000  # section text shown per task (~40k tokens at 3 characters a token)


@dataclass
class ScreenCounts:
    total: int
    done: int = 0
    cached: int = 0
    asked: int = 0          # tasks sent to the judge in this run (not those a failing endpoint left unsent)
    feasible: int = 0
    infeasible: int = 0
    errors: int = 0

    def line(self) -> str:
        return (f"screened {self.done}/{self.total} (cached {self.cached}, asked {self.asked}; "
                f"feasible {self.feasible}, rejected {self.infeasible}, errors {self.errors})")


@dataclass
class ScreenRun:
    records: dict[str, dict[str, Any]]
    counts: ScreenCounts
    requests: int = 0                                # HTTP requests the judge was sent
    tokens: dict[str, int] = field(default_factory=dict)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


async def screen_sources(sources: dict[str, TaskSource], judge: ScreenJudge, cache: ScreenCache, *,
                         max_chars: int = DEFAULT_MAX_CHARS,
                         progress: Callable[[ScreenCounts], None] | None = None,
                         stop_after_api_errors: int = 8) -> ScreenRun:
    counts = ScreenCounts(total=len(sources))
    failing = {"in_a_row": 0, "last": ""}
    records: dict[str, dict[str, Any]] = {}

    def finish(tid: str, record: dict[str, Any], *, cached: bool) -> None:
        records[tid] = record
        counts.done += 1
        counts.cached += cached
        counts.feasible += record["verdict"] == "feasible"
        counts.infeasible += record["verdict"] == "infeasible"
        counts.errors += record["verdict"] == "error"
        if progress is not None:
            progress(counts)

    # the prompt is built inside the limit too: a pool's prompts at once would not fit in memory
    limit = asyncio.Semaphore(judge.cfg.max_concurrency)

    async def one(tid: str, source: TaskSource, key: str) -> None:
        async with limit:
            if failing["in_a_row"] >= stop_after_api_errors:
                out = ScreenOutcome("error", f"not asked: the endpoint failed {failing['in_a_row']} times in a row "
                                             f"(last: {failing['last']})")
                cut: list[str] = []
            else:
                prompt, cut = build_prompt(source, max_chars)
                counts.asked += 1
                out = await judge.ask(prompt)
                if out.verdict == "error" and out.reason.startswith("api:"):
                    failing.update(in_a_row=failing["in_a_row"] + 1, last=out.reason[:200])
                else:
                    failing["in_a_row"] = 0
        record = {"verdict": out.verdict, "reason": out.reason, "confidence": out.confidence,
                  "model": judge.cfg.model, "provider": judge.cfg.provider, "prompt_version": PROMPT_VERSION,
                  "source_hash": source.source_hash, "time": _now(), "requests": out.requests,
                  "cut_sections": cut}
        if out.verdict != "error":
            cache.put(key, tid, record)
        finish(tid, record, cached=False)

    pending = []
    for tid, source in sources.items():
        key = screen_key(source_hash=source.source_hash, prompt_version=PROMPT_VERSION, max_chars=max_chars,
                         identity=judge.identity)
        hit = cache.get(key)
        if hit is not None:
            finish(tid, hit, cached=True)
        else:
            pending.append(one(tid, source, key))
    try:
        await asyncio.gather(*pending)
    finally:
        await judge.aclose()
    u = judge.usage
    return ScreenRun({tid: records[tid] for tid in sources}, counts, requests=u.http_calls,
                     tokens={"prompt": u.prompt_tokens, "completion": u.completion_tokens})
