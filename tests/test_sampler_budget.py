"""Token-budgeted chunking: a call is split into device calls whose padded cache-token
equivalents fit the budget; samples do not depend on how the call was split."""

import jax
import numpy as np
import pytest

from actionopd_jax.model.config import PRESETS
from actionopd_jax.sampling import Buckets, Sampler, budget
from tests._sampler_fixtures import random_model


def _old_chunks(ns, b):
    """The chunking before token budgets (prompts bucket x samples bucket <= max_rows)."""
    def padded_rows(count, most):
        return Buckets.fit(count, b.prompts, "prompts") * Buckets.fit(most, b.samples, "samples")

    chunks, current = [], []
    for i, n in enumerate(ns):
        most = max([int(ns[j]) for j in current] + [int(n)])
        if current and (len(current) == b.prompts[-1] or padded_rows(len(current) + 1, most) > b.max_rows):
            chunks.append(current)
            current = []
        current.append(i)
    chunks.append(current)
    return chunks


@pytest.mark.parametrize("seed", range(5))
def test_without_a_budget_the_chunks_are_unchanged(seed):
    rng = np.random.default_rng(seed)
    b = Buckets(max_rows=int(rng.choice([16, 64, 256])))
    ns = rng.integers(1, 9, int(rng.integers(1, 200))).tolist()
    lens = rng.integers(1, 30000, len(ns)).tolist()
    assert budget.plan_chunks(ns, lens, [4096] * len(ns), b, None) == _old_chunks(ns, b)


def test_a_collector_call_is_split_by_the_budget():
    """64 states x 4 samples at 4,096-token prompts, 4,096 new: a budget for 16 states gives
    four chunks of 16, each within the budget."""
    b = Buckets()
    per_16 = budget.chunk_tokens(16, 4096, 4, 4096)
    chunks = budget.plan_chunks([4] * 64, [4000] * 64, [4096] * 64, b, int(per_16))
    assert [len(c) for c in chunks] == [16, 16, 16, 16]
    assert sum(chunks, []) == list(range(64))
    # a single state above the budget still runs alone
    assert budget.plan_chunks([4, 4], [30000, 10], [4096, 4096], b, 10) == [[0], [1]]


def test_budget_from_memory():
    cfg = PRESETS["qwen3-4b"].replace(param_dtype="bfloat16")
    assert budget.cache_bytes_per_token(cfg, "bfloat16") == 2 * 36 * 8 * 128 * 2
    got = budget.token_budget(cfg, 10 * 2 ** 30, 4, safety=1.0, dtype="bfloat16")
    assert got == 40 * 2 ** 30 // (2 * 36 * 8 * 128 * 2)
    assert budget.default_token_budget(cfg) is None      # CPU: no memory limit reported


def test_budget_plans_within_the_usable_memory_fraction():
    """The sampler's runtime budget and `train --check` plan the same usable memory: on TPU
    the fraction of bytes_limit, on GPU bytes_limit itself (the runtime fraction, set by the
    launchers and `actionopd train` from the same constant)."""
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION

    class Chip:
        process_index, is_addressable = 0, True

        def __init__(self, platform):
            self.platform = platform

        def memory_stats(self):
            return {"bytes_limit": 96 * 2 ** 30, "bytes_in_use": 16 * 2 ** 30}

    class Mesh:
        def __init__(self, platform):
            self.devices = np.array([Chip(platform)] * 4)

    cfg = PRESETS["qwen3-4b"].replace(param_dtype="bfloat16")
    per_token = budget.cache_bytes_per_token(cfg, "bfloat16")
    tpu = budget.default_token_budget(cfg, Mesh("tpu"), safety=1.0, dtype="bfloat16")
    assert tpu == int((96 * USABLE_MEMORY_FRACTION - 16) * 2 ** 30 * 4 // per_token)
    gpu = budget.default_token_budget(cfg, Mesh("gpu"), safety=1.0, dtype="bfloat16")
    assert gpu == int(80 * 2 ** 30 * 4 // per_token)


def test_budgeted_calls_give_the_same_samples():
    model = random_model(3, vocab_size=256)
    b = Buckets(prompt_len=(16, 64), prompts=(1, 2, 4), samples=(1, 2, 4), max_new=(8, 16))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 17, 50, 9, 12)]
    kw = dict(n=2, max_new_tokens=8, temperature=1.0, top_k=20, key=jax.random.key(4))
    whole = Sampler(model, eos_ids=[], buckets=b, lm_head="float32", token_budget=None)
    split = Sampler(model, eos_ids=[], buckets=b, lm_head="float32",
                    token_budget=int(budget.chunk_tokens(2, 64, 2, 8)))
    assert [len(c) for c in split._chunks([2] * 5, [p.size for p in prompts], [8] * 5)] == [2, 2, 1]
    assert whole.current_token_budget() is None and Sampler(model, eos_ids=[]).current_token_budget() is None
    a, c = whole.sample(prompts, **kw), split.sample(prompts, **kw)
    for ga, gc in zip(a.generations, c.generations):
        for x, y in zip(ga, gc):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="token_budget"):
        Sampler(model, eos_ids=[], token_budget=0)


def test_slot_utilisation_counts_the_rows_that_finished_early():
    model = random_model(3, vocab_size=256)
    b = Buckets(prompt_len=(16,), prompts=(2,), samples=(2,), max_new=(16,))
    out = Sampler(model, eos_ids=[], buckets=b, lm_head="float32").sample(
        [np.arange(5, dtype=np.int32), np.arange(7, dtype=np.int32)], n=2, max_new_tokens=[16, 4],
        temperature=0.0, key=jax.random.key(0))
    assert out.generated_tokens == 2 * 16 + 2 * 4 and out.row_steps == 4 * 16
    assert out.slot_utilisation == 40 / 64


def test_beside_a_running_update_the_auto_budget_keeps_its_reserve_fixed_at_the_first_call(monkeypatch):
    """Asynchronous collection (collect.max_staleness >= 1) runs sampler calls while an update
    runs: "auto" is the free memory at the first call (before any update) less the update's
    reserve, then kept; read later it would count an update's buffers twice, or none."""
    cfg = PRESETS["qwen3-4b"].replace(param_dtype="bfloat16")
    per_token = budget.cache_bytes_per_token(cfg, "float32")
    free = iter([40 * 2 ** 30, 8 * 2 ** 30, 60 * 2 ** 30])   # an update's buffers come and go
    monkeypatch.setattr(budget, "free_bytes_per_chip", lambda mesh=None: next(free))
    s = Sampler(None, cfg, eos_ids=[0], reserve_bytes=24 * 2 ** 30)
    s.backend = "xla"   # an accelerator's path (the CPU plans no budget)
    first = s.current_token_budget()
    assert first == int(16 * 2 ** 30 * budget.SAFETY // per_token)
    assert s.current_token_budget() == s.current_token_budget() == first
    # without a reserve (synchronous collection: no update beside the calls) it reads free memory each call
    free = iter([40 * 2 ** 30, 8 * 2 ** 30])
    s = Sampler(None, cfg, eos_ids=[0])
    s.backend = "xla"
    assert [s.current_token_budget(), s.current_token_budget()] == [
        int(40 * 2 ** 30 * budget.SAFETY // per_token), int(8 * 2 ** 30 * budget.SAFETY // per_token)]
