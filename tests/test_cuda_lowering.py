"""The programs a GPU user runs, lowered for CUDA on this CPU host (the `cuda-lower` extra:
the CUDA plugin and cuDNN's library, no GPU): a lowering error, a shape cuDNN refuses or a
sharding that does not partition fails here, not on a user's GPU. Small shapes; the GPU
recipes' settings. Compiling for a GPU needs one (jax 0.10.2 has no deviceless CUDA
topology): benchmarks/device_check.py is the check on the hardware."""

import contextlib
import io

import jax
import jax.numpy as jnp
import pytest

from actionopd_jax.aot.lowering import cuda_lowering_missing, lower_for, lowering_for

from tests._required import REQUIRE_CUDA, skip_or_fail  # noqa: E402

MISSING = cuda_lowering_missing()


@pytest.fixture(autouse=True)
def _cuda_lowering_available():
    """Skip without the CUDA plugin; in CI (ACTIONOPD_REQUIRE_CUDA_LOWERING=1) fail instead."""
    if MISSING:
        skip_or_fail(REQUIRE_CUDA, MISSING)


from actionopd_jax.commands import train as cli  # noqa: E402
from actionopd_jax.model import PRESETS, Qwen3, make_mesh  # noqa: E402
from actionopd_jax.model.attention import causal_self_attention, resolve  # noqa: E402
from actionopd_jax.model.runtime import RuntimeOptions  # noqa: E402
from actionopd_jax.sampling.aot import lower_sampler_programs  # noqa: E402

FWD, BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
H200X8 = "configs/paper/qwen3_4b_h200x8.yaml"
H200X1 = "configs/paper/qwen3_4b_h200.yaml"
# the recipes at test size: the tiny model (head dim 16, 4 query / 2 KV heads), short rows
SMALL = ["model.preset=tiny", "model.hf_path=", "train.max_seq_len=256", "collect.max_prompt_tokens=128",
         "collect.max_response_tokens=64", "collect.concurrency=2"]
SDS = jax.ShapeDtypeStruct


