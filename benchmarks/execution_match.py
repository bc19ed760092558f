"""The matcher's execution stage (issue 45) on the planted pairs of
tests/data/execution_match_planted.json: our own EnvScaler-style scenarios run in the real
sandbox (one contained process per episode and per fork), and pairs on our mini AWM pool
(tests/data/awm_mini: each fork a sandboxed MCP server loaded with a copy of the episode's
database); each pair's state reached by a real episode (reset, then the pair's setup calls),
then decided by `ExecutionStage` on forks of it; and pairs on a BFCL multi-turn task of the
package's own data (`bfcl:<task id>`: forks are deep copies of the episode's bfcl_eval class
instances).

    python benchmarks/execution_match.py [--json OUT]

Prints, per kind of pair: how many, how many execution decided, how many of those were wrong
against the label, and how many it left to the judge; then the totals, the share decided and
each fork run's wall time (p50 / p99). A wrong verdict is a failure (exit 1): execution must
abstain rather than guess. `tests/test_matching_execution.py` runs the same set and asserts it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actionopd_jax.envs.envscaler.env import EnvScalerEnvironment  # noqa: E402
from actionopd_jax.envs.sandbox import SubprocessSandbox  # noqa: E402
from actionopd_jax.matching.execution import ExecutionStage, call_key  # noqa: E402
from actionopd_jax.matching.matcher import rules_decision  # noqa: E402
from actionopd_jax.types import Task, ToolCall  # noqa: E402

PLANTED = ROOT / "tests" / "data" / "execution_match_planted.json"


def planted_tasks(data: dict) -> dict[str, Task]:
    return {name: Task(task_id=f"planted_{name}", env="envscaler", payload={
        "env_id": f"planted_{name}", "task": "planted pairs", "conversational": False,
        "tools": t["tools"], "intro": "", "class_name": t["class_name"], "class_code": t["class_code"],
        "init_config": t["init_config"], "checks": [], "tool_effects": t["tool_effects"]})
        for name, t in data["tasks"].items()}


def _call(d: dict) -> ToolCall:
    return ToolCall(d["name"], d["arguments"])


AWM_MINI = ROOT / "tests" / "data" / "awm_mini"


def _awm_factory(cache_dir: str):
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.factory import awm_env_factory

    return awm_env_factory(EnvConfig(name="awm", awm_dir=str(AWM_MINI), mcp_pool_size=2), judge=None,
                           cache_dir=cache_dir)


async def run_planted(path: Path = PLANTED, sandbox=None) -> tuple[list[dict], list[float]]:
    """One row per planted pair: its kind, label, expect, the rules' stage and the execution
    verdict ("match" / "no_match" / None for abstained, with the reason); and every fork's wall time."""
    import tempfile

    data = json.loads(Path(path).read_text())
    tasks = planted_tasks(data)
    sandbox = sandbox or SubprocessSandbox()
    awm = None
    if any(p["task"].startswith("awm:") for p in data["pairs"]):
        from actionopd_jax.envs.awm.layout import load_awm

        awm_tasks = {t.task_id: t for t in load_awm(AWM_MINI).tasks()}
        awm_cache = tempfile.TemporaryDirectory(prefix="planted-awm-")
        awm = _awm_factory(awm_cache.name)
        tasks.update({f"awm:{tid}": t for tid, t in awm_tasks.items()})
    bfcl = {p["task"] for p in data["pairs"] if p["task"].startswith("bfcl:")}
    if bfcl:  # BFCL multi-turn tasks of the package's own data, by id
        tasks.update({name: Task(task_id=name[len("bfcl:"):], env="bfcl") for name in bfcl})
    stage = ExecutionStage()
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for p in data["pairs"]:  # pairs at one state share an episode and one fork point
        groups[(p["task"], json.dumps(p["setup"], sort_keys=True))].append(p)
    rows, fork_s = [], []
    try:
        for (task_name, setup), pairs in groups.items():
            rows_, forks_ = await _state_group(tasks[task_name], setup, pairs, sandbox, awm, stage)
            rows += rows_
            fork_s += forks_
    finally:
        if awm is not None:
            awm.close()
            awm_cache.cleanup()
    return rows, fork_s


