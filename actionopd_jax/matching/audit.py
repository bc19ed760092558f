"""The statistics of the matcher audit (`actionopd audit-matcher`, matching/audit_cli.py):
which judged pairs to re-ask, and what the second judge's answers say.

Population: every (candidate, teacher sample) pair of the judged-pair log (judged_log.py)
with a definite verdict. The pairs a second judge can be asked the same question about fall
into strata by who decided them, the verdict and the action type:

    judge/match/tool_call   judge/no_match/tool_call   judge/match/message   judge/no_match/message
        decided by the run's LLM judge
    rules/match/tool_call   rules/match/message
        decided by the rules alone (same tool and canonically equal arguments; equal
        normalized messages): the audit judge answering NO_MATCH is a judge error
    rules/no_match/tool_call
        two calls of different tools: the audit judge answering MATCH is a judge error
    execution/match/tool_call   execution/no_match/tool_call
        decided by running both calls on forks of the state (matching/execution.py, issue 45):
        the audit judge's answers measure execution's agreement with a judge

Pairs with an Invalid side or a tool call against a message are decided by the rules and
cannot be posed to the judge; they count in the population (with no possible flip).

Sampling is stratified and seeded: the sample size is spread evenly over the strata (a small
stratum gives all it has, the rest goes to the others), and each stratum's pairs are drawn
uniformly without replacement with a generator seeded by (seed, stratum).

Estimators (population shares, N_s pairs in stratum s, d_s the audit judge's disagreement rate
among the stratum's answered sampled pairs):
- a rate over several strata: sum_s N_s d_s / sum_s N_s;
- the 2x2 table of the two judges (judge strata only): each answered sampled pair weighs
  N_s / n_s; agreement and Cohen's kappa from that table (and from the plain sample counts);
- share of pair verdicts that would flip with the audit judge in place of the run's judge:
  sum over judge strata of N_s d_s, divided by all pairs with a definite verdict (rules-decided
  pairs never reach a judge in training, so they cannot flip);
- share of candidate rewards that would change: over candidates of groups without an
  unavailable verdict, the mean of 1 - prod_k (1 - d_{s(i,k)}) (a candidate's reward changes
  when any of its K verdicts flips; flips taken as independent), d = 0 for rules-decided pairs.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from actionopd_jax.matching.canonical import differing_paths
from actionopd_jax.matching.judged_log import JudgedState
from actionopd_jax.teacher.cache import action_to_json
from actionopd_jax.types import Message, ToolCall

DEFINITE = ("match", "no_match")
STRATA = ("judge/match/tool_call", "judge/no_match/tool_call", "judge/match/message", "judge/no_match/message",
          "rules/match/tool_call", "rules/match/message", "rules/no_match/tool_call",
          "execution/match/tool_call", "execution/no_match/tool_call")


@dataclass(frozen=True)
class PairRef:
    """One pair of the population: state index in the log, candidate i, teacher sample k."""

    state: int
    i: int
    k: int


def stratum_of(state: JudgedState, i: int, k: int) -> str | None:
    """The pair's stratum, or None when it is not auditable (no definite verdict, an Invalid
    or cross-kind pair, or a rules-only run's undecided pair)."""
    verdict, stage = state.verdicts[i][k], state.stages[i][k]
    if verdict not in DEFINITE:
        return None
    cand = state.candidates[i]
    kind = "tool_call" if isinstance(cand, ToolCall) else "message" if isinstance(cand, Message) else None
    who = {"judge": "judge", "rules_match": "rules", "name_mismatch": "rules", "execution": "execution"}.get(stage)
    if kind is None or who is None:
        return None
    return f"{who}/{verdict}/{kind}"


def population(states: Sequence[JudgedState]) -> tuple[dict[str, list[PairRef]], int]:
    """(auditable pairs by stratum, number of pairs with a definite verdict)."""
    strata: dict[str, list[PairRef]] = {}
    definite = 0
    for si, st in enumerate(states):
        for i, row in enumerate(st.verdicts):
            for k, v in enumerate(row):
                definite += v in DEFINITE
                s = stratum_of(st, i, k)
                if s is not None:
                    strata.setdefault(s, []).append(PairRef(si, i, k))
    return strata, definite


