"""The matcher m_s(y, y_T): one verdict per (student candidate, teacher sample) pair.

Order of decisions (paper 2.2, A.3):
1. an Invalid on either side never matches; a tool call never matches a message (cross-kind);
2. tool calls: different names never match; canonically equal arguments match (canonical.py);
   messages: a normalized exact match matches (messages.py);
3. execution (matching/execution.py, issue 45): where the environment can fork its state and
   the matcher has an `ExecutionStage`, a same-name call pair is run on forks and decided by its
   effects; a pair execution cannot settle goes on to the judge;
4. what remains goes to the LLM judge: same-name calls with differing arguments, and
   non-identical messages. Without a judge ("rules only" mode) the remainder is no_match.

Every teacher sample is compared separately (repeated samples each count), but identical
pairs at the same state reuse one judgement: in memory (single flight, so concurrent
identical pairs cost one judge call) and, for definite verdicts, in the persistent cache.
"unavailable" is never cached: a later run asks again.

Tool-implementation evidence (paper A.3) is shown to the judge, never to the teacher. For an
environment that supplies it (`evidence_by_env`, built by envs/evidence.py) it is required: a
same-name tool-call pair that needs the judge but whose tool has no evidence is "unavailable"
(no supervision), not guessed. `evidence` (by tool name, any environment) is optional help.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence

from actionopd_jax.matching.canonical import canonical_value, compare_tool_calls
from actionopd_jax.matching.execution import ExecutionRecord, ExecutionStage, call_key
from actionopd_jax.matching.judge import JudgeOutcome
from actionopd_jax.matching.messages import messages_equal
from actionopd_jax.teacher.cache import PROTOCOL_VERSION, PersistentCache, action_to_json, stable_digest
from actionopd_jax.types import Action, ChatMessage, Invalid, Message, ToolCall, ToolSchema, Verdict

log = logging.getLogger(__name__)


class Judge(Protocol):
    identity: Any

    async def judge_tool_calls(self, a: ToolCall, b: ToolCall, paths: tuple[str, ...], *, messages: list[ChatMessage],
                               tools: list[ToolSchema], evidence: str | None = None) -> JudgeOutcome: ...

    async def judge_messages(self, a: Message, b: Message, *, messages: list[ChatMessage],
                             tools: list[ToolSchema]) -> JudgeOutcome: ...


@dataclass
class MatcherStats:
    pairs: int = 0
    invalid_or_cross_kind: int = 0
    name_mismatch: int = 0
    programmatic_match: int = 0
    judge_calls: int = 0
    judge_reused: int = 0        # identical pair already judged (memory, in flight, or persistent cache)
    judge_match: int = 0
    judge_no_match: int = 0
    unavailable: int = 0         # pairs without a verdict: the three causes below
    unavailable_api: int = 0     # the judge endpoint failed (after its transport retries)
    unavailable_format: int = 0  # every reply, retries included, was outside the verdict format
    missing_evidence: int = 0    # judged pairs made unavailable because required evidence was absent
    judge_format_retries: int = 0  # extra judge requests after a reply outside the format
    judge_context_truncated: int = 0  # judge calls whose conversation was cut to the judge's budget
    rules_only_no_match: int = 0
    execution_match: int = 0     # pairs the execution stage decided (no judge asked): match
    execution_no_match: int = 0  # ... and no_match
    execution_abstain: int = 0   # pairs it ran but could not settle (they went on to the judge)
    execution_forks: int = 0     # fork runs (each a sandboxed call on a copy of the state)
    judge_calls_saved: int = 0   # distinct judge questions execution answered instead (per state group)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class RulesDecision:
    """What the programmatic rules say about one pair. stage: "invalid" (an Invalid on either
    side, or a tool call against a message), "name_mismatch", "rules_match" (canonically equal
    arguments, or equal normalized messages), or "judge" (verdict None: the rules cannot
    settle it; `paths` are the differing argument paths the judge is shown)."""

    stage: str
    verdict: Verdict | None
    paths: tuple[str, ...] = ()


def rules_decision(student: Action, teacher: Action) -> RulesDecision:
    """Steps 1-2 of the module docstring, for one pair."""
    if isinstance(student, Invalid) or isinstance(teacher, Invalid) or type(student) is not type(teacher):
        return RulesDecision("invalid", "no_match")
    if isinstance(student, ToolCall):
        cmp = compare_tool_calls(student, teacher)  # type: ignore[arg-type]
        if not cmp.same_name:
            return RulesDecision("name_mismatch", "no_match")
        if cmp.equal:
            return RulesDecision("rules_match", "match")
        return RulesDecision("judge", None, cmp.paths)
    if isinstance(student, Message):
        if messages_equal(student.text, teacher.text):  # type: ignore[union-attr]
            return RulesDecision("rules_match", "match")
        return RulesDecision("judge", None)
    raise TypeError(f"not an Action: {type(student).__name__}")


class Matcher:
    def __init__(self, judge: Judge | None, *, cache: PersistentCache | None = None,
                 evidence: dict[str, str] | None = None,
                 evidence_by_env: dict[str, dict[str, str]] | None = None,
                 execution: ExecutionStage | None = None):
        """`evidence` maps a tool name to implementation evidence shown to the judge (never
        to the teacher); `evidence_by_env` the same per environment, where it is required (see
        the module docstring). Evidence is part of the verdict cache key."""
        self.judge = judge
        self.cache = cache
        self.evidence = dict(evidence or {})
        self.evidence_by_env = {env: dict(ev) for env, ev in (evidence_by_env or {}).items()}
        self.stats = MatcherStats()
        self._memo: dict[str, Verdict] = {}
        self._in_flight: dict[str, asyncio.Future[Verdict]] = {}
        self.execution = execution
        self.fork_latencies_s: deque[float] = deque(maxlen=100_000)  # per fork run, for benchmarks
        self._decided_by: OrderedDict[str, str] = OrderedDict()  # pair-at-state digest -> "execution"

    async def aclose(self) -> None:
        """Close the judge's HTTP client on the running loop (where it has one)."""
        aclose = getattr(self.judge, "aclose", None)
        if aclose is not None:
            await aclose()

    def evidence_for(self, name: str, env: str | None) -> tuple[str | None, bool]:
        """(evidence for tool `name` in `env`, whether the judge requires it there)."""
        if env is not None and env in self.evidence_by_env:
            return self.evidence_by_env[env].get(name), True
        return self.evidence.get(name), False

    def stage(self, student: Action, teacher: Action, messages: list[ChatMessage] | None = None) -> str:
        """Which stage decides this pair (`rules_decision`'s stage), "execution" where forks of
        the state decided it at this state (`messages`: the state's conversation), "rules_only"
        where the judge would decide but this matcher has none. The judged-pair log records it."""
        stage = rules_decision(student, teacher).stage
        if stage == "judge" and messages is not None and self._decided_by.get(
                self._state_pair(student, teacher, messages)) == "execution":
            return "execution"
        return "rules_only" if stage == "judge" and self.judge is None else stage

    @staticmethod
    def _state_pair(student: Action, teacher: Action, messages: list[ChatMessage]) -> str:
        return stable_digest({"s": canonical_value(action_to_json(student)),
                              "t": canonical_value(action_to_json(teacher)), "m": messages})

    async def verdict(self, student: Action, teacher: Action, *, messages: list[ChatMessage],
                      tools: list[ToolSchema], env: str | None = None,
                      executed: ExecutionRecord | None = None) -> Verdict:
        self.stats.pairs += 1
        rules = rules_decision(student, teacher)
        if rules.stage == "invalid":
            self.stats.invalid_or_cross_kind += 1
            return "no_match"
        if rules.stage == "name_mismatch":
            self.stats.name_mismatch += 1
            return "no_match"
        if rules.stage == "rules_match":
            self.stats.programmatic_match += 1
            return "match"
        if executed is not None and isinstance(student, ToolCall):
            pair = (call_key(student), call_key(teacher))  # type: ignore[arg-type]
            if pair in executed.verdicts:
                verdict = executed.verdicts[pair]
                self.stats.execution_match += verdict == "match"
                self.stats.execution_no_match += verdict == "no_match"
                return verdict
            self.stats.execution_abstain += pair in executed.abstained
        if self.judge is None:
            self.stats.rules_only_no_match += 1
            return "no_match"
        evidence = None
        if isinstance(student, ToolCall):
            evidence, required = self.evidence_for(student.name, env)
            if required and not evidence:
                self.stats.missing_evidence += 1
                self.stats.unavailable += 1
                return "unavailable"
        return await self._judged(student, teacher, rules.paths, messages, tools, evidence)

    async def match_group(self, candidates: Sequence[Action], teacher_actions: Sequence[Action], *,
                          messages: list[ChatMessage], tools: list[ToolSchema],
                          env: str | None = None, fork: Any = None) -> list[list[Verdict]]:
        """verdicts[i][k] for every candidate i and teacher sample k, all pairs concurrently;
        `env` (the task's environment) selects the tool evidence. `fork`: an async callable
        giving the episode's `ForkPoint` (envs/fork.py) or None; asked only when this matcher
        has an execution stage and some tool-call pair needs more than the rules."""
        executed = await self._execute(candidates, teacher_actions, messages, fork)
        flat = await asyncio.gather(*(self.verdict(c, t, messages=messages, tools=tools, env=env, executed=executed)
                                      for c in candidates for t in teacher_actions))
        width = len(teacher_actions)
        return [list(flat[i * width:(i + 1) * width]) for i in range(len(candidates))]

    async def _execute(self, candidates: Sequence[Action], teacher_actions: Sequence[Action],
                       messages: list[ChatMessage], fork: Any) -> ExecutionRecord | None:
        """The execution stage's record for this group, or None (no stage, nothing forkable, or
        it failed: then every pair goes on as without it, never with a verdict it did not reach)."""
        if self.execution is None or fork is None:
            return None
        pairs = [(c, t) for c in candidates for t in teacher_actions
                 if isinstance(c, ToolCall) and rules_decision(c, t).stage == "judge"]
        if not pairs:
            return None
        point = None
        try:
            point = await fork()
            if point is None:
                return None
            executed = await self.execution.decide(point, pairs)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the stage is an optimisation: the judge still decides
            log.warning("execution stage failed (%s: %s): its pairs go to the judge", type(err).__name__, err)
            return None
        finally:
            if point is not None:
                try:
                    point.close()
                except Exception:  # noqa: BLE001
                    pass
        self.stats.execution_forks += len(executed.fork_s)
        self.fork_latencies_s.extend(executed.fork_s)
        self.stats.judge_calls_saved += len(executed.verdicts)
        for c, t in pairs:
            if (call_key(c), call_key(t)) in executed.verdicts:  # type: ignore[arg-type]
                self._decided_by[self._state_pair(c, t, messages)] = "execution"
        while len(self._decided_by) > 50_000:
            self._decided_by.popitem(last=False)
        return executed

    def pair_key(self, student: Action, teacher: Action, messages: list[ChatMessage], tools: list[ToolSchema],
                 evidence: str | None = None) -> str:
        """Cache key of a judged pair: both actions (canonical), the evidence the judge sees,
        and the judge's model and prompt (paper A.3: "action pair, evidence, model, prompt")."""
        if evidence is None and isinstance(student, ToolCall):
            evidence = self.evidence.get(student.name)
        return stable_digest({
            "protocol": PROTOCOL_VERSION, "kind": "verdict",
            "student": canonical_value(action_to_json(student)), "teacher": canonical_value(action_to_json(teacher)),
            "messages": messages, "tools": tools, "evidence": evidence,
            "judge": self.judge.identity if self.judge is not None else None,
        })

    async def _judged(self, student: Action, teacher: Action, paths: tuple[str, ...],
                      messages: list[ChatMessage], tools: list[ToolSchema], evidence: str | None) -> Verdict:
        key = self.pair_key(student, teacher, messages, tools, evidence)
        if key in self._memo:
            self.stats.judge_reused += 1
            return self._memo[key]
        if key in self._in_flight:
            self.stats.judge_reused += 1
            return await asyncio.shield(self._in_flight[key])
        if self.cache is not None:
            stored = self.cache.get_verdict(key)
            if stored is not None:
                self.stats.judge_reused += 1
                self._memo[key] = stored
                return stored
        future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            outcome = await self._call_judge(student, teacher, paths, messages, tools, evidence)
            verdict = outcome.verdict
            self.stats.judge_format_retries += max(getattr(outcome, "requests", 1) - 1, 0)
            self.stats.judge_context_truncated += bool(getattr(outcome, "context_truncated", False))
            if verdict == "unavailable":
                self.stats.unavailable += 1
                if outcome.reason.startswith("format"):
                    self.stats.unavailable_format += 1
                else:
                    self.stats.unavailable_api += 1
            else:
                self.stats.judge_match += verdict == "match"
                self.stats.judge_no_match += verdict == "no_match"
                self._memo[key] = verdict
                if self.cache is not None:
                    model = str(self.judge.identity.get("model", "")) if isinstance(self.judge.identity, dict) else ""
                    self.cache.put_verdict(key, verdict, model=model)
            future.set_result(verdict)
            return verdict
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as err:
            future.set_exception(err)
            future.exception()  # mark retrieved; joiners re-raise it
            raise
        finally:
            del self._in_flight[key]

    async def _call_judge(self, student: Action, teacher: Action, paths: tuple[str, ...],
                          messages: list[ChatMessage], tools: list[ToolSchema], evidence: str | None) -> JudgeOutcome:
        assert self.judge is not None
        self.stats.judge_calls += 1
        if isinstance(student, ToolCall):
            return await self.judge.judge_tool_calls(student, teacher, paths, messages=messages, tools=tools,  # type: ignore[arg-type]
                                                     evidence=evidence)
        return await self.judge.judge_messages(student, teacher, messages=messages, tools=tools)  # type: ignore[arg-type]
