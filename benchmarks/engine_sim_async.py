"""Replay of ActionOPD steps on the paged engine with a staleness bound eta (issue 44).

    python benchmarks/engine_sim_async.py [--updates 100] [--etas 0,1,2,4] [--seed 0] [engine_sim options]

The workload and the engine's costs are engine_sim.py's (its docstring; compiler estimates, not
a measurement). Each step is 64 task starts drawn afresh; one update (policy version v -> v+1)
trains on as many state groups as that step has, so every eta trains the same number of groups.

- eta = 0 is today's loop: the step's 64 trajectories run to their end, then the update, then
  the next step. It equals the one-step replay (run_engine) plus the update, step after step.
- eta >= 1: episodes keep running across updates. Admission control: task starts are admitted
  while started <= (v + eta + 1) x 64, and a state enters the slots only while groups in flight
  plus groups accepted and not yet trained stay within the next eta + 1 updates' groups (the
  task-start cap already implies it, drops only lowering the count; the check is the guarantee).
- A group carries the policy version that was current when its rows entered the slots (a row
  that runs on across a weight swap keeps the older stamp: the conservative one). An update of
  version v trains a group only if v - stamp <= eta; older groups are dropped and counted (their
  teacher samples were paid for; in the trainer they stay in the cache).
- One host: the update and the engine share the devices, so decoding pauses while the update
  runs (between segments; nothing is drained); teacher calls, the matcher and tools go on.
- The update's cost: 5 forwards (behaviour log-probs, forward, backward = 2, full remat) of each
  group's shared prompt plus its N replies, at --train-mfu of the slice's peak; no padding.
"""

from __future__ import annotations

import collections
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_sim import (  # noqa: E402
    CHIPS, BW, HEAD_DIM, KV_TOKEN, LAYERS, N, PARAMS, PEAK, Q_HEADS, STARTS, build_parser, draw_workload,
    prefill_seconds, prompts_of, run_engine)


def trainable(stamp: int, updating: int, eta: int) -> bool:
    """The staleness rule: the update of policy `updating` trains a group sampled by policy
    `stamp` only if it is at most eta updates older."""
    return updating - stamp <= eta


def group_forward_flops(prompt: int, replies) -> float:
    """One forward over a shared-prompt row: the prompt once, each reply attending the prompt
    and its own prefix."""
    attn = 4 * LAYERS * Q_HEADS * HEAD_DIM
    return (2 * PARAMS * (prompt + sum(replies))
            + attn * (prompt * prompt / 2 + sum(r * (prompt + r / 2) for r in replies)))


def update_seconds(groups, mfu: float) -> float:
    """groups: (prompt length, replies) of the groups one update trains on."""
    return 5 * sum(group_forward_flops(p, r) for p, r in groups) / (CHIPS * PEAK * mfu)


def draw_steps(seed: int, steps: int, args) -> list[list]:
    return [draw_workload(np.random.default_rng([seed, k]), args) for k in range(steps)]


