"""The accelerator paged-attention backends against the plain gather path, and their switch.

- "paged_tpu" (jax's Pallas TPU paged kernel) and "paged_gpu" (jax's Pallas GPU kernel) run
  here in Pallas interpret mode and must equal `paged_attention_gather` on a shuffled pool:
  decode rows, a prefill chunk with explicit positions, slots of different lengths, table
  entries past a slot's length naming junk pages. TPU interpret mode multiplies at the TPU's
  default precision (bfloat16 operands), so inputs are bfloat16-exact.
- Both TPU kernels compile for v5p (libtpu, deviceless) under a tensor-parallel mesh; the
  ragged kernel cannot run interpreted in jax 0.10.2, so compiling is its check here.
- The GPU kernel lowers for CUDA (Triton) when jax's CUDA plugin is installed.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.aot.lowering import cuda_stand_in
from actionopd_jax.cuda_plugin import cuda_plugin
from actionopd_jax.model.attention.dispatch import PAGED_IMPLEMENTATIONS, resolve_paged
from actionopd_jax.model.attention.paged import paged_attention, storage_layout, write_rows
from actionopd_jax.model.attention.paged_gather import paged_attention_gather
from actionopd_jax.model.attention.paged_gpu import check_gpu_shapes, gpu_blocks
from actionopd_jax.model.attention.paged_tpu import check_shapes, combine_pages, pages_per_block, query_rows
from tests._required import REQUIRE_CUDA, REQUIRE_TPU, need_libtpu, skip_or_fail

KVH, G, DH, PAGE, PPS = 2, 2, 16, 8, 4          # 4 pages of 8 tokens per slot: up to 32 tokens


def _bf16_exact(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def _pool(lengths, seed=0):
    """A shuffled pool holding each slot's tokens, junk in every unused page (page 0: null)."""
    rng = np.random.default_rng(seed)
    slots = len(lengths)
    total = 1 + slots * PPS
    k_pages = _bf16_exact(rng.normal(size=(KVH, total, PAGE, DH)) * 3)
    v_pages = _bf16_exact(rng.normal(size=(KVH, total, PAGE, DH)) * 3)
    order = rng.permutation(np.arange(1, total))
    table = np.zeros((slots, PPS), np.int32)
    for s, n in enumerate(lengths):
        used = -(-n // PAGE)
        table[s, :used] = order[s * PPS: s * PPS + used]
    return jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table)


def _q(slots, q_len, seed):
    return jnp.asarray(_bf16_exact(np.random.default_rng(seed).normal(size=(slots, q_len, KVH * G, DH))))


