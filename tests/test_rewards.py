"""Rewards, retention and advantages against the paper's rules, with hand-computed numbers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actionopd_jax.rewards import (
    RewardConfig,
    batch_advantages,
    match_counts,
    reward_lambda,
    score_batch,
    score_group,
)

M, X = "match", "no_match"


def test_paper_worked_example_k3_lambda_half():
    # Teacher multiset [A, A, B]; candidates: matches A, matches B, valid non-match, invalid.
    verdicts = [[M, M, X], [X, X, M], [X, X, X], [X, X, X]]
    valid = [True, True, True, False]
    s = score_group(verdicts, valid, RewardConfig(k=3, lam=0.5))
    assert s.counts.tolist() == [2, 1, 0, 0]
    np.testing.assert_allclose(s.train_rewards, [1.25, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(s.commit_rewards, [1.25, 1.0, 0.0, -1.0])
    assert s.retained and s.drop_reason == ""


def test_partial_multiset_keeps_configured_k_in_denominator():
    # Only two samples (A, A) retained of K=3: a match of A still earns 1 + 0.5*(2-1)/(3-1) = 1.25,
    # not 1 + 0.5*(2-1)/(2-1) = 1.5.
    s = score_group([[M, M], [X, X]], [True, True], RewardConfig(k=3, lam=0.5))
    np.testing.assert_allclose(s.train_rewards, [1.25, 0.0])
    # one retained sample of K=3: unit reward for a match
    s1 = score_group([[M], [X]], [True, True], RewardConfig(k=3, lam=0.5))
    np.testing.assert_allclose(s1.train_rewards, [1.0, 0.0])


def test_raw_count_case_and_k1():
    # lambda = K-1 = 2: the reward equals the raw count c (A.2).
    np.testing.assert_allclose(reward_lambda(np.array([1, 2, 3, 0]), np.ones(4, bool), k=3, lam=2.0), [1, 2, 3, 0])
    # explicit K=1: a match earns exactly 1, no division by zero
    np.testing.assert_allclose(reward_lambda(np.array([1, 0, 0]), np.array([True, True, False]), k=1, lam=0.5),
                               [1.0, 0.0, -1.0])


def test_binary_ablation_is_lambda_zero_for_train_and_commit():
    s = score_group([[M, M, X], [X, X, M], [X, X, X]], [True] * 3, RewardConfig(k=3, lam=0.5, mode="binary"))
    np.testing.assert_allclose(s.train_rewards, [1.0, 1.0, 0.0])
    np.testing.assert_allclose(s.commit_rewards, [1.0, 1.0, 0.0])


def test_validity_ablation_trains_on_validity_but_commits_on_semantics():
    s = score_group([[M, M, X], [X, X, X], [X, X, X]], [True, True, False], RewardConfig(mode="validity"))
    np.testing.assert_allclose(s.train_rewards, [1.0, 1.0, -1.0])
    np.testing.assert_allclose(s.commit_rewards, [1.25, 0.0, -1.0])
    assert s.retained
    # all valid: equal training rewards -> masked, though semantic rewards differ (B.4)
    s2 = score_group([[M, M, X], [X, X, X]], [True, True], RewardConfig(mode="validity"))
    assert not s2.retained and s2.drop_reason == "equal_rewards"
    np.testing.assert_allclose(s2.commit_rewards, [1.25, 0.0])


def test_retention_reasons():
    cfg = RewardConfig()
    none = score_group([[], []], [True, True], cfg)
    assert (none.retained, none.drop_reason, none.train_rewards) == (False, "no_supervision", None)
    unavailable = score_group([[M, "unavailable", X], [X, X, X]], [True, True], cfg)
    assert (unavailable.retained, unavailable.drop_reason, unavailable.train_rewards) == (False, "unavailable", None)
    # the commit of an unavailable group reads the known matches only (an unavailable pair adds 0):
    # known counts [1, 2, 0, 0] -> [1.0, 1.25, 0.0, -1.0] at K=3, lambda=0.5
    u = score_group([[M, "unavailable", X], [M, M, X], ["unavailable"] * 3, [X, X, X]], [True, True, True, False],
                    RewardConfig(k=3, lam=0.5))
    np.testing.assert_allclose(u.commit_rewards, [1.0, 1.25, 0.0, -1.0])
    assert u.train_rewards is None and u.counts is None and not u.retained
    equal = score_group([[M, X, X], [X, M, X]], [True, True], cfg)  # both 1.0
    assert (equal.retained, equal.drop_reason) == (False, "equal_rewards")
    np.testing.assert_allclose(equal.commit_rewards, [1.0, 1.0])  # equal groups still advance the env
    # all matching but differing counts stays informative (A.4)
    informative = score_group([[M, M, M], [M, X, X]], [True, True], cfg)
    assert informative.retained
    np.testing.assert_allclose(informative.train_rewards, [1.5, 1.0])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="unavailable"):
        match_counts([[M, "unavailable"]])
    with pytest.raises(ValueError, match="K=3"):
        score_group([[M, M, M, M]], [True], RewardConfig(k=3))
    with pytest.raises(ValueError, match="same teacher samples"):
        score_group([[M, X], [M]], [True, True], RewardConfig())
    with pytest.raises(ValueError, match="invalid actions never match"):
        score_group([[M, X, X], [X, X, X]], [False, True], RewardConfig())
    with pytest.raises(ValueError, match="positive integer"):
        RewardConfig(k=0)
    with pytest.raises(ValueError, match="mode"):
        RewardConfig(mode="bogus")


def test_batch_advantages_hand_computed():
    # group 1 rewards [1.25, 1, 0, -1] mean 0.3125 -> centred [0.9375, 0.6875, -0.3125, -1.3125]
    # group 2 rewards [1, 0, 0, 0]     mean 0.25   -> centred [0.75, -0.25, -0.25, -0.25]
    # group 3 equal rewards -> dropped
    scores, adv = score_batch(
        [
            ([[M, M, X], [X, X, M], [X, X, X], [X, X, X]], [True, True, True, False]),
            ([[M, X, X], [X, X, X], [X, X, X], [X, X, X]], [True] * 4),
            ([[X, X, X]] * 4, [True] * 4),
        ],
        RewardConfig(),
    )
    centred = np.array([0.9375, 0.6875, -0.3125, -1.3125, 0.75, -0.25, -0.25, -0.25])
    sigma = np.sqrt(np.mean(centred**2))  # population std; mean of centred values is 0
    assert adv.num_retained == 2 and adv.advantages[2] is None
    assert adv.sigma == pytest.approx(sigma)
    np.testing.assert_allclose(np.concatenate(adv.advantages[:2]), centred / (sigma + 1e-8))
    # squares sum to 3.921875 over 8 candidates -> sigma = sqrt(0.490234375)
    assert sigma == pytest.approx(np.sqrt(0.490234375)) and sigma == pytest.approx(0.70016739, abs=1e-8)


def test_empty_active_batch():
    adv = batch_advantages([None, np.array([1.0, 1.0])], [False, False])
    assert adv.advantages == [None, None] and adv.sigma == 0.0 and adv.num_retained == 0


reward_values = st.sampled_from([-1.0, 0.0, 1.0, 1.25, 1.5])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(reward_values, min_size=2, max_size=6), min_size=1, max_size=8))
def test_advantage_properties(groups):
    cfg = RewardConfig()
    rewards = [np.array(g) for g in groups]
    keep = [bool(np.ptp(r) > cfg.range_tol) for r in rewards]
    adv = batch_advantages(rewards, keep)
    active = [a for a in adv.advantages if a is not None]
    assert len(active) == sum(keep)
    for r, k, a in zip(rewards, keep, adv.advantages):
        if not k:
            assert a is None  # equal-reward groups are dropped
            continue
        assert abs(a.mean()) < 1e-9  # zero mean per group
        # ordering inside the group is preserved
        assert np.all(np.sign(np.diff(a)) == np.sign(np.diff(r)))
    if active:
        flat = np.concatenate(active)
        # batch std normalization: population std of all advantages is sigma/(sigma+eps) ~ 1
        assert np.std(flat) == pytest.approx(adv.sigma / (adv.sigma + 1e-8), rel=1e-9)
        assert np.std(flat) == pytest.approx(1.0, abs=1e-6)
