"""Replay of ActionOPD steps on the paged engine with a staleness bound eta (issue 44).

    python benchmarks/engine_sim_async.py [--updates 100] [--etas 0,1,2,4] [--seeds 0,1] [--splits 1,2,3]
        [--train-mfu 0.425] [--remat full] [--unpadded-update] [--sort-key tiles] [--concurrency 64]
        [--train-order draw] [--at-goal 41+42] [engine_sim options]

The workload and the engine's costs are engine_sim.py's (its docstring; compiler estimates, not
a measurement); the update's are engine_sim_update.py's (the recipe's padded minibatches, remat
and old-logprob forward at --train-mfu). Each step is 64 task starts drawn afresh (a draw).
The schedule is the product's (collect/async_source.py, async_scheduler.py):
- draws up to v + eta are admitted while v updates are done; collect.concurrency (--concurrency,
  the recipe's 64) runners take the admitted task starts oldest draw first, one trajectory each;
- update v trains draw v's groups once its last trajectory has ended (whole draws, so eta = 0
  is today's loop: the one-step replay plus the update, step after step); --train-order
  finished is not the product's rule but shows what that wait costs: update v trains the
  oldest ended groups, as many as draw v has, once there are that many;
- a group carries the version current when its rows entered the slots (engine/versions.py: a
  request's version is the one it was admitted under; its rows run on across a swap); an update
  drops a group older than eta (admission by draws means none is: the filter is the guarantee);
- a swap drops the engine's prefix index (engine/versions.py), so a trajectory's first state
  after it prefills its whole prompt again.
Where the devices go:
- shared (the default, one host): decoding pauses while the update runs (between segments;
  nothing is drained); teacher calls, the matcher and tools go on;
- split k (mesh.rollout_devices): k chips decode and prefill (engine_sim.py's
  steps take CHIPS / k as long; the pool is what k chips hold beside the weights), CHIPS - k
  chips train at the same per-chip rate, and decoding pauses only while the new weights move
  (once per update). A split the recipe cannot run is replayed and marked (train_fits).
"""

from __future__ import annotations

import collections
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_sim import (  # noqa: E402
    BW, CHIPS, KV_TOKEN, N, STARTS, WEIGHTS, build_parser, decode_step_seconds, draw_workload, kv_read, prefill_seconds,
    prompts_of,
    reservation, run_engine)
from engine_sim_update import (  # noqa: E402
    SORT_KEYS, decode_pool_tokens, train_fits, update_seconds, weight_move_seconds)


def trainable(stamp: int, updating: int, eta: int) -> bool:
    """The staleness rule: the update of policy `updating` trains a group sampled by policy
    `stamp` only if it is at most eta updates older."""
    return updating - stamp <= eta


def draw_steps(seed: int, steps: int, args) -> list[list]:
    return [draw_workload(np.random.default_rng([seed, k]), args) for k in range(steps)]


def step_update_seconds(groups, args, chips: int = CHIPS) -> float:
    return update_seconds(groups, args.train_mfu, chips, args.remat, padded=not args.unpadded_update,
                          sort_key=args.sort_key)


