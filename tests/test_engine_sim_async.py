"""benchmarks/engine_sim_async.py (issue 44): the staleness replay keeps its own rules.

eta = 0 must be today's synchronous loop (the one-step replay plus the update, step after step),
and no update may train a group sampled by a policy more than eta updates older. Small
workloads (3 decisions per trajectory on average, a few updates): pure Python, no JAX.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_sim_async as A  # noqa: E402


def _args(*extra):
    ap = A.build_parser()
    ap.add_argument("--train-mfu", type=float, default=0.4)
    return ap.parse_args(["--mean-decisions", "3", *extra])


def test_rule_counts_updates_between_sampling_and_training():
    assert A.trainable(4, 4, 0) and not A.trainable(3, 4, 0)
    assert A.trainable(2, 4, 2) and not A.trainable(1, 4, 2)


def test_eta_zero_is_the_synchronous_replay():
    args = _args()
    steps = A.draw_steps(0, 4, args)
    r = A.run_async(steps, 0, 3, args)
    assert r["wall"] == pytest.approx(A.synchronous_wall(steps, 3, args), rel=1e-12)
    assert r["dropped"] == 0
    assert r["waited"] == pytest.approx(r["wall"] - r["update_s"], rel=1e-12)  # each collection
    assert r["staleness"] == {0: sum(t.decisions for s in steps[:3] for t in s)}
    # only the trained steps' states were asked of the teacher: nothing ran ahead
    assert r["asked"] == r["trained"]
    assert r["peak_load"] == 1.0            # the whole step in flight or accepted: the cap


@pytest.mark.parametrize("eta", [1, 2])
def test_no_group_older_than_eta_is_trained(eta):
    # a slow teacher and a fast update: groups outlive updates, so the rule must drop some
    args = _args("--teacher-median", "60", "--train-mfu", "4")
    steps = A.draw_steps(0, 8, args)
    r = A.run_async(steps, eta, 4, args)
    assert max(r["staleness"]) <= eta
    assert r["dropped"] > 0
    assert r["trained"] == sum(t.decisions for s in steps[:4] for t in s)   # same work as eta=0
    assert max(r["staleness"]) == eta                                         # and eta was used
    # admission control: in flight plus accepted work stayed within eta + 1 updates' groups
    # (the task-start cap implies it: every group not yet trained belongs to those steps)
    assert 0.0 < r["peak_load"] <= 1.0


def test_async_is_faster_than_sync_and_needs_enough_steps():
    args = _args()
    steps = A.draw_steps(0, 6, args)
    assert A.run_async(steps, 1, 3, args)["wall"] < A.run_async(steps, 0, 3, args)["wall"]
    with pytest.raises(ValueError, match="need 6"):
        A.run_async(steps[:5], 2, 3, args)
