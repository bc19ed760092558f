"""Task pipeline: per-step quotas, seeded per-epoch shuffles, and exact resumption after a
checkpoint restore (plain JSON state and Orbax with grain's checkpoint handler)."""

from __future__ import annotations

import collections
import json

import grain
import orbax.checkpoint as ocp
import pytest

from actionopd_jax.envs.tasks import TaskSource, TaskStream, load_task_set, task_from_record, task_record
from actionopd_jax.types import Task


def _source(name, n, env="bfcl"):
    return TaskSource(name, [Task(task_id=f"{name}_{i}", env=env, split="train", payload={"i": i}) for i in range(n)])


def test_sources_have_a_stable_content_repr_and_round_trip_records():
    a, b = _source("a", 5), _source("a", 5)
    assert repr(a) == repr(b) and "sha256=" in repr(a)
    assert repr(_source("a", 6)) != repr(a)
    task = Task("t", "tau2_airline", "test", {"domain": "airline", "tau2_id": "3"})
    assert task_from_record(json.loads(json.dumps(task_record(task)))) == task
    assert a[0] == {"task_id": "a_0", "env": "bfcl", "split": "train", "payload": {"i": 0}}
    a[0]["payload"]["i"] = 99  # reads are private copies
    assert a[0]["payload"]["i"] == 0
    with pytest.raises(ValueError, match="empty"):
        TaskSource("none", [])


def test_each_step_has_exact_quotas_and_each_epoch_covers_a_source_once():
    big, small = _source("big", 7), _source("small", 3)
    stream = TaskStream([(big, 5), (small, 2)], seed=11)
    assert stream.step_size == 7
    steps = [stream.next_step() for _ in range(21)]  # 21 steps = 15 epochs of big, 14 of small
    for step in steps:
        counts = collections.Counter(t.task_id.split("_")[0] for t in step)
        assert counts == {"big": 5, "small": 2}
        assert [t.task_id.split("_")[0] for t in step] == ["big"] * 5 + ["small"] * 2
    big_order = [t.task_id for s in steps for t in s if t.task_id.startswith("big")]
    epochs = [big_order[i:i + 7] for i in range(0, len(big_order), 7)]
    assert all(sorted(e) == sorted(f"big_{i}" for i in range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled between epochs


def test_seed_determines_the_order():
    def first_ids(seed):
        s = TaskStream([(_source("a", 20), 3), (_source("b", 9), 1)], seed=seed)
        return [t.task_id for _ in range(5) for t in s.next_step()]

    assert first_ids(1) == first_ids(1)
    assert first_ids(1) != first_ids(2)


def test_resume_from_json_state_continues_with_the_next_task_start():
    def make():
        return TaskStream([(_source("a", 13), 4), (_source("b", 5), 2)], seed=3)

    stream = make()
    for _ in range(4):
        stream.next_step()
    stream.next_task()  # mid-step
    state = json.loads(json.dumps(stream.get_state()))
    expected = [stream.next_task().task_id for _ in range(20)]
    restored = make()
    restored.set_state(state)
    assert [restored.next_task().task_id for _ in range(20)] == expected
    assert state["next_index"] == 4 * 6 + 1
    other = TaskStream([(_source("a", 13), 4), (_source("b", 5), 3)], seed=3)
    with pytest.raises(ValueError, match="different configuration"):
        other.set_state(state)


def test_resume_through_orbax_with_grain_checkpoint_handler(tmp_path):
    def make():
        return TaskStream([(_source("a", 8), 3), (_source("b", 4), 1)], seed=5)

    stream = make()
    for _ in range(3):
        stream.next_step()
    manager = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(stream.iterator)))
    manager.wait_until_finished()
    expected = [[t.task_id for t in stream.next_step()] for _ in range(4)]

    restored = make()
    restored.next_step()  # a fresh run that already moved: the restore must override it
    manager2 = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    assert manager2.latest_step() == 3
    manager2.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored.iterator)))
    assert [[t.task_id for t in restored.next_step()] for _ in range(4)] == expected
    manager.close()
    manager2.close()


def test_mixing_real_environments_59_plus_5():
    """The paper's shape (59 + 5 task starts per step) over real task sets."""
    bfcl = TaskSource("bfcl_base", load_task_set("bfcl", "base"))
    airline = TaskSource("tau2_airline_train", load_task_set("tau2_airline", "train"))
    stream = TaskStream([(bfcl, 59), (airline, 5)], seed=0)
    step = stream.next_step()
    assert len(step) == 64
    assert collections.Counter(t.env for t in step) == {"bfcl": 59, "tau2_airline": 5}
    assert all(t.split == "train" for t in step if t.env == "tau2_airline")
    with pytest.raises(ValueError, match="positive int"):
        TaskStream([(bfcl, 0)], seed=0)
    with pytest.raises(ValueError, match="unknown environment"):
        load_task_set("webshop", "train")