def run_async(steps_work: list[list], eta: int, updates: int, args) -> dict:
    """Replay `updates` updates at staleness bound eta over the drawn steps (at least
    updates + eta + 1 of them: admission may start that many)."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if len(steps_work) < updates + eta + 1:
        raise ValueError(f"{len(steps_work)} drawn steps; {updates} updates at eta={eta} need "
                         f"{updates + eta + 1}")
    work = [t for step in steps_work for t in step]
    prompts = [prompts_of(t) for t in work]
    groups_of = [sum(t.decisions for t in step) for step in steps_work]   # groups per update
    slots = args.slots
    ready: list = []                      # (time the state is ready, trajectory)
    pending: list = []                    # (time the group is done, seq, trajectory, decision, stamp)
    queue: collections.deque = collections.deque()  # accepted groups, oldest first
    next_decision = [0] * len(work)
    waiting, live, rows_left = [], [], {}
    live_tokens = 0
    now, v, started, in_flight, seq = 0.0, 0, 0, 0, 0
    busy = update_time = waited = teacher_s = 0.0
    last_update_end = 0.0
    peak_load = 0.0         # the most (in flight + accepted) groups seen, as a share of the cap
    decode_slot_steps = active_slot_steps = 0
    dropped, asked_total = 0, 0
    staleness = collections.Counter()
    while v < updates:
        while started < min((v + eta + 1) * STARTS, len(work)):       # admit task starts
            heapq.heappush(ready, (now, started))
            started += 1
        while pending and pending[0][0] <= now:                         # groups done by now
            _, _, t, d, stamp = heapq.heappop(pending)
            in_flight -= 1
            if trainable(stamp, v, eta):
                queue.append((t, d, stamp))
            else:
                dropped += 1
        while queue and not trainable(queue[0][2], v, eta):            # stale since the last update
            queue.popleft()
            dropped += 1
        if len(queue) >= groups_of[v]:                                  # the update (devices shared)
            batch = [queue.popleft() for _ in range(groups_of[v])]
            for t, d, stamp in batch:
                staleness[v - stamp] += 1
            dt = update_seconds([(prompts[t][d][0], work[t].replies[d]) for t, d, _ in batch], args.train_mfu)
            waited += now - last_update_end       # the update waited for data this long
            now += dt
            last_update_end = now
            busy += dt
            update_time += dt
            v += 1
            continue
        while ready and ready[0][0] <= now:                             # the teacher is asked now
            t = heapq.heappop(ready)[1]
            waiting.append((t, now))
            asked_total += 1
            teacher_s += work[t].teacher[next_decision[t]]
        if not live and not waiting:
            nxt = min([q[0][0] for q in (ready, pending) if q], default=None)
            if nxt is None:
                raise RuntimeError(f"nothing left to run before update {v} (draw more steps)")
            now = max(now, nxt)
            continue
        cap = sum(groups_of[v:v + eta + 1])
        t_prefill = 0.0
        while waiting and len(live) + N <= slots and in_flight + len(queue) < cap:
            t, asked = waiting.pop(0)
            d = next_decision[t]
            plen, reused = prompts[t][d]
            t_prefill += prefill_seconds(plen - reused, reused, args.prefill_mfu)
            for r in work[t].replies[d]:
                live.append([t, plen, r, 0])
                live_tokens += plen
            rows_left[t] = (N, asked, v)
            in_flight += 1
            peak_load = max(peak_load, (in_flight + len(queue)) / cap)
        if not live:
            now += t_prefill
            busy += t_prefill
            if t_prefill == 0.0:            # admission full, nothing decoding: wait for a group
                now = max(now, pending[0][0])
            continue
        tokens = live_tokens + (slots - len(live)) * args.page
        t_step = args.engine_fixed_ms / 1e3 + tokens * KV_TOKEN / (CHIPS * BW * args.kernel_efficiency)
        now += t_prefill + args.segment * t_step
        busy += t_prefill + args.segment * t_step
        decode_slot_steps += slots * args.segment
        still = []
        for row in live:
            steps = min(args.segment, row[2] - row[3])
            row[3] += steps
            live_tokens += steps
            active_slot_steps += steps
            if row[3] < row[2]:
                still.append(row)
                continue
            live_tokens -= row[1] + row[3]
            t = row[0]
            n, asked, stamp = rows_left[t]
            if n > 1:
                rows_left[t] = (n - 1, asked, stamp)
                continue
            del rows_left[t]
            d = next_decision[t]
            done = max(now, asked + work[t].teacher[d]) + 1.0 + 0.2     # matcher, then the tool
            heapq.heappush(pending, (done, seq, t, d, stamp))
            seq += 1
            next_decision[t] = d + 1
            if d + 1 < work[t].decisions:
                heapq.heappush(ready, (done, t))
        live = still
    return {"wall": now, "util": active_slot_steps / max(decode_slot_steps, 1), "busy": busy / now,
            "update_s": update_time, "dropped": dropped, "trained": sum(staleness.values()),
            "staleness": dict(sorted(staleness.items())), "asked": asked_total, "waited": waited,
            "teacher_in_flight": teacher_s / now, "peak_load": peak_load}


def synchronous_wall(steps_work: list[list], updates: int, args) -> float:
    """Today's loop by the one-step replay: each step's collection, then its update."""
    total = 0.0
    for step in steps_work[:updates]:
        total += run_engine(step, args)["wall"]
        groups = [(prompts_of(t)[d][0], t.replies[d]) for t in step for d in range(t.decisions)]
        total += update_seconds(groups, args.train_mfu)
    return total


def main() -> None:
    ap = build_parser(__doc__)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--etas", default="0,1,2,4", help="staleness bounds to replay (0 first: the baseline)")
    ap.add_argument("--train-mfu", type=float, default=0.4, help="the update's share of the slice's peak")
    args = ap.parse_args()
    etas = [int(e) for e in args.etas.split(",")]
    if etas[0] != 0:
        raise SystemExit("--etas must start with 0: the ratios are against eta=0 of the same run")
    steps = draw_steps(args.seed, args.updates + max(etas) + 1, args)
    groups = sum(sum(t.decisions for t in s) for s in steps[:args.updates])
    print(f"# {args.updates} updates, {STARTS} task starts and {groups / args.updates:.0f} groups per update "
          f"(seed {args.seed}); engine {args.slots} slots, {args.engine_fixed_ms} ms + KV; update at "
          f"{args.train_mfu:.0%} MFU, devices shared with the engine")
    print(f"{'eta':>3} | {'wall s':>9} | {'vs eta=0':>8} | {'slot util':>9} | {'device busy':>11} | "
          f"{'update s':>8} | {'update waited s':>15} | {'teacher in flight':>17} | {'dropped':>7} | "
          f"staleness of trained groups")
    base = None
    for eta in etas:
        r = run_async(steps, eta, args.updates, args)
        base = base or r
        hist = ", ".join(f"{k}: {n}" for k, n in r["staleness"].items())
        print(f"{eta:>3} | {r['wall']:9.0f} | {base['wall'] / r['wall']:7.2f}x | {100 * r['util']:8.1f}% | "
              f"{100 * r['busy']:10.1f}% | {r['update_s']:8.0f} | {r['waited']:15.0f} | "
              f"{r['teacher_in_flight']:17.1f} | {r['dropped']:7d} | {hist}")
    # the devices are shared: no eta beats the updates alone (decoding for free)
    print(f"ceiling with free decoding (eta=0 wall / its update s): {base['wall'] / base['update_s']:.2f}x")


if __name__ == "__main__":
    main()
