"""The matcher's execution stage (issue 45): between the rules and the LLM judge, a same-name
tool-call pair that the rules cannot settle is decided by running both calls on separate forks
of the episode's current state (envs/fork.py) and comparing their effects.

How it decides one pair (student call s, teacher call t):
- either tool declared external (it sends mail, calls out): cannot settle;
- each distinct call runs once on its own fork. A fork that could not run the call (its process
  did not start or died: `ForkResult.error`, not a tool's answer) is run again on a fresh fork,
  `retries` times: it is the same experiment, and a busy machine must not turn a transient
  start failure into a judge call. A fork that timed out is not retried (a hanging tool hangs
  again). A fork error that remains, or a tool answer that reports a failure ("Error: ...",
  `success: false`), on either side: cannot settle (the judge decides, as without this stage);
- both effects are normalised: the values under the tool's declared volatile fields that the
  call put in the state (at a place that did not hold them before: a new record, a rewritten
  field; fresh ids, timestamps, even a stamp equal to an older record's) or that its answer shows
  and the state before did not hold, are masked wherever they appear (a key, a value, inside the
  tool's text), on both sides alike;
- equal final states (the forks start from one state, so equal changes) and equal observations:
  **match**. A read-only pair leaves both states as they were and so compares observations;
- otherwise each call runs a second time on a fresh fork (retried like the first): if either
  call's two runs differ after normalising, its effect is not a function of the state (an
  undeclared clock or random id): cannot settle. A second run that could not run at all says
  nothing about that and is reported as the fork failure it is. If both reproduce, the effects
  really differ: **no_match**, no judge call.

"Cannot settle" (None) always falls through to the judge; execution never guesses.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

from actionopd_jax import pyast
from actionopd_jax.envs.fork import ForkPoint, ForkResult
from actionopd_jax.matching.canonical import canonical_value
from actionopd_jax.teacher.cache import action_to_json, stable_digest
from actionopd_jax.types import Action, ToolCall, Verdict

MASK = "<volatile>"


def call_key(call: ToolCall) -> str:
    return stable_digest(canonical_value(action_to_json(call)))


def _structured(text: str) -> Any:
    """The tool's text as a value where it is JSON or a Python literal (EnvScaler shows str()
    of a dict), so that volatile keys inside it can be found; else the text itself. The literal
    is parsed under the process's parse lock (pyast): CPython 3.11 counts the AST converter's
    recursion per interpreter, and a parse racing a fork start's import reader in another thread
    fails one of them with SystemError."""
    for parse in (json.loads, _literal):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


def _literal(text: str) -> Any:
    try:
        return pyast.literal_eval(text)
    except SystemError:  # a parse outside the lock (a library's, in another thread) raced it: once more
        return pyast.literal_eval(text)


def _values_at(value: Any, keys: frozenset[str], out: set[str]) -> set[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k in keys and _scalar(v):
                out.add(str(v))
            _values_at(v, keys, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _values_at(v, keys, out)
    return out


_NOWHERE = object()  # a place the state before the call did not have
_BY_VALUE = object()  # masking a value with no state before it (a tool's answer): by fresh values


def _counterpart(before: Any, key: Any) -> Any:
    if isinstance(before, dict):
        return before.get(key, _NOWHERE)
    if isinstance(before, (list, tuple)) and isinstance(key, int) and key < len(before):
        return before[key]
    return _NOWHERE


def _placed(after: Any, before: Any, keys: frozenset[str], out: set[str]) -> set[str]:
    """The values under `keys` in the state `after` a call that were not at that place before it
    (a new record, or a field the call rewrote), whatever their value. Freshness by value alone
    fails a coarse clock: a record a call adds in the same second as an older one gets the older
    one's stamp, so its stamp was masked on a fork that ran a second later and not on one that
    ran in time, and the pair went to the judge or not depending on the machine's load."""
    if isinstance(after, dict):
        for k, v in after.items():
            old = _counterpart(before, k)
            if k in keys and _scalar(v) and (old is _NOWHERE or old != v):
                out.add(str(v))
            _placed(v, old, keys, out)
    elif isinstance(after, (list, tuple)):
        for i, v in enumerate(after):
            _placed(v, _counterpart(before, i), keys, out)
    return out


def _mask(value: Any, fresh: set[str], keys: frozenset[str], before: Any = _BY_VALUE) -> Any:
    """`value` with the fresh volatile values masked: at the declared keys whatever their type,
    and elsewhere (a dict key, a reference in another record, a mention in a text) only as strings
    of four or more characters, so that a small number that happens to equal a fresh id is
    never hidden. With `before` (the state, walked alongside), a value at a declared key is
    masked where it is not what that place held before the call; without (a tool's answer),
    where it is one of the fresh values; a place the call left as it was is not an effect and
    stays as it is (an old log line that mentions a stamp a new record also got)."""
    if before is not _BY_VALUE and before is not _NOWHERE and type(before) is type(value) and before == value:
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = MASK if _long(str(k), fresh) else k
            old = before if before is _BY_VALUE else _counterpart(before, k)
            if k in keys and _scalar(v):
                new = str(v) in fresh if before is _BY_VALUE else (old is _NOWHERE or old != v)
                out[key] = MASK if new else v
            else:
                out[key] = _mask(v, fresh, keys, old)
        return out
    if isinstance(value, (list, tuple)):
        return [_mask(v, fresh, keys, before if before is _BY_VALUE else _counterpart(before, i))
                for i, v in enumerate(value)]
    if isinstance(value, str):
        if _long(value, fresh):
            return MASK
        for f in sorted(fresh, key=len, reverse=True):  # longest first: one id inside another stays whole
            if len(f) >= 4 and f in value:
                value = value.replace(f, MASK)
    return value


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def _long(text: str, fresh: set[str]) -> bool:
    return len(text) >= 4 and text in fresh


