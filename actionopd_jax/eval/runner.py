"""Run (task, trial) episodes concurrently and append each finished one to a JSONL file.

Resumable: episodes already in the file are skipped, so an interrupted evaluation picks up
where it stopped. An episode whose agent became unavailable is not written (it reruns next
time); one whose prompt outgrew the context ends there and is scored as it stands.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from actionopd_jax.envs.base import Environment
from actionopd_jax.eval.agents import Agent, AgentUnavailable, ContextTooLong
from actionopd_jax.types import Task

EnvFactory = Callable[[Task], Environment]


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


async def run_episode(agent: Agent, env: Environment, task: Task, trial: int, *, max_actions: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    obs = await env.reset(task)
    actions, end_reason = 0, ""
    done = obs.done
    while not done:
        if actions >= max_actions:
            env.end("action_limit")
            end_reason = "action_limit"
            break
        try:
            action = await agent.act(obs, task=task, trial=trial)
        except ContextTooLong:
            env.end("context_budget")
            end_reason = "context_budget"
            break
        obs, done = await env.step(action)
        actions += 1
    score = await asyncio.to_thread(env.score)
    return {"task_id": task.task_id, "env": task.env, "split": task.split, "group": episode_group(task),
            "trial": trial, "agent": agent.name, "actions": actions,
            "end_reason": end_reason or score.get("end_reason", ""), "seconds": round(time.perf_counter() - t0, 3),
            "score": score}


async def run_eval(agent: Agent, tasks: list[Task], make_env: EnvFactory, out_jsonl: str | Path, *,
                   trials: int = 1, concurrency: int = 8, max_actions: int = 200,
                   progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Returns (all finished records, errors of episodes that could not finish)."""
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(out)
    records = load_finished(out)
    done_keys = {(r["task_id"], r["env"], r["trial"]) for r in records}
    todo = [(t, i) for t in tasks for i in range(trials) if (t.task_id, t.env, i) not in done_keys]
    errors: list[str] = []
    sem = asyncio.Semaphore(max(1, concurrency))
    bar = tqdm(total=len(todo), desc=f"eval {agent.name}", disable=not progress, unit="ep")

    with out.open("a") as sink:
        async def one(task: Task, trial: int) -> None:
            async with sem:
                try:
                    rec = await run_episode(agent, make_env(task), task, trial, max_actions=max_actions)
                except AgentUnavailable as e:
                    errors.append(f"{task.task_id} trial {trial}: {e}")
                    return
                except Exception as e:  # an environment bug ends that episode only
                    errors.append(f"{task.task_id} trial {trial}: {type(e).__name__}: {e}")
                    return
                finally:
                    bar.update(1)
                records.append(rec)
                sink.write(json.dumps(rec) + "\n")
                sink.flush()

        await asyncio.gather(*(one(t, i) for t, i in todo))
    bar.close()
    return records, errors
