"""Task admission for the AWM and EnvScaler pools (paper appendix B.1): a deterministic integrity
audit, then the context selection, then a manifest of admitted task ids and a funnel table.

Integrity (what needs no running server): the scenario/environment records are present and
parse; AWM databases build from schema + sample rows with few failed statements; verifiers
(AWM) and check functions (EnvScaler) run, in the sandbox, on the initial state and return the
published result shape; an environment class (EnvScaler) instantiates with the scenario's
initial config. A verifier that already reports success on the untouched initial state would
reward doing nothing, so it is refused too. The server stage (AWM: the generated server
starts and lists tools) needs the MCP runtime: pass `server_probe`, else that stage is reported
as not run and tool schemas come from the API spec.

Context selection: the initial native prompt (system + first user turn, rendered with the
tool schemas by chat.template under the student's tokenizer) must fit `max_prompt_tokens`
(16,000 in the paper).
"""

from __future__ import annotations

import collections
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from actionopd_jax import pyast
from actionopd_jax.envs.sandbox import Sandbox, SandboxError
from actionopd_jax.types import Task

MAX_PROMPT_TOKENS = 16_000
MAX_DB_FAILURE_RATIO = 0.1  # AWM's own retry threshold for schema / sample statements
POOLS = ("awm", "envscaler")

# server_probe(scenario, initial_db_path) -> the tool schemas tools/list gives (raises on failure)
ServerProbe = Callable[[Any, Path], list[dict[str, Any]]]


@dataclass
class Funnel:
    stages: list[str] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, collections.Counter] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def stage(self, name: str, kept: int, dropped: dict[str, str], note: str = "") -> None:
        self.stages.append(name)
        self.kept[name] = kept
        self.reasons[name] = collections.Counter(dropped.values())
        if note:
            self.notes[name] = note

    def table(self, title: str) -> str:
        lines = [f"{title}", "", "| stage | tasks kept | dropped | why dropped |", "|---|---:|---:|---|"]
        prev = None
        for s in self.stages:
            kept = self.kept[s]
            dropped = 0 if prev is None else prev - kept
            why = "; ".join(f"{r} ({n})" for r, n in self.reasons[s].most_common(3))
            if s in self.notes:
                why = (why + "; " if why else "") + self.notes[s]
            lines.append(f"| {s} | {kept} | {dropped} | {why} |")
            prev = kept
        return "\n".join(lines)


@dataclass
class AuditResult:
    pool: str
    root: str
    admitted: list[str]
    dropped: dict[str, str]  # task id -> first failed check
    funnel: Funnel
    prompt_tokens: dict[str, int]
    verifier_modes: dict[str, str] = field(default_factory=dict)  # AWM: task id -> "code" | "sql"
    # every task of the directory -> its source hash (envs/task_sources.py): what a screening
    # record was made from, so a changed task is screened again
    source_hashes: dict[str, str] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        return {"pool": self.pool, "dir": self.root, "admitted": list(self.admitted), "dropped": dict(self.dropped),
                "funnel": [{"stage": s, "kept": self.funnel.kept[s], "reasons": dict(self.funnel.reasons[s]),
                            "note": self.funnel.notes.get(s, "")} for s in self.funnel.stages],
                "prompt_tokens": dict(self.prompt_tokens), "verifier_modes": dict(self.verifier_modes),
                "source_hashes": dict(self.source_hashes)}

    def write_manifest(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.manifest(), indent=1) + "\n", encoding="utf-8")
        return path

    def table(self) -> str:
        return self.funnel.table(f"{self.pool} admission ({self.root})")


def _compiles(code: str | None, what: str) -> str:
    """"" when `code` parses as Python (compile only: nothing runs), else why not."""
    if not code or not code.strip():
        return f"no {what}"
    try:
        pyast.compile_source(code, f"<{what}>", "exec")
    except SyntaxError as e:
        return f"{what} does not parse (line {e.lineno})"
    return ""


class _Stages:
    """Tasks flow through named checks; each check drops tasks with a reason."""

    def __init__(self, tasks: list[Task]):
        self.alive = list(tasks)
        self.dropped: dict[str, str] = {}
        self.funnel = Funnel()
        self.funnel.stage("tasks in the directory", len(tasks), {})

    def apply(self, name: str, check: Callable[[Task], str], note: str = "") -> None:
        now: dict[str, str] = {}
        keep = []
        for t in self.alive:
            why = check(t)
            if why:
                now[t.task_id] = why
            else:
                keep.append(t)
        self.alive = keep
        self.dropped.update(now)
        self.funnel.stage(name, len(keep), now, note)


