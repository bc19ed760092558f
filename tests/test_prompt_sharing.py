"""Prompt sharing in the engine's decode (engine/prompt_sharing.py): the samples of one prompt
read its pages once, in a pass merged with each row's own pass. The result is attention over
every page of the row, on the CPU live path and with the GPU kernel (paged_gpu_parts.py, Pallas
interpret mode here), and the engine that shares gives the static sampler's samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _engine_fixtures import EOS, assert_same, model, reference
from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.engine import engine as engine_module
from actionopd_jax.engine.pages import NULL_PAGE
from actionopd_jax.engine.prompt_sharing import SHARE_WIDTH, Groups, shared_attend
from actionopd_jax.model.attention.paged_gather import paged_attention_gather
from actionopd_jax.model.attention.paged_gpu_parts import kernel_parts, paged_parts_gpu
from actionopd_jax.model.attention.paged_live import live_part, merge_parts

KVH, G, DH, PAGE, PPS = 2, 2, 16, 8, 16          # 16 pages of 8 per slot: up to 128 tokens, 2 partitions


def _bf16_exact(x):
    return jnp.asarray(np.asarray(x, np.float32)).astype(jnp.bfloat16).astype(jnp.float32)


def _layout():
    """10 rows: block 0 = 4 samples of a 61-token prompt (7 whole pages shared; each sample has
    its copy of the partial 8th page), block 1 = 3 samples of a 16-token prompt (2 whole pages)
    and an idle row, then 2 single rows. Returns full tables, lengths and the Groups."""
    rng = np.random.default_rng(0)
    free = iter(rng.permutation(np.arange(1, 400)))
    take = lambda n: [int(next(free)) for _ in range(n)]  # noqa: E731
    tables, lengths = np.zeros((10, PPS), np.int32), np.zeros(10, np.int32)
    g_table, g_length = np.full((2, PPS), NULL_PAGE, np.int32), np.zeros(2, np.int32)
    own_start = np.zeros(10, np.int32)
    for b, (prompt, replies) in enumerate([(61, [3, 10, 1, 60]), (16, [1, 40, 7])]):
        full = prompt // PAGE
        shared = take(full)
        g_table[b, :full], g_length[b] = shared, full * PAGE
        for i, reply in enumerate(replies):
            r = b * SHARE_WIDTH + i
            n = prompt + reply
            tables[r, :-(-n // PAGE)] = shared + take(-(-n // PAGE) - full)
            lengths[r], own_start[r] = n, full * PAGE
    lengths[7] = 1                                        # idle: its own null page only
    for r, n in ((8, 100), (9, 1)):
        tables[r, :-(-n // PAGE)] = take(-(-n // PAGE))
        lengths[r] = n
    own_table = np.zeros_like(tables)
    for r in range(10):
        skip = own_start[r] // PAGE
        own_table[r, :PPS - skip] = tables[r, skip:]
    groups = Groups(table=jnp.asarray(g_table), length=jnp.asarray(g_length), own_start=jnp.asarray(own_start),
                    own_table=jnp.asarray(own_table))
    return jnp.asarray(tables), jnp.asarray(lengths), groups


@pytest.mark.parametrize("attention", ["paged_gpu", "live"])
def test_shared_pass_equals_reading_every_page(attention):
    tables, lengths, groups = _layout()
    rng = np.random.default_rng(1)
    k, v = (_bf16_exact(rng.normal(size=(KVH, 400, PAGE, DH)) * 3) for _ in range(2))
    q = _bf16_exact(rng.normal(size=(10, 1, KVH * G, DH)))
    want = paged_attention_gather(q, k, v, lengths, tables)
    got = shared_attend(q, k, v, lengths, groups, 0, attention)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_gpu_parts_over_partitions_and_empty_rows():
    """The kernel's parts merge like the live path's: 2 partitions of the 16-page table
    (paged_gpu.gpu_blocks), T = 3 queries a row, a row with no keys gives an empty part
    (total 0: it drops out of a merge)."""
    rng = np.random.default_rng(2)
    k, v = (_bf16_exact(rng.normal(size=(KVH, 200, PAGE, DH))) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, 200))[:4 * PPS].reshape(4, PPS), jnp.int32)
    lengths = jnp.asarray([0, 9, 70, 128], jnp.int32)
    q = _bf16_exact(rng.normal(size=(4, 3, KVH * G, DH)))
    top, total, acc = paged_parts_gpu(q, k, v, lengths, table, interpret=True)
    assert top.shape == total.shape == (4, KVH, G, 3) and acc.shape == (4, KVH, G, 3, DH)
    assert float(jnp.abs(total[0]).max()) == 0.0 and float(jnp.abs(acc[0]).max()) == 0.0
    want = live_part(q, k, v, lengths, table, q_positions=jnp.broadcast_to(lengths[:, None] - 1, (4, 3)))
    np.testing.assert_allclose(np.asarray(merge_parts([(top, total, acc)], q.dtype)[1:]),
                               np.asarray(merge_parts([want], q.dtype)[1:]), rtol=2e-5, atol=2e-5)


def test_gpu_kernel_loads_only_live_keys_and_stores_only_real_queries():
    """The kernel reads a key only below its row's length: NaN in the unwritten tail of a
    row's last page and in the pages its table holds ahead of it (a reply's pages are
    allocated at admission; a freed page may hold a diverged row's NaN) leaves the result
    equal to the reference on a clean pool (a load of them would put 0 x NaN in acc). And it
    stores only the real queries of a block: a decode row's 2 heads of the 16-query block
    (Pallas interpret mode starts outputs as NaN, so unwritten rows read NaN)."""
    rng = np.random.default_rng(5)
    k, v = (np.asarray(_bf16_exact(rng.normal(size=(KVH, 80, PAGE, DH)))) for _ in range(2))
    table = np.asarray(rng.permutation(np.arange(1, 80))[:4 * PPS].reshape(4, PPS), np.int32)
    lengths = np.asarray([5, 9, 70, 128], np.int32)
    dirty_k, dirty_v = k.copy(), v.copy()
    for row, n in enumerate(lengths):
        for pos in range(n, PPS * PAGE):                  # every key slot at or past the length
            page, off = divmod(pos, PAGE)
            dirty_k[:, table[row, page], off] = np.nan
            dirty_v[:, table[row, page], off] = np.nan
    q = _bf16_exact(rng.normal(size=(4, 1, KVH * G, DH)))
    want = paged_parts_gpu(q, k, v, lengths, table, interpret=True)
    got = paged_parts_gpu(q, dirty_k, dirty_v, lengths, table, interpret=True)
    for a, b in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    top, total, acc = kernel_parts(q, k, v, jnp.asarray(lengths), jnp.asarray(table),
                                   jnp.asarray(lengths)[:, None] - 1, interpret=True)
    assert acc.shape[3] == 16                             # G = 2 queries padded to Triton's 16
    for x in (top, total, acc):
        assert np.isfinite(np.asarray(x[:, :, :, :G])).all()
        assert np.isnan(np.asarray(x[:, :, :, G:])).all()


def test_gpu_engine_reads_prompts_once_and_gives_the_static_samples(monkeypatch):
    """The engine on the accelerator path (the GPU's program: layer scan, the Pallas kernel in
    interpret mode here) with 4 samples of prompts of 1-3 whole pages: the segments run with
    blocks that share, and the samples are the static sampler's."""
    seen = []

    def spy(*args, **kwargs):
        rows, groups = arrange(*args, **kwargs)
        seen.append(int(np.asarray(groups.length).max(initial=0)))
        return rows, groups

    arrange = engine_module.arrange
    monkeypatch.setattr(engine_module, "arrange", spy)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).astype(np.int32) for n in (37, 20)]
    settings = dict(n=[4, 3], max_new_tokens=[6, 5], temperature=[1.0, 0.0], top_p=[0.9, 1.0], top_k=[40, 0])
    keys = [jax.random.key(200 + i) for i in range(2)]
    want = reference(prompts, keys, **settings)
    eng = Engine(model(), eos_ids=EOS, lm_head="float32", backend="accelerator",
                 config=EngineConfig(slots=8, page_size=16, max_len=64, chunk=16, prefill_lanes=2, pages=40,
                                     segment=4, attention="paged_gpu"))
    assert eng.shares_prompts()
    got = eng.sample(prompts, key=keys, **settings).generations
    assert_same(got, want)
    assert max(seen) >= 32                    # a block read two whole prompt pages in one pass


