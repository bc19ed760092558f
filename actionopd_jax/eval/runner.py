"""Run (task, trial) episodes concurrently and append each finished one to a JSONL file.

Resumable: episodes already in the file are skipped, so an interrupted evaluation picks up
where it stopped. An episode whose agent or user simulator became unavailable (its endpoint
failed past the transport retries) is not written: it is no score and no finished episode, it
is left out of every metric and reruns next time. One whose prompt outgrew the context ends
there and is scored as it stands.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from actionopd_jax import paid_calls
from actionopd_jax.envs.base import Environment
from actionopd_jax.envs.user_sim import UserSimUnavailable
from actionopd_jax.eval.agents import Agent, AgentUnavailable, ContextTooLong
from actionopd_jax.types import Reply, Task, ToolCall, ToolCalls

EnvFactory = Callable[[Task], Environment]


class EpisodeFailure(str):
    """The error line of an episode that did not finish. `where` names the endpoint that failed
    (the agent's or the user simulator's URL and model); "" for an environment error."""

    where: str = ""


def _failure(text: str, where: str = "") -> EpisodeFailure:
    out = EpisodeFailure(text)
    out.where = where
    return out


def unavailable_summary(errors: list[str]) -> str:
    """"N episode(s) unavailable: <endpoint> xK; ..." over the endpoint failures of `errors`
    (what `actionopd eval` and KD print when they stop); "" when there are none."""
    from collections import Counter

    by_where = Counter(e.where for e in errors if isinstance(e, EpisodeFailure) and e.where)
    if not by_where:
        return ""
    return (f"{sum(by_where.values())} episode(s) unavailable: "
            + "; ".join(f"{where} x{n}" for where, n in by_where.most_common()))


def episode_group(task: Task) -> str:
    """The reporting group: BFCL category, or the tau2 split."""
    if task.env == "bfcl":
        from actionopd_jax.envs.bfcl_data import category_of

        return category_of(task.task_id)
    return task.split


def _drop_torn_tail(path: Path) -> None:
    """A kill mid-write can leave a partial last line; cut it so appends start on a clean line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def load_finished(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a kill: everything before it is intact
    return records


async def _act(agent: Agent, obs, task: Task, trial: int, detailed: bool) -> tuple[Reply, str]:
    """(action, reasoning). Reasoning only when asked for and the agent can report it
    (`act_detailed`); evaluation itself never needs it."""
    if detailed and hasattr(agent, "act_detailed"):
        return await agent.act_detailed(obs, task=task, trial=trial)
    return await agent.act(obs, task=task, trial=trial), ""


async def _step(env: Environment, action: Reply):
    """Apply one reply. Native parallel calls (`ToolCalls`) go to an environment that runs
    them as one message (`parallel_calls`: BFCL, tau2, as their own runners do); any other
    environment gets them one by one, in order, each as its own step, until the episode ends."""
    if not isinstance(action, ToolCalls) or getattr(env, "parallel_calls", False):
        return await env.step(action)
    for call in action.calls:
        obs, done = await env.step(call)
        if done:
            break
    return obs, done


def _calls_in(action: Reply) -> int:
    return len(action.calls) if isinstance(action, ToolCalls) else int(isinstance(action, ToolCall))


async def run_episode(agent: Agent, env: Environment, task: Task, trial: int, *, max_actions: int,
                      record_conversation: bool = False) -> dict[str, Any]:
    """One episode. `actions` counts the agent's replies (one decision each, bounded by
    `max_actions`) and `tool_calls` the tool calls they made: a reply with N parallel calls is
    one action and N calls. With `record_conversation` the record also holds the final public
    conversation (`messages`, the agent's reasoning as `reasoning_content` on its turns when
    the agent reports it), the final `tools`, and per agent turn (`turns`): the index of its
    assistant message, the tool list it saw (an index into `tool_sets`) and the action kind
    (KD builds its examples from these; paper B.4)."""
    t0 = time.perf_counter()
    actions, calls, parallel_replies, end_reason = 0, 0, 0, ""
    try:
        obs = await env.reset(task)
    except Exception as err:
        end_reason = _env_fault(err)  # a server that cannot start (MCP / AWM): scored as it stands
        obs = None
    done = obs is None or obs.done
    turns: list[dict[str, Any]] = []
    tool_sets: list[list[dict]] = []
    while not done:
        if actions >= max_actions:
            env.end("action_limit")
            end_reason = "action_limit"
            break
        try:
            action, reasoning = await _act(agent, obs, task, trial, record_conversation)
        except ContextTooLong:
            env.end("context_budget")
            end_reason = "context_budget"
            break
        before, tools = len(obs.messages), obs.tools
        calls += _calls_in(action)
        parallel_replies += int(isinstance(action, ToolCalls))
        try:
            obs, done = await _step(env, action)
        except Exception as err:
            end_reason = _env_fault(err)  # the environment ended the episode on a fault, with its reason
            actions += 1
            obs = env.end(end_reason)
            break
        actions += 1
        if record_conversation:
            if not tool_sets or tool_sets[-1] != tools:
                tool_sets.append(list(tools))
            turns.append({"index": before, "tools": len(tool_sets) - 1, "kind": type(action).__name__,
                          "reasoning": reasoning})
    score = await asyncio.to_thread(env.score)
    record = {"task_id": task.task_id, "env": task.env, "split": task.split, "group": episode_group(task),
              "trial": trial, "agent": agent.name, "actions": actions, "tool_calls": calls,
              "parallel_replies": parallel_replies,
              "end_reason": end_reason or score.get("end_reason", ""), "seconds": round(time.perf_counter() - t0, 3),
              "score": score}
    if record_conversation:
        if obs is None:
            obs = env.end(end_reason)
        messages = [dict(m) for m in obs.messages]
        for turn in turns:
            reasoning = turn.pop("reasoning")
            if turn["index"] >= len(messages) or messages[turn["index"]].get("role") != "assistant":
                raise RuntimeError(f"{task.task_id}: the environment did not append the agent's turn at "
                                   f"message {turn['index']}; cannot record the conversation")
            if reasoning:
                messages[turn["index"]]["reasoning_content"] = reasoning
        record.update(messages=messages, tools=list(obs.tools), tool_sets=tool_sets, turns=turns)
    return record


def _env_fault(err: Exception) -> str:
    """The end reason of an environment fault that ends one episode (`McpFault.end_reason`);
    any other error is re-raised (the episode does not finish and reruns on resume)."""
    reason = getattr(err, "end_reason", None)
    if isinstance(reason, str) and reason:
        return reason
    raise err


CONVERSATION_KEYS = ("messages", "tools", "tool_sets", "turns")


def trajectory_record(rec: dict[str, Any], env: Environment) -> dict[str, Any]:
    """An episode as a reader wants it: the whole conversation (messages with the tool calls
    and tool results), the verdict and its reason, and for BFCL the call strings the official
    checker scored (`scored_calls["ours"]`) and those bfcl_eval's executor would have recorded."""
    score = rec["score"]
    reason = rec["end_reason"]
    if score.get("error_type") or score.get("error_message"):
        reason += f"; {score.get('error_type', '')}: {score.get('error_message', '')}"
    out = {k: rec[k] for k in ("task_id", "env", "split", "group", "trial", "agent", "actions")}
    if "evaluated" in rec:
        out["evaluated"] = rec["evaluated"]
    out.update(verdict={k: score[k] for k in ("reward", "official", "strict", "bfcl_eval_official") if k in score},
               reason=reason, score=score, **{k: rec[k] for k in CONVERSATION_KEYS})
    scored = getattr(env, "scored_calls", None)
    if scored is not None:
        out["scored_calls"] = scored()
    return out


def _keep_only(path: Path, keys: set[tuple]) -> None:
    """Drop trajectory lines of episodes that never reached the scores file (a kill between
    the two writes): those episodes run again and write their trajectory again."""
    if not path.exists():
        return
    _drop_torn_tail(path)
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and tuple(json.loads(line)[k] for k in ("task_id", "env", "trial")) in keys]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _check_same_weights(out: Path, records: list[dict[str, Any]], evaluated: dict[str, Any]) -> None:
    key = lambda e: (e or {}).get("step_dir") or (e or {}).get("hf")
    other = {key(r.get("evaluated")) for r in records} - {key(evaluated), None}  # None: written before this record
    if other:
        raise ValueError(f"{out} holds episodes of other weights ({sorted(map(str, other))}); this run scores "
                         f"{key(evaluated)}: pass another --out, or remove that file to start over")