async def _state_group(task: Task, setup: str, pairs: list[dict], sandbox, awm, stage) -> tuple[list[dict], list[float]]:
    """The pairs of one state: a real episode reaches it, the stage decides them on forks, and
    the live state is read again to check that no fork reached it."""
    if task.env == "bfcl":
        from actionopd_jax.envs.bfcl import BFCLEnv

        env = BFCLEnv()
    else:
        env = awm(task) if task.env == "awm" else EnvScalerEnvironment(sandbox)
    try:
        await env.reset(task)
        for step in json.loads(setup):
            await env.step(_call(step))
        point = await env.fork_point()
        before = point.before
        actions = [(_call(p["student"]), _call(p["teacher"])) for p in pairs]
        record = await stage.decide(point, actions)
        point.close()
        again = await env.fork_point()
        assert again is not None and again.before == before, "a fork changed the live episode"
        again.close()
    finally:
        env.end("planted")
        if task.env == "awm":
            await asyncio.to_thread(env.close)
        elif task.env == "envscaler":
            env._close()
    rows = []
    for p, (s, t) in zip(pairs, actions):
        key = (call_key(s), call_key(t))
        rows.append({"kind": p["kind"], "label": p["label"], "expect": p["expect"], "env": task.env,
                     "rules": rules_decision(s, t).stage, "verdict": record.verdicts.get(key),
                     "why": record.abstained.get(key, ""), "fork_s": list(record.fork_s)})
        record.fork_s = []  # each fork time once, on the group's first row
    return rows, [t for r in rows for t in r["fork_s"]]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def table(rows: list[dict], fork_s: list[float]) -> tuple[str, int]:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    lines = [f"{'kind':24} {'pairs':>5} {'decided':>7} {'wrong':>5} {'to judge':>8}"]
    wrong_total = 0
    for kind, rs in sorted(by_kind.items()):
        decided = [r for r in rs if r["verdict"] is not None]
        wrong = sum(r["verdict"] != r["label"] for r in decided)
        wrong_total += wrong
        lines.append(f"{kind:24} {len(rs):5d} {len(decided):7d} {wrong:5d} {len(rs) - len(decided):8d}")
    decided = sum(r["verdict"] is not None for r in rows)
    lines.append(f"{'total':24} {len(rows):5d} {decided:7d} {wrong_total:5d} {len(rows) - decided:8d}")
    lines.append(f"decided by execution: {decided / max(len(rows), 1):.1%} of {len(rows)} pairs; "
                 f"accuracy of its verdicts: {(decided - wrong_total) / max(decided, 1):.1%}")
    lines.append(f"fork runs: {len(fork_s)}; wall per fork p50 {percentile(fork_s, 50) * 1e3:.1f} ms, "
                 f"p99 {percentile(fork_s, 99) * 1e3:.1f} ms")
    for env in sorted({r["env"] for r in rows}):
        mine = [r for r in rows if r["env"] == env]
        times = [t for r in mine for t in r["fork_s"]]
        lines.append(f"  {env}: {sum(r['verdict'] is not None for r in mine)}/{len(mine)} decided, "
                     f"{len(times)} forks, p50 {percentile(times, 50) * 1e3:.1f} ms, p99 {percentile(times, 99) * 1e3:.1f} ms")
    return "\n".join(lines), wrong_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--planted", default=str(PLANTED))
    ap.add_argument("--json", default="", help="also write the rows and fork times here")
    args = ap.parse_args()
    rows, fork_s = asyncio.run(run_planted(Path(args.planted)))
    text, wrong = table(rows, fork_s)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "fork_s": fork_s}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