def test_the_shared_decode_lowers_to_one_triton_kernel_block_of_16_queries_at_qwen3_4b_heads():
    """For CUDA, at Qwen3-4B's heads (32 query, 8 KV, 128 wide) and the H200 run's table (272
    pages of 16): the shared pass puts a block's 4 samples x 4 query heads in one 16-query
    block, the own pass pads its 4 to 16, both are the Pallas kernel lowered to Triton."""
    from actionopd_jax.aot.lowering import cuda_stand_in, lowering_for
    from actionopd_jax.cuda_plugin import cuda_plugin
    from tests._required import REQUIRE_CUDA, skip_or_fail

    if cuda_plugin() is None:
        skip_or_fail(REQUIRE_CUDA, "jax's CUDA plugin is not installed: lowering for CUDA needs it")
    rows, pps = 16, 272
    SDS = jax.ShapeDtypeStruct
    i32 = lambda *s: SDS(s, jnp.int32)  # noqa: E731
    groups = Groups(table=i32(rows // SHARE_WIDTH, pps), length=i32(rows // SHARE_WIDTH), own_start=i32(rows),
                    own_table=i32(rows, pps))
    pages = SDS((8, rows * pps + 1, 16, 128), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v, n, g: shared_attend(q, k, v, n, g, 0, "paged_gpu"))
    with lowering_for("gpu"), cuda_stand_in():
        text = fn.trace(SDS((rows, 1, 32, 128), jnp.bfloat16), pages, pages, i32(rows), groups).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2 and all("paged_parts_m16_pages8" in line for line in calls), calls