@pytest.mark.parametrize("impl", ["paged_tpu", "paged_gpu"])
def test_kernel_equals_gather_at_decode(impl):
    lengths = jnp.asarray([1, 13, 32], jnp.int32)     # one token, a partial last page, a full slot
    k_pages, v_pages, table = _pool([1, 13, 32], seed=1)
    q = _q(3, 1, seed=2)
    want = paged_attention_gather(q, k_pages, v_pages, lengths, table)
    got = paged_attention(q, k_pages, v_pages, lengths, table, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_gpu_decode_without_jaxs_kernel_runs_ours_and_equals_gather(monkeypatch):
    """jax 0.12 removed the Pallas GPU paged_attention: "paged_gpu" decode then runs our kernel
    (paged_gpu_parts.py) with one query a slot, and gives the gather path's answer."""
    import actionopd_jax.model.attention.paged as paged_mod

    calls = []
    monkeypatch.setattr(paged_mod, "has_pallas_kernel", lambda name: calls.append(name) or False)
    monkeypatch.setattr(paged_mod, "paged_attention_gpu", lambda *a, **k: pytest.fail("jax's kernel was called"))
    lengths = jnp.asarray([1, 13, 32], jnp.int32)
    k_pages, v_pages, table = _pool([1, 13, 32], seed=1)
    q = _q(3, 1, seed=2)
    want = paged_attention_gather(q, k_pages, v_pages, lengths, table)
    got = paged_attention(q, k_pages, v_pages, lengths, table, impl="paged_gpu")
    assert calls == ["gpu_paged_attention"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["paged_tpu", "paged_gpu"])
def test_kernel_equals_gather_on_a_prefill_chunk(impl):
    lengths = jnp.asarray([7, 20], jnp.int32)
    k_pages, v_pages, table = _pool([7, 20], seed=3)
    q = _q(2, 4, seed=4)
    # slot 0: its last 4 tokens; slot 1: positions 9..12 (a chunk not at the end of the slot)
    positions = jnp.asarray([[3, 4, 5, 6], [9, 10, 11, 12]], jnp.int32)
    want = paged_attention_gather(q, k_pages, v_pages, lengths, table, q_positions=positions)
    got = paged_attention(q, k_pages, v_pages, lengths, table, q_positions=positions, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_gpu_chunk_in_query_blocks_over_partitions_equals_gather():
    """A prefill chunk through "paged_gpu" runs our kernel (paged_gpu_parts.py) in blocks of
    queries: 40 tokens x 2 heads = 2 blocks of 64, over a 32-page table in 4 partitions; a
    chunk continuing 150 tokens of history, one at the start of its slot, an idle lane (0
    tokens: finite, as the decode kernel's rows were)."""
    rng = np.random.default_rng(7)
    pps, t = 32, 40
    k_pages, v_pages = (jnp.asarray(_bf16_exact(rng.normal(size=(KVH, 1 + 3 * pps, PAGE, DH)) * 3)) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, 1 + 3 * pps)).reshape(3, pps), jnp.int32)
    assert gpu_blocks(pps, PAGE)[0] == 4
    lengths = jnp.asarray([190, 40, 0], jnp.int32)
    positions = jnp.asarray([150, 0, 0], jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    q = _q(3, t, seed=8)
    got = np.asarray(paged_attention(q, k_pages, v_pages, lengths, table, q_positions=positions, impl="paged_gpu"))
    want = np.asarray(paged_attention_gather(q, k_pages, v_pages, lengths, table, q_positions=positions))
    np.testing.assert_allclose(got[:2], want[:2], rtol=2e-5, atol=2e-5)
    assert np.isfinite(got).all()


def test_chunk_rows_see_their_own_prefix():
    """query_rows: row (slot, i) sees min(length, position + 1) keys, at least 1."""
    lengths = jnp.asarray([6, 3], jnp.int32)
    table = jnp.asarray([[5, 6], [7, 8]], jnp.int32)
    q = jnp.zeros((2, 3, 4, 8))
    rows, seen, tables = query_rows(q, lengths, table, jnp.asarray([[3, 4, 5], [-1, 0, 9]], jnp.int32))
    assert rows.shape == (6, 4, 8)
    assert seen.tolist() == [4, 5, 6, 1, 1, 3]
    assert tables.tolist() == [[5, 6]] * 3 + [[7, 8]] * 3


def test_switch_names_and_refusals():
    assert PAGED_IMPLEMENTATIONS == ("auto", "gather", "paged_tpu", "ragged_tpu", "paged_gpu")
    assert [resolve_paged("auto", p) for p in ("tpu", "gpu", "cuda", "cpu", "rocm")] == \
        ["paged_tpu", "paged_gpu", "paged_gpu", "gather", "gather"]
    assert storage_layout("ragged_tpu", "tpu") == "combined" and storage_layout("auto", "tpu") == "split"
    with pytest.raises(ValueError, match="expected one of"):
        resolve_paged("flash", "tpu")
    with pytest.raises(ValueError, match="ragged_tpu.*does not run on CPU"):
        resolve_paged("ragged_tpu", "cpu")
    with pytest.raises(ValueError, match="'paged_gpu' runs on gpu / cuda / cpu.*targets 'tpu'"):
        resolve_paged("paged_gpu", "tpu")
    with pytest.raises(ValueError, match="head_dim 64 is not a multiple of 128"):
        check_shapes((4, 1, 8, 64), (2, 9, 16, 64), platform="tpu", name="paged_tpu")
    with pytest.raises(ValueError, match="head_dim 48 is not a power of two"):
        check_gpu_shapes((4, 1, 8, 48), (2, 9, 16, 48), (4, 8))
    with pytest.raises(ValueError, match="blocks of 4 keys, under Triton's 16"):
        check_gpu_shapes((4, 1, 8, 64), (2, 9, 4, 64), (4, 1))
    with pytest.raises(ValueError, match="last q_len tokens"):
        paged_attention(jnp.zeros((1, 1, 4, 128)), jnp.zeros((3, 16, 4, 128)), None, jnp.ones((1,), jnp.int32),
                        jnp.zeros((1, 2), jnp.int32), q_positions=jnp.zeros((1, 1), jnp.int32), impl="ragged_tpu",
                        mesh=_FakeMesh("tpu"))


class _FakeMesh:
    """Stands in for an abstract mesh of `platform` devices (the refusal happens before any
    device is touched)."""

    empty = False

    def __init__(self, platform):
        self.abstract_device = type("D", (), {"platform": platform})()
        self.axis_names, self.axis_sizes = (), ()


def test_block_choices():
    assert pages_per_block(32, 16) == 16 and pages_per_block(6, 128) == 3 and pages_per_block(7, 16) == 7
    # keys per block first (up to 128), then partitions: the H200 run's table (272 pages of 16 =
    # 16 x 17) had 16 partitions of one-page blocks; pages of 128 (34 per slot) keep 2 partitions
    assert gpu_blocks(272, 16) == (2, 8) and gpu_blocks(34, 128) == (2, 1) and gpu_blocks(64, 16) == (8, 8)
    assert gpu_blocks(4, 8) == (1, 4) and gpu_blocks(3, 16) == (3, 1) and gpu_blocks(16, 16) == (2, 8)
    assert gpu_blocks(12, 16) == (3, 4)          # blocks are powers of two (Triton): 4 pages, not 6


def test_combined_pool_interleaves_k_and_v():
    k = jnp.arange(2 * 3 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 4, 2)
    pool = combine_pages(k, -k)
    assert pool.shape == (3, 4, 4, 2)
    np.testing.assert_array_equal(pool[1, 2, 0], k[0, 1, 2])     # k head 0 at 0
    np.testing.assert_array_equal(pool[1, 2, 3], -k[1, 1, 2])    # v head 1 at 3


@pytest.fixture(scope="module")
def v5p_mesh():
    need_libtpu()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from actionopd_jax.sampling import aot

    try:
        return aot.tpu_mesh(aot.v5p_topology("v5p:2x2x1"), {"tensor": 4})
    except Exception as e:  # noqa: BLE001 - any libtpu init failure means: cannot test here
        skip_or_fail(REQUIRE_TPU, f"libtpu cannot describe a v5p:2x2x1 topology here: {e}")


@pytest.mark.parametrize("impl", ["paged_tpu", "ragged_tpu"])
def test_tpu_kernels_compile_for_v5p(v5p_mesh, impl):
    from jax.sharding import NamedSharding, PartitionSpec as P

    from actionopd_jax.aot.compile import no_persistent_cache

    slots, kvh, dh, pages = 8, 8, 128, 33
    sds = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(v5p_mesh, spec))
    q = sds((slots, 1, kvh * 4, dh), jnp.bfloat16, P(None, None, "tensor"))
    if impl == "paged_tpu":
        pools = (sds((kvh, pages, 16, dh), jnp.bfloat16, P("tensor")),) * 2
    else:
        pools = (sds((pages, 16, 2 * kvh, dh), jnp.bfloat16, P(None, None, "tensor")), None)
    lengths, table = sds((slots,), jnp.int32), sds((slots, 4), jnp.int32)
    fn = jax.jit(lambda q, k, v, n, t: paged_attention(q, k, v, n, t, impl=impl))
    with jax.set_mesh(v5p_mesh), no_persistent_cache():
        compiled = fn.lower(q, *pools, lengths, table).compile()
    text = compiled.as_text()
    assert "custom-call" in text and "tpu_custom_call" in text      # the Mosaic kernel, not a fallback
    assert compiled.output_shardings.spec[2] == "tensor"            # query heads stay split over tensor


