"""Each AWM / EnvScaler task's source, as the static feasibility screen sees it (paper B.1): the
goal, the tools, their implementation, the initial data and the verifier evidence, read from the
pool directory; and its source hash, the digest that links a manifest's screening record to the
exact data it was made from.

The hash covers every section in full (the screen's prompt may show them cut to a budget), so
any edit to a task's text, its scenario's tools, server or class code, initial rows or verifier
gives a new hash and the task is screened again. What is ours and not the published data (the
mini pools' reference solutions) is never part of a source: it is neither shown nor hashed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from actionopd_jax.types import Task

# section name -> the heading the screen shows it under, in the order it is shown
SECTIONS: dict[str, str] = {
    "environment": "Environment description",
    "tools": "Tools the agent can call (schemas)",
    "implementation": "Tool implementation (environment source code)",
    "initial_data": "Initial data (the state every episode starts from)",
    "verifier": "Verifier evidence (how success is decided)",
}


@dataclass(frozen=True)
class TaskSource:
    task_id: str
    pool: str
    goal: str                     # the task as the user states it
    sections: dict[str, str]      # SECTIONS key -> full text

    @functools.cached_property
    def source_hash(self) -> str:
        """sha256 of the canonical JSON of the pool, id, goal and every section (uncut)."""
        doc = {"pool": self.pool, "task_id": self.task_id, "goal": self.goal, "sections": self.sections}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _dump(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False)


def awm_sources(data: Any, tasks: list[Task], verifier_modes: dict[str, str] | None = None) -> dict[str, TaskSource]:
    """`data`: an `envs.awm.layout.AwmDataset`; `verifier_modes`: the audit's task id -> "code" |
    "sql" (the verifier the task was admitted with; else code where present, then sql)."""
    modes = verifier_modes or {}
    shared: dict[str, dict[str, str]] = {}  # scenario -> its sections, one copy for all its tasks
    out = {}
    for t in tasks:
        sc = data.scenario_of(t)
        if sc.name not in shared:
            ddl = "\n".join(tb.get("ddl", "") for tb in (sc.db_schema or {}).get("tables", []))
            rows = "\n".join(s for tb in (sc.sample_data or {}).get("tables", [])
                             for s in tb.get("insert_statements", []))
            shared[sc.name] = {
                "environment": f"scenario {sc.name}: {sc.description}".strip(),
                # the published spec's tools, not what a probed server listed: the hash must not
                # depend on whether the audit started the servers
                "tools": _dump(sc.tool_schemas()),
                "implementation": sc.server_code or "(no server code)",
                "initial_data": f"-- schema\n{ddl}\n-- rows\n{rows}",
            }
        idx = t.payload["task_idx"]
        order = (modes[t.task_id],) if t.task_id in modes else ("code", "sql")
        mode, entry = next(((m, sc.verifier(idx, m)) for m in order if sc.verifier(idx, m)), (order[0], None))
        if entry is None:
            verifier = "(no verifier)"
        elif mode == "code":
            verifier = ("# code verifier: called with the initial and final database paths; 'complete' is success\n"
                        + entry["code"])
        else:
            verifier = ("# SQL verifier: its output (facts read from the initial and final databases) is shown to "
                        "an LLM judge together with the task, which decides success\n" + entry["code"])
        out[t.task_id] = TaskSource(t.task_id, "awm", str(t.payload["task"]), {**shared[sc.name], "verifier": verifier})
    return out


def envscaler_sources(data: Any, tasks: list[Task]) -> dict[str, TaskSource]:
    """`data`: an `envs.envscaler.layout.EnvScalerDataset`."""
    out = {}
    for t in tasks:
        s = data.scenarios[t.task_id]
        env = data.envs.get(s.env_id)
        # the introduction and rules as plain lines: the environment's own markdown headings
        # would read as sections of the prompt
        intro = (env.introduction + "".join(f"\nrule: {r}" for r in env.rules)) if env else "(environment missing)"
        mode = ("conversational: a simulated user holds details the task text may leave out\n"
                if s.conversational else "")
        checks = "\n\n".join(f"# check: {c.get('check_item', '')}\n{c.get('check_func', '')}" for c in s.checks)
        out[t.task_id] = TaskSource(t.task_id, "envscaler", str(s.task), {
            "environment": mode + intro,
            "tools": _dump(env.tools if env else []),
            "implementation": (f"# class {s.class_name or env.class_name}\n{env.class_code}" if env
                               else "(no class code)"),
            "initial_data": _dump(s.init_config),
            "verifier": ("# every check function below must return True on the final state\n" + checks) if checks
            else "(no checks)",
        })
    return out
