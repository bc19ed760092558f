"""One state group: from the N parsed candidates, the retained teacher samples and the
verdict matrix to rewards, retention and the committed candidate (paper eqs. 5-6,
algorithm 1 lines 10-12, appendix A.3-A.4).

Rewards and retention come from `actionopd_jax.rewards.score_group` (not re-derived here);
this module only adds the commit rule and assembles the `StateGroup` record:

- commit (ActionOPD): the highest *semantic* reward r_lambda, ties broken uniformly at
  random with the state's commit key. Under the validity-reward ablation the update trains
  on +-1 validity rewards but the commit still follows the semantic reward (paper B.4);
  under the binary ablation both use lambda = 0.
- commit (random ablation): uniform over all N candidates, whatever their rewards.
- a group without any valid teacher sample is *no group at all* (the trajectory ends; it is
  not a failure label), so `build_group` returns None for it;
- a group with an "unavailable" verdict is recorded but masked (retained False,
  drop_reason "unavailable", no rewards): an unavailable judgement is never read as a
  non-match and never trained on. The trajectory goes on (paper A.3 ends a rollout only for
  an empty teacher multiset or a prompt that cannot fit): the commit follows the semantic
  reward of the matches that are known (rewards.known_match_counts), with the same tie-break;
- a group whose training rewards are all equal is recorded, masked ("equal_rewards"), and
  still commits a candidate so the trajectory goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import jax
import numpy as np

from actionopd_jax.collect.keys import uniform_index
from actionopd_jax.rewards import GroupScore, RewardConfig, score_group
from actionopd_jax.types import Candidate, Invalid, StateGroup, TeacherSample, Verdict

CommitMode = Literal["argmax", "random"]
NO_COMMIT = -1  # committed index when there is no group (no valid teacher sample)


def commit_index(commit_rewards: np.ndarray, key: jax.Array, mode: CommitMode) -> int:
    """Index of the candidate that advances the environment.

    "argmax": uniform among the candidates whose reward equals the maximum exactly (rewards
    of equal match counts are computed by the same float expression, so equal means equal).
    "random": uniform over all candidates (the random-commit ablation).
    """
    rewards = np.asarray(commit_rewards, dtype=np.float64)
    if rewards.ndim != 1 or rewards.size == 0:
        raise ValueError(f"commit rewards must be a non-empty 1-D array, got shape {rewards.shape}")
    if mode == "random":
        return uniform_index(key, rewards.size)
    if mode != "argmax":
        raise ValueError(f"commit mode must be 'argmax' or 'random', got {mode!r}")
    best = np.flatnonzero(rewards == rewards.max())
    return int(best[uniform_index(key, best.size)])


@dataclass
class GroupOutcome:
    """What one decision point produced: the recorded group (None when the teacher gave no
    valid sample), the score, and the candidate to commit (NO_COMMIT: no group, the trajectory
    ends)."""

    group: StateGroup | None
    score: GroupScore
    committed: int

    @property
    def drop_reason(self) -> str:
        return self.score.drop_reason


def verdicts_width_check(verdicts: Sequence[Sequence[Verdict]], n_candidates: int, n_teacher: int) -> None:
    if len(verdicts) != n_candidates or any(len(row) != n_teacher for row in verdicts):
        shape = [len(row) for row in verdicts]
        raise ValueError(f"verdicts must be {n_candidates} rows of {n_teacher} (candidates x teacher samples), "
                         f"got rows {shape}")


def build_group(
    *,
    task_id: str,
    decision_index: int,
    prompt_ids: np.ndarray,
    candidates: list[Candidate],
    teacher_samples: list[TeacherSample],
    verdicts: Sequence[Sequence[Verdict]],
    reward_cfg: RewardConfig,
    commit_mode: CommitMode,
    key: jax.Array,
) -> GroupOutcome:
    """Score one state group and choose its commit. `verdicts[i][k]`: candidate i against
    teacher sample k. Candidates are updated in place (reward, verdicts)."""
    if not candidates:
        raise ValueError("a state group needs at least one candidate")
    verdicts_width_check(verdicts, len(candidates), len(teacher_samples))
    valid = [not isinstance(c.action, Invalid) for c in candidates]
    score = score_group(verdicts, valid, reward_cfg)
    for cand, row in zip(candidates, verdicts):
        cand.verdicts = list(row)
    if score.drop_reason == "no_supervision":
        return GroupOutcome(group=None, score=score, committed=NO_COMMIT)
    if score.drop_reason == "unavailable":
        for cand in candidates:
            cand.reward = 0.0  # no reward exists; the group is masked and never trained on
    else:
        for cand, r in zip(candidates, score.train_rewards):
            cand.reward = float(r)
    committed = commit_index(score.commit_rewards, key, commit_mode)
    group = StateGroup(
        task_id=task_id,
        decision_index=decision_index,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        candidates=candidates,
        teacher_samples=list(teacher_samples),
        committed_index=committed,
        retained=score.retained,
        drop_reason=score.drop_reason,
    )
    return GroupOutcome(group=group, score=score, committed=committed)