def test_gpu_kernel_lowers_for_cuda():
    if cuda_plugin() is None:
        skip_or_fail(REQUIRE_CUDA, "jax's CUDA plugin is not installed (pip install jax-cuda12-plugin==0.10.2 "
                    "jax-cuda12-pjrt==0.10.2, or jax 0.11's cuda13 pair): lowering for CUDA needs it")
    q = jax.ShapeDtypeStruct((4, 2, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 33, 16, 128), jnp.bfloat16)
    lengths, table = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32)
    fn = jax.jit(lambda q, k, v, n, t: paged_attention(q, k, v, n, t, impl="paged_gpu", mesh=_FakeMesh("gpu")))
    with cuda_stand_in():
        text = fn.trace(q, pages, pages, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text      # the Pallas kernel went to Triton, not an XLA fallback


def test_write_rows_equals_the_indexed_write():
    pages = jnp.asarray(np.random.default_rng(5).normal(size=(2, 6, 4, 8)), jnp.float32)
    values = jnp.asarray(np.random.default_rng(6).normal(size=(2, 3, 2, 8)), jnp.float32)   # [lanes, chunk, KVH, Dh]
    page = jnp.asarray([[1, 1, 2], [5, 5, 0]], jnp.int32)
    offset = jnp.asarray([[2, 3, 0], [0, 1, 3]], jnp.int32)
    want = pages.at[:, page, offset].set(jnp.moveaxis(values, -2, 0))
    got = write_rows(pages, page, offset, values)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(pages))


