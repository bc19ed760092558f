"""The audit's second judge: the run's judged pairs asked again, with the matcher's own
prompt and client (LLMJudge), so it is the same question put to another model or endpoint.

Every pair is posed as the matcher poses a judged pair -- a tool-call pair with the tool's
schema, the argument paths that differ and the tool evidence the run's judge was shown, a
message pair with the tools' names -- including the pairs the rules decided, which the run's
judge never saw. Definite verdicts are cached in the run directory
(`audit/verdicts.sqlite`, keyed by the question and the judge's identity), so a re-run
never repeats a paid call; "unavailable" is not cached (a re-run asks again).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from actionopd_jax.matching.audit import PairRef
from actionopd_jax.matching.canonical import canonical_value, differing_paths
from actionopd_jax.matching.judge import LLMJudge
from actionopd_jax.matching.judged_log import JudgedState
from actionopd_jax.teacher.cache import PROTOCOL_VERSION, PersistentCache, action_to_json, stable_digest
from actionopd_jax.types import ToolCall


@dataclass
class AskStats:
    questions: int = 0     # distinct questions among the sampled pairs
    cached: int = 0        # answered from the audit cache (no request)
    asked: int = 0         # sent to the audit judge
    unavailable: int = 0   # the audit judge gave no verdict (not cached)


class AuditJudge:
    def __init__(self, judge: LLMJudge, cache: PersistentCache):
        self.judge = judge
        self.cache = cache
        self.stats = AskStats()

    def question_key(self, state: JudgedState, ref: PairRef) -> str:
        cand, teach = state.candidates[ref.i], state.teacher[ref.k]
        return stable_digest({
            "protocol": PROTOCOL_VERSION, "kind": "audit-verdict",
            "student": canonical_value(action_to_json(cand)), "teacher": canonical_value(action_to_json(teach)),
            "messages": state.messages, "tools": state.tools, "evidence": self._evidence(state, ref),
            "judge": self.judge.identity,
        })

    async def verdicts(self, states: Sequence[JudgedState], refs: Sequence[PairRef]) -> dict[PairRef, str]:
        """The audit judge's definite verdict for each pair it answered (identical questions
        are asked once)."""
        by_key: dict[str, list[PairRef]] = {}
        for ref in refs:
            by_key.setdefault(self.question_key(states[ref.state], ref), []).append(ref)
        self.stats.questions = len(by_key)
        answers = await asyncio.gather(*(self._answer(key, states[group[0].state], group[0])
                                         for key, group in by_key.items()))
        out: dict[PairRef, str] = {}
        for (key, group), verdict in zip(by_key.items(), answers):
            if verdict is not None:
                out.update({ref: verdict for ref in group})
        return out

    async def _answer(self, key: str, state: JudgedState, ref: PairRef) -> str | None:
        stored = self.cache.get_verdict(key)
        if stored is not None:
            self.stats.cached += 1
            return stored
        self.stats.asked += 1
        cand, teach = state.candidates[ref.i], state.teacher[ref.k]
        if isinstance(cand, ToolCall):
            paths = tuple(differing_paths(cand.arguments, teach.arguments))  # type: ignore[union-attr]
            outcome = await self.judge.judge_tool_calls(cand, teach, paths,  # type: ignore[arg-type]
                                                        messages=state.messages,
                                                        tools=state.tools, evidence=self._evidence(state, ref))
        else:
            outcome = await self.judge.judge_messages(cand, teach, messages=state.messages,  # type: ignore[arg-type]
                                                      tools=state.tools)
        if outcome.verdict not in ("match", "no_match"):
            self.stats.unavailable += 1
            return None
        self.cache.put_verdict(key, outcome.verdict, model=self.judge.cfg.model)
        return outcome.verdict

    @staticmethod
    def _evidence(state: JudgedState, ref: PairRef) -> str | None:
        cand = state.candidates[ref.i]
        return state.evidence.get(cand.name) if isinstance(cand, ToolCall) else None
