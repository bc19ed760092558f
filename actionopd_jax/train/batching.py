"""From state groups to fixed-shape, length-bucketed training arrays.

A training row is one prompt followed by one candidate (the N candidates of a group are N
rows). Rows have very different lengths (the prompt grows along a trajectory), and a jitted
step needs fixed shapes, so:

- rows are sorted by length and cut into minibatches of consecutive rows (one optimizer
  update each; the loop shuffles the order of minibatches with a seeded generator), so the
  rows of a minibatch have similar lengths; shared-prompt rows have two widths (prompt, and
  the N response regions) and are tiled in both instead (`plan_shared_minibatches`);
- a minibatch is [microbatches, rows, T] with T (and the response width R) rounded up to a
  small set of bucket sizes, so few distinct shapes are ever compiled;
- missing rows are zero-weight padding rows (they add nothing to sums or counts).

Only response positions are scored: `resp_index[r]` is the position whose hidden state
predicts response token r (prompt_len - 1 + r), so the model computes logits for those
positions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from actionopd_jax.sampling.buckets import bucket_length  # shared with serve/scoring.py
from actionopd_jax.types import StateGroup

# array name -> (dtype, per-row trailing dim: "T" sequence, "R" response, None scalar)
BATCH_FIELDS: dict[str, tuple[str, str | None]] = {
    "tokens": ("int32", "T"),
    "positions": ("int32", "T"),
    "attention_mask": ("bool", "T"),
    "resp_index": ("int32", "R"),
    "resp_tokens": ("int32", "R"),
    "loss_mask": ("float32", "R"),
    "advantages": ("float32", None),
    "sampler_logp": ("float32", "R"),
    "old_logp": ("float32", "R"),
    "teacher_logp": ("float32", "R"),
}


@dataclass
class Row:
    """One prompt + one generated (or, for KD, demonstrated) response."""

    prompt: np.ndarray
    response: np.ndarray
    advantage: float = 0.0
    sampler_logp: np.ndarray | None = None
    teacher_logp: np.ndarray | None = None
    group: int = -1  # index of its state group: rows of one group share their prompt
    # sampled by a policy older than the one being updated (collect.max_staleness >= 1): its
    # loss takes the off-policy weight against the recorded sampler log-probs (train/losses.py)
    stale: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass
class SharedRow:
    """The candidates of one state packed behind their common prompt (train.shared_prompt):
    [prompt | response 1 | ... | response N], each region padded to a fixed width, so the
    prompt is computed once for all N (model/attention.SharedPrefix)."""

    prompt: np.ndarray
    rows: list[Row]

    @property
    def length(self) -> int:  # for length sorting: the tokens actually computed
        return len(self.prompt) + sum(len(r.response) for r in self.rows)

    @property
    def longest_response(self) -> int:
        return max(len(r.response) for r in self.rows)


def update_microbatches(cfg) -> int:
    """Microbatches one optimizer update scans over (a minibatch of `train.minibatch_rows` rows,
    microbatches of `train.microbatch_rows` packed rows, each of N candidates with
    `train.shared_prompt`): what train/loop.py packs and `--check --aot` compiles. With more
    than one, an f32 gradient accumulator is live beside each microbatch's gradient."""
    t = cfg.train
    return max(1, t.minibatch_rows // (t.microbatch_rows * (cfg.collect.num_candidates if t.shared_prompt else 1)))


def share_prompts(rows: Sequence[Row]) -> list[SharedRow]:
    """Rows of the same group (consecutive, as `rows_from_groups` makes them) -> one SharedRow."""
    units: list[SharedRow] = []
    for row in rows:
        if units and row.group >= 0 and units[-1].rows[0].group == row.group:
            units[-1].rows.append(row)
        else:
            units.append(SharedRow(prompt=row.prompt, rows=[row]))
    return units


@dataclass
class Minibatch:
    """Host arrays [microbatches, rows, ...] for one optimizer update, plus padding stats."""

    arrays: dict[str, np.ndarray]
    real_rows: int
    real_tokens: int  # prompt + response tokens of real rows
    real_resp_tokens: int
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        m, b, t = self.arrays["tokens"].shape
        return m, b, t, self.arrays["resp_tokens"].shape[-1]


def rows_from_groups(groups: Sequence[StateGroup], *, need_teacher_logp: bool = False,
                     step: int | None = None) -> list[Row]:
    """Rows of every retained group (all N candidates, paper A.4); dropped groups and empty
    responses give no rows. `group.advantages` must be set (see `advantages.assign`).
    `step`: the step being trained; a group whose recorded policy_version is older gives stale
    rows (asynchronous collection; the synchronous collector records none: -1)."""
    rows: list[Row] = []
    for gi, g in enumerate(groups):
        if not g.retained or g.advantages is None:
            continue
        stale = step is not None and 0 <= g.policy_version < step
        if len(g.advantages) != len(g.candidates):
            raise ValueError(
                f"group {g.task_id}/{g.decision_index}: {len(g.advantages)} advantages for "
                f"{len(g.candidates)} candidates")
        for cand, adv in zip(g.candidates, g.advantages):
            resp = np.asarray(cand.token_ids, dtype=np.int32).reshape(-1)
            if resp.size == 0:
                continue
            teacher = getattr(cand, "teacher_logprobs", None)
            if need_teacher_logp and teacher is None:
                raise ValueError(
                    f"loss 'opd' needs teacher log-probabilities for every sampled token, but a "
                    f"candidate of group {g.task_id}/{g.decision_index} has none "
                    f"(Candidate.teacher_logprobs); use a collector that scores with the teacher")
            rows.append(Row(
                prompt=np.asarray(g.prompt_ids, dtype=np.int32).reshape(-1),
                response=resp,
                advantage=float(adv),
                sampler_logp=None if cand.logprobs is None else np.asarray(cand.logprobs, np.float32),
                teacher_logp=None if teacher is None else np.asarray(teacher, np.float32),
                group=gi,
                stale=stale,
            ))
    return rows


def plan_minibatches(
    rows: Sequence[Row] | Sequence[SharedRow], *, minibatch_rows: int, sort_by_length: bool,
    rng: np.random.Generator, regions: int = 0, multiples: tuple[int, int] = (64, 16),
) -> list[list[int]]:
    """Row indices of each minibatch (one optimizer update each), shortest first.

    With `sort_by_length`, minibatches are consecutive runs of length-sorted rows (little
    padding); otherwise a seeded random partition. `regions` > 0: `rows` are SharedRows packed
    with that many response regions (train.shared_prompt), and `sort_by_length` tiles them by
    prompt and longest response (`plan_shared_minibatches`, bucketed by `multiples`: the prompt
    and the response region's). Either way ceil(len(rows) / minibatch_rows) minibatches of at
    most minibatch_rows rows. The caller shuffles the order of the minibatches (with one
    permutation shared by all processes).
    """
    if minibatch_rows <= 0:
        raise ValueError(f"minibatch_rows must be positive, got {minibatch_rows}")
    n = len(rows)
    if n == 0:
        return []
    perm = rng.permutation(n).tolist()
    if sort_by_length and regions:
        return plan_shared_minibatches([len(u.prompt) for u in rows], [u.longest_response for u in rows],
                                       units=minibatch_rows, regions=regions, multiples=multiples, order=perm)
    # stable sort of a seeded permutation: ties are broken by the seed, not by arrival order
    order = sorted(perm, key=lambda i: rows[i].length) if sort_by_length else perm
    return [order[i : i + minibatch_rows] for i in range(0, n, minibatch_rows)]


TILE_SPAN = 8   # minibatches a prompt band may hold: wider never won in the replay, and it keeps planning linear


def plan_shared_minibatches(prompt_lens: Sequence[int], resp_lens: Sequence[int], *, units: int, regions: int,
                            multiples: tuple[int, int], order: Sequence[int]) -> list[list[int]]:
    """Minibatches of shared-prompt rows (indices into the lengths), smallest padded area first.

    A minibatch of shared rows is packed [units rows x (prompt width + regions x response
    width)], each width the bucket of its longest (train/loop.py update_epoch), so sorting by
    one length leaves the other wide: sorted by real tokens, nearly every minibatch of the paper
    recipe held some 4,096-token reply and 71% of the update's FLOPs were padding
    (benchmarks/engine_sim_update.py). Here the rows are sorted by prompt and cut into bands
    of whole minibatches; inside a band they are sorted by longest response and cut into
    minibatches. The bands are chosen by dynamic programming to minimise the padded tokens,
    units x (bucketed prompt + regions x bucketed response) per minibatch. The count of
    minibatches stays ceil(n / units), all full but one: the spare room goes to the shortest
    prompts' minibatch or the longest's, whichever pads fewer. `order` (the seeded permutation) breaks
    ties: both sorts are stable. The result is ordered by padded area, so minibatch i of every
    process has a like cost (the loop takes each width's maximum over processes)."""
    n = len(order)
    if n == 0:
        return []
    prompts, resps = np.asarray(prompt_lens, np.int64), np.asarray(resp_lens, np.int64)
    by_prompt = np.asarray(sorted(order, key=lambda i: prompts[i]), np.int64)
    k = -(-n // units)
    spare = k * units - n

    def plan(starts: list[int]) -> tuple[float, list[np.ndarray]]:
        """Minibatch c holds by_prompt[starts[c]:starts[c + 1]] of the bands; the fewest padded tokens."""

        def band(a: int, b: int) -> tuple[float, list[np.ndarray]]:
            """Minibatches a..b-1 as one band: their padded tokens and their rows."""
            rows = by_prompt[starts[a]:starts[b]]
            rows = rows[np.argsort(resps[rows], kind="stable")]
            cuts = [rows[starts[c] - starts[a]:starts[c + 1] - starts[a]] for c in range(a, b)]
            return float(sum(width(c) for c in cuts)), cuts

        # best[b]: (padded tokens, first minibatch of the last band, its minibatches) for minibatches
        # 0..b-1 in bands; ties keep the narrower last band
        best: list[tuple[float, int, list[np.ndarray]]] = [(0.0, 0, [])]
        for b in range(1, k + 1):
            options = []
            for a in range(b - 1, max(0, b - TILE_SPAN) - 1, -1):
                area, cuts = band(a, b)
                options.append((best[a][0] + area, a, cuts))
            best.append(min(options, key=lambda o: o[0]))
        out, b = [], k
        while b:
            out[:0], b = best[b][2], best[b][1]
        return best[k][0], out

    def width(rows: np.ndarray) -> int:   # padded tokens of a packed row of these
        return (bucket_length(int(prompts[rows].max()), multiples[0])
                + regions * bucket_length(int(resps[rows].max()), multiples[1]))

    # the spare room in the shortest prompts' minibatch (fewer tokens on the replay), or in the
    # longest's where that pads fewer (one outlier alone); ties keep the first
    plans = [plan([0] + [c * units - spare for c in range(1, k)] + [n])]
    if spare and k > 1:
        plans.append(plan([c * units for c in range(k)] + [n]))
    _, cuts = min(plans, key=lambda o: o[0])
    cost = [width(c) for c in cuts]
    return [cuts[i].tolist() for i in sorted(range(k), key=lambda i: cost[i])]


def pack_minibatch(
    rows: Sequence[Row],
    indices: Sequence[int],
    *,
    microbatches: int,
    microbatch_rows: int,
    bucket_multiple: int = 64,
    resp_multiple: int = 16,
    max_len: int | None = None,
    seq_len: int | None = None,
    resp_len: int | None = None,
    pad_id: int = 0,
    with_stale: bool = False,
) -> Minibatch:
    """Arrays [microbatches, microbatch_rows, ...] for the rows `indices` (the rest padding).

    `seq_len`/`resp_len` force the widths (multi-host: every process must use the same);
    otherwise they are the bucketed maxima of these rows. `with_stale` adds "stale" [.., R]:
    1.0 on the response tokens of stale rows (only then: the synchronous batch is unchanged).
    """
    capacity = microbatches * microbatch_rows
    if len(indices) > capacity:
        raise ValueError(f"{len(indices)} rows do not fit {microbatches} x {microbatch_rows}")
    sel = [rows[i] for i in indices]
    longest = max((r.length for r in sel), default=1)
    longest_resp = max((len(r.response) for r in sel), default=1)
    if max_len is not None and longest > max_len:
        raise ValueError(f"a row of {longest} tokens exceeds train.max_seq_len={max_len}; "
                         f"raise it or shorten the collector's context budget")
    t = seq_len or bucket_length(longest, bucket_multiple)
    r_w = resp_len or bucket_length(longest_resp, resp_multiple)
    if t < longest or r_w < longest_resp:
        raise ValueError(f"forced widths T={t}, R={r_w} are smaller than the rows ({longest}, {longest_resp})")

    out = {
        name: np.zeros((capacity,) + ((t,) if dim == "T" else (r_w,) if dim == "R" else ()), dtype)
        for name, (dtype, dim) in BATCH_FIELDS.items()
    }
    if with_stale:
        out["stale"] = np.zeros((capacity, r_w), np.float32)
    out["tokens"][:] = pad_id
    out["positions"][:] = np.arange(t, dtype=np.int32)
    real_tokens = real_resp = 0
    for j, row in enumerate(sel):
        p, n_resp = len(row.prompt), len(row.response)
        if p == 0:
            raise ValueError("a row has an empty prompt: the first response token needs a context")
        out["tokens"][j, :p] = row.prompt
        out["tokens"][j, p : p + n_resp] = row.response
        out["attention_mask"][j, : p + n_resp] = True
        out["resp_index"][j, :n_resp] = np.arange(p - 1, p - 1 + n_resp)
        out["resp_tokens"][j, :n_resp] = row.response
        out["loss_mask"][j, :n_resp] = 1.0
        out["advantages"][j] = row.advantage
        if with_stale and row.stale:
            out["stale"][j, :n_resp] = 1.0
        for name, values in (("sampler_logp", row.sampler_logp), ("teacher_logp", row.teacher_logp)):
            if values is None:
                continue
            if len(values) != n_resp:
                raise ValueError(f"{name} has {len(values)} entries for {n_resp} response tokens")
            out[name][j, :n_resp] = values
        real_tokens += p + n_resp
        real_resp += n_resp
    arrays = {k: v.reshape((microbatches, microbatch_rows) + v.shape[1:]) for k, v in out.items()}
    stats = {
        "rows": float(len(sel)),
        "seq_len": float(t),
        "resp_len": float(r_w),
        "padding_waste": 1.0 - real_tokens / float(capacity * t),
        "resp_padding_waste": 1.0 - real_resp / float(capacity * r_w),
    }
    return Minibatch(arrays, len(sel), real_tokens, real_resp, stats)


def pack_shared_minibatch(
    units: Sequence[SharedRow],
    indices: Sequence[int],
    *,
    microbatches: int,
    microbatch_rows: int,
    count: int,
    prompt_len: int,
    resp_len: int,
    pad_id: int = 0,
    with_stale: bool = False,
) -> Minibatch:
    """`pack_minibatch` for shared-prompt rows: arrays [microbatches, microbatch_rows, ...] of
    packed rows [prompt region (prompt_len) | `count` response regions (resp_len each)].
    Response arrays are [.., count * resp_len] (region-major) and advantages are per token.
    The hidden state of the last prompt token predicts every response's first token."""
    capacity = microbatches * microbatch_rows
    if len(indices) > capacity:
        raise ValueError(f"{len(indices)} shared rows do not fit {microbatches} x {microbatch_rows}")
    t, r_all = prompt_len + count * resp_len, count * resp_len
    out = {name: np.zeros((capacity, t if dim == "T" else r_all), dtype)
           for name, (dtype, dim) in BATCH_FIELDS.items()}
    if with_stale:
        out["stale"] = np.zeros((capacity, r_all), np.float32)
    out["tokens"][:] = pad_id
    real_tokens = real_resp = rows = 0
    for j, unit in enumerate(units[i] for i in indices):
        p = len(unit.prompt)
        if len(unit.rows) > count:
            raise ValueError(f"a state has {len(unit.rows)} candidates; shared rows hold {count}")
        if p > prompt_len or unit.longest_response > resp_len:
            raise ValueError(f"a shared row ({p} prompt, {unit.longest_response} response tokens) exceeds "
                             f"its regions ({prompt_len}, {resp_len})")
        out["tokens"][j, :p] = unit.prompt
        out["positions"][j, :p] = np.arange(p)
        out["attention_mask"][j, :p] = True
        for i, row in enumerate(unit.rows):
            n, start, col = len(row.response), prompt_len + i * resp_len, i * resp_len
            out["tokens"][j, start:start + n] = row.response
            out["positions"][j, start:start + n] = p + np.arange(n)
            out["attention_mask"][j, start:start + n] = True
            out["resp_index"][j, col] = p - 1
            out["resp_index"][j, col + 1:col + n] = np.arange(start, start + n - 1)
            out["resp_tokens"][j, col:col + n] = row.response
            out["loss_mask"][j, col:col + n] = 1.0
            out["advantages"][j, col:col + n] = row.advantage
            if with_stale and row.stale:
                out["stale"][j, col:col + n] = 1.0
            for name, values in (("sampler_logp", row.sampler_logp), ("teacher_logp", row.teacher_logp)):
                if values is None:
                    continue
                if len(values) != n:
                    raise ValueError(f"{name} has {len(values)} entries for {n} response tokens")
                out[name][j, col:col + n] = values
            real_resp += n
            rows += 1
        real_tokens += unit.length
    arrays = {k: v.reshape((microbatches, microbatch_rows) + v.shape[1:]) for k, v in out.items()}
    stats = {"rows": float(rows), "seq_len": float(t), "resp_len": float(r_all),
             "padding_waste": 1.0 - real_tokens / float(capacity * t),
             "resp_padding_waste": 1.0 - real_resp / float(capacity * r_all)}
    return Minibatch(arrays, rows, real_tokens, real_resp, stats)
