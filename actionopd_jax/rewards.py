"""Rewards, group retention and advantages (paper eqs. 5-7, appendix A.2, A.4, B.4).

All functions are pure numpy. Shapes: a state group has N student candidates and M <= K
retained teacher samples; `verdicts[i][k]` is the matcher verdict of candidate i against
teacher sample k.

- count  c_i = #{k : verdicts[i][k] == "match"}                              (eq. 5)
- reward r_i = -1 if candidate i is invalid, 0 if valid and c_i == 0,
               1 + lambda * (c_i - 1) / (K - 1) if c_i > 0                  (eq. 6)
  K is the CONFIGURED sample count, also when fewer samples were retained (A.3); with
  K == 1 a match earns exactly 1 (A.2: "an explicit K=1 configuration").
- ablations (B.4): "binary" is lambda = 0 for training and commitment; "validity" trains on
  +1 valid / -1 invalid while the commitment rule keeps ActionOPD's semantic reward.
- retention (A.4): drop a group without teacher samples ("no_supervision"), with any
  "unavailable" verdict ("unavailable": never turned into a 0 and never trained on), or whose
  training rewards span <= 1e-8 ("equal_rewards").
- an unavailable group still has commit rewards: r_lambda of the matches that are known
  (`known_match_counts`), so the trajectory goes on (paper A.3 ends a rollout only for an
  empty teacher multiset or a prompt that cannot fit).
- advantages (eq. 7): centre by the group mean, divide by the population std of ALL centred
  rewards of the retained groups in the batch, plus eps = 1e-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from actionopd_jax.types import Verdict

RewardMode = Literal["actionopd", "binary", "validity"]
_MODES = ("actionopd", "binary", "validity")


@dataclass(frozen=True)
class RewardConfig:
    k: int = 3                      # configured teacher samples per state (denominator K)
    lam: float = 0.5                # frequency-bonus scale lambda
    mode: RewardMode = "actionopd"
    range_tol: float = 1e-8         # groups whose reward range is <= this are dropped
    eps: float = 1e-8               # added to the batch std

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"RewardConfig.k must be a positive integer (teacher samples per state), got {self.k!r}")
        if not np.isfinite(self.lam):
            raise ValueError(f"RewardConfig.lam must be a finite number, got {self.lam!r}")
        if self.mode not in _MODES:
            raise ValueError(f"RewardConfig.mode must be one of {_MODES}, got {self.mode!r}")


def match_counts(verdicts: Sequence[Sequence[Verdict]]) -> np.ndarray:
    """c per candidate. Raises ValueError if any verdict is "unavailable" (mask the group
    instead; an unavailable judgement must never be counted as a non-match)."""
    counts = np.zeros(len(verdicts), dtype=np.int64)
    for i, row in enumerate(verdicts):
        for v in row:
            if v == "match":
                counts[i] += 1
            elif v == "unavailable":
                raise ValueError(f"candidate {i} has an 'unavailable' verdict: the group must be masked, not scored")
            elif v != "no_match":
                raise ValueError(f"unknown verdict {v!r} for candidate {i}; expected match/no_match/unavailable")
    return counts


def known_match_counts(verdicts: Sequence[Sequence[Verdict]]) -> np.ndarray:
    """c per candidate over the pairs with a definite verdict: "unavailable" adds nothing. Only
    the commit of an unavailable group reads these (a lower bound of each count); its training
    rewards do not exist."""
    counts = np.zeros(len(verdicts), dtype=np.int64)
    for i, row in enumerate(verdicts):
        for v in row:
            if v not in ("match", "no_match", "unavailable"):
                raise ValueError(f"unknown verdict {v!r} for candidate {i}; expected match/no_match/unavailable")
            counts[i] += v == "match"
    return counts


def reward_lambda(counts: np.ndarray, valid: np.ndarray, *, k: int, lam: float) -> np.ndarray:
    """Eq. 6 elementwise. `counts` int[N], `valid` bool[N] -> float64[N]."""
    counts = np.asarray(counts, dtype=np.int64)
    valid = np.asarray(valid, dtype=bool)
    if counts.shape != valid.shape:
        raise ValueError(f"counts {counts.shape} and valid {valid.shape} must have the same shape")
    if np.any(counts < 0) or np.any(counts > k):
        raise ValueError(f"match counts must lie in [0, K={k}], got {counts.tolist()}")
    if np.any(counts[~valid] > 0):
        raise ValueError("an invalid candidate has a nonzero match count; invalid actions never match")
    bonus = lam * (counts - 1) / (k - 1) if k > 1 else np.zeros(counts.shape)
    matched = 1.0 + bonus
    return np.where(~valid, -1.0, np.where(counts > 0, matched, 0.0)).astype(np.float64)


def validity_reward(valid: np.ndarray) -> np.ndarray:
    """B.4 "Validity Reward": +1 for a valid action, -1 for invalid output."""
    return np.where(np.asarray(valid, dtype=bool), 1.0, -1.0)


@dataclass
class GroupScore:
    """Rewards of one state group. `commit_rewards` drive the argmax commit; `train_rewards`
    the update. Both are None without teacher samples (the collector then ends the trajectory);
    an unavailable group has commit rewards from its known matches only and no training rewards."""

    train_rewards: np.ndarray | None
    commit_rewards: np.ndarray | None
    counts: np.ndarray | None
    retained: bool
    drop_reason: str = ""  # "", "no_supervision", "unavailable", "equal_rewards"


def score_group(verdicts: Sequence[Sequence[Verdict]], valid: Sequence[bool], cfg: RewardConfig) -> GroupScore:
    """Counts, rewards and retention of one group.

    `verdicts` is N rows of M verdicts (M = retained teacher samples, 0 <= M <= K);
    `valid[i]` says whether candidate i parsed to a valid action.
    """
    valid_arr = np.asarray(list(valid), dtype=bool)
    if len(verdicts) != len(valid_arr):
        raise ValueError(f"{len(verdicts)} verdict rows for {len(valid_arr)} candidates")
    widths = {len(row) for row in verdicts}
    if len(widths) > 1:
        raise ValueError(f"every candidate must be compared with the same teacher samples; row widths {sorted(widths)}")
    num_samples = widths.pop() if widths else 0
    if num_samples > cfg.k:
        raise ValueError(f"{num_samples} teacher samples retained but K={cfg.k} configured")
    if num_samples == 0:
        return GroupScore(None, None, None, retained=False, drop_reason="no_supervision")
    lam = 0.0 if cfg.mode == "binary" else cfg.lam
    if any(v == "unavailable" for row in verdicts for v in row):
        known = reward_lambda(known_match_counts(verdicts), valid_arr, k=cfg.k, lam=lam)
        return GroupScore(None, known, None, retained=False, drop_reason="unavailable")
    counts = match_counts(verdicts)
    semantic = reward_lambda(counts, valid_arr, k=cfg.k, lam=lam)
    train = validity_reward(valid_arr) if cfg.mode == "validity" else semantic
    retained = bool(np.ptp(train) > cfg.range_tol) if len(train) else False
    return GroupScore(train, semantic, counts, retained=retained, drop_reason="" if retained else "equal_rewards")


@dataclass
class BatchAdvantages:
    advantages: list[np.ndarray | None]   # per group, None for dropped groups
    sigma: float                          # population std of centred rewards of retained groups
    num_retained: int


def batch_advantages(rewards: Sequence[np.ndarray | None], retained: Sequence[bool], *, eps: float = 1e-8) -> BatchAdvantages:
    """Eq. 7: A_gi = (r_gi - mean_g r) / (sigma + eps), sigma over all retained candidates.

    Groups with retained False (or rewards None) get None and contribute nothing to sigma.
    An empty active batch gives all None and sigma 0 (the trainer skips the update).
    """
    if len(rewards) != len(retained):
        raise ValueError(f"{len(rewards)} reward arrays but {len(retained)} retention flags")
    centred: list[np.ndarray | None] = []
    for r, keep in zip(rewards, retained):
        if not keep or r is None:
            centred.append(None)
            continue
        r = np.asarray(r, dtype=np.float64)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"group rewards must be a non-empty 1-D array, got shape {r.shape}")
        centred.append(r - r.mean())
    active = [c for c in centred if c is not None]
    if not active:
        return BatchAdvantages([None] * len(rewards), 0.0, 0)
    sigma = float(np.std(np.concatenate(active)))  # population std (ddof=0)
    return BatchAdvantages([None if c is None else c / (sigma + eps) for c in centred], sigma, len(active))


def score_batch(groups: Sequence[tuple[Sequence[Sequence[Verdict]], Sequence[bool]]], cfg: RewardConfig
                ) -> tuple[list[GroupScore], BatchAdvantages]:
    """Score every group and compute the batch's advantages in one call."""
    scores = [score_group(v, ok, cfg) for v, ok in groups]
    adv = batch_advantages([s.train_rewards for s in scores], [s.retained for s in scores], eps=cfg.eps)
    return scores, adv
