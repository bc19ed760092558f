"""Shared-prompt rows (train.shared_prompt): the N candidates of a state packed behind one
copy of their prompt give the same behaviour logprobs, loss, token count and update as the
N separate rows (the prompt is computed once instead of N times), on one device and on a
sharded mesh; plus the packed layout itself, by hand."""

import numpy as np
import pytest

from actionopd_jax.train.batching import Row, pack_minibatch, pack_shared_minibatch, share_prompts
from actionopd_jax.train.step import StepSettings
from tests._train_fixtures import max_abs_diff, tiny_params, to_host, train_step


def _group_rows(groups: int, n: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        prompt = rng.integers(0, 2000, rng.integers(5, 30)).astype(np.int32)
        for _ in range(n):
            r = rng.integers(0, 2000, rng.integers(1, 12)).astype(np.int32)
            rows.append(Row(prompt, r, advantage=float(rng.normal()),
                            sampler_logp=-rng.uniform(0.5, 3, len(r)).astype(np.float32), group=g))
    return rows


def test_shared_layout_by_hand():
    p = np.array([5, 6, 7], np.int32)
    rows = [Row(p, np.array([8, 9], np.int32), 0.5, group=0), Row(p, np.array([4], np.int32), -1.0, group=0),
            Row(np.array([1], np.int32), np.array([2, 3], np.int32), 2.0, group=1)]
    units = share_prompts(rows)
    assert [len(u.rows) for u in units] == [2, 1]
    a = pack_shared_minibatch(units, [0, 1], microbatches=1, microbatch_rows=2, count=2, prompt_len=4,
                              resp_len=3).arrays
    np.testing.assert_array_equal(a["tokens"][0, 0], [5, 6, 7, 0, 8, 9, 0, 4, 0, 0])
    np.testing.assert_array_equal(a["positions"][0, 0], [0, 1, 2, 0, 3, 4, 0, 3, 0, 0])
    np.testing.assert_array_equal(a["attention_mask"][0, 0], [1, 1, 1, 0, 1, 1, 0, 1, 0, 0])
    # the last prompt token (position 2) predicts the first token of every response
    np.testing.assert_array_equal(a["resp_index"][0, 0], [2, 4, 0, 2, 0, 0])
    np.testing.assert_array_equal(a["resp_tokens"][0, 0], [8, 9, 0, 4, 0, 0])
    np.testing.assert_array_equal(a["loss_mask"][0, 0], [1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(a["advantages"][0, 0], [0.5, 0.5, 0, -1.0, 0, 0])
    np.testing.assert_array_equal(a["resp_index"][0, 1], [0, 4, 0, 0, 0, 0])


def test_shared_prompt_step_equals_the_separate_rows():
    """The plain rows on one device against the shared rows on a (data 2, fsdp 2) mesh: one
    comparison holds both the packing and its sharding (two compiles, not four); the shared
    rows on one device are test_trainer_step_with_shared_prompt_equals_the_plain_one's."""
    graphdef, params = tiny_params(3)
    n, groups = 2, 8                       # 16 rows: 2 microbatches of 8 rows = of 4 shared rows
    rows = _group_rows(groups, n, seed=11)
    plain = pack_minibatch(rows, list(range(len(rows))), microbatches=2, microbatch_rows=8,
                           seq_len=64, resp_len=16).arrays
    units = share_prompts(rows)
    shared = pack_shared_minibatch(units, list(range(groups)), microbatches=2, microbatch_rows=4, count=n,
                                   prompt_len=32, resp_len=16).arrays
    results = []
    for settings, arrays, shape in ((StepSettings(), plain, None),
                                    (StepSettings(shared_prompt=n), shared, {"data": 2, "fsdp": 2})):
        step = train_step(graphdef, params, shape, settings=settings)
        batch = step.put_batch(arrays)
        old, _ = step.old_logprobs(params, batch)
        batch["old_logp"] = old
        state, metrics = step.update(step.init_state(params), batch)
        results.append((to_host(old), to_host(state["params"]), to_host(metrics)))
    (old_a, params_a, m_a), (old_b, params_b, m_b) = results
    # behaviour logprobs of every response token, unpacked from the shared rows' regions
    for i, row in enumerate(rows):
        j, c = divmod(i, n)
        mb_plain, r_plain = divmod(i, 8)
        mb_shared, r_shared = divmod(j, 4)
        got = old_b[mb_shared, r_shared, c * 16:c * 16 + len(row.response)]
        want = old_a[mb_plain, r_plain, :len(row.response)]
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert m_a["tokens"] == m_b["tokens"] == sum(len(r.response) for r in rows)
    np.testing.assert_allclose(m_b["loss"], m_a["loss"], atol=1e-6)
    np.testing.assert_allclose(m_b["grad_norm"], m_a["grad_norm"], rtol=1e-4)
    assert max_abs_diff(params_a, params_b) < 1e-5


def test_trainer_step_with_shared_prompt_equals_the_plain_one(tmp_path):
    """The whole trainer (collect -> batches -> old logprobs -> update -> checkpoint) through the
    real command: the same groups give the same loss, gradient norm and tokens either way."""
    import json
    import subprocess
    import sys

    from tests._subprocess_fixtures import cli_env

    metrics = {}
    for name, extra in (("plain", []), ("shared", ["train.shared_prompt=true"])):
        out = subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "train", "--smoke", "run.tensorboard=false",
                              "train.microbatch_rows=2", f"run.name={name}", *extra], cwd=tmp_path,
                             env=cli_env(devices=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=900)
        assert out.returncode == 0 and "smoke OK" in out.stdout, out.stdout[-3000:]
        (run,) = (tmp_path / "runs").glob(f"*-{name}-smoke")
        metrics[name] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    plain, shared = metrics["plain"], metrics["shared"]
    assert plain["tokens"] == shared["tokens"] and plain["rows"] == shared["rows"] == 8
    assert shared["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert shared["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert shared["real_tokens"] < plain["real_tokens"]   # each prompt computed once, not N times
