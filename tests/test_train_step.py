"""The sharded train step: batching layout, loss/gradients against an independent per-row
computation, exact accumulation over unequal microbatches, sharded == single device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from actionopd_jax.train import losses as L
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.train.batching import (Row, bucket_length, pack_minibatch, plan_minibatches, rows_from_groups,
                                         share_prompts)
from actionopd_jax.train.step import StepSettings, make_optimizer, response_logprobs
from actionopd_jax.types import Candidate, Message, StateGroup
from tests._train_fixtures import (TINY, device_params, max_abs_diff, packed, random_rows, tiny_params,
                                   to_host, train_step)

# ---- batching -----------------------------------------------------------------------------


@pytest.mark.parametrize("n, want", [(1, 64), (64, 64), (65, 128), (300, 320), (600, 640), (1000, 1024),
                                     (5000, 5120), (0, 64)])
def test_bucket_length(n, want):
    assert bucket_length(n, 64) == want


def test_pack_minibatch_layout_and_padding_waste():
    rows = [Row(np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32), 0.5, np.array([-1.0, -2.0])),
            Row(np.array([1], np.int32), np.array([2, 3, 4], np.int32), -1.0, np.array([-3.0, -4.0, -5.0]))]
    mb = pack_minibatch(rows, [0, 1], microbatches=2, microbatch_rows=2, seq_len=8, resp_len=4)
    a = mb.arrays
    assert a["tokens"].shape == (2, 2, 8) and a["resp_tokens"].shape == (2, 2, 4)
    np.testing.assert_array_equal(a["tokens"][0, 0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(a["attention_mask"][0, 1], [1, 1, 1, 1, 0, 0, 0, 0])
    # hidden state at position p-1+r predicts response token r
    np.testing.assert_array_equal(a["resp_index"][0, 0], [2, 3, 0, 0])
    np.testing.assert_array_equal(a["resp_index"][0, 1], [0, 1, 2, 0])
    np.testing.assert_array_equal(a["resp_tokens"][0, 1], [2, 3, 4, 0])
    np.testing.assert_array_equal(a["loss_mask"][0], [[1, 1, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(a["loss_mask"][1], 0)  # the second microbatch is padding
    np.testing.assert_array_equal(a["advantages"][0], [0.5, -1.0])
    np.testing.assert_array_equal(a["sampler_logp"][0, 1], [-3, -4, -5, 0])
    assert mb.real_tokens == 9 and mb.stats["padding_waste"] == pytest.approx(1 - 9 / 32)
    with pytest.raises(ValueError, match="smaller than the rows"):
        pack_minibatch(rows, [0, 1], microbatches=1, microbatch_rows=2, seq_len=4, resp_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        pack_minibatch(rows, [0, 1], microbatches=1, microbatch_rows=2, max_len=4)


def test_rows_from_groups_takes_all_candidates_of_retained_groups_only():
    def cand(n):
        return Candidate(np.arange(n, dtype=np.int32), np.zeros(n, np.float32), "", Message("x"))

    kept = StateGroup("t", 0, np.array([1, 2], np.int32), [cand(2), cand(0), cand(3)], [], 0,
                      advantages=np.array([1.0, 0.0, -1.0]))
    dropped = StateGroup("t", 1, np.array([1], np.int32), [cand(2)], [], 0, retained=False)
    rows = rows_from_groups([kept, dropped])
    assert [len(r.response) for r in rows] == [2, 3]  # empty response skipped, dropped group absent
    assert [r.advantage for r in rows] == [1.0, -1.0]
    with pytest.raises(ValueError, match="teacher log-probabilities"):
        rows_from_groups([kept], need_teacher_logp=True)
    kept.advantages = np.array([1.0])
    with pytest.raises(ValueError, match="1 advantages for 3 candidates"):
        rows_from_groups([kept])


def test_plan_minibatches_sorted_by_length_and_seeded():
    rows = random_rows(10, seed=1)
    plan = plan_minibatches(rows, minibatch_rows=4, sort_by_length=True, rng=np.random.default_rng(0))
    assert [len(c) for c in plan] == [4, 4, 2] and sorted(sum(plan, [])) == list(range(10))
    lengths = [[rows[i].length for i in c] for c in plan]
    assert all(max(a) <= min(b) for a, b in zip(lengths, lengths[1:]))
    again = plan_minibatches(rows, minibatch_rows=4, sort_by_length=True, rng=np.random.default_rng(0))
    assert plan == again


def _shared_units(shapes):
    """SharedRows of (prompt length, reply lengths) through share_prompts, as the trainer makes them."""
    rows = [Row(np.ones(p, np.int32), np.ones(r, np.int32), group=g) for g, (p, replies) in enumerate(shapes)
            for r in replies]
    return share_prompts(rows)


def test_shared_rows_are_tiled_by_prompt_and_reply():
    """train.shared_prompt packs a minibatch [rows x (prompt width + N x reply width)], each width
    its longest: sorting by real tokens paired long prompts with long replies (issue 44's replay:
    71% padding); the tiling pairs like shapes. Widths under 128 are exact buckets of 16."""
    shapes = [(112, [16, 16]), (16, [64, 64]), (112, [16, 32]), (16, [64, 80])]   # real tokens 144, 144, 160, 160
    units = _shared_units(shapes)

    def area(plan):
        return sum(max(shapes[i][0] for i in c) + 2 * max(max(shapes[i][1]) for i in c) for c in plan)

    old = plan_minibatches(units, minibatch_rows=2, sort_by_length=True, rng=np.random.default_rng(0))
    new = plan_minibatches(units, minibatch_rows=2, sort_by_length=True, rng=np.random.default_rng(0),
                           regions=2, multiples=(16, 16))
    assert sorted(map(sorted, old)) == [[0, 1], [2, 3]] and area(old) == (112 + 2 * 64) + (112 + 2 * 80) == 512
    assert sorted(map(sorted, new)) == [[0, 2], [1, 3]] and area(new) == 2 * (16 + 2 * 80) == 352

    # the paper recipe's shape at random: minibatch count, trained rows, spare room and seed are kept
    gen = np.random.default_rng(3)
    shapes = [(int(gen.integers(500, 24576)), gen.integers(1, 4096, size=4).tolist()) for _ in range(203)]
    units = _shared_units(shapes)
    kw = dict(minibatch_rows=16, sort_by_length=True, regions=4, multiples=(64, 128))
    plan = plan_minibatches(units, rng=np.random.default_rng(7), **kw)
    assert sorted(sum(plan, [])) == list(range(203)) and sorted(map(len, plan)) == [11] + [16] * 12
    assert plan == plan_minibatches(units, rng=np.random.default_rng(7), **kw)

    def widths(plan):
        return [bucket_length(max(shapes[i][0] for i in c), 64)
                + 4 * bucket_length(max(max(shapes[i][1]) for i in c), 128) for c in plan]

    assert widths(plan) == sorted(widths(plan))      # cheapest first: minibatch i of every process alike
    by_length = plan_minibatches(units, rng=np.random.default_rng(7), **{**kw, "regions": 0})
    assert len(by_length) == 13 and sum(widths(plan)) < 0.9 * sum(widths(by_length))
    # unsorted: a seeded random partition, whatever the regions
    assert plan_minibatches(units, rng=np.random.default_rng(7), **{**kw, "sort_by_length": False}) == \
        plan_minibatches(units, rng=np.random.default_rng(7), **{**kw, "sort_by_length": False, "regions": 0})


# ---- logits only at response positions ----------------------------------------------------


@pytest.mark.parametrize("chunk, vocab_chunk", [(0, 0), (4, 0), (0, 7)])
def test_response_logprobs_equal_full_logits_at_those_positions(chunk, vocab_chunk):
    graphdef, params = tiny_params()
    rows = random_rows(3, seed=2)
    a = packed(rows, seq_len=32, resp_len=8).arrays
    model = nnx.merge(graphdef, params)
    tok, pos, att = (jnp.asarray(a[k][0]) for k in ("tokens", "positions", "attention_mask"))
    hidden, _ = model(tok, pos, attention_mask=att)
    got = response_logprobs(model, hidden, jnp.asarray(a["resp_index"][0]), jnp.asarray(a["resp_tokens"][0]),
                            0.7, chunk, vocab_chunk)
    full = jax.nn.log_softmax(model.logits(hidden) / 0.7, axis=-1)  # every position: the slow way
    for j, row in enumerate(rows):
        p, n = len(row.prompt), len(row.response)
        want = full[j, p - 1: p - 1 + n][jnp.arange(n), row.response]
        np.testing.assert_allclose(np.asarray(got[j, :n]), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---- the update against an independent computation --------------------------------------


def _same_length_rows(n, seed, total=12):
    """Rows of equal total length but different prompt/response splits: the reference below
    can then run them as one unpadded batch, while the train step pads and gathers."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        p = int(rng.integers(3, total - 2))
        seq = rng.integers(0, TINY.vocab_size, total).astype(np.int32)
        rows.append(Row(seq[:p], seq[p:], float(rng.normal()),
                        teacher_logp=-rng.uniform(0.5, 3, total - p).astype(np.float32)))
    return rows