async def run_eval(agent: Agent, tasks: list[Task], make_env: EnvFactory, out_jsonl: str | Path, *,
                   trials: int | Callable[[Task], int] = 1, concurrency: int = 8, max_actions: int = 200,
                   progress: bool = True, record_conversation: bool = False,
                   trajectories_jsonl: str | Path | None = None,
                   evaluated: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Returns (all finished records, errors of episodes that could not finish).
    `record_conversation`: see `run_episode`. `trajectories_jsonl`: also write each episode's
    `trajectory_record` there (the scores file then stays compact unless record_conversation).
    `evaluated`: what was loaded (the checkpoint step and folder), written into every episode
    and trajectory; resuming a file of another checkpoint step is refused."""
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(out)
    records = load_finished(out)
    if evaluated is not None:
        _check_same_weights(out, records, evaluated)
    done_keys = {(r["task_id"], r["env"], r["trial"]) for r in records}
    traj = Path(trajectories_jsonl) if trajectories_jsonl is not None else None
    if traj is not None:
        _keep_only(traj, done_keys)
    trials_of = trials if callable(trials) else (lambda _task: trials)  # per task: BFCL 1, tau2 4 (paper B.3)
    todo = [(t, i) for t in tasks for i in range(trials_of(t)) if (t.task_id, t.env, i) not in done_keys]
    errors: list[str] = []
    sem = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(total=len(todo), desc=f"eval {agent.name}", disable=not progress, unit="ep")

    with out.open("a") as sink, (traj.open("a") if traj is not None else open(os.devnull, "w")) as traj_sink:
        async def one(task: Task, trial: int) -> None:
            async with sem:
                try:
                    env = make_env(task)
                    rec = await run_episode(agent, env, task, trial, max_actions=max_actions,
                                            record_conversation=record_conversation or traj is not None)
                    if evaluated is not None:
                        rec["evaluated"] = evaluated
                    if traj is not None:
                        traj_sink.write(json.dumps(trajectory_record(rec, env)) + "\n")
                        traj_sink.flush()
                        if not record_conversation:
                            rec = {k: v for k, v in rec.items() if k not in CONVERSATION_KEYS}
                except AgentUnavailable as e:
                    errors.append(_failure(f"{task.task_id} trial {trial}: {e}", e.where or f"agent {agent.name}"))
                    return
                except UserSimUnavailable as e:   # the user's endpoint failed: no score, rerun on resume
                    errors.append(_failure(f"{task.task_id} trial {trial}: {e}", e.where or "user simulator"))
                    return
                except Exception as e:  # an environment bug ends that episode only
                    errors.append(_failure(f"{task.task_id} trial {trial}: {type(e).__name__}: {e}"))
                    return
                finally:
                    bar.update(1)
                    _spend_postfix(bar)
                records.append(rec)
                sink.write(json.dumps(rec) + "\n")
                sink.flush()

        await asyncio.gather(*(one(t, i) for t, i in todo))
    bar.close()
    return records, errors


def _spend_postfix(bar: Any) -> None:
    """The progress line's spend field, as training's (train/spend_report.progress_fields): the
    dollars so far where a role is priced, else the first role's tokens, from the installed
    paid-call ledger (eval's, KD's or the warm start's; nothing when none is)."""
    ledger = paid_calls.current()
    if ledger is None or not any(t.requests for t in ledger.totals.values()):
        return
    from actionopd_jax.train.spend_report import progress_fields

    bar.set_postfix(progress_fields({f"collect/{k}": v for k, v in ledger.metrics().items()}), refresh=False)
