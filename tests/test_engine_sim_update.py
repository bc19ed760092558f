"""benchmarks/engine_sim_update.py (issue 44): the replay's update costs what the trainer runs.

The constants are pinned to the product (the recipe's plan, the FLOP count the measured MFU
used, the trainer's buckets), and the packing and timing rules are checked by hand.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_sim_update as U  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "paper" / "qwen3_4b_tpu.yaml"


def test_constants_are_the_products():
    from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION, get_target
    from actionopd_jax.config.load import load_config
    from actionopd_jax.model.attention import SharedPrefix
    from actionopd_jax.model.config import PRESETS, count_params
    from actionopd_jax.sampling.buckets import bucket_length
    from actionopd_jax.train.aot_check import model_flops
    from actionopd_jax.train.plan import GIB, estimate_memory
    from actionopd_jax.train.remat_choice import choose_remat

    cfg = load_config(str(RECIPE))
    t, c = cfg.train, cfg.collect
    assert (cfg.model.remat, t.old_logprobs, t.shared_prompt, t.sort_by_length) == ("full", "recompute", True, True)
    # train/loop.py: microbatches = minibatch_rows // (microbatch_rows x N), states a minibatch = that x microbatch_rows
    assert t.minibatch_rows // (t.microbatch_rows * c.num_candidates) * t.microbatch_rows == U.MINIBATCH_UNITS
    assert (t.microbatch_rows, t.bucket_multiple, t.logits_chunk) == (U.MICROBATCH_ROWS, U.PROMPT_MULTIPLE, 512)
    assert c.concurrency == 64
    target = get_target(cfg.mesh.target)
    assert (target.chips, target.hbm_bytes, USABLE_MEMORY_FRACTION) == (4, U.HBM_GIB * 2**30, U.USABLE)
    qcfg = PRESETS["qwen3-4b"]
    assert count_params(qcfg)["non_embedding"] == U.NON_EMBEDDING
    # 3 x the row's forward is the FLOP count the measured MFU (42.5%) was taken with
    layout = SharedPrefix(prompt=6144, response=1024, count=4)
    f = U.row_flops(6144, [1024] * 4)
    assert 3 * sum(f.values()) == pytest.approx(model_flops(qcfg, 1, 6144 + 4096, 4096, layout), rel=1e-9)
    for n in (1, 63, 64, 700, 1000, 4096, 5000, 24576):
        assert U.bucket_length(n, 64) == bucket_length(n, 64) and U.bucket_length(n, 128) == bucket_length(n, 128)
    for chips, plans in U.REMAT_PLAN_GIB.items():
        mesh = {"data": 1, "fsdp": chips, "tensor": 1}
        for policy, gib in plans.items():
            assert estimate_memory(cfg, qcfg, mesh, "splash", remat=policy).total / GIB == pytest.approx(gib, abs=0.05)
    # `auto` on the recipe's 4 chips would take "attn"; the recipe names full
    assert choose_remat(cfg, qcfg, {"data": 1, "fsdp": 4, "tensor": 1}, "splash", U.HBM_GIB * U.USABLE * GIB).policy == "attn"


def test_minibatches_are_padded_as_the_trainer_packs_them():
    # 65 states: 64 short ones and one long. Sorted by real tokens (the old rule), the long one
    # is alone in the second minibatch, still padded to all 64 rows; the product's tiling fills
    # those rows with 63 short states, which cost nothing there, and leaves one short state alone
    # in a narrow first minibatch (the state with the 1,100-token reply no longer widens it)
    groups = [(1000, [100, 200, 700, 50])] * 63 + [(1000, [100, 100, 100, 1100])] + [(9000, [4096] * 4)]
    assert U.minibatches(groups, "length") == [(1024, 1280), (10240, 4096)]
    assert U.minibatches(groups) == U.minibatches(groups, "tiles") == [(1024, 768), (10240, 4096)]
    # widths round up to max(multiple, 2^floor(log2 n) / 4): 1,000 -> 1,024 (128); 1,100 -> 1,280 (256);
    # 700 -> 768 (128); 9,000 -> 10,240 (2,048)
    assert U.bucket_length(1100, 128) == 1280 and U.bucket_length(700, 128) == 768
    assert U.bucket_length(9000, 64) == 10240
    real = sum(sum(U.row_flops(p, r).values()) for p, r in groups)
    long = 64 * sum(U.row_flops(10240, [4096] * 4).values())
    for key, resp in (("length", 1280), ("tiles", 768)):
        padded = long + 64 * sum(U.row_flops(1024, [resp] * 4).values())
        assert U.padding_share(groups, key) == pytest.approx(1 - real / padded, rel=1e-12)
    assert U.padding_share(groups) < U.padding_share(groups, "length")
    assert U.padding_share(groups) > 0.9          # still 64 rows at the long state's widths
    with pytest.raises(ValueError, match="sort_key"):
        U.minibatches(groups, "prompt")


def test_replay_plans_with_the_products_function():
    # engine_sim_update imports train/batching.plan_shared_minibatches: the replay cannot drift
    from actionopd_jax.train import batching
    assert U.plan_shared_minibatches is batching.plan_shared_minibatches


def test_update_time_by_hand():
    groups = [(1000, [100, 200, 300, 400])]
    f = U.row_flops(1000, [100, 200, 300, 400])
    fwd = sum(f.values())
    step = 3 * fwd / (0.5 * U.PEAK * 2)                      # the measured share, full remat
    rate = (3 * fwd + f["matmul"] + f["attention"]) / step    # its hardware FLOP/s
    assert U.update_seconds(groups, 0.5, 2, padded=False) == pytest.approx(step + fwd / rate, rel=1e-12)
    assert U.update_seconds(groups, 0.5, 2, "none", padded=False) == pytest.approx(4 * fwd / rate, rel=1e-12)
    assert U.update_seconds(groups, 0.5, 1, padded=False) == pytest.approx(2 * (step + fwd / rate), rel=1e-12)
    # padded: one minibatch of 64 rows at (1,024, 512)
    big = {k: 64 * v for k, v in U.row_flops(1024, [512] * 4).items()}
    step = 3 * sum(big.values()) / (0.5 * U.PEAK * 2)
    assert U.update_seconds(groups, 0.5, 2) == pytest.approx(step * (1 + sum(big.values()) / U.hardware_flops(big, "full")))


def test_which_splits_the_recipe_runs():
    assert U.train_fits(4) == ""
    assert "does not split over 3 chips" in U.train_fits(3)
    # 2 chips: the update compiled for v5p needs 114.8 GiB a chip; the plan says 103.4
    assert "103.4 GiB" in U.train_fits(2) and "206.9 GiB" in U.train_fits(1)
    # the pool of k chips holding only the bf16 weights: (k x 95.74 GiB x 0.9 - 8.04 GB) / 147,456 B
    assert U.decode_pool_tokens(1) == pytest.approx((95.74 * 2**30 * 0.9 - 8.04e9) / 147456, rel=1e-12)
    assert U.decode_pool_tokens(1) == pytest.approx(572_917, abs=1)
    assert U.weight_move_seconds(2) == pytest.approx(8.04e9 / 1.2e12, rel=1e-12)