def _reference_sums(graphdef, params, rows, old, settings):
    """Unpadded forward, logits at EVERY position, then each row's response slice."""
    model = nnx.merge(graphdef, params)
    seqs = jnp.stack([jnp.concatenate([r.prompt, r.response]) for r in rows])
    h, _ = model(seqs, jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape))
    logp_all = jax.nn.log_softmax(model.logits(h) / settings.temperature, axis=-1)
    total = L.zero_sums()
    for j, (row, old_row) in enumerate(zip(rows, old)):
        p, n = len(row.prompt), len(row.response)
        lp = logp_all[j, p - 1: p - 1 + n][jnp.arange(n), row.response][None]
        mask = jnp.ones_like(lp)
        if settings.loss == "actionopd":
            s = L.actionopd_sums(lp, old_row[None], jnp.array([row.advantage]), mask,
                                 clip_eps=settings.clip_eps, dual_clip=settings.dual_clip)
        elif settings.loss == "opd":
            s = L.opd_sums(lp, old_row[None], row.teacher_logp[None], mask)
        else:
            s = L.kd_sums(lp, mask)
        total = L.add_sums(total, s)
    return total


@pytest.mark.parametrize("loss, vocab_chunk", [("actionopd", 0), ("opd", 0), ("kd", 0), ("actionopd", 50)])
def test_update_equals_independent_loss_gradient_and_adamw(loss, vocab_chunk):
    """vocab_chunk > 0: the fused LM head (a custom VJP) must give the same update."""
    graphdef, params = tiny_params(seed=3)
    settings = StepSettings(loss=loss, temperature=0.7, vocab_chunk=vocab_chunk)
    rows = _same_length_rows(5, seed=4)
    # behaviour logprobs near the model's own, so that some ratios leave [0.8, 1.2]
    rng = np.random.default_rng(5)
    seqs = jnp.stack([jnp.concatenate([r.prompt, r.response]) for r in rows])

    @jax.jit
    def all_logp(pr):
        model = nnx.merge(graphdef, pr)
        h, _ = model(seqs, jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape))
        return jax.nn.log_softmax(model.logits(h) / 0.7, -1)

    lp_all = all_logp(params)
    old = []
    for j, row in enumerate(rows):
        p, n = len(row.prompt), len(row.response)
        old.append(np.asarray(lp_all[j, p - 1: p - 1 + n][jnp.arange(n), row.response]) + rng.normal(0, 0.3, n))
        row.sampler_logp = old[-1].astype(np.float32)

    def ref_loss(pr):
        return L.mean_loss(_reference_sums(graphdef, pr, rows, [jnp.asarray(o, jnp.float32) for o in old],
                                           settings))

    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss))(params)   # one compile, not op by op
    tx = make_optimizer(lr=1e-2, eps=1e-2, grad_clip=0.0, weight_decay=0.0)
    upd, _ = tx.update(ref_grads, tx.init(params), params)
    want = optax.apply_updates(params, upd)

    ts = train_step(graphdef, params, settings=settings)
    state = ts.init_state(device_params(params))
    batch = ts.put_batch(packed(rows, microbatches=2, microbatch_rows=3).arrays)
    batch["old_logp"] = batch["sampler_logp"]
    state, m = ts.update(state, batch)
    assert float(m["loss"]) == pytest.approx(float(ref_value), rel=1e-5, abs=1e-6)
    assert float(m["tokens"]) == sum(len(r.response) for r in rows)
    assert float(m["grad_norm"]) == pytest.approx(float(optax.tree.norm(ref_grads)), rel=1e-4)
    assert max_abs_diff(to_host(state["params"]), to_host(want)) < 2e-6
    if loss == "actionopd":
        assert float(m["clip_frac_low"]) + float(m["clip_frac_high"]) > 0  # the clip was exercised


