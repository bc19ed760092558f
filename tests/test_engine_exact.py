"""The engine gives the static sampler's samples (same tokens, same finish reasons, logprobs to
float32 rounding) whatever the arrival order, the slot a sample lands in and the segment
length; and a new mix of requests never compiles again (the CPU engine's programs: the prefill
chunk and one segment per row count, programs.row_buckets, each compiled once)."""

import jax
import numpy as np
import pytest

from _engine_fixtures import assert_same, engine, reference
from actionopd_jax.engine.programs import row_buckets

N_STATES = 7


def _workload(seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 30))).astype(np.int32) for _ in range(N_STATES)]
    settings = dict(n=[int(rng.integers(1, 4)) for _ in prompts],
                    max_new_tokens=[int(rng.integers(1, 25)) for _ in prompts],
                    temperature=[float(rng.choice([0.0, 0.7, 1.0])) for _ in prompts],
                    top_p=[float(rng.choice([1.0, 0.9])) for _ in prompts],
                    top_k=[int(rng.choice([0, 5, 40])) for _ in prompts])
    keys = [jax.random.key(100 + i) for i in range(N_STATES)]
    return prompts, settings, keys


@pytest.mark.parametrize("segment", [1, 3, 8])
def test_random_arrivals_give_the_static_samples(segment):
    prompts, settings, keys = _workload(seed=segment)
    want = reference(prompts, keys, **settings)
    eng = engine(segment)
    rng = np.random.default_rng(1000 + segment)
    order = rng.permutation(N_STATES)        # arrival order, each arrival after a random number of steps
    got = [None] * N_STATES
    pending = list(order)
    while pending or eng.busy:
        for _ in range(int(rng.integers(0, 3)) if pending else 0):
            if pending:
                i = pending.pop(0)
                eng.submit(prompts[i], key=keys[i], on_done=lambda r, i=i: got.__setitem__(i, r.generations),
                           **{k: v[i] for k, v in settings.items()})
        eng.step()
    assert_same(got, want)
    assert eng.stats.generated_tokens == sum(g.token_ids.size for gens in want for g in gens)
    assert eng.pages.in_use == 0             # every page released (cached ones stay evictable)


def test_new_request_mixes_never_compile_again():
    eng = engine(3)
    prompts, settings, keys = _workload(seed=3)
    eng.sample(prompts, key=keys, **settings)
    # chunk + a segment per row count (6 slots: 4 and 6 rows); 0 if another test compiled them
    assert eng.compile_count <= 1 + len(row_buckets(eng.config.slots)) == 3
    before = eng.compile_count
    for seed in (11, 12):                    # other lengths, n, max_new, sampling settings
        prompts, settings, keys = _workload(seed)
        result = eng.sample(prompts[:4], key=keys[:4], **{k: v[:4] for k, v in settings.items()})
        assert result.compiled_programs == 0
    assert eng.compile_count == before


def _run_ahead_segments(lengths, buckets, limit):
    """Segments the run-ahead policy makes when every row starts in the first one and nothing
    waits: each runs until `limit` steps, or until the rows still running fit a smaller row
    count than the rows running at its start (a row of length L runs L steps)."""
    t, segments = 0, 0
    while any(n > t for n in lengths):
        running = sum(n > t for n in lengths)
        below = max([b for b in buckets if b < running], default=0)
        for _ in range(limit):
            t += 1
            left = sum(n > t for n in lengths)
            if left == 0 or left <= below:
                break
        segments += 1
    return segments


def test_run_ahead_segments_follow_the_row_counts_and_keep_the_samples():
    """`sample` (Engine.step(run_ahead=True)): while nothing waits, a segment runs past
    `segment` steps and ends early only where the rows still running fit a smaller row count's
    program (6 slots: 4 and 6 rows), against at least ceil(longest / segment) plain segments;
    the samples are the static sampler's either way."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=6 + 3 * i).astype(np.int32) for i in range(3)]
    settings = dict(n=[2, 2, 2], max_new_tokens=[4, 11, 20], temperature=[1.0, 0.7, 1.0], top_p=[1.0] * 3,
                    top_k=[0] * 3)
    keys = [jax.random.key(300 + i) for i in range(3)]
    want = reference(prompts, keys, **settings)
    eng = engine(3)                          # max_segment 24 >= every row's length
    before = eng.stats.segments
    assert_same(eng.sample(prompts, key=keys, **settings).generations, want)
    lengths = [g.token_ids.size for gens in want for g in gens]
    made = eng.stats.segments - before
    assert made == _run_ahead_segments(lengths, row_buckets(eng.config.slots), eng.config.max_segment)
    # every row fits one run-ahead segment: one segment per row count the rows pass through
    assert made == len(row_buckets(eng.config.slots)) == 2, (made, lengths)

    plain = engine(3)
    reqs = [plain.submit(p, key=k, **{name: v[i] for name, v in settings.items()})
            for i, (p, k) in enumerate(zip(prompts, keys))]
    before = plain.stats.segments
    while plain.busy:
        plain.step()
    assert_same([r.generations for r in reqs], want)
    assert plain.stats.segments - before >= -(-max(lengths) // 3) > made


def test_run_ahead_with_requests_waiting_keeps_the_samples():
    """More states than slots: `sample` runs plain segments while requests wait, run-ahead
    ones after, with the static sampler's samples."""
    prompts, settings, keys = _workload(seed=21)
    eng = engine(3)
    assert sum(settings["n"]) > eng.config.slots
    assert_same(eng.sample(prompts, key=keys, **settings).generations, reference(prompts, keys, **settings))


def test_gpu_kernel_engine_gives_the_static_samples():
    """The engine with the GPU paged kernels ("paged_gpu", Pallas interpret mode here; pages of
    16 tokens, its smallest block) in its prefill chunks that continue a prompt (ours, in
    query blocks) and its decode segments (jax's, each slot reading its own pages), the model's causal attention in chunks that start prompts: the static
    samples, as the device check asks of it on a GPU ("engine tokens float32 ... vs CPU")."""
    prompts, settings, keys = _workload(seed=5)
    want = reference(prompts, keys, **settings)
    eng = engine(3, attention="paged_gpu", page_size=16)
    eng.share_prompts = False       # jax's decode kernel, a row per slot (the shared path: test_prompt_sharing.py)
    assert eng.attention() == "paged_gpu" and not eng.shares_prompts()
    got = [None] * N_STATES
    for i in range(N_STATES):
        eng.submit(prompts[i], key=keys[i], on_done=lambda r, i=i: got.__setitem__(i, r.generations),
                   **{k: v[i] for k, v in settings.items()})
    while eng.busy:
        eng.step()
    assert_same(got, want)
    # chunks whose lanes all start a prompt ran the model's causal attention (no kernel rows per
    # token), the others the kernel over the pages (programs.FRESH_PREFILL): both gave these samples
    assert {"chunk", "chunk_fresh"} <= set(eng.programs._local)
