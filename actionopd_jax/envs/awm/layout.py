"""Reading an AWM directory (gen_scenario / gen_tasks / gen_db / gen_sample / gen_spec / gen_envs /
gen_verifier[.pure_code] .jsonl) into scenario records and our Task objects.

Task ids are "<scenario>/<task_idx>" (AWM's own key: normalised scenario name and the task's
position in gen_tasks). A Task's payload holds only what a prompt or a runtime needs to find the
rest (scenario, index, the task text, the tool schemas); verifiers, databases and server code
stay in the `AwmScenario` records the pool keeps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actionopd_jax.types import Task

ENV_NAME = "awm"
FILES = {
    "scenarios": "gen_scenario.jsonl", "tasks": "gen_tasks.jsonl", "db": "gen_db.jsonl",
    "sample": "gen_sample.jsonl", "spec": "gen_spec.jsonl", "envs": "gen_envs.jsonl",
    "verifier_sql": "gen_verifier.jsonl", "verifier_code": "gen_verifier.pure_code.jsonl",
}
# Ours, not AWM's: a reference solution per task ({"scenario", "task_idx", "actions": [{"tool",
# "arguments"} | {"message"}]}), written only for our mini pool so that the privileged reference
# teacher can solve its tasks (envs/reference.py). Published pools have no such file.
SOLUTIONS_FILE = "reference_solutions.jsonl"
REQUIRED = ("tasks", "db", "sample", "envs")  # without these no task can be started

# the system prompt of an AWM episode (our wording): the scenario's tools are the native tools
SYSTEM_PROMPT = ("You are an assistant working in a simulated {scenario} application through its tools. "
                 "The user is already signed in (user id 1). Call one tool at a time; when the task is done, "
                 "reply to the user with the result instead of calling a tool.")


def normalize_name(name: str) -> str:
    """AWM's scenario key: lower case, runs of other characters as one underscore."""
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9_]", "_", name.lower())).strip("_")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return rows


@dataclass
class AwmScenario:
    name: str  # normalised
    description: str = ""
    tasks: list[str] = field(default_factory=list)
    db_schema: dict[str, Any] | None = None  # {"tables": [{"name", "ddl", "indexes": [...]}]}
    sample_data: dict[str, Any] | None = None  # {"tables": [{"table_name", "insert_statements": [...]}]}
    api_spec: dict[str, Any] | None = None  # {"api_groups": [{"group_name", "endpoints": [...]}]}
    server_code: str | None = None  # gen_envs full_code
    verifiers: dict[str, dict[int, dict[str, Any]]] = field(default_factory=lambda: {"code": {}, "sql": {}})
    solutions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # ours (SOLUTIONS_FILE)

    def verifier(self, task_idx: int, mode: str) -> dict[str, Any] | None:
        """{"code", "function_name", "raw"} of a task's verifier in mode "code" or "sql"."""
        return self.verifiers.get(mode, {}).get(task_idx)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function tools from the API spec (operation_id, summary, request_params): what the
        server's tools/list reports for a FastAPI+MCP server, available without starting it."""
        return spec_tool_schemas(self.api_spec or {})


_TYPES = {"string": "string", "str": "string", "integer": "integer", "int": "integer", "float": "number",
          "number": "number", "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array",
          "object": "object", "dict": "object"}


def spec_tool_schemas(api_spec: dict[str, Any]) -> list[dict[str, Any]]:
    tools = []
    for group in api_spec.get("api_groups", []):
        for ep in group.get("endpoints", []):
            name = ep.get("operation_id")
            if not name:
                continue
            props, required = {}, []
            for pname, p in (ep.get("request_params") or {}).items():
                p = p if isinstance(p, dict) else {}
                prop = {"type": _TYPES.get(str(p.get("type", "string")).lower(), "string")}
                if p.get("description"):
                    prop["description"] = p["description"]
                props[pname] = prop
                if p.get("required"):
                    required.append(pname)
            desc = ep.get("summary") or ep.get("description") or ""
            if ep.get("description") and ep.get("description") != desc:
                desc = f"{desc}. {ep['description']}".replace("..", ".")
            params: dict[str, Any] = {"type": "object", "properties": props}
            if required:
                params["required"] = required
            tools.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return tools