def run_async(steps_work: list[list], eta: int, updates: int, args, split: int = 0) -> dict:
    """Replay `updates` updates at staleness bound eta over the drawn steps (at least
    updates + eta of them: admission may start that many); split: decode chips (0: shared)."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if not 0 <= split < CHIPS:
        raise ValueError(f"split must be 0 (shared) or 1..{CHIPS - 1} decode chips, got {split}")
    if len(steps_work) < updates + eta:
        raise ValueError(f"{len(steps_work)} drawn steps; {updates} updates at eta={eta} need {updates + eta}")
    work = [t for step in steps_work for t in step]
    prompts = [prompts_of(t) for t in work]
    draw_of = [k for k, step in enumerate(steps_work) for _ in step]
    left = [len(step) for step in steps_work]          # trajectories of each draw not yet ended
    groups_of = [[] for _ in steps_work]                # (trajectory, decision, stamp) that ended
    finished: collections.deque = collections.deque()   # --train-order finished: every ended group, in order
    sizes = [sum(t.decisions for t in step) for step in steps_work]
    by_draw = args.train_order == "draw"
    dchips, tchips = (split, CHIPS - split) if split else (CHIPS, CHIPS)
    pool = decode_pool_tokens(split) if split else args.pool_tokens
    slots = args.slots
    ready: list = []                      # (time the state is ready, trajectory)
    pending: list = []                    # (time the group is done, seq, trajectory, decision, stamp)
    startable: collections.deque = collections.deque()
    next_decision = [0] * len(work)
    admitted_at = [-1] * len(work)       # the version the trajectory's last state was admitted under
    waiting, live, rows_left = [], [], {}
    row_tokens = row_prompts = group_prompts = reserved = 0
    now, v, admitted, running, seq = 0.0, 0, 0, 0, 0
    train_end = None                      # split: when the update on the train chips ends
    chip_s = update_time = waited = teacher_s = 0.0
    last_update_end = 0.0
    decode_slot_steps = active_slot_steps = 0
    dropped, asked_total, ahead, reprefilled = 0, 0, 0, 0
    staleness = collections.Counter()
    while v < updates:
        if train_end is not None and now >= train_end:              # split: the new weights move
            v, train_end, last_update_end = v + 1, None, train_end
            now += weight_move_seconds(dchips)
            continue
        while admitted <= min(v + eta, len(steps_work) - 1):        # admission control: draws
            startable.extend(i for i, d in enumerate(draw_of) if d == admitted)
            admitted += 1
        ahead = max(ahead, admitted - v)
        while running < args.concurrency and startable:             # a free runner takes a start
            heapq.heappush(ready, (now, startable.popleft()))
            running += 1
        while pending and pending[0][0] <= now:                     # groups done by now
            _, _, t, d, stamp = heapq.heappop(pending)
            groups_of[draw_of[t]].append((t, d, stamp))
            finished.append((t, d, stamp))
            if d + 1 == work[t].decisions:
                left[draw_of[t]] -= 1
                running -= 1
        if by_draw:
            ready_to_train, ended = left[v] == 0, groups_of[v]
        else:                               # the oldest ended groups, as many as draw v has, none too old
            ready_to_train = len(finished) >= sizes[v]
            if ready_to_train:
                keep = [g for g in finished if trainable(g[2], v, eta)]
                dropped += len(finished) - len(keep)
                finished = collections.deque(keep)
                ready_to_train = len(finished) >= sizes[v]
            ended = list(finished)[:sizes[v]] if ready_to_train else []
        if train_end is None and ready_to_train:                        # the update
            batch = [(t, d, stamp) for t, d, stamp in ended if trainable(stamp, v, eta)]
            dropped += len(ended) - len(batch)
            if not by_draw:
                for _ in batch:
                    finished.popleft()
            for t, d, stamp in batch:
                staleness[v - stamp] += 1
            dt = step_update_seconds([(prompts[t][d][0], work[t].replies[d]) for t, d, _ in batch], args, tchips)
            waited += now - last_update_end       # the update waited for data this long
            update_time += dt
            chip_s += dt * tchips
            if split:
                train_end = now + dt
            else:
                now += dt
                last_update_end = now
                v += 1
            continue
        while ready and ready[0][0] <= now:                             # the teacher is asked now
            t = heapq.heappop(ready)[1]
            waiting.append((t, now))
            asked_total += 1
            teacher_s += work[t].teacher[next_decision[t]]
        if not live and not waiting:
            nxt = min([q[0][0] for q in (ready, pending) if q] + ([train_end] if train_end is not None else []),
                      default=None)
            if nxt is None:
                raise RuntimeError(f"nothing left to run before update {v} (draw more steps)")
            now = max(now, nxt)
            continue
        t_prefill = 0.0
        while waiting and len(live) + N <= slots:                       # admit whole states
            t, asked = waiting[0]
            d = next_decision[t]
            plen, reused = prompts[t][d]
            if admitted_at[t] != v:        # a swap since its last state dropped the prefix index
                reused = 0
            admitted_at[t] = v
            reprefilled += prompts[t][d][1] - reused
            if reserved + reservation(plen) > pool:                    # first come, first served
                break
            waiting.pop(0)
            reserved += reservation(plen)
            t_prefill += prefill_seconds(plen - reused, reused, args.prefill_mfu, dchips)
            for r in work[t].replies[d]:
                live.append([t, plen, r, 0])
            row_tokens += N * plen
            row_prompts += N * plen
            group_prompts += plen
            rows_left[t] = (N, asked, v)
        if not live:
            if t_prefill == 0.0:                # the pool is full and nothing decodes: cannot be
                raise RuntimeError(f"a state needs {reservation(prompts[waiting[0][0]][next_decision[waiting[0][0]]][0])} "
                                   f"pool tokens, the pool holds {pool:.0f}")
            now += t_prefill
            chip_s += t_prefill * dchips
            continue
        t_step = decode_step_seconds(kv_read(row_tokens, group_prompts, row_prompts, args), slots - len(live), args,
                                     dchips)
        now += t_prefill + args.segment * t_step
        chip_s += (t_prefill + args.segment * t_step) * dchips
        decode_slot_steps += slots * args.segment
        still = []
        for row in live:
            steps = min(args.segment, row[2] - row[3])
            row[3] += steps
            row_tokens += steps
            active_slot_steps += steps
            if row[3] < row[2]:
                still.append(row)
                continue
            row_tokens -= row[1] + row[3]
            row_prompts -= row[1]
            t = row[0]
            n, asked, stamp = rows_left[t]
            if n > 1:
                rows_left[t] = (n - 1, asked, stamp)
                continue
            del rows_left[t]
            group_prompts -= row[1]
            reserved -= reservation(row[1])
            d = next_decision[t]
            done = max(now, asked + work[t].teacher[d]) + 1.0 + 0.2     # matcher, then the tool
            heapq.heappush(pending, (done, seq, t, d, stamp))
            seq += 1
            next_decision[t] = d + 1
            if d + 1 < work[t].decisions:
                heapq.heappush(ready, (done, t))
        live = still
    return {"wall": now, "util": active_slot_steps / max(decode_slot_steps, 1), "busy": chip_s / (CHIPS * now),
            "update_s": update_time, "dropped": dropped, "trained": sum(staleness.values()),
            "staleness": dict(sorted(staleness.items())), "asked": asked_total, "waited": waited,
            "teacher_in_flight": teacher_s / now, "draws_ahead": ahead, "reprefilled": reprefilled}


def synchronous_wall(steps_work: list[list], updates: int, args) -> float:
    """Today's loop by the one-step replay: each step's collection, then its update."""
    total = 0.0
    for step in steps_work[:updates]:
        total += run_engine(step, args)["wall"]
        total += step_update_seconds([(prompts_of(t)[d][0], t.replies[d]) for t in step for d in range(t.decisions)],
                                     args)
    return total


def add_options(ap) -> None:
    ap.add_argument("--train-mfu", type=float, default=0.425,
                    help="model FLOPs' share of PEAK in a full-remat train step (H200, 4,096 tokens: 42.5%%)")
    ap.add_argument("--remat", default="full", choices=("full", "attn", "dots", "none"),
                    help="the recipe's model.remat (full; auto would take attn on the shared 4 chips)")
    ap.add_argument("--unpadded-update", action="store_true",
                    help="an option the trainer lacks: every group at its own length, no minibatch padding")
    ap.add_argument("--sort-key", default="tiles", choices=SORT_KEYS,
                    help="which states share a minibatch: tiles (the product's plan) or length (the sort by real "
                         "tokens it replaced)")
    ap.add_argument("--concurrency", type=int, default=64, help="collect.concurrency: trajectories running")
    ap.add_argument("--train-order", default="draw", choices=("draw", "finished"),
                    help="draw: update v trains draw v once it has ended (the product's rule); finished: the "
                         "oldest ended groups, as many as draw v has (not the product's: what its wait costs)")
    ap.add_argument("--at-goal", default="", help="41, 42 or 41+42: those issues' goals in place of today's costs")


def apply_goals(args) -> str:
    """--at-goal: the costs issue 41 and/or 42 ask for, in place of today's; returns the label.
    41: decode at 60% of the HBM bound, the bound counting the weights and each running row's
    KV with a shared prompt read once (no fixed part beyond the weights, no empty slot read);
    42: the train step at 500 TFLOP/s of the measured 799 (model FLOPs, as --train-mfu counts)."""
    goals = [g for g in args.at_goal.split("+") if g]
    if "41" in goals:
        args.shared_prompt_read, args.kernel_efficiency, args.page = True, 0.6, 0
        args.engine_fixed_ms = WEIGHTS / (CHIPS * BW * 0.6) * 1e3
    if "42" in goals:
        args.train_mfu = 500 / 799
    if set(goals) - {"41", "42"}:
        raise SystemExit(f"--at-goal takes 41, 42 or 41+42, got {args.at_goal!r}")
    return " and ".join(f"at issue {g}'s goal" for g in goals) or "today's costs"


def main() -> None:
    ap = build_parser(__doc__)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--etas", default="0,1,2,4", help="staleness bounds to replay (0 first: the baseline)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--splits", default="1,2,3", help="decode chips of the mesh split ('' for none)")
    add_options(ap)
    args = ap.parse_args()
    label = apply_goals(args)
    etas = [int(e) for e in args.etas.split(",")]
    splits = [int(k) for k in args.splits.split(",") if k]
    if etas[0] != 0:
        raise SystemExit("--etas must start with 0: the ratios are against eta=0 on shared chips of the same run")
    print(f"# {label}: {args.updates} updates of {STARTS} task starts, {args.concurrency} running; engine {args.slots} slots "
          f"({args.engine_fixed_ms:.2f} ms + KV at {args.kernel_efficiency:.0%}, prompt KV read "
          f"{'once a group' if args.shared_prompt_read else 'by every row'}); update {args.remat} remat, "
          f"{'unpadded' if args.unpadded_update else f'padded minibatches ({args.sort_key})'}, "
          f"{args.train_mfu:.1%} MFU; it trains "
          f"{'whole draws' if args.train_order == 'draw' else 'the oldest ended groups (not the product rule)'}")
    print(f"{'seed':>4} | {'eta':>3} | {'chips':<17} | {'wall s':>8} | {'vs eta=0':>8} | {'slots busy':>10} | "
          f"{'device busy':>11} | {'update s':>8} | {'upd. waited s':>13} | {'dropped':>7} | staleness | runs?")
    for seed in (int(x) for x in args.seeds.split(",")):
        steps = draw_steps(seed, args.updates + max(etas), args)
        base, best = None, {}
        for eta in etas:
            for split in [0] + splits:
                r = run_async(steps, eta, args.updates, args, split)
                base = base or r
                why = train_fits(CHIPS - split, args.remat) if split else ""
                if split and not why and (eta not in best or r["wall"] < best[eta][1]):
                    best[eta] = (split, r["wall"])
                hist = ", ".join(f"{k}: {n}" for k, n in r["staleness"].items())
                where = f"{split} decode, {CHIPS - split} train" if split else f"{CHIPS} shared"
                print(f"{seed:>4} | {eta:>3} | {where:<17} | {r['wall']:8.0f} | {base['wall'] / r['wall']:7.2f}x | "
                      f"{100 * r['util']:9.1f}% | {100 * r['busy']:10.1f}% | {r['update_s']:8.0f} | "
                      f"{r['waited']:13.0f} | {r['dropped']:7d} | {hist} | {why or 'yes'}")
        print(f"# seed {seed}: best split the recipe runs, by eta: "
              + ", ".join(f"{e}: {k} decode chips ({base['wall'] / w:.2f}x)" for e, (k, w) in best.items())
              + f"; shared-chip ceiling with free decoding (eta=0 wall / its update s): "
              f"{base['wall'] / base['update_s']:.2f}x")


if __name__ == "__main__":
    main()