def context_check(tokenizer: Any, initial_messages: Callable[[Task], list[dict[str, Any]]],
                  max_prompt_tokens: int, counts: dict[str, int]) -> Callable[[Task], str]:
    from actionopd_jax.chat.template import render_ids

    def check(task: Task) -> str:
        n = int(render_ids(tokenizer, initial_messages(task), task.payload.get("tools") or None).size)
        counts[task.task_id] = n
        return "" if n <= max_prompt_tokens else f"initial prompt over {max_prompt_tokens} tokens"

    return check


def audit_awm(root: str | Path, *, sandbox: Sandbox, tokenizer: Any, cache_dir: str | Path,
              max_prompt_tokens: int = MAX_PROMPT_TOKENS, verifier_mode: str = "auto",
              server_probe: ServerProbe | None = None, timeout_s: float = 30.0) -> AuditResult:
    from actionopd_jax.envs.awm.db import DbCache
    from actionopd_jax.envs.awm.layout import initial_messages, load_awm
    from actionopd_jax.envs.awm.verify import run_verifier_code

    if verifier_mode not in ("auto", "code", "sql"):
        raise ValueError(f"verifier_mode must be 'auto', 'code' or 'sql', got {verifier_mode!r}")
    data = load_awm(root)
    cache = DbCache(cache_dir)
    tasks = data.tasks()
    st = _Stages(tasks)
    sc = data.scenario_of
    modes: dict[str, str] = {}  # task id -> the verifier mode it is admitted with

    def pick(t: Task) -> tuple[str, dict[str, Any] | None]:
        order = ("code", "sql") if verifier_mode == "auto" else (verifier_mode,)
        for mode in order:
            entry = sc(t).verifier(t.payload["task_idx"], mode)
            if entry is not None:
                return mode, entry
        return order[0], None

    def present(t: Task) -> str:
        s = sc(t)
        if s.db_schema is None or not s.db_schema.get("tables"):
            return "no database schema"
        if s.sample_data is None:
            return "no sample rows"
        if why := _compiles(s.server_code, "server code"):
            return why
        mode, entry = pick(t)
        if entry is None:
            return "no verifier" if verifier_mode == "auto" else f"no {verifier_mode} verifier"
        modes[t.task_id] = mode
        return _compiles(entry["code"], "verifier")

    st.apply("scenario, database and verifier present and parse", present)

    built: dict[str, str] = {}

    def builds(t: Task) -> str:
        s = sc(t)
        if s.name not in built:
            try:
                r = cache.report(s)
                built[s.name] = (f"database build failed ({r.failed}/{r.statements} statements)"
                                 if r.failure_ratio > MAX_DB_FAILURE_RATIO else "")
            except Exception as e:  # noqa: BLE001 - any failure drops the scenario with its reason
                built[s.name] = f"database build failed ({type(e).__name__})"
        return built[s.name]

    st.apply("database builds", builds)

    if server_probe is None:
        st.apply("server starts and lists tools", lambda t: "", note="not run (no MCP runtime given)")
    else:
        listed: dict[str, tuple[str, list]] = {}

        def serves(t: Task) -> str:
            s = sc(t)
            if s.name not in listed:
                try:
                    tools = list(server_probe(s, cache.initial(s)) or [])
                    listed[s.name] = ("" if tools else "server lists no tools", tools)
                except Exception as e:  # noqa: BLE001 - any failure drops the scenario with its reason
                    listed[s.name] = (f"server did not start or list tools ({type(e).__name__})", [])
            why, tools = listed[s.name]
            if not why:
                t.payload["tools"] = tools  # what the runtime will show, for the context check
            return why

        st.apply("server starts and lists tools", serves)

    def runs_on_initial(t: Task) -> str:
        s = sc(t)
        mode, entry = pick(t)
        db = cache.initial(s)
        with tempfile.TemporaryDirectory(prefix="awm-audit-") as d:
            final = cache.episode_copy(s, d)
            ran, value, error = run_verifier_code(entry, db, final, sandbox=sandbox, timeout_s=timeout_s)
        if not ran:
            return f"verifier fails on the initial state ({error.split(':')[0]})"
        if mode == "code":
            if not isinstance(value, dict) or str(value.get("result", "")).lower() not in ("complete", "others"):
                return "verifier result is not {'result': complete|others}"
            if str(value["result"]).lower() == "complete":
                return "verifier accepts the untouched initial state"
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                return "verifier output is not JSON"
        return ""

    st.apply("verifier runs on the initial state", runs_on_initial)
    counts: dict[str, int] = {}
    st.apply(f"initial prompt fits {max_prompt_tokens} tokens", context_check(tokenizer, initial_messages,
                                                                             max_prompt_tokens, counts))
    admitted = [t.task_id for t in st.alive]
    from actionopd_jax.envs.task_sources import awm_sources

    hashes = {k: v.source_hash for k, v in awm_sources(data, tasks, modes).items()}
    return AuditResult("awm", str(root), admitted, st.dropped, st.funnel, counts,
                       verifier_modes={k: modes[k] for k in admitted}, source_hashes=hashes)