def test_accumulation_over_unequal_microbatches_equals_one_batch():
    graphdef, params = tiny_params(seed=6)
    rows = random_rows(4, seed=7)
    results = []
    # one microbatch of 4 rows; or 2 microbatches holding 3 rows and 1 row (+ padding rows)
    for micro, per in [(1, 4), (2, 3), (4, 1)]:
        ts = train_step(graphdef, params)
        state = ts.init_state(device_params(params))
        batch = ts.put_batch(packed(rows, microbatches=micro, microbatch_rows=per).arrays)
        batch["old_logp"], _ = ts.old_logprobs(state["params"], batch)
        state, m = ts.update(state, batch)
        results.append((to_host(state["params"]), {k: float(v) for k, v in m.items()}))
    (p0, m0) = results[0]
    for p, m in results[1:]:
        assert m["tokens"] == m0["tokens"]
        assert m["loss"] == pytest.approx(m0["loss"], rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
        assert max_abs_diff(p, p0) < 1e-6


_SINGLE_DEVICE = {}   # vocab_chunk -> the single-device run every mesh is held to (computed once)


# every axis alone at 8 (fsdp) or beside data (tensor), and all three at once with the fused
# (vocab-chunked) LM head; all three with the plain head adds no layout the others lack
@pytest.mark.parametrize("shape, vocab_chunk", [({"fsdp": 8}, 0), ({"data": 4, "tensor": 2}, 0),
                                                ({"data": 2, "fsdp": 2, "tensor": 2}, 64)])
def test_sharded_step_equals_single_device(shape, vocab_chunk):
    graphdef, params = tiny_params(seed=8)
    rows = random_rows(14, seed=9)
    arrays = packed(rows, microbatches=2, microbatch_rows=8).arrays
    settings = StepSettings(vocab_chunk=vocab_chunk)

    def two_updates(mesh_shape):
        ts = train_step(graphdef, params, mesh_shape, grad_clip=1.0, settings=settings)
        state = ts.init_state(device_params(params))
        batch = ts.put_batch(arrays)
        batch["old_logp"], _ = ts.old_logprobs(state["params"], batch)
        metrics = []
        for _ in range(2):
            state, m = ts.update(state, batch)
            metrics.append({k: float(v) for k, v in m.items()})
        return to_host(state["params"]), metrics, state

    if vocab_chunk not in _SINGLE_DEVICE:
        _SINGLE_DEVICE[vocab_chunk] = two_updates({"data": 1})[:2]
    p1, m1 = _SINGLE_DEVICE[vocab_chunk]
    pn, mn, state = two_updates(shape)
    for a, b in zip(m1, mn):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert max_abs_diff(pn, p1) < 1e-6
    # the state really is laid out on the mesh (parameters and their Adam moments alike)
    emb = state["params"]["embed_tokens"]
    assert len(emb.sharding.device_set) == 8 and not emb.sharding.is_fully_replicated
    mu = state["opt_state"][-1][0].mu["embed_tokens"]
    assert mu.sharding == emb.sharding


def test_minibatch_without_active_tokens_changes_nothing():
    graphdef, params = tiny_params(seed=10)
    ts = train_step(graphdef, params)
    state = ts.init_state(device_params(params))
    before = to_host(state)
    # the shapes of the accumulation test's one-microbatch step: its programs come from the cache
    arrays = packed(random_rows(4, seed=11), microbatches=1, microbatch_rows=4).arrays
    arrays["loss_mask"][:] = 0
    batch = ts.put_batch(arrays)
    batch["old_logp"] = batch["sampler_logp"]
    state, m = ts.update(state, batch)
    assert float(m["tokens"]) == 0 and max_abs_diff(to_host(state), before) == 0


def test_first_update_ratio_is_one_with_recomputed_old_logprobs():
    graphdef, params = tiny_params(seed=12)
    ts = train_step(graphdef, params)
    state = ts.init_state(device_params(params))
    # (the accumulation test's one-microbatch shapes: its compiled programs serve this one)
    batch = ts.put_batch(packed(random_rows(4, seed=13), microbatches=1, microbatch_rows=4).arrays)
    batch["old_logp"], mismatch = ts.old_logprobs(state["params"], batch)
    state, m = ts.update(state, batch)
    assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert abs(float(m["approx_kl"])) < 1e-5 and float(m["clip_frac_high"]) == 0
    assert float(mismatch["tokens"]) == float(m["tokens"]) and float(mismatch["abs_diff_sum"]) > 0


@pytest.mark.parametrize("override, tol", [({"remat": "full"}, 1e-6), ({"dtype": "bfloat16"}, 5e-2)])
def test_remat_and_bf16_compute_keep_f32_master_weights(override, tol):
    graphdef, params = tiny_params(seed=14)
    rows = random_rows(4, seed=15)
    arrays = packed(rows, microbatches=1, microbatch_rows=4).arrays
    out = []
    for runtime in (RuntimeOptions(), RuntimeOptions(**override)):
        gd, _ = tiny_params(seed=14, runtime=runtime)
        ts = train_step(gd, params)
        state = ts.init_state(device_params(params))
        batch = ts.put_batch(arrays)
        batch["old_logp"] = batch["sampler_logp"]
        state, m = ts.update(state, batch)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
        out.append((float(m["loss"]), to_host(state["params"])))
    assert out[1][0] == pytest.approx(out[0][0], rel=tol, abs=tol)
    if tol < 1e-3:
        assert max_abs_diff(out[0][1], out[1][1]) < tol


@pytest.mark.parametrize("loss, want", [("actionopd", 0.6), ("opd", 0.6), ("kd", 1.0)])
def test_the_update_takes_log_probs_at_the_rollout_temperature_except_kd(loss, want):
    """Issue 33: the ActionOPD and OPD updates take the student's log-probs at
    collect.temperature (the policy it sampled from: their ratios need it); KD imitates the
    teacher's tokens plainly, cross-entropy at T=1 (paper B.4), whatever the rollout's T.
    test_update_equals_independent_loss_gradient_and_adamw holds the step to its temperature."""
    from actionopd_jax.config.load import load_config
    from actionopd_jax.train.setup import step_settings

    cfg = load_config(None, ["collect.temperature=0.6", f"train.loss={loss}"])
    assert step_settings(cfg).temperature == want
