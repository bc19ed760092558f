"""Replay simulation of one paper-scale collection step: today's static sampler vs the paged engine.

    python benchmarks/engine_sim.py [--seed 0] [--runs 5] [--engine-fixed-ms 1.94] [--static-ratio 1.53]

Compiler estimates, not a measurement: the device is modelled by per-step costs from the TPU
compiler (benchmarks/sampler_aot.py for today's decode, benchmarks/engine_aot.py for the
engine's segment), Qwen3-4B bf16 on v5p-8 (4 chips, 2,765 GB/s each), and the workload is drawn
from the distributions below. Everything else is the two schedulers' rules.

Device costs (per decode step, all 4 chips together):
- static: --static-ratio x (weights + KV the call's program reads) / bandwidth. A call reads its
  prompts' caches once per prompt (shared by the N samples) and the whole generated buffer of
  every row (4,096 slots, masked), every step until its LAST row ends (early exit). 1.53 is
  today's decode at 64 rows x 4,096-token prompts (docs/measurements.md).
- engine: --engine-fixed-ms (the compiler's cost of one step of the 256-slot segment without
  the kernel, benchmarks/engine_aot.py) + the live KV tokens of every slot at
  --kernel-efficiency of the bandwidth: the paged kernel reads each slot's own pages (a
  prompt's pages once per sample, as programs.py does on accelerators today: only the CPU
  "live" path lets a prompt's samples read its pages together, engine/groups.py; an empty slot
  one page); finished slots are refilled between segments of --segment steps.
  --shared-prompt-read is the option the engine does not have on accelerators: a group's
  prompt pages read once per step for all its running samples.
- on fewer chips (the mesh split, engine_sim_async.py) a decode step, fixed part and KV alike,
  takes CHIPS / chips as long: weights and pool sharded over the chips, each reading its share
  of them from its own HBM at the same rate (no collectives counted: they are in the 4-chip
  compiler estimate and would shrink with fewer chips; an assumption, not measured).
- prefill (both): 2 x params x tokens + causal attention FLOPs at --prefill-mfu of peak
  (459 TFLOP/s per chip); the engine prefills between segments, the segment waiting for it.

Workload (64 task starts, N=4 candidates per state; lognormal = median, sigma of log):
- decisions per trajectory: geometric, mean --mean-decisions (10), capped at 40;
- first prompt (system, tool schemas, task): lognormal(2,500, 0.4), in [500, 24,576];
- tool result per decision: lognormal(200, 1.0), in [10, 4,000];
- candidate reply (thinking + action): lognormal(--reply-median 700, 0.8), capped at 4,096;
- the committed reply as the next prompt renders it (Qwen3's template drops earlier thinking):
  lognormal(80, 0.5);
- teacher (K=3 samples in parallel, thinking) per state: lognormal(--teacher-median 12 s, 0.5),
  asked when the state is ready; matcher 1 s after both sides; tool call 0.2 s.
- a state's prompt = the previous prompt + committed reply (visible part) + tool result; past
  24,576 tokens the oldest exchanges are dropped (a prefix miss: only the first prompt is
  reused). The engine keeps each trajectory's prompt pages resident for its next state (the
  recipe's pool holds ~1.8M tokens, 64 trajectories x 24,576 = 1.57M, so nothing is evicted).
  A state enters the slots only while the pool (--pool-tokens) holds its worst case besides
  the running states' (engine/admission.py: the prompt once plus N x 4,096 for the samples);
  the resident prompts of trajectories between states are not counted (assumed never evicted).
Static calls take every ready state up to the sampler's token budget (budget.py: 1.25 x
padded prompt + N x 4,096 per state; 38 x 24,576-token states with the trainer resident).

benchmarks/engine_sim_async.py replays 100 steps of this engine with the update in between and
a staleness bound eta (collect.max_staleness, issue 44).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq

import numpy as np

CHIPS, BW, PEAK = 4, 2765e9, 459e12
PARAMS, LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 4.02e9, 36, 8, 32, 128
KV_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2          # bytes of k and v of one token, bf16
WEIGHTS = PARAMS * 2
N, MAX_NEW, MAX_PROMPT, STARTS, MAX_DECISIONS = 4, 4096, 24576, 64, 40
BUDGET_TOKENS = 38 * (1.25 * 24576 + 4 * 4096)           # the plan's states per call at 24,576


def lognormal(rng, median, sigma, lo, hi):
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


@dataclasses.dataclass
class Trajectory:
    decisions: int
    first_prompt: int
    tool_results: list
    visible: list
    replies: list            # per decision: N candidate lengths
    teacher: list            # per decision: teacher seconds


def draw_workload(rng, args) -> list[Trajectory]:
    out = []
    for _ in range(STARTS):
        d = int(min(MAX_DECISIONS, rng.geometric(1 / args.mean_decisions)))
        out.append(Trajectory(
            decisions=d, first_prompt=lognormal(rng, 2500, 0.4, 500, MAX_PROMPT),
            tool_results=[lognormal(rng, 200, 1.0, 10, 4000) for _ in range(d)],
            visible=[lognormal(rng, 80, 0.5, 5, 1000) for _ in range(d)],
            replies=[[lognormal(rng, args.reply_median, 0.8, 1, MAX_NEW) for _ in range(N)] for _ in range(d)],
            teacher=[float(rng.lognormal(np.log(args.teacher_median), 0.5)) for _ in range(d)]))
    return out


def prompts_of(t: Trajectory) -> list[tuple[int, int]]:
    """(prompt length, tokens reusable from the previous state's prompt) per decision."""
    out, length = [], t.first_prompt
    for i in range(t.decisions):
        if i == 0:
            out.append((length, 0))
            continue
        grown = length + t.visible[i - 1] + t.tool_results[i - 1]
        if grown > MAX_PROMPT:             # the context budget drops the oldest exchanges
            length = MAX_PROMPT
            out.append((length, t.first_prompt))
        else:
            out.append((grown, length))
            length = grown
    return out


def prefill_seconds(tokens: float, context: float, mfu: float, chips: int = CHIPS) -> float:
    """FLOPs of `tokens` new tokens after `context` cached ones, at mfu of `chips` chips' peak."""
    flops = 2 * PARAMS * tokens + 4 * LAYERS * Q_HEADS * HEAD_DIM * tokens * (context + tokens / 2)
    return flops / (chips * PEAK * mfu)


def decode_step_seconds(kv_tokens: float, empty_slots: int, args, chips: int = CHIPS) -> float:
    """One decode step of the engine's segment on `chips` chips: the fixed part plus the KV the
    kernel reads (kv_tokens over the running slots, one page per empty slot), both taking
    CHIPS / chips as long as on the slice (the docstring's assumption)."""
    tokens = kv_tokens + empty_slots * args.page
    return (args.engine_fixed_ms / 1e3
            + tokens * KV_TOKEN / (CHIPS * BW * args.kernel_efficiency)) * CHIPS / chips


def reservation(prompt: int) -> int:
    """Pool tokens a running state holds (engine/admission.py: its prompt's pages once, each
    sample's own pages for max_new tokens)."""
    return prompt + N * MAX_NEW


def kv_read(row_tokens: float, group_prompts: float, row_prompts: float, args) -> float:
    """Tokens of KV a step reads for its running rows: every row its prompt and its own tokens
    (today's accelerators), or with --shared-prompt-read each running group's prompt once.
    row_tokens: prompt + generated over the rows; group_prompts: prompts over the running
    groups; row_prompts: prompts over the rows."""
    return row_tokens - row_prompts + group_prompts if args.shared_prompt_read else row_tokens


PROMPT_BUCKETS = tuple(128 * 2 ** i for i in range(8)) + (24576, 32768)   # the sampler's (buckets.py)


def _padded(n: int) -> int:
    return next(b for b in PROMPT_BUCKETS if b >= n)


class Collector:
    """The step's trajectories, their ready times and the per-state bookkeeping both schedulers share."""

    def __init__(self, work: list[Trajectory]):
        self.work = work
        self.prompts = [prompts_of(t) for t in work]
        self.ready = [(0.0, i) for i in range(len(work))]      # (time the state is ready, trajectory)
        heapq.heapify(self.ready)
        self.next_decision = [0] * len(work)
        self.prefill_tokens = 0
        self.prefill_all = 0
        self.generated = 0       # static: tokens made / row-steps its calls ran
        self.provisioned = 0
        self.end = 0.0
        self.busy = 0.0          # device seconds (prefill + decode)

    def take_ready(self, now: float) -> list[int]:
        got = []
        while self.ready and self.ready[0][0] <= now:
            got.append(heapq.heappop(self.ready)[1])
        return got

    def finish_state(self, traj: int, sampled_at: float, asked_at: float) -> None:
        """The student's N rows are done at sampled_at; the teacher was asked at asked_at. The
        next state is ready once both sides and the matcher and the tool are done."""
        d = self.next_decision[traj]
        done = max(sampled_at, asked_at + self.work[traj].teacher[d]) + 1.0 + 0.2
        self.next_decision[traj] = d + 1
        self.end = max(self.end, done)
        if d + 1 < self.work[traj].decisions:
            heapq.heappush(self.ready, (done, traj))

    def pending(self) -> bool:
        return bool(self.ready)


def run_static(work, args) -> dict:
    c = Collector(work)
    now = 0.0
    while c.pending():
        now = max(now, c.ready[0][0])
        states = c.take_ready(now)
        asked = {t: now for t in states}          # the teacher is asked when the state is ready...
        batch, used = [], 0.0
        for t in states:                          # ...and the sampler takes what the budget allows
            plen = c.prompts[t][c.next_decision[t]][0]
            cost = 1.25 * _padded(plen) + N * MAX_NEW
            if batch and used + cost > BUDGET_TOKENS:
                heapq.heappush(c.ready, (now, t))
                continue
            batch.append(t)
            used += cost
        plens = [c.prompts[t][c.next_decision[t]][0] for t in batch]
        padded = _padded(max(plens))
        t_prefill = prefill_seconds(len(batch) * padded, 0, args.prefill_mfu)
        c.prefill_tokens += sum(plens)
        c.prefill_all += sum(plens)
        replies = [c.work[t].replies[c.next_decision[t]] for t in batch]
        steps = max(max(r) for r in replies)
        kv = (len(batch) * padded + len(batch) * N * MAX_NEW) * KV_TOKEN
        t_step = args.static_ratio * (WEIGHTS + kv) / (CHIPS * BW)
        end = now + t_prefill + steps * t_step
        c.busy += end - now
        c.generated += sum(sum(r) for r in replies)
        c.provisioned += len(batch) * N * steps
        for t in batch:
            c.finish_state(t, end, asked.get(t, now))
        now = end
    return {"wall": c.end, "util": c.generated / c.provisioned, "prefill": c.prefill_tokens, "saved": 0,
            "busy": c.busy / c.end}


def run_engine(work, args) -> dict:
    c = Collector(work)
    slots = args.slots
    live = []        # per active row: [trajectory, prompt len, reply len, generated]
    waiting = []     # (trajectory, asked_at) admitted in arrival order
    rows_left = {}   # trajectory -> (rows still running, asked_at)
    now, decode_slot_steps, active_slot_steps, reserved = 0.0, 0, 0, 0
    while c.pending() or waiting or live:
        if not live and not waiting:
            now = max(now, c.ready[0][0])
        waiting += [(t, now) for t in c.take_ready(now)]
        t_prefill = 0.0
        while waiting and len(live) + N <= slots:       # admit whole states into free slots
            t, asked = waiting[0]
            plen, reused = c.prompts[t][c.next_decision[t]]
            if reserved + reservation(plen) > args.pool_tokens:     # first come, first served
                break
            waiting.pop(0)
            reserved += reservation(plen)
            new = plen - reused
            t_prefill += prefill_seconds(new, reused, args.prefill_mfu)
            c.prefill_tokens += new
            c.prefill_all += plen
            for r in c.work[t].replies[c.next_decision[t]]:
                live.append([t, plen, r, 0])
            rows_left[t] = (N, asked)
        if not live:
            if t_prefill == 0.0:            # the head state can never fit: a loop without end
                raise RuntimeError(f"a state needs {reservation(c.prompts[waiting[0][0]][c.next_decision[waiting[0][0]]][0])} "
                                   f"pool tokens, --pool-tokens is {args.pool_tokens:.0f}")
            now += t_prefill
            c.busy += t_prefill
            continue
        row_tokens = sum(p + g for _, p, _, g in live)
        row_prompts = sum(p for _, p, _, _ in live)
        group_prompts = sum(c.prompts[t][c.next_decision[t]][0] for t in rows_left)   # groups running
        t_step = decode_step_seconds(kv_read(row_tokens, group_prompts, row_prompts, args), slots - len(live), args)
        now += t_prefill + args.segment * t_step
        c.busy += t_prefill + args.segment * t_step
        decode_slot_steps += slots * args.segment
        still = []
        for row in live:
            steps = min(args.segment, row[2] - row[3])
            row[3] += steps
            active_slot_steps += steps
            if row[3] >= row[2]:
                t = row[0]
                n, asked = rows_left[t]
                if n == 1:
                    del rows_left[t]
                    reserved -= reservation(row[1])
                    c.finish_state(t, now, asked)
                else:
                    rows_left[t] = (n - 1, asked)
            else:
                still.append(row)
        live = still
    return {"wall": c.end, "util": active_slot_steps / decode_slot_steps, "prefill": c.prefill_tokens,
            "saved": c.prefill_all - c.prefill_tokens, "busy": c.busy / c.end}


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The workload and device-cost options (shared with engine_sim_async.py's staleness replay)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=5, help="workloads drawn (seeds seed .. seed + runs - 1)")
    ap.add_argument("--static-ratio", type=float, default=1.53, help="today's decode step / its bandwidth bound")
    ap.add_argument("--engine-fixed-ms", type=float, default=1.94,
                    help="segment step without the kernel, 256 slots (engine_aot.py)")
    ap.add_argument("--kernel-efficiency", type=float, default=0.86, help="paged kernel's share of HBM bandwidth")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--segment", type=int, default=16, help="decode steps per segment")
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--pool-tokens", type=float, default=1.8e6, help="the engine's page pool, tokens (the recipe's)")
    ap.add_argument("--shared-prompt-read", action="store_true",
                    help="an option the engine lacks on accelerators: a group's prompt KV read once per step")
    ap.add_argument("--prefill-mfu", type=float, default=0.4)
    ap.add_argument("--mean-decisions", type=float, default=10.0)
    ap.add_argument("--reply-median", type=float, default=700.0)
    ap.add_argument("--teacher-median", type=float, default=12.0)
    return ap


def main() -> None:
    args = build_parser().parse_args()
    res = {"static": [], "engine": []}
    for s in range(args.seed, args.seed + args.runs):
        work = draw_workload(np.random.default_rng(s), args)
        res["static"].append(run_static(work, args))
        res["engine"].append(run_engine(work, args))
    states = sum(sum(t.decisions for t in draw_workload(np.random.default_rng(s), args))
                 for s in range(args.seed, args.seed + args.runs)) / args.runs
    print(f"# one collection step, {STARTS} task starts, {states:.0f} states (mean of {args.runs} workloads); "
          f"compiler-estimate step costs (static {args.static_ratio}x its bound; engine {args.engine_fixed_ms} ms + KV at "
          f"{args.kernel_efficiency:.0%} of bandwidth)")
    print(f"{'scheduler':<8} | {'wall s':>8} | {'device busy':>11} | {'slot utilisation':>16} | {'prefill tokens':>14} | "
          f"{'saved by prefix reuse':>21}")
    for name, rows in res.items():
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        saved = mean["saved"] / (mean["prefill"] + mean["saved"])
        print(f"{name:<8} | {mean['wall']:8.1f} | {100 * mean['busy']:10.1f}% | {100 * mean['util']:15.1f}% | {mean['prefill'] / 1e6:12.2f} M | "
              f"{mean['saved'] / 1e6:8.2f} M ({100 * saved:4.1f}%)")
    ratio = np.mean([s["wall"] / e["wall"] for s, e in zip(res["static"], res["engine"])])
    print(f"static / engine wall time: {ratio:.2f}x. Slot utilisation: static = tokens made / (rows x steps) of its "
          f"calls (SampleResult.slot_utilisation); engine = running rows / its {args.slots} slots per step (a "
          f"finished row frees its slot at once; the rest are empty because states wait for the teacher)")


if __name__ == "__main__":
    main()
