"""The sampler's real prefill and decode programs compile for TPU (AOT, on this CPU host).

libtpu describes a v5p-8 (v5p:2x2x1, 4 chips) without hardware; `sampling.aot` lowers and
compiles exactly what `Sampler` compiles (same functions, static arguments, donation) for
abstract sharded parameters on a mesh over those chips. Catches TPU-only lowering and
partitioning errors (e.g. the `conditional` shape mismatch of the candidate search) and the
CPU-path-on-TPU pitfall (the backend must follow the target, not the host). Skipped when
libtpu is not installed (a failure in CI: tests/_required.py).
"""

import os

import pytest

from tests._required import REQUIRE_TPU, need_libtpu, skip_or_fail  # noqa: E402

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock

from actionopd_jax.model.config import PRESETS  # noqa: E402
from actionopd_jax.model.runtime import RuntimeOptions  # noqa: E402
from actionopd_jax.sampling import aot  # noqa: E402

V5P_HBM_GIB = 95.74
# the real Qwen3 vocabulary with tiny layers: the candidate search's grouped path (151936 =
# 16 x 9496) and its lax.cond run as they do at paper scale; compiles in seconds
CFG = PRESETS["tiny"].replace(vocab_size=151936, param_dtype="bfloat16")
RUNTIME = RuntimeOptions(dtype="bfloat16")


@pytest.fixture(scope="module")
def topology():
    need_libtpu()
    try:
        return aot.v5p_topology("v5p:2x2x1")
    except Exception as e:  # noqa: BLE001 - any libtpu init failure means: cannot test here
        skip_or_fail(REQUIRE_TPU, f"libtpu cannot describe a v5p:2x2x1 topology here: {e}")


def test_prefill_and_decode_compile_for_v5p(topology):
    # one mesh with both axes the sampler shards over (prompt rows over fsdp, KV heads over
    # tensor): an fsdp-only mesh is the same programs with the tensor axis of size 1
    mesh = aot.tpu_mesh(topology, {"tensor": 2, "fsdp": 2})
    assert aot.target_platform(mesh) == "tpu"
    programs = aot.compile_sampler_programs(CFG, mesh, prompts=4, prompt_len=256, samples=4, max_new=64,
                                           runtime=RUNTIME)
    decode_text = programs.decode.as_text()
    # the accelerator path was compiled (not the CPU backend's unrolled layers): the layer
    # scan is a loop inside the decode loop, and no fused output-major weights exist
    assert decode_text.count(" while(") >= 2 or decode_text.count("while(") >= 2
    assert "rk,nk->rn" not in decode_text
    for name, compiled in (("prefill", programs.prefill), ("decode", programs.decode)):
        mem = aot.memory_gib(compiled)
        assert 0 < mem["args"] and 0 < mem["peak"] < 0.1 * V5P_HBM_GIB, (name, mem)
        # parameters are sharded: a chip holds well under the whole model (bf16 ~ 2 bytes/param)
        whole_model_gib = 2 * 151936 * 64 / 2 ** 30
        assert mem["args"] < whole_model_gib, (name, mem)
    # the caches are sharded (prompt rows over data/fsdp, KV heads over tensor), not replicated
    state = programs.prefill.output_shardings
    for cache in (state.prompt.k, state.gen_k, state.gen_v):
        assert not cache.is_fully_replicated, cache
    # decode donates its state: the new state reuses the old one's buffers
    assert aot.memory_gib(programs.decode)["alias"] > 0
