"""What `actionopd eval` will call and the API keys it needs (issue 43 item 1): the evaluated
endpoint (--endpoint / --api-key-env), the tau2 / conversational EnvScaler user simulator
(--user-sim-* or eval.user), and the AWM verifiers' judge (--judge-*). `--check` lists each with
its key's state. As `train --check`, a key unset here is named and does not fail the check (a
planning host need not hold secrets); an endpoint the run needs and lacks (no URL or model) does.
The run itself refuses to start while either is missing, instead of playing episodes that cannot
finish (before: a tau2 run with EVAL_USER_API_KEY unset scored 0 and exited 0). Only variable
NAMES are read or printed, never their values."""

from __future__ import annotations

import argparse
import os
from typing import Any

from actionopd_jax.types import Task


def needs_user(task: Task) -> bool:
    """Whether the task's episodes talk to the user simulator."""
    return task.env.startswith("tau2_") or (task.env == "envscaler" and bool(task.payload.get("conversational")))


def _key(var: str | None) -> tuple[str, bool]:
    if not var:
        return "no key (none named)", True
    return (f"key ${var} set", True) if os.environ.get(var) else (f"key ${var} NOT SET", False)


def endpoint_lines(args: argparse.Namespace, settings: Any, tasks: list[Task]
                   ) -> tuple[list[str], list[str], list[str]]:
    """(lines for --check, problems, unset keys): each endpoint the run calls; the endpoints it
    needs and lacks; the keys it will read that are not set in this environment."""
    lines, problems, unset = ["endpoints and keys"], [], []
    if getattr(args, "endpoint", None):
        text, ok = _key(args.api_key_env)
        lines.append(f"  agent  {args.endpoint} (model {args.model or '?'}): {text}")
        if not args.model:
            problems.append("the evaluated endpoint needs --model")
        if not ok:
            unset.append(f"{args.api_key_env} (the evaluated endpoint's API key, --api-key-env)")
    user_tasks = sum(1 for t in tasks if needs_user(t))
    if user_tasks:
        u = settings.user
        if not (u.base_url and u.model):
            lines.append(f"  user   MISSING: {user_tasks} task(s) talk to a user simulator")
            problems.append(f"{user_tasks} task(s) need a user simulator: --user-sim-url and --user-sim-model (or "
                            "eval.user in the --config recipe)")
        else:
            text, ok = _key(u.api_key_env)
            lines.append(f"  user   {u.base_url} (model {u.model}), for {user_tasks} task(s): {text}")
            if not ok:
                unset.append(f"{u.api_key_env} (the user simulator's API key, --user-sim-api-key-env or "
                             "eval.user.api_key_env)")
    awm_tasks = sum(1 for t in tasks if t.env == "awm")
    if awm_tasks and (getattr(args, "judge_url", None) or getattr(args, "judge_model", None)):
        text, ok = _key(args.judge_api_key_env)
        lines.append(f"  judge  {args.judge_url or '?'} (model {args.judge_model or '?'}), for {awm_tasks} AWM "
                     f"task(s): {text}")
        if not (args.judge_url and args.judge_model):
            problems.append("the AWM judge needs both --judge-url and --judge-model")
        if not ok:
            unset.append(f"{args.judge_api_key_env} (the AWM judge's API key, --judge-api-key-env)")
    if len(lines) == 1:
        lines.append("  none: no endpoint is called")
    return lines, problems, unset
