"""The update's device time in the paper-scale replay (engine_sim_async.py), as the trainer runs it.

engine_sim.py's CHIPS, PEAK and BW are a TPU v5p-8, so the recipe is configs/paper/qwen3_4b_tpu.yaml.
One update of train/loop.py `update_epoch` under it:
- train.shared_prompt: a state's N candidates are one packed row [prompt | N response regions]
  (train/batching.SharedRow), the prompt computed once;
- train.sort_by_length: minibatches of MINIBATCH_UNITS = 64 states (minibatch_rows 256 = 16
  microbatches x 4 rows x N), planned by the product's train/batching.plan_shared_minibatches
  (imported: bands of prompt length, cut by longest reply inside, the bands chosen for the
  fewest padded tokens; until issue 44's replay found 71% of the update's FLOPs were padding,
  the rows were sorted by real tokens, prompt + replies: --sort-key length replays that);
  a minibatch is padded to all its 64 rows, its prompt region to bucket_length(longest
  prompt, 64) and each response region to bucket_length(longest response, 128) (loop.py:
  logits_chunk 512 // gcd(512, N)); the device computes those padded shapes;
- train.old_logprobs recompute: one forward over every minibatch before the updates;
- model.remat full (the recipe names it; `auto` would take "attn" on the 4 chips, planned
  64.3 GiB of 86.2 usable; on 2 chips nothing fits: full plans 103.4 GiB and compiles for
  v5p to 114.8; REMAT_PLAN_GIB, since the plan counts splash's backward dq partials and
  XLA:TPU's bf16 weight copy: before, it planned full on 2 chips at 72.2 and said it fit).

FLOPs are counted as train/aot_check.model_flops counts them (MaxText's model FLOPs, no remat
recompute): 6 x non-embedding params x tokens + 12 L H Dh x attention pairs (a shared row:
P^2/2 + N R (P + R/2)) + 6 D V x response tokens. --train-mfu is the share of PEAK these model
FLOPs reach in one train step under full remat, as docs/measurements.md measured it: 42.5% on an
H200 at 4,096 tokens (49.7% at 16,384; issue 42's goal, 500 TFLOP/s of the measured 799, is
62.6%). No TPU has run the step: that share is assumed to carry over to v5p. The step's hardware
rate is then its hardware FLOPs (full remat: the layers' forward once more) over its time, and
every other program (the old-logprob forward, a lighter remat) is assumed to run at that rate.
Not counted: AdamW (~0.1 s a step at HBM speed) and ActionOPD's dropping of groups whose
candidates all scored alike (rewards.py; unknown here, so every group trains: an upper bound).
"""

from __future__ import annotations

import math

from engine_sim import HEAD_DIM, KV_TOKEN, LAYERS, N, PEAK, Q_HEADS, WEIGHTS

from actionopd_jax.train.batching import plan_shared_minibatches

HIDDEN, VOCAB = 2560, 151936
NON_EMBEDDING = 3_633_511_936          # model/config.count_params(qwen3-4b)["non_embedding"]
MINIBATCH_UNITS = 16 * 4               # train.minibatch_rows 256 / (microbatch_rows 4 x N)
PROMPT_MULTIPLE, RESP_MULTIPLE = 64, 128
HBM_GIB, USABLE = 95.74, 0.9           # aot/targets.py v5p; config.USABLE_MEMORY_FRACTION
MICROBATCH_ROWS = 4                    # train.microbatch_rows: rows split over the fsdp chips
# `train --check`'s plan (train/plan.estimate_memory) of the recipe's update per chip, GiB, by fsdp chips
REMAT_PLAN_GIB = {1: {"none": 1460.5, "dots": 530.5, "attn": 257.1, "full": 206.9},
                  2: {"none": 730.3, "dots": 265.3, "attn": 128.6, "full": 103.4},
                  3: {"none": 716.5, "dots": 251.5, "attn": 114.8, "full": 89.7},
                  4: {"none": 365.1, "dots": 132.6, "attn": 64.3, "full": 51.7}}