def _check(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue()


def _row(text, prefix):
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    return [c.strip() for c in line.split("|")]


def _attention(q_heads, kv_heads, head_dim, t, dtype=jnp.bfloat16):
    """Our attention switch (impl auto) traced for a GPU, forward and the gradient of q, k, v."""
    def loss(q, k, v, mask):
        return causal_self_attention(q, k, v, mask, dtype).astype(jnp.float32).sum()

    g = q_heads // kv_heads
    args = (SDS((2, t, kv_heads, g, head_dim), dtype), SDS((2, t, kv_heads, head_dim), dtype),
            SDS((2, t, kv_heads, head_dim), dtype), SDS((2, t), jnp.bool_))
    return lower_for(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args, label="attention")


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, t", [(32, 8, 128, 512), (16, 8, 128, 200), (4, 2, 16, 64)])
def test_auto_attention_on_gpu_is_cudnn_forward_and_backward(q_heads, kv_heads, head_dim, t):
    """Qwen3-4B's heads (32 over 8, dim 128), 0.6B's (16 over 8) at a length that is no multiple
    of 64 (cuDNN needs none for causal + padding), the tiny test model's."""
    r = _attention(q_heads, kv_heads, head_dim, t)
    assert r.ok, r.error
    assert FWD in r.custom_calls and BWD in r.custom_calls, r.custom_calls


@pytest.mark.parametrize("heads, dtype, message", [
    ((32, 8, 128), jnp.float32, "compute dtype float32"),
    ((32, 8, 100), jnp.bfloat16, "head dim 100 (cuDNN needs a multiple of 8, at most 128)"),
    ((32, 8, 192), jnp.bfloat16, "head dim 192"),
])
def test_what_cudnn_cannot_take_is_refused_by_our_check_before_jax_sees_it(heads, dtype, message):
    r = _attention(*heads, 128, dtype=dtype)
    assert not r.ok and "cuDNN flash attention cannot take" in r.error and message in r.error, r.error
    # jax's own cuDNN wrapper refuses the same shapes (so the rule is not ours alone)
    q_heads, kv_heads, dh = heads

    def direct(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    kv = SDS((2, 128, kv_heads, dh), dtype)
    with pytest.raises(NotImplementedError):
        jax.jit(direct).trace(SDS((2, 128, q_heads, dh), dtype), kv, kv).lower(lowering_platforms=("cuda",))


def test_grouped_query_layout_and_shared_prefix_rows_are_refused_for_cudnn():
    with pytest.raises(ValueError, match="12 query heads over 8 KV heads"):
        resolve("auto", "gpu", heads=(12, 8, 128), dtype="bfloat16")
    with pytest.raises(ValueError, match="arbitrary masks"):
        resolve("cudnn", "gpu", shared_prompt=True)
    assert resolve("auto", "gpu", heads=(32, 8, 128), dtype="bfloat16") == "cudnn"


def test_h200x8_check_lowers_every_program_of_the_run():
    """The 8-GPU recipe at test size with the static sampler (auto's choice on GPUs; the
    engine is the test below): FSDP over 8 stand-in devices (8 partitions, cuDNN behind the partitioner), the
    one-GPU update with both cuDNN calls, the old-logprob recompute, the sampler's prefill and
    decode tensor-parallel over the host, and prefill on one GPU."""
    code, text = _check(["--config", H200X8, "--check", *SMALL, "collect.sampler=static"])
    assert code == 0, text
    assert "memory per device (analytic estimate, not a compiler figure)" in text
    # and that `--aot` compiles them here, for the target's own GPUs (aot/gpu_topology.py)
    assert "`actionopd train --check --aot` compiles these programs for 8 NVIDIA H200 with XLA's GPU compiler" in text
    assert _row(text, "train update, 8 x 256")[1:4] == ["lowered", "8", "behind the partitioner"]
    assert _row(text, "old logprobs, 8 x 256")[1:3] == ["lowered", "8"]
    assert _row(text, "train update, one GPU's program: 1 x 256")[1:4] == ["lowered", "1", f"{FWD}, {BWD}"]
    assert _row(text, "sampler prefill (2 x 128 prompt, 4 x 64 new)")[1:3] == ["lowered", "8"]
    assert _row(text, "sampler decode (2 x 128 prompt, 4 x 64 new)")[1:3] == ["lowered", "8"]
    assert _row(text, "sampler prefill on one GPU")[1:4] == ["lowered", "1", FWD]
    assert text.rstrip().endswith("config OK")


@pytest.mark.parametrize("config, target, rows", [(H200X1, "h200x1", 1), (H200X8, "h100x8", 8)])
def test_other_gpu_targets_lower_too(config, target, rows):
    code, text = _check(["--config", config, "--check", *SMALL, f"mesh.target={target}"])
    assert code == 0, text
    assert f"CUDA lowering for {target}" in text
    cells = _row(text, f"train update, {rows} x 256")
    assert cells[1] == "lowered" and cells[2] == str(rows), cells


def test_a_float32_gpu_run_is_refused_with_the_setting_to_change(capsys):
    """A config cuDNN cannot run exits 2 before anything is lowered, naming the setting."""
    assert cli.main(["--config", H200X8, "--check", *SMALL, "model.dtype=float32"]) == 2
    err = capsys.readouterr().err
    assert "model.attention: attention='auto' picks cuDNN on gpu" in err and "set model.dtype=bfloat16" in err, err


def test_serve_programs_lower_for_cuda():
    """`actionopd serve --mesh tensor=-1` on a GPU: the sampler's programs at the serve's
    segment length (256 new tokens) over a 2-GPU tensor mesh, and the scoring program of
    /v1/completions echo (right-padded rows through cuDNN)."""
    from flax import nnx

    from actionopd_jax.serve.scoring import TokenScorer

    cfg = PRESETS["tiny"]
    runtime = RuntimeOptions(dtype="bfloat16")
    mesh = make_mesh({"tensor": 2}, devices=jax.devices()[:2])
    reports = lower_sampler_programs(cfg, mesh, prompts=1, prompt_len=128, samples=2, max_new=256, runtime=runtime)
    assert [r.ok for r in reports] == [True, True], [r.error for r in reports]
    model = nnx.eval_shape(lambda: Qwen3(cfg.replace(param_dtype="bfloat16"), runtime=runtime, rngs=nnx.Rngs(0)))
    scorer = TokenScorer(model)
    args = (scorer.state, SDS((2, 256), jnp.int32), SDS((2, 256), jnp.bool_), SDS((), jnp.float32))
    r = lower_for(scorer._fn, args, kwargs={"k": 1}, label="score")
    assert r.ok and FWD in r.custom_calls, (r.error, r.custom_calls)


def test_without_the_gpu_trace_cudnn_is_refused_on_the_cpu_stand_ins():
    """The stand-in devices are CPUs: outside `lowering_for("gpu")` the same program picks the
    CPU kernel, and cudnn is refused, so nothing lowers for CUDA by accident."""
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        resolve("cudnn", None)
    with lowering_for("gpu"):
        assert resolve("auto", None) == "cudnn"


def test_engine_programs_lower_for_cuda():
    """The paged rollout engine's prefill chunk and decode segment (issue 25), on the
    accelerator path over the page pool, lowered for CUDA on one GPU and over a 2-GPU mesh,
    with the gather path and with the paged switch's GPU kernel ("paged_gpu": Pallas ->
    Triton), whose Triton call must be in both programs and not in the chunk program for
    lanes that all start a prompt (the model's causal attention: no kernel row per token)."""
    from actionopd_jax.engine.aot import TRITON, abstract_pool, lower_engine_programs
    from actionopd_jax.engine.sizing import EngineConfig
    from actionopd_jax.model.attention.paged import paged_attention

    cfg = PRESETS["tiny"]
    shapes = EngineConfig(slots=4, page_size=16, max_len=64, chunk=16, prefill_lanes=2, segment=4)
    meshes = [make_mesh({"tensor": n}, devices=jax.devices()[:n]) for n in (1, 2)]
    for mesh in meshes:
        for attention in ("gather", "paged_gpu"):
            reports = lower_engine_programs(cfg, mesh, shapes, attention=attention)
            assert all(r.ok for r in reports), [r.error for r in reports]
            triton = [any(TRITON in c for c in r.custom_calls) for r in reports]
            if attention == "gather":
                assert triton == [False, False], [r.custom_calls for r in reports]
            else:   # the chunk for lanes that all start a prompt runs the model's attention, not the kernel
                assert triton == [True, True, False], [(r.label, r.custom_calls) for r in reports]
                assert "fresh-prompt chunk" in reports[2].label
    # in bfloat16 (the rollout copy on a GPU) that chunk is cuDNN's fused attention, as the static
    # sampler's prefill; in float32 (above) cuDNN refuses and "auto" takes the xla path
    from actionopd_jax.model.runtime import RuntimeOptions

    fresh = lower_engine_programs(cfg, meshes[0], shapes, attention="paged_gpu",
                                  runtime=RuntimeOptions(dtype="bfloat16"))[2]
    assert fresh.ok and fresh.has_call("__cudnn$fmha"), (fresh.error, fresh.custom_calls)
    # The switch itself at the engine's shapes (its pool layout, decode q [slots, 1, Hq, Dh],
    # a prefill chunk [lanes, chunk, Hq, Dh] at explicit positions), as the engine's programs
    # call it.
    q_heads, dh = cfg.num_attention_heads, cfg.head_dim
    pps = shapes.pages_per_slot
    for mesh in meshes:
        pool = abstract_pool(cfg, mesh, shapes.slots * pps + 1, shapes.page_size)
        k, v = jax.tree.leaves(pool.k)[0], jax.tree.leaves(pool.v)[0]   # per-layer or stacked layout
        fn = jax.jit(lambda q, k, v, n, t, pos: paged_attention(q, k, v, n, t, q_positions=pos, impl="paged_gpu"))
        for rows, q_len in ((shapes.slots, 1), (shapes.prefill_lanes, shapes.chunk)):
            args = (SDS((rows, q_len, q_heads, dh), jnp.bfloat16), k, v, SDS((rows,), jnp.int32),
                    SDS((rows, pps), jnp.int32), SDS((rows, q_len), jnp.int32))
            r = lower_for(fn, args, label=f"paged_gpu {rows} x {q_len}", mesh=mesh)
            assert r.ok and any(TRITON in c for c in r.custom_calls), (r.error, r.custom_calls)


def test_check_with_the_engine_lowers_its_programs():
    """`train --check` for a GPU target with `collect.sampler=engine` (auto is the static
    sampler on GPUs) lowers the engine's programs in place of the static sampler's, with the
    paged GPU kernel (Triton)."""
    code, text = _check(["--config", H200X1, "--check", *SMALL, "collect.sampler=engine"])
    assert code == 0, text
    assert "sampler prefill" not in text and "sampler decode" not in text
    for program in ("engine prefill chunk", "engine decode segment"):
        cells = _row(text, program)
        assert cells[1:3] == ["lowered", "1"], cells
        assert "triton" in cells[3], cells
