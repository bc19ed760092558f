"""Per-step collection metrics: what was kept and why the rest was dropped, match and
invalid rates, the reward histogram, teacher cost, and where the time went.

Time is accumulated per state and per trajectory. Waits overlap across trajectories (that is
the point of the collector), so the sums are "trajectory-seconds", not wall time; the wall
time and the sampler's busy time are measured once per step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actionopd_jax.teacher.base import UsageReport
from actionopd_jax.types import Invalid, StateGroup


# Trajectory end reasons whose last state produced no group (no valid teacher sample).
NO_GROUP_REASONS = ("no_supervision", "teacher_timeout", "teacher_error")
# ... of which the teacher never answered (transport failures past the retries, a refused
# request, a timeout): unavailable supervision, as a masked group is (issue 46 item 5)
UNANSWERED_REASONS = ("teacher_timeout", "teacher_error")


@dataclass
class TrajectoryRecord:
    """One task start: how it ended and how long it waited on each external part."""

    task_start: int
    task_id: str
    env: str
    decisions: int = 0            # states visited (groups recorded or not)
    groups: int = 0               # StateGroups recorded
    end_reason: str = ""
    score: dict[str, Any] = field(default_factory=dict)
    teacher_s: float = 0.0        # latency of the teacher calls of this trajectory
    matcher_s: float = 0.0        # latency of its matcher phases (all pairs of a state)
    env_s: float = 0.0            # reset + steps
    sampler_wait_s: float = 0.0   # from queueing a state to its candidates coming back
    state_s: float = 0.0          # wall time of its decision points, end to end

    @property
    def external_chain_s(self) -> float:
        """The sequential teacher -> matcher chain no amount of sampler speed can shorten."""
        return self.teacher_s + self.matcher_s


@dataclass
class StepMetrics:
    groups_kept: int = 0
    groups_dropped: Counter = field(default_factory=Counter)   # reason -> count
    trajectory_ends: Counter = field(default_factory=Counter)  # end reason -> count
    groups: int = 0                   # StateGroups recorded (kept or dropped)
    candidates: int = 0
    invalid_candidates: int = 0
    truncated_candidates: int = 0     # cut at collect.max_response_tokens: Invalid (-1), see chat/prompt.py
    truncated_in_reasoning: int = 0   # ... of which cut inside an unclosed <think> block
    matched_candidates: int = 0       # scored candidates with c > 0
    scored_candidates: int = 0        # candidates of groups with usable verdicts
    verdict_counts: Counter = field(default_factory=Counter)   # match / no_match / unavailable
    reward_hist: Counter = field(default_factory=Counter)      # training reward (rounded) -> count
    teacher: UsageReport = field(default_factory=UsageReport)
    matcher: dict[str, int] = field(default_factory=dict)       # Matcher.stats deltas
    judge: UsageReport = field(default_factory=UsageReport)      # the LLM judge's requests and tokens
    user: UsageReport = field(default_factory=UsageReport)       # the user simulators' requests and tokens
    sampler_calls: int = 0
    sampler_states: int = 0
    sampler_busy_s: float = 0.0
    sampler_compiled: int = 0
    wall_s: float = 0.0
    teacher_s: float = 0.0
    matcher_s: float = 0.0
    env_s: float = 0.0
    sampler_wait_s: float = 0.0
    longest_chain_s: float = 0.0
    trajectories: int = 0

    def add_group(self, group: StateGroup, counts: np.ndarray | None) -> None:
        self.groups += 1
        if group.retained:
            self.groups_kept += 1
        else:
            self.groups_dropped[group.drop_reason] += 1
        for cand in group.candidates:
            self.candidates += 1
            self.invalid_candidates += isinstance(cand.action, Invalid)
            if cand.finish_reason == "length":
                self.truncated_candidates += 1
                self.truncated_in_reasoning += "<think>" in cand.text and "</think>" not in cand.text
            self.verdict_counts.update(cand.verdicts)
        if counts is not None:
            self.scored_candidates += len(counts)
            self.matched_candidates += int(np.count_nonzero(counts))
            self.reward_hist.update(f"{c.reward:g}" for c in group.candidates)

    def add_trajectory(self, rec: TrajectoryRecord) -> None:
        self.trajectories += 1
        self.trajectory_ends[rec.end_reason] += 1
        if rec.end_reason in NO_GROUP_REASONS:
            # The last state had no teacher supervision: no StateGroup exists for it, but
            # it is a dropped decision point and is counted as such.
            self.groups_dropped[rec.end_reason] += 1
        self.teacher_s += rec.teacher_s
        self.matcher_s += rec.matcher_s
        self.env_s += rec.env_s
        self.sampler_wait_s += rec.sampler_wait_s
        self.longest_chain_s = max(self.longest_chain_s, rec.external_chain_s)

    @property
    def match_rate(self) -> float:
        """Share of the candidates of scored groups (invalid ones included) with c > 0."""
        return self.matched_candidates / self.scored_candidates if self.scored_candidates else 0.0

    @property
    def unavailable_pair_rate(self) -> float:
        """Share of the (candidate, teacher sample) verdicts that are "unavailable" (paper A.3)."""
        total = sum(self.verdict_counts.values())
        return self.verdict_counts["unavailable"] / total if total else 0.0

    @property
    def unavailable_states(self) -> int:
        """Decision points whose supervision was unavailable: groups masked by an unavailable
        verdict, and states the teacher never answered (they have no group at all)."""
        return self.groups_dropped["unavailable"] + sum(self.groups_dropped[r] for r in UNANSWERED_REASONS)

    @property
    def unavailable_group_rate(self) -> float:
        """Share of the step's decision points (recorded groups, and states that got no group)
        whose supervision was unavailable (`unavailable_states`). Before issue 46 a teacher
        outage read 0.0 here: its states have no group, so they were in neither count."""
        decisions = self.groups + sum(self.groups_dropped[r] for r in NO_GROUP_REASONS)
        return self.unavailable_states / decisions if decisions else 0.0

    @property
    def invalid_rate(self) -> float:
        return self.invalid_candidates / self.candidates if self.candidates else 0.0

    @property
    def sampler_busy_fraction(self) -> float:
        return self.sampler_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def critical_path_s(self) -> float:
        """Lower bound on the step's wall time: the device's own work, or the longest
        chain of external calls one trajectory must make in sequence."""
        return max(self.sampler_busy_s, self.longest_chain_s)

    def as_dict(self) -> dict[str, Any]:
        """Flat scalars for logging (TensorBoard-friendly keys)."""
        out: dict[str, Any] = {
            "collect/groups_kept": self.groups_kept,
            "collect/groups_dropped": sum(self.groups_dropped.values()),
            "collect/trajectories": self.trajectories,
            "collect/match_rate": self.match_rate,
            "collect/invalid_rate": self.invalid_rate,
            "collect/truncated_candidates": self.truncated_candidates,
            "collect/truncated_in_reasoning": self.truncated_in_reasoning,
            "collect/unavailable_pair_rate": self.unavailable_pair_rate,
            "collect/unavailable_group_rate": self.unavailable_group_rate,
            "collect/unavailable_states": self.unavailable_states,
            "collect/sampler_calls": self.sampler_calls,
            "collect/sampler_states_per_call": self.sampler_states / self.sampler_calls if self.sampler_calls else 0.0,
            "collect/sampler_busy_fraction": self.sampler_busy_fraction,
            "collect/sampler_busy_s": self.sampler_busy_s,
            "collect/sampler_compiled_programs": self.sampler_compiled,
            "collect/wall_s": self.wall_s,
            "collect/critical_path_s": self.critical_path_s,
            "collect/longest_chain_s": self.longest_chain_s,
            "collect/wait_teacher_s": self.teacher_s,
            "collect/wait_matcher_s": self.matcher_s,
            "collect/wait_env_s": self.env_s,
            "collect/wait_sampler_s": self.sampler_wait_s,
        }
        for reason, n in sorted(self.groups_dropped.items()):
            out[f"collect/dropped/{reason}"] = n
        for reason, n in sorted(self.trajectory_ends.items()):
            out[f"collect/ended/{reason}"] = n
        for verdict, n in sorted(self.verdict_counts.items()):
            out[f"collect/verdicts/{verdict}"] = n
        for reward, n in sorted(self.reward_hist.items(), key=lambda kv: float(kv[0])):
            out[f"collect/reward_hist/{reward}"] = n
        for name, n in self.teacher.as_dict().items():
            out[f"collect/teacher/{name}"] = n
        for name, n in self.matcher.items():
            out[f"collect/matcher/{name}"] = n
        for role, usage in (("judge", self.judge), ("user", self.user)):
            for name in ("http_calls", "cache_hits", "prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
                out[f"collect/{role}/{name}"] = getattr(usage, name)
        return out
