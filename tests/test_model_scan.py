"""Layers run under one scan (program size independent of depth); remat keeps gradients."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from actionopd_jax.model import KVCache, PRESETS, Qwen3, count_params, flops_per_token
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.testing.tiny_checkpoint import tiny_config


def _program_size(cfg, with_cache=False):
    """Number of equations in the jaxpr of a forward pass, built abstractly (no weights made)."""
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(params=jax.random.key(0))))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def fwd(state, tokens):
        m = nnx.merge(graphdef, state)
        cache = KVCache.init(cfg, 2, 16) if with_cache else None
        h, _ = m(tokens, tokens, cache=cache)
        return m.logits(h)

    jaxpr = jax.make_jaxpr(fwd)(state, tokens)

    def count(jx):
        n = 0
        for eqn in jx.eqns:
            n += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub)
        return n

    return count(jaxpr.jaxpr)


@pytest.mark.parametrize("with_cache", [False, True])
def test_program_size_does_not_grow_with_depth(with_cache):
    small = _program_size(tiny_config(num_hidden_layers=2), with_cache)
    deep = _program_size(tiny_config(num_hidden_layers=32), with_cache)
    assert small > 50  # a real program was traced
    assert deep == small


def _loss(model, tokens):
    h, _ = model(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
    logp = jax.nn.log_softmax(model.logits(h[:, :-1]))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def test_remat_gives_same_loss_and_gradients():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    results = {}
    for policy in ("none", "full", "dots"):
        cfg = tiny_config(num_hidden_layers=3)
        model = Qwen3(cfg, runtime=RuntimeOptions(remat=policy), rngs=nnx.Rngs(params=jax.random.key(1)))
        loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model, tokens)
        results[policy] = (float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)))
    base_loss, base_grads = results["none"]
    assert np.isfinite(base_loss)
    assert max(float(jnp.abs(g).max()) for g in base_grads) > 0
    for policy in ("full", "dots"):
        loss, grads = results[policy]
        assert loss == pytest.approx(base_loss, abs=1e-6)
        for a, b in zip(base_grads, grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_scan_unroll_gives_same_loss_and_gradients_and_unrolls_the_program():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 12)), jnp.int32)
    results = {}
    for unroll in (1, 2, 0):  # 2 does not divide 3 layers: lax.scan handles the remainder
        cfg = tiny_config(num_hidden_layers=3)
        model = Qwen3(cfg, runtime=RuntimeOptions(scan_unroll=unroll), rngs=nnx.Rngs(params=jax.random.key(1)))
        loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model, tokens)
        results[unroll] = (float(loss), jax.tree.leaves(nnx.to_pure_dict(grads)))
    for unroll in (2, 0):
        assert results[unroll][0] == pytest.approx(results[1][0], abs=1e-6)
        for a, b in zip(results[1][1], results[unroll][1]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    # the layer scan carries the unroll factor to XLA (0 = every layer)
    for unroll, want in ((0, 4), (3, 3), (9, 4)):
        cfg, rt = tiny_config(num_hidden_layers=4), RuntimeOptions(scan_unroll=unroll)
        model = nnx.eval_shape(lambda cfg=cfg, rt=rt: Qwen3(cfg, runtime=rt, rngs=nnx.Rngs(params=jax.random.key(0))))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda st, t: nnx.merge(graphdef, st)(t, t)[0])(state, jnp.zeros((1, 4), jnp.int32))
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert [e.params["unroll"] for e in scans] == [want]
    with pytest.raises(ValueError, match="scan_unroll must be >= 0"):
        RuntimeOptions(scan_unroll=-1)


def test_remat_changes_the_backward_program():
    """The checkpoint is really applied: the 'full' policy recomputes the layer in the backward pass."""
    def grad_eqns(policy):
        cfg = tiny_config(num_hidden_layers=2)
        model = nnx.eval_shape(lambda: Qwen3(cfg, runtime=RuntimeOptions(remat=policy), rngs=nnx.Rngs(params=jax.random.key(0))))
        graphdef, state = nnx.split(model)
        fn = jax.grad(lambda s, t: _loss(nnx.merge(graphdef, s), t))
        text = str(jax.make_jaxpr(fn)(state, jnp.zeros((1, 4), jnp.int32)))
        return text.count("remat") + text.count("checkpoint")

    assert grad_eqns("none") == 0
    assert grad_eqns("full") > 0


def test_presets_and_counts():
    cfg = PRESETS["qwen3-0.6b"]
    counts = count_params(cfg)
    # Qwen3-0.6B: 0.6B total with tied embeddings, 0.44B without the embedding table
    assert 0.59e9 < counts["total"] < 0.61e9
    assert 0.43e9 < counts["non_embedding"] < 0.45e9
    assert count_params(PRESETS["qwen3-8b"])["total"] == pytest.approx(8.19e9, rel=0.01)
    assert count_params(PRESETS["qwen3-4b"])["total"] == pytest.approx(4.02e9, rel=0.01)
    assert count_params(PRESETS["qwen3-1.7b"])["total"] == pytest.approx(1.72e9, rel=0.01)
    tiny = PRESETS["tiny"]
    model = Qwen3(tiny, rngs=nnx.Rngs(params=jax.random.key(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == count_params(tiny)["total"]
    # forward FLOPs/token ~ 2 * matmul params (+ attention); training = 3x forward
    f = flops_per_token(cfg, 0)
    assert f == pytest.approx(2 * (counts["non_embedding"] - 28 * (2 * 1024 + 2 * 128) - 1024)
                              + 2 * 1024 * 151936, rel=1e-6)
    assert flops_per_token(cfg, 512, training=True) == pytest.approx(3 * flops_per_token(cfg, 512))
    assert PRESETS["bench-small"].vocab_size == 151669


def test_config_validation_messages():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="remat='some'"):
        RuntimeOptions(remat="some")
    with pytest.raises(ValueError, match="param_dtype='float16'"):
        tiny_config().replace(param_dtype="float16")
