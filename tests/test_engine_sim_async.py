"""benchmarks/engine_sim_async.py (issue 44): the staleness replay keeps the product's rules.

eta = 0 must be today's synchronous loop (the one-step replay plus the update, step after
step); an update trains its whole draw, and no group sampled by a policy more than eta updates
older; the mesh split decodes through the update. Small workloads (3 decisions per trajectory
on average, a few updates): pure Python, no JAX.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_sim_async as A  # noqa: E402
import engine_sim_update as U  # noqa: E402


def _args(*extra):
    ap = A.build_parser()
    A.add_options(ap)
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
    assert r["draws_ahead"] == 1
    assert r["reprefilled"] == 0          # no swap inside a draw: every prefix is reused


@pytest.mark.parametrize("eta", [1, 2])
def test_whole_draws_and_no_group_older_than_eta_is_trained(eta):
    # a slow teacher and a fast update: trajectories outlive updates
    args = _args("--teacher-median", "60", "--train-mfu", "4")
    steps = A.draw_steps(0, 8, args)
    r = A.run_async(steps, eta, 4, args)
    assert max(r["staleness"]) == eta                                         # eta was used, not passed
    assert r["trained"] == sum(t.decisions for s in steps[:4] for t in s)   # update v: all of draw v
    assert r["dropped"] == 0              # admission by draws: no group can be too old (the filter is the guarantee)
    assert r["draws_ahead"] == eta + 1    # admission control: draws v .. v + eta
    # a swap drops the prefix index (engine/versions.py): trajectories running across one prefill again
    reusable = sum(p[1] for s in steps for t in s for p in A.prompts_of(t))
    assert 0 < r["reprefilled"] < reusable


def test_async_is_faster_than_sync_and_needs_enough_steps():
    args = _args()
    steps = A.draw_steps(0, 6, args)
    assert A.run_async(steps, 1, 3, args)["wall"] < A.run_async(steps, 0, 3, args)["wall"]
    with pytest.raises(ValueError, match="need 5"):
        A.run_async(steps[:4], 2, 3, args)
    with pytest.raises(ValueError, match="split must be"):
        A.run_async(steps, 1, 3, args, split=4)


def test_split_trains_on_fewer_chips_while_decoding_goes_on():
    # an update far slower than a draw's collection (0.1% MFU): on shared chips decoding stops
    # for it, so the trainer waits for draw 1's remaining decoding after update 0; with the
    # split, draw 1 is done while update 0 runs, and after the first draw the trainer waits
    # only for the weights to move
    args = _args("--train-mfu", "0.001")
    steps = A.draw_steps(0, 3, args)
    shared, split = A.run_async(steps, 1, 2, args), A.run_async(steps, 1, 2, args, split=2)
    assert split["update_s"] == pytest.approx(2 * shared["update_s"], rel=1e-12)    # same draws, half the chips
    # split: all of draw 1 ran under the first weights, during update 0; shared: some of it waited
    # for the update and ran under the new ones
    assert split["staleness"] == {0: sum(t.decisions for t in steps[0]), 1: sum(t.decisions for t in steps[1])}
    assert shared["staleness"][0] > split["staleness"][0]
    move = U.weight_move_seconds(2)
    first = split["waited"] - move                       # draw 0's collection on the 2 decode chips
    assert split["wall"] == pytest.approx(first + split["update_s"] + 2 * move, rel=1e-9)
    assert first > A.run_async(steps, 0, 1, args)["waited"]          # decoding on 2 chips is slower
    # the device-busy share counts chip-seconds: the train chips are busy through both updates
    assert split["busy"] * 4 * split["wall"] >= 2 * split["update_s"]


def test_goal_costs_are_the_issues_definitions():
    args = _args("--at-goal", "41+42")
    assert A.apply_goals(args) == "at issue 41's goal and at issue 42's goal"
    # issue 41: a step at 60% of (weights + running rows' KV, a shared prompt once) / bandwidth
    kv = A.kv_read(4 * (1000 + 50), 1000, 4000, args)
    assert kv == 1000 + 200
    bound = (A.WEIGHTS + kv * A.KV_TOKEN) / (4 * A.BW)
    assert A.decode_step_seconds(kv, 252, args) == pytest.approx(bound / 0.6, rel=1e-12)
    assert args.train_mfu == pytest.approx(500 / 799)        # issue 42: 500 TFLOP/s of the measured 799
    with pytest.raises(SystemExit, match="41, 42"):
        A.apply_goals(_args("--at-goal", "43"))


def test_train_order_finished_trains_the_oldest_ended_groups():
    # not the product's rule: an update takes as many ended groups as its draw has, from any
    # draw, so it never waits for a draw's slowest trajectory; groups older than eta are dropped
    args = _args("--train-order", "finished", "--teacher-median", "60", "--train-mfu", "4")
    steps = A.draw_steps(0, 8, args)
    r = A.run_async(steps, 1, 4, args)
    assert r["trained"] == sum(t.decisions for s in steps[:4] for t in s)
    assert max(r["staleness"]) <= 1
    by_draw = A.run_async(steps, 1, 4, _args("--teacher-median", "60", "--train-mfu", "4"))
    assert r["wall"] < by_draw["wall"]