def test_write_rows_does_not_copy_the_pool_on_v5p(v5p_mesh):
    """Two layers of a decode step, each writing every slot's k and v into the pool and then
    running the kernel: no pool-sized copy in the program (written with the 4-d indexed scatter,
    the compiler copies the pool between the layers)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from actionopd_jax.aot.compile import no_persistent_cache

    slots, kvh, dh, pages, size = 16, 8, 128, 40, 16
    sds = lambda shape, dt, spec=P(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(v5p_mesh, spec))
    pool = sds((kvh, pages, size, dh), jnp.bfloat16, P("tensor"))

    def step(k_pages, v_pages, k, v, q, pos, table):
        # two layers' pages in one pool (layer l's at l * pages / 2), written and read in turn
        outs = []
        for layer in range(2):
            at = table + layer * (pages // 2)
            page = jnp.take_along_axis(at, (pos // size)[:, None], 1)[:, 0]
            k_pages, v_pages = write_rows(k_pages, page, pos % size, k), write_rows(v_pages, page, pos % size, v)
            outs.append(paged_attention(q, k_pages, v_pages, pos + 1, at, impl="paged_tpu"))
            q = q + outs[-1]
        return k_pages, v_pages, q

    new = sds((slots, kvh, dh), jnp.bfloat16, P(None, "tensor"))
    args = (pool, pool, new, new, sds((slots, 1, 4 * kvh, dh), jnp.bfloat16, P(None, None, "tensor")),
            sds((slots,), jnp.int32), sds((slots, 4), jnp.int32))
    with jax.set_mesh(v5p_mesh), no_persistent_cache():
        text = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    local_pool = f"bf16[{kvh // 4},{pages},{size},{dh}]"
    copies = [ln for ln in text.splitlines() if " copy(" in ln and (local_pool in ln or f"{kvh // 4 * pages * size},{dh}]" in ln)]
    assert "tpu_custom_call" in text and not copies, copies
