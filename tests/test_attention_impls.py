"""Every attention implementation that runs here equals the reference `layers.attend`
(scores and softmax in float32, causal & key mask), forward and gradients: the blocked CPU
path, jax's xla dot_product_attention and the Pallas splash kernel (interpret mode on CPU, the
same kernel code the TPU runs). cuDNN needs an NVIDIA GPU and is not run here; its wrapper is
checked for the right error. Cases: grouped-query heads, right- and left-padded rows, a length
that is not a tile multiple, and a sharded mesh (rows over data/fsdp, KV heads over tensor)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from actionopd_jax.model import PRESETS, Qwen3, make_mesh
from actionopd_jax.model.attention import causal_self_attention, resolve
from actionopd_jax.model.runtime import RuntimeOptions
from actionopd_jax.model.layers import attend

B, KVH, G, DH = 3, 2, 2, 16


def _inputs(t: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, t, KVH, G, DH), jnp.float32)
    k = jax.random.normal(ks[1], (B, t, KVH, DH), jnp.float32)
    v = jax.random.normal(ks[2], (B, t, KVH, DH), jnp.float32)
    mask = np.ones((B, t), bool)
    mask[1, t - 37:] = False          # right-padded row (the trainer's layout)
    mask[2, :t // 3] = False          # left-padded row (the sampler's prefill layout)
    return q, k, v, jnp.asarray(mask)


def _reference(q, k, v, mask):
    t = q.shape[1]
    full = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]
    return attend(q, k, v, full, jnp.float32)


def _loss(fn, mask):
    # padding queries hold arbitrary finite values in every implementation: score real ones only
    def f(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(jnp.where(mask[:, :, None, None, None], out, 0.0) * jnp.cos(out))
    return f


def _check(impl: str, t: int, *, right_padded_only: bool = False, tol=2e-5):
    q, k, v, mask = _inputs(t)
    if right_padded_only:
        mask = mask.at[2].set(True)
    ref = _reference(q, k, v, mask)
    out = causal_self_attention(q, k, v, mask, jnp.float32, impl)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=tol, rtol=tol)
    g_ref = jax.grad(_loss(lambda *a: _reference(*a, mask), mask), argnums=(0, 1, 2))(q, k, v)
    g_out = jax.grad(_loss(lambda *a: causal_self_attention(*a, mask, jnp.float32, impl), mask),
                     argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", g_out, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5 * tol, rtol=5 * tol,
                                   err_msg=f"d{name} ({impl})")


@pytest.mark.parametrize("impl", ["cpu", "xla"])
@pytest.mark.parametrize("t", [64, 200])
def test_xla_and_blocked_equal_the_reference(impl, t):
    _check(impl, t)


@pytest.mark.parametrize("t", [128, 200, 1024])
def test_splash_kernel_equals_the_reference(t):
    # 200 is not a multiple of the 128-token tile: the wrapper pads with a padding segment;
    # 1,024: two 512-key tiles in one KV block of the fused backward (splash._dkv_block)
    _check("splash", t)


def test_splash_under_a_sharded_mesh_equals_single_device():
    q, k, v, mask = _inputs(128, seed=1)
    q, k, v, mask = (jnp.concatenate([x, x[:1]]) for x in (q, k, v, mask))   # 4 rows
    single = causal_self_attention(q, k, v, mask, jnp.float32, "splash")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        sharded = jax.jit(lambda *a: causal_self_attention(*a, jnp.float32, "splash"))(q, k, v, mask)
        grads = jax.jit(jax.grad(_loss(lambda *a: causal_self_attention(*a, mask, jnp.float32, "splash"), mask),
                                 argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), atol=1e-6)
    g_single = jax.grad(_loss(lambda *a: causal_self_attention(*a, mask, jnp.float32, "splash"), mask),
                        argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, g_single):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_auto_follows_the_target_platform_and_cudnn_refuses_cpu():
    assert resolve("auto", "tpu") == "splash"
    assert resolve("auto", "gpu") == "cudnn"
    assert resolve("auto", "cpu") == "cpu"
    assert resolve("auto") == "cpu"  # this machine, no mesh
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        resolve("cudnn", "cpu")
    with pytest.raises(ValueError, match="expected one of"):
        resolve("flash", "cpu")


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_model_forward_and_gradient_equal_the_cpu_path(impl):
    """The whole model (bf16-free tiny preset) with each kernel: same hidden states and
    parameter gradients as the default CPU path."""
    cfg = PRESETS["tiny"]
    tokens = jax.random.randint(jax.random.key(3), (2, 96), 0, cfg.vocab_size)
    mask = jnp.ones((2, 96), bool).at[1, 70:].set(False)
    positions = jnp.broadcast_to(jnp.arange(96), (2, 96))
    results = {}
    for name in ("cpu", impl):
        model = Qwen3(cfg, runtime=RuntimeOptions(remat="attn", attention=name), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            h, _ = nnx.merge(graphdef, state)(tokens, positions, attention_mask=mask)
            return jnp.sum(jnp.where(mask[..., None], h, 0.0) ** 2), h

        (_, h), grads = jax.value_and_grad(loss, has_aux=True)(state)
        results[name] = (h, grads)
    (h_cpu, g_cpu), (h_impl, g_impl) = results["cpu"], results[impl]
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(h_impl)[real], np.asarray(h_cpu)[real], atol=2e-5, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g_impl), jax.tree.leaves(g_cpu)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("impl", ["cpu", "splash"])
def test_prefill_kv_equals_the_cached_forward(impl):
    """`Qwen3.prefill_kv` (the sampler's long-prompt prefill: fused attention, no [T, T]
    scores) gives the cached forward's hidden states and keys/values on left-padded prompts."""
    from actionopd_jax.model import KVCache, left_pad_positions

    cfg = PRESETS["tiny"]
    model = Qwen3(cfg, runtime=RuntimeOptions(attention=impl), rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(4), (2, 80), 0, cfg.vocab_size)
    mask = jnp.ones((2, 80), bool).at[1, :30].set(False)
    positions = left_pad_positions(mask)
    h_ref, cache = model(tokens, positions, attention_mask=mask, cache=KVCache.init(cfg, 2, 80))
    h, k, v = model.prefill_kv(tokens, positions, mask)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(h)[real], np.asarray(h_ref)[real], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(k)[:, real], np.asarray(cache.k)[:, real], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(v)[:, real], np.asarray(cache.v)[:, real], atol=2e-5, rtol=2e-5)