def audit_envscaler(root: str | Path, *, sandbox: Sandbox, tokenizer: Any,
                    max_prompt_tokens: int = MAX_PROMPT_TOKENS, timeout_s: float = 30.0) -> AuditResult:
    from actionopd_jax.envs.envscaler.check import score_state
    from actionopd_jax.envs.envscaler.layout import initial_messages, load_envscaler

    data = load_envscaler(root)
    tasks = data.tasks()
    st = _Stages(tasks)

    def present(t: Task) -> str:
        s = data.scenarios[t.task_id]
        env = data.envs.get(s.env_id)
        if env is None:
            return "environment missing from the metadata"
        if not env.tools:
            return "environment lists no tools"
        if why := _compiles(env.class_code, "environment class code"):
            return why
        if not s.checks:
            return "no check functions"
        for c in s.checks:
            if why := _compiles(c.get("check_func"), "check function"):
                return why
        return ""

    st.apply("environment, scenario and checks present and parse", present)
    initial_states: dict[str, dict[str, Any]] = {}

    def instantiates(t: Task) -> str:
        s = data.scenarios[t.task_id]
        env = data.envs[s.env_id]
        try:
            session = sandbox.open_class(env.class_code, s.class_name or env.class_name, s.init_config,
                                         timeout_s=timeout_s)
        except SandboxError as e:
            return f"environment class does not start ({str(e).split(':')[0]})"
        try:
            initial_states[t.task_id] = session.state()
            missing = [tl["function"]["name"] for tl in env.tools if not tl["function"]["name"].isidentifier()]
            return f"tool names not methods: {missing}" if missing else ""
        except SandboxError as e:
            return f"environment state unreadable ({str(e).split(':')[0]})"
        finally:
            session.close()

    st.apply("environment class starts with the initial config", instantiates)

    def checks_run(t: Task) -> str:
        s = data.scenarios[t.task_id]
        init = initial_states[t.task_id]
        out = score_state(s, init, init, sandbox=sandbox, timeout_s=timeout_s)
        if out.errors:
            return "a check function fails on the initial state"
        if out.success:
            return "checks accept the untouched initial state"
        return ""

    st.apply("checks run on the initial state", checks_run)
    counts: dict[str, int] = {}
    st.apply(f"initial prompt fits {max_prompt_tokens} tokens", context_check(tokenizer, initial_messages,
                                                                             max_prompt_tokens, counts))
    from actionopd_jax.envs.task_sources import envscaler_sources

    hashes = {k: v.source_hash for k, v in envscaler_sources(data, tasks).items()}
    return AuditResult("envscaler", str(root), [t.task_id for t in st.alive], st.dropped, st.funnel, counts,
                       source_hashes=hashes)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A manifest written by `AuditResult.write_manifest`, or a combined one
    {"pools": {"awm": {...}, "envscaler": {...}}}; returns {pool: set of admitted ids} under
    "admitted", {pool: set of held-out ids} under "heldout" (admitted tasks kept for evaluation,
    never drawn for training), the per-pool entries under "pools"."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("the manifest is not a JSON object")
    pools = raw.get("pools") if isinstance(raw.get("pools"), dict) else {raw.get("pool", ""): raw}
    return {"admitted": {p: set(m.get("admitted", [])) for p, m in pools.items()},
            "heldout": {p: set(m.get("heldout", [])) for p, m in pools.items()}, "pools": pools, "raw": raw}


def heldout_split(admitted: list[str], fraction: float) -> list[str]:
    """A held-out split of `fraction` of the admitted ids (rounded down, at least one when the
    fraction is > 0): the ids whose sha256 is smallest, so it depends on nothing but the ids
    and stays put when other tasks are added or dropped."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0 or not admitted:
        return []
    import hashlib

    n = max(1, int(len(admitted) * fraction))
    return sorted(sorted(admitted, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:n])


def default_manifest(pool_dir: str | Path) -> Path:
    """Where the manifest of a pool directory goes without --manifest: the user's cache, never
    the dataset itself (a published pool may be read-only or shared). Named by the directory's
    name and a hash of its full path, so two pools of one name keep two manifests."""
    import hashlib

    real = Path(pool_dir).resolve()
    digest = hashlib.sha256(str(real).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "actionopd_jax" / "admission" / f"{real.name}-{digest}" / "admitted.json"