@dataclass
class AwmDataset:
    root: Path
    scenarios: dict[str, AwmScenario]
    missing_files: list[str]

    def tasks(self, split: str = "train") -> list[Task]:
        out = []
        for sc in self.scenarios.values():
            tools = sc.tool_schemas()
            for i, text in enumerate(sc.tasks):
                payload = {"scenario": sc.name, "task_idx": i, "task": text, "tools": tools,
                           "evidence_scope": f"{ENV_NAME}/{sc.name}"}
                if i in sc.solutions:  # ours, mini data only: read by the reference teacher alone
                    payload["reference_solution"] = sc.solutions[i]
                out.append(Task(task_id=f"{sc.name}/{i}", env=ENV_NAME, split=split, payload=payload))
        return out

    def scenario_of(self, task: Task) -> AwmScenario:
        return self.scenarios[task.payload["scenario"]]


def initial_messages(task: Task) -> list[dict[str, Any]]:
    """The episode's opening conversation (system + the user's task); tools go alongside."""
    return [{"role": "system", "content": SYSTEM_PROMPT.format(scenario=task.payload["scenario"])},
            {"role": "user", "content": task.payload["task"]}]


def _verifier_entry(row: dict[str, Any], mode: str) -> dict[str, Any]:
    ver = row.get("verification") or {}
    code = ver.get("code") or ""
    raw: Any = ver.get("raw_response")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raw = {"text": raw}
    raw = raw if isinstance(raw, dict) else {}
    name = raw.get("function_name") or ""
    if not name:  # the first top-level `def verify_...` names it, as AWM reads it
        m = re.search(r"^def (verify_\w*)\s*\(", code, re.M)
        name = m.group(1) if m else ("verify_task_completion" if mode == "code" else "verify_task")
    return {"code": code, "function_name": name, "raw": raw}


def load_awm(root: str | Path) -> AwmDataset:
    """Every scenario named in any of the files; a scenario's missing parts stay None (the audit
    reports them). Raises FileNotFoundError when the directory lacks gen_tasks.jsonl."""
    root = Path(root)
    if not (root / FILES["tasks"]).is_file():
        raise FileNotFoundError(f"{root}: no {FILES['tasks']} (not an AWM directory in the published layout)")
    missing = [f for f in FILES.values() if not (root / f).is_file()]
    rows = {k: (read_jsonl(root / f) if (root / f).is_file() else []) for k, f in FILES.items()}
    scenarios: dict[str, AwmScenario] = {}

    def get(name: str) -> AwmScenario:
        key = normalize_name(name)
        return scenarios.setdefault(key, AwmScenario(name=key))

    for r in rows["tasks"]:
        get(r["scenario"]).tasks = [str(t) for t in r.get("tasks", [])]
    for r in rows["scenarios"]:
        key = normalize_name(r.get("name", ""))
        if key in scenarios:
            scenarios[key].description = r.get("description", "")
    for r in rows["db"]:
        if normalize_name(r["scenario"]) in scenarios:
            get(r["scenario"]).db_schema = r.get("db_schema")
    for r in rows["sample"]:
        if normalize_name(r["scenario"]) in scenarios:
            get(r["scenario"]).sample_data = r.get("sample_data")
    for r in rows["spec"]:
        if normalize_name(r["scenario"]) in scenarios:
            get(r["scenario"]).api_spec = r.get("api_spec")
    for r in rows["envs"]:
        if normalize_name(r["scenario"]) in scenarios:
            get(r["scenario"]).server_code = r.get("full_code")
    for mode, key in (("code", "verifier_code"), ("sql", "verifier_sql")):
        for r in rows[key]:
            if normalize_name(r["scenario"]) in scenarios and "task_idx" in r:
                get(r["scenario"]).verifiers[mode][int(r["task_idx"])] = _verifier_entry(r, mode)
    if (root / SOLUTIONS_FILE).is_file():
        for r in read_jsonl(root / SOLUTIONS_FILE):
            if normalize_name(r["scenario"]) in scenarios:
                get(r["scenario"]).solutions[int(r["task_idx"])] = list(r["actions"])
    return AwmDataset(root=root, scenarios=scenarios, missing_files=missing)