def effect(result: ForkResult, before: Any, volatile: Sequence[str]) -> tuple[Any, Any]:
    """(state, observation) of one fork run, the fresh volatile values masked."""
    obs = _structured(result.observation)
    if not volatile:
        return result.state, obs
    keys = frozenset(volatile)
    fresh = _placed(result.state, before, keys, set()) | (_values_at(obs, keys, set()) - _values_at(before, keys, set()))
    return _mask(result.state, fresh, keys, before), _mask(obs, fresh, keys)


def _failed(result: ForkResult) -> bool:
    """A fork error, or a tool answer that reports a failure: "Error..." text, or a mapping with
    `success: false` or an `error` entry (how generated environment classes report one). Two
    failures that look alike say nothing about whether the two attempts meant the same."""
    if result.error or result.observation.lstrip().startswith("Error"):
        return True
    obs = _structured(result.observation)
    return isinstance(obs, dict) and (obs.get("success") is False or bool(obs.get("error")))


@dataclass
class ExecutionRecord:
    """What the stage did for one state group: verdicts by (student key, teacher key), the pairs
    it could not settle with why, and each fork's wall time."""

    verdicts: dict[tuple[str, str], Verdict] = field(default_factory=dict)
    abstained: dict[tuple[str, str], str] = field(default_factory=dict)
    fork_s: list[float] = field(default_factory=list)
    retried: int = 0  # fork runs repeated because the fork itself failed (not the tool)


class ExecutionStage:
    """Decides same-name tool-call pairs of one state group on forks of `point`. `max_forks`
    bounds the forks running at once over every group of the event loop (each fork is a
    sandboxed process or server call: many episodes in flight must not start hundreds)."""

    def __init__(self, max_forks: int = 8, retries: int = 2):
        if max_forks < 1:
            raise ValueError(f"max_forks must be >= 1, got {max_forks}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.max_forks, self.retries = max_forks, retries
        self._gates: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = \
            weakref.WeakKeyDictionary()

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()  # a semaphore serves one loop; tests and eval run several
        if loop not in self._gates:
            self._gates[loop] = asyncio.Semaphore(self.max_forks)
        return self._gates[loop]

    async def decide(self, point: ForkPoint, pairs: Sequence[tuple[Action, Action]]) -> ExecutionRecord:
        rec = ExecutionRecord()
        gate = self._gate()
        runs: dict[str, list[ForkResult]] = {}
        calls: dict[str, ToolCall] = {}

        async def run(key: str) -> None:
            for attempt in range(1 + self.retries):
                async with gate:
                    result = await point.run(calls[key])
                rec.fork_s.append(result.wall_s)
                if not result.error or "timeout" in result.error:
                    break
                rec.retried += 1
            runs.setdefault(key, []).append(result)

        todo: list[tuple[str, str]] = []
        for s, t in pairs:
            if not (isinstance(s, ToolCall) and isinstance(t, ToolCall)) or s.name != t.name:
                continue
            ks, kt = call_key(s), call_key(t)
            if (ks, kt) in rec.verdicts or (ks, kt) in rec.abstained or (ks, kt) in todo:
                continue
            if point.effects(s.name).external:
                rec.abstained[(ks, kt)] = f"tool {s.name} is declared external"
                continue
            calls[ks], calls[kt] = s, t
            todo.append((ks, kt))
        await asyncio.gather(*(run(k) for k in {k for pair in todo for k in pair}))
        unequal: list[tuple[str, str]] = []
        for ks, kt in todo:
            verdict, why = self._compare(point, calls[ks].name, runs[ks][0], runs[kt][0])
            if verdict == "match":
                rec.verdicts[(ks, kt)] = "match"
            elif verdict is None:
                rec.abstained[(ks, kt)] = why
            else:
                unequal.append((ks, kt))
        # replicas: an unequal-looking pair is no_match only if both calls reproduce their effect
        await asyncio.gather(*(run(k) for k in {k for pair in unequal for k in pair}))
        for ks, kt in unequal:
            name = calls[ks].name
            broken = next((r.error for k in (ks, kt) for r in runs[k][1:] if r.error), "")
            if broken:  # the second run never happened: no evidence either way
                rec.abstained[(ks, kt)] = f"a fork failed on the second run: {broken}"
            elif all(self._reproduces(point, name, runs[k]) for k in (ks, kt)):
                rec.verdicts[(ks, kt)] = "no_match"
            else:
                rec.abstained[(ks, kt)] = "an effect does not reproduce on a second fork (undeclared volatile field)"
        return rec

    @staticmethod
    def _compare(point: ForkPoint, name: str, a: ForkResult, b: ForkResult) -> tuple[Verdict | None, str]:
        if _failed(a) or _failed(b):
            return None, "a fork failed or the tool answered an error: " + (a.error or b.error or "Error")
        volatile = point.effects(name).volatile
        if effect(a, point.before, volatile) == effect(b, point.before, volatile):
            return "match", ""
        return "no_match", ""

    @staticmethod
    def _reproduces(point: ForkPoint, name: str, results: list[ForkResult]) -> bool:
        if len(results) < 2 or any(_failed(r) for r in results):
            return False
        volatile = point.effects(name).volatile
        first = effect(results[0], point.before, volatile)
        return all(effect(r, point.before, volatile) == first for r in results[1:])