def allocate(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Sample size per stratum: `total` spread evenly, smallest strata first, each giving at
    most what it has (what a small one cannot use goes to the larger ones)."""
    out: dict[str, int] = {}
    left = max(int(total), 0)
    order = sorted(sizes, key=lambda s: (sizes[s], s))
    for pos, s in enumerate(order):
        take = min(sizes[s], left // (len(order) - pos))
        out[s] = take
        left -= take
    return out


def stratified_sample(strata: dict[str, list[PairRef]], total: int, seed: int) -> dict[str, list[PairRef]]:
    """Seeded stratified sample (see the module docstring); each stratum's draw depends only on
    (seed, stratum, its pairs), so adding a stratum does not reshuffle the others."""
    sizes = allocate({s: len(p) for s, p in strata.items()}, total)
    out = {}
    for s in sorted(strata):
        rng = random.Random(f"{seed}:{s}")
        picked = rng.sample(range(len(strata[s])), sizes[s])
        out[s] = [strata[s][j] for j in sorted(picked)]
    return out


def cohen_kappa(table: Sequence[Sequence[float]]) -> float | None:
    """Cohen's kappa of a 2x2 agreement table (rows: rater 1, columns: rater 2; the same
    category order on both). None when chance agreement is 1 (both raters constant)."""
    (a, b), (c, d) = table
    n = a + b + c + d
    if n <= 0:
        return None
    p_o = (a + d) / n
    p_e = ((a + b) * (a + c) + (c + d) * (b + d)) / (n * n)
    if math.isclose(p_e, 1.0):
        return None
    return (p_o - p_e) / (1 - p_e)


def agreement(table: Sequence[Sequence[float]]) -> float | None:
    (a, b), (c, d) = table
    n = a + b + c + d
    return (a + d) / n if n > 0 else None


@dataclass
class StratumResult:
    population: int
    sampled: int = 0
    answered: int = 0           # the audit judge gave a definite verdict
    disagreements: int = 0

    @property
    def rate(self) -> float | None:
        return self.disagreements / self.answered if self.answered else None


@dataclass
class Disagreement:
    stratum: str
    ref: PairRef
    first: str                  # the run's verdict (the judge's, or the rules')
    second: str                 # the audit judge's
    pattern: str


@dataclass
class AuditResult:
    strata: dict[str, StratumResult]
    definite_pairs: int
    disagreements: list[Disagreement] = field(default_factory=list)
    unanswered: int = 0

    def weighted_rate(self, names: Sequence[str]) -> float | None:
        known = [self.strata[s] for s in names if s in self.strata and self.strata[s].answered]
        pop = sum(r.population for r in known)
        return sum(r.population * r.rate for r in known) / pop if pop else None

    def judge_tables(self, states: Sequence[JudgedState], second: dict[PairRef, str],
                     sample: dict[str, list[PairRef]]) -> tuple[list[list[int]], list[list[float]]]:
        """(sample counts, population-weighted shares): rows the run's judge, columns the audit
        judge, order (match, no_match); judge strata only."""
        counts = [[0, 0], [0, 0]]
        weighted = [[0.0, 0.0], [0.0, 0.0]]
        for s, refs in sample.items():
            if not s.startswith("judge/"):
                continue
            res = self.strata[s]
            for ref in refs:
                if ref not in second:
                    continue
                r = DEFINITE.index(states[ref.state].verdicts[ref.i][ref.k])
                c = DEFINITE.index(second[ref])
                counts[r][c] += 1
                weighted[r][c] += res.population / res.answered
        total = sum(map(sum, weighted))
        return counts, [[v / total for v in row] for row in weighted] if total else weighted


def evaluate(states: Sequence[JudgedState], strata: dict[str, list[PairRef]], definite: int,
             sample: dict[str, list[PairRef]], second: dict[PairRef, str]) -> AuditResult:
    """Compare the audit judge's verdicts (`second`, by pair; absent: it gave none) with the run's."""
    result = AuditResult(strata={s: StratumResult(len(strata[s])) for s in strata}, definite_pairs=definite)
    for s, refs in sample.items():
        res = result.strata[s]
        for ref in refs:
            res.sampled += 1
            if ref not in second:
                result.unanswered += 1
                continue
            res.answered += 1
            first = states[ref.state].verdicts[ref.i][ref.k]
            if second[ref] != first:
                res.disagreements += 1
                result.disagreements.append(Disagreement(s, ref, first, second[ref],
                                                         pattern_of(states[ref.state], ref, s, first, second[ref])))
    return result


def pattern_of(state: JudgedState, ref: PairRef, stratum: str, first: str, second: str) -> str:
    """A disagreement's pattern: stratum, the verdicts, and what differs (for tool calls the
    tool names and the differing argument paths, list indices folded to [*])."""
    cand, teach = state.candidates[ref.i], state.teacher[ref.k]
    head = f"{stratum}: {first} -> {second}"
    if isinstance(cand, ToolCall) and isinstance(teach, ToolCall):
        if cand.name != teach.name:
            return f"{head}; tools {cand.name} vs {teach.name}"
        paths = sorted({re.sub(r"\[\d+\]", "[*]", p) for p in differing_paths(cand.arguments, teach.arguments)})
        return f"{head}; {cand.name} at {', '.join(paths) if paths else '(equal arguments)'}"
    return f"{head}; message"


def flip_estimates(states: Sequence[JudgedState], result: AuditResult) -> dict[str, float | None]:
    """The two flip shares of the module docstring."""
    rate = {s: (r.rate if s.startswith("judge/") and r.rate is not None else 0.0) for s, r in result.strata.items()}
    judge_strata = [s for s in result.strata if s.startswith("judge/")]
    unknown = [s for s in judge_strata if result.strata[s].rate is None]
    pair_share = (sum(result.strata[s].population * rate[s] for s in judge_strata) / result.definite_pairs
                  if result.definite_pairs else None)
    changed, candidates = 0.0, 0
    for st in states:
        if any(v not in DEFINITE for row in st.verdicts for v in row):
            continue  # a group with an unavailable verdict is masked: no training reward
        for i, row in enumerate(st.verdicts):
            keep = 1.0
            for k in range(len(row)):
                s = stratum_of(st, i, k)
                keep *= 1.0 - (rate.get(s, 0.0) if s is not None else 0.0)
            changed += 1.0 - keep
            candidates += 1
    return {"pair_verdicts": pair_share, "candidate_rewards": changed / candidates if candidates else None,
            "candidates": candidates, "judge_strata_without_answers": unknown}


def pattern_table(states: Sequence[JudgedState], result: AuditResult,
                  top: int = 10) -> list[tuple[str, int, list[Disagreement]]]:
    """The most common disagreement patterns, most frequent first, with up to two examples each."""
    counts = Counter(d.pattern for d in result.disagreements)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    out = []
    for p, n in ranked:
        examples: dict[tuple, Disagreement] = {}
        for d in result.disagreements:   # distinct examples: repeated teacher samples ask one question
            key = (d.ref.state, d.ref.i, repr(states[d.ref.state].teacher[d.ref.k]))
            if d.pattern == p and key not in examples and len(examples) < 2:
                examples[key] = d
        out.append((p, n, list(examples.values())))
    return out


def summary(states: Sequence[JudgedState], result: AuditResult, second: dict[PairRef, str],
            sample: dict[str, list[PairRef]]) -> dict[str, Any]:
    """Everything audit.json holds but the identity of the judges and the log's read report."""
    counts, weighted = result.judge_tables(states, second, sample)

    def conditional(table, row):   # P(audit judge says the other verdict | run's judge said `row`)
        total = sum(table[row])
        return table[row][1 - row] / total if total else None

    return {
        "strata": {s: {"population": r.population, "sampled": r.sampled, "answered": r.answered,
                       "disagreements": r.disagreements, "rate": r.rate} for s, r in sorted(result.strata.items())},
        "definite_pairs": result.definite_pairs,
        "unanswered": result.unanswered,
        "judge_vs_judge": {
            "sample_table": counts, "sample_agreement": agreement(counts), "sample_kappa": cohen_kappa(counts),
            "weighted_table": weighted, "agreement": agreement(weighted), "kappa": cohen_kappa(weighted),
            "run_match_audit_no_match": conditional(weighted, 0),
            "run_no_match_audit_match": conditional(weighted, 1),
        },
        "rules": {
            "judge_no_match_where_rules_match": result.weighted_rate(["rules/match/tool_call", "rules/match/message"]),
            "judge_match_where_rules_no_match": result.weighted_rate(["rules/no_match/tool_call"]),
        },
        "execution": {  # pairs decided on forks (issue 45), against the audit judge
            "pairs": sum(r.population for n, r in result.strata.items() if n.startswith("execution/")),
            "disagreement": result.weighted_rate(["execution/match/tool_call", "execution/no_match/tool_call"]),
            "audit_no_match_where_execution_match": result.weighted_rate(["execution/match/tool_call"]),
            "audit_match_where_execution_no_match": result.weighted_rate(["execution/no_match/tool_call"]),
        },
        "flips": flip_estimates(states, result),
        "patterns": [{"pattern": p, "count": n, "examples": [example(states, d) for d in ex]}
                     for p, n, ex in pattern_table(states, result)],
        "disagreements": [example(states, d) for d in result.disagreements],
    }


def example(states: Sequence[JudgedState], d: Disagreement) -> dict[str, Any]:
    st = states[d.ref.state]
    return {"step": st.step, "task_start": st.task_start, "task_id": st.task_id, "decision": st.decision,
            "candidate_index": d.ref.i, "teacher_index": d.ref.k, "stratum": d.stratum, "run_verdict": d.first,
            "audit_verdict": d.second, "candidate": action_to_json(st.candidates[d.ref.i]),
            "teacher": action_to_json(st.teacher[d.ref.k])}