def _packed(prompt_len=40, resp=(17, 24, 9), region=32, seed=5):
    """A shared-prefix row [prompt | 3 responses] and the 3 unpacked rows it stands for."""
    from actionopd_jax.model.attention import SharedPrefix

    vocab = PRESETS["tiny"].vocab_size
    rng = np.random.default_rng(seed)
    layout = SharedPrefix(prompt=48, response=region, count=len(resp))
    prompt = rng.integers(0, vocab, prompt_len)
    responses = [rng.integers(0, vocab, n) for n in resp]
    tokens = np.zeros(layout.length, np.int32)
    positions = np.zeros(layout.length, np.int32)
    mask = np.zeros(layout.length, bool)
    tokens[:prompt_len], positions[:prompt_len], mask[:prompt_len] = prompt, np.arange(prompt_len), True
    for i, r in enumerate(responses):
        start = layout.prompt + i * region
        tokens[start:start + len(r)] = r
        positions[start:start + len(r)] = prompt_len + np.arange(len(r))
        mask[start:start + len(r)] = True
    return layout, prompt, responses, tokens[None], positions[None], mask[None]


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_shared_prefix_row_equals_the_separate_rows(impl):
    """Each response of a packed row gets exactly the hidden states (and so the logprobs) it
    gets as its own row [prompt, response]: the prompt is computed once for all of them."""
    layout, prompt, responses, tokens, positions, mask = _packed()
    model = Qwen3(PRESETS["tiny"], runtime=RuntimeOptions(attention=impl), rngs=nnx.Rngs(2))
    packed, _ = model(jnp.asarray(tokens), jnp.asarray(positions), attention_mask=jnp.asarray(mask),
                      shared_prefix=layout)
    for i, r in enumerate(responses):
        row = np.concatenate([prompt, r])[None]
        alone, _ = model(jnp.asarray(row), jnp.arange(row.shape[1])[None])
        start = layout.prompt + i * layout.response
        np.testing.assert_allclose(np.asarray(packed[0, start:start + len(r)]),
                                   np.asarray(alone[0, len(prompt):]), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(packed[0, :len(prompt)]), np.asarray(alone[0, :len(prompt)]),
                                   atol=2e-5, rtol=2e-5)


def test_shared_prefix_splash_gradients_equal_the_reference():
    from actionopd_jax.model.attention import SharedPrefix

    layout = SharedPrefix(prompt=64, response=40, count=4)          # 224 tokens: padded to 256
    q, k, v, _ = _inputs(layout.length, seed=7)
    mask = jnp.ones((B, layout.length), bool).at[1, 50:64].set(False).at[2, 64 + 30:64 + 40].set(False)
    full = jnp.asarray(layout.dense())[None] & mask[:, None, :]
    ref = lambda q, k, v: attend(q, k, v, full, jnp.float32)  # noqa: E731
    splash = lambda q, k, v: causal_self_attention(q, k, v, mask, jnp.float32, "splash", layout)  # noqa: E731
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(splash(q, k, v))[real], np.asarray(ref(q, k, v))[real], atol=2e-5)
    for a, b in zip(jax.grad(_loss(splash, mask), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(_loss(ref, mask), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
