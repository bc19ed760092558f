"""Reading an EnvScaler directory: one environment-metadata JSON (an object keyed by env_id, or
a list of records with env_id) and one or more scenario-metadata JSON lists.

The class code is kept as a string: it is machine-generated and runs only in a Sandbox
(envs/sandbox.py `open_class`), never here. Task ids are the scenario's own `task_id`.
Which scenarios are conversational (played with a simulated user) is decided per scenario by
envs/envscaler/mode.py: the caller's override, else the record's own `"conversational"` field
(our extension), else conversational (the published records carry no mode; the paper plays
EnvScaler with a simulated user).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from actionopd_jax.envs.envscaler.mode import UnknownScenarioIds, parse_rule, record_mark
from actionopd_jax.types import Task

ENV_NAME = "envscaler"

NON_CONV_PROMPT = ("You are an assistant completing a task in an interactive environment with the tools below. "
                   "Call one tool at a time with valid arguments; look things up before changing them. When the task "
                   "is complete, reply with a short message saying so instead of calling a tool.")
CONV_PROMPT = ("You are an assistant helping a user in an interactive environment with the tools below. Call one "
               "tool at a time with valid arguments, and ask the user when you lack information no tool can give. "
               "When a request is done, tell the user the outcome and ask whether they need anything else.")


@dataclass
class EnvScalerEnv:
    env_id: str
    class_name: str
    class_code: str
    tools: list[dict[str, Any]]
    introduction: str = ""
    rules: list[str] = field(default_factory=list)
    summary: str = ""
    record: dict[str, Any] = field(default_factory=dict, repr=False)

    def intro_text(self) -> str:
        rules = "".join(f"- {r}\n" for r in self.rules)
        return f"# Environment\n\n{self.introduction}\n\n## Rules\n{rules}".rstrip() + "\n"


@dataclass
class EnvScalerScenario:
    task_id: str
    env_id: str
    class_name: str
    init_config: dict[str, Any]
    task: str
    checks: list[dict[str, Any]]  # [{"check_item", "check_func"}]
    conversational: bool = False
    conversational_by: str = ""  # why (envs/envscaler/mode.py: the override, the record's mark, the default)
    source: str = ""  # the file it came from
    # OUR extension, only in our own mini data: the tool calls that solve the task, in order
    # ([{"name", "arguments"}]), for the privileged reference teacher (envs/reference.py)
    reference_actions: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EnvScalerDataset:
    root: Path
    envs: dict[str, EnvScalerEnv]
    scenarios: dict[str, EnvScalerScenario]

    def tasks(self, split: str = "train") -> list[Task]:
        """One Task per scenario. The payload carries what an episode needs (the environment
        class source, initial state, checks: hidden from the agent, which sees only the
        observation) so that any process can run it from the Task alone; the class code and
        tool lists are shared references, not copies."""
        out = []
        for sc in self.scenarios.values():
            # a scenario whose environment is missing still loads (the audit drops it, saying why)
            env = self.envs.get(sc.env_id) or EnvScalerEnv(env_id=sc.env_id, class_name="", class_code="", tools=[])
            out.append(Task(task_id=sc.task_id, env=ENV_NAME, split=split, payload={
                "env_id": sc.env_id, "task": sc.task, "conversational": sc.conversational,
                "conversational_by": sc.conversational_by,
                "tools": env.tools, "intro": env.intro_text(), "class_name": sc.class_name or env.class_name,
                "class_code": env.class_code, "init_config": sc.init_config, "checks": sc.checks,
                "reference_actions": sc.reference_actions,
                # our extension (issue 45, docs/formats.md): the env record's per-tool effects
                "tool_effects": env.record.get("tool_effects") or {},
                # the matcher's tool evidence is per environment: tool names repeat across them
                "evidence_scope": f"{ENV_NAME}/{sc.env_id}"}))
        return out


def initial_messages(task: Task) -> list[dict[str, Any]]:
    """System prompt (ours + the environment's introduction) and the first user turn. For a
    conversational task the user's first turn comes from the simulator; the task text stands in
    for it where no simulator runs (the context audit)."""
    p = task.payload
    system = (CONV_PROMPT if p.get("conversational") else NON_CONV_PROMPT) + "\n\n" + p.get("intro", "")
    return [{"role": "system", "content": system.rstrip()}, {"role": "user", "content": p["task"]}]


def _find(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file())


def load_envscaler(root: str | Path, *, scenario_files: Iterable[str] = (),
                   conversational: str | Iterable[str] | None = None) -> EnvScalerDataset:
    """`scenario_files` narrows which *scenario_metadata*.json files load (default: all of them).
    `conversational` overrides which scenarios play with the user simulator, as
    `env.envscaler_conversational` does: "all", "none" or task ids (exactly those); None: each
    record's own mark, else conversational (envs/envscaler/mode.py). Ids the directory does not
    hold raise `UnknownScenarioIds`."""
    root = Path(root)
    env_files = _find(root, "*env_metadata*.json")
    if len(env_files) != 1:
        raise FileNotFoundError(f"{root}: expected one *env_metadata*.json, found {[p.name for p in env_files]}")
    raw = json.loads(env_files[0].read_text(encoding="utf-8"))
    records = list(raw.values()) if isinstance(raw, dict) else list(raw)
    envs = {}
    for r in records:
        envs[r["env_id"]] = EnvScalerEnv(env_id=r["env_id"], class_name=r.get("env_class_name", ""),
                                         class_code=r.get("env_class_code", ""), tools=list(r.get("tools", [])),
                                         introduction=r.get("environment_introduction", ""),
                                         rules=list(r.get("constraints_rules", [])),
                                         summary=r.get("environment_summary", ""), record=r)
    wanted = set(scenario_files)
    files = [p for p in _find(root, "*scenario_metadata*.json") if not wanted or p.name in wanted]
    if not files:
        raise FileNotFoundError(f"{root}: no *scenario_metadata*.json")
    rule = parse_rule(conversational)
    scenarios: dict[str, EnvScalerScenario] = {}
    for path in files:
        for item in json.loads(path.read_text(encoding="utf-8")):
            tid = str(item["task_id"])
            if tid in scenarios:
                raise ValueError(f"{path.name}: task_id {tid!r} appears twice")
            conv, why = rule.decide(tid, record_mark(item, f"{path.name}: scenario {tid!r}"))
            scenarios[tid] = EnvScalerScenario(
                task_id=tid, env_id=item["env_id"], class_name=item.get("env_class_name", ""),
                init_config=item.get("init_config") or {}, task=item.get("task", ""),
                checks=list(item.get("checklist_with_func") or []),
                conversational=conv, conversational_by=why, source=path.name,
                reference_actions=list(item.get("reference_actions") or []))
    unknown = rule.unknown(scenarios)
    if unknown:
        raise UnknownScenarioIds(unknown, str(root))
    return EnvScalerDataset(root=root, envs=envs, scenarios=scenarios)