def bucket_length(n: int, multiple: int) -> int:
    """sampling/buckets.bucket_length: n rounded up to a multiple of max(multiple, 2^floor(log2 n) / 4)."""
    if n <= 0:
        return multiple
    granularity = max(multiple, (1 << (int(n).bit_length() - 1)) // 4)
    return int(math.ceil(n / granularity) * granularity)


def row_flops(prompt: int, replies) -> dict:
    """Forward FLOPs of one packed row [prompt | one region per reply]: the layers' matmuls, the
    attention, the LM head over the response tokens (3x their sum is aot_check.model_flops)."""
    resp = sum(replies)
    pairs = prompt * prompt / 2 + sum(r * (prompt + r / 2) for r in replies)
    return {"matmul": 2 * NON_EMBEDDING * (prompt + resp), "attention": 4 * LAYERS * Q_HEADS * HEAD_DIM * pairs,
            "head": 2 * HIDDEN * VOCAB * resp}


SORT_KEYS = ("tiles", "length")   # the product's plan; the sort by real tokens it replaced


def minibatches(groups, sort_key: str = "tiles") -> list[tuple[int, int]]:
    """(prompt width, response width) of each minibatch the trainer packs from `groups`
    ((prompt length, N reply lengths) per state), each MINIBATCH_UNITS rows. sort_key
    "tiles": the product's plan (the identity order for its seeded tie-breaks); "length": the
    sort by real tokens, prompt + replies, that it replaced (a stable sort, consecutive runs)."""
    if sort_key == "tiles":
        chunks = [[groups[i] for i in c] for c in plan_shared_minibatches(
            [p for p, _ in groups], [max(r) for _, r in groups], units=MINIBATCH_UNITS, regions=N,
            multiples=(PROMPT_MULTIPLE, RESP_MULTIPLE), order=range(len(groups)))]
    elif sort_key == "length":
        units = sorted(groups, key=lambda g: g[0] + sum(g[1]))
        chunks = [units[i:i + MINIBATCH_UNITS] for i in range(0, len(units), MINIBATCH_UNITS)]
    else:
        raise ValueError(f"sort_key is one of {SORT_KEYS}, got {sort_key!r}")
    return [(bucket_length(max(p for p, _ in c), PROMPT_MULTIPLE),
             bucket_length(max(max(r) for _, r in c), RESP_MULTIPLE)) for c in chunks]


def hardware_flops(f: dict, remat: str) -> float:
    """A train step's FLOPs on the device: forward + backward (2x) + what the remat policy
    recomputes of the layers (full: all; attn: the matmuls; dots: the attention; none: nothing)."""
    extra = {"full": f["matmul"] + f["attention"], "attn": f["matmul"], "dots": f["attention"], "none": 0.0}[remat]
    return 3 * sum(f.values()) + extra


def update_seconds(groups, mfu: float, chips: int, remat: str = "full", padded: bool = True,
                   sort_key: str = "tiles") -> float:
    """Device seconds of one update over `groups` on `chips` chips: per minibatch the
    old-logprob forward and the train step, at padded shapes (the module docstring).
    padded=False: each group at its own length, as no code here packs them (an option)."""
    if padded:
        rows = [{k: MINIBATCH_UNITS * v for k, v in row_flops(p, [r] * N).items()}
                for p, r in minibatches(groups, sort_key)]
    else:
        rows = [row_flops(p, r) for p, r in groups]
    total = 0.0
    for f in rows:
        step_full = 3 * sum(f.values()) / (mfu * PEAK * chips)       # the measured share, full remat
        rate = hardware_flops(f, "full") / step_full                 # that step's hardware FLOP/s
        total += (sum(f.values()) + hardware_flops(f, remat)) / rate
    return total


def padding_share(groups, sort_key: str = "tiles") -> float:
    """The share of the update's model FLOPs spent on padding (rows, prompt and response regions)."""
    padded = sum(MINIBATCH_UNITS * sum(row_flops(p, [r] * N).values()) for p, r in minibatches(groups, sort_key))
    return 1.0 - sum(sum(row_flops(p, r).values()) for p, r in groups) / padded


def train_fits(chips: int, remat: str = "full") -> str:
    """'' if the recipe's update runs on `chips` chips, else why not."""
    if MICROBATCH_ROWS % chips:
        return f"train.microbatch_rows={MICROBATCH_ROWS} does not split over {chips} chips (train/preflight.py)"
    plan = REMAT_PLAN_GIB[chips][remat]
    if plan > HBM_GIB * USABLE:
        return f"the update plans {plan} GiB a chip (remat {remat}) against {HBM_GIB * USABLE:.1f} usable"
    return ""


# The mesh split (mesh.rollout_devices, being built): k chips decode, CHIPS - k train.
ICI_BYTES_S = 600e9     # Cloud TPU v5p: 4,800 Gbps of interchip interconnect per chip


def decode_pool_tokens(chips: int) -> float:
    """The page pool of `chips` chips that hold only the bf16 weights and the pool: usable HBM
    less the weights, in KV tokens (the segment's own temporaries not subtracted: optimistic)."""
    return (chips * HBM_GIB * 2**30 * USABLE - WEIGHTS) / KV_TOKEN


def weight_move_seconds(chips: int) -> float:
    """The bf16 weights moved to the decode chips once per update, each receiving its share."""
    return WEIGHTS / (chips * ICI_BYTES_S)
