"""MCP tasks from a JSON-lines file (`env.tasks_file`): one task per line,
{"task_id": str, "split": str (default "train"), "prompt": str, "system": str} or
{"task_id", "messages": [...]}, optional "tools": [names]. Everything but task_id / split is
the payload `McpEnv` reads."""

from __future__ import annotations

import json
from pathlib import Path

from actionopd_jax.types import Task


def load_mcp_tasks(path: str, split: str = "") -> list[Task]:
    """The file's tasks (of `split` when given; "all" or "": every task)."""
    tasks, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            task_id = str(record.pop("task_id"))
        except (ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"{path}:{n}: not a task record ({err})") from None
        if task_id in seen:
            raise ValueError(f"{path}:{n}: task_id {task_id!r} appears twice")
        seen.add(task_id)
        task_split = str(record.pop("split", "train"))
        if not ("messages" in record or "prompt" in record):
            raise ValueError(f"{path}:{n}: task {task_id!r} needs 'prompt' or 'messages'")
        if split in ("", "all") or task_split == split:
            tasks.append(Task(task_id=task_id, env="mcp", split=task_split, payload=record))
    return tasks
