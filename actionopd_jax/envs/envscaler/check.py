"""Scoring an EnvScaler episode by its scenario's check functions, and a minimal episode over a
sandboxed class session (the runtime's Environment adapter wraps the same calls).

A check function is `def check_func(final_state): -> bool`, with the initial state available as
the global `initial_state`. The published reward is the fraction of checks that return True
(a check that fails to run counts as False); the task succeeds when every check passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actionopd_jax.envs.envscaler.layout import EnvScalerEnv, EnvScalerScenario
from actionopd_jax.envs.sandbox import ClassSession, Sandbox


@dataclass
class CheckOutcome:
    reward: float  # fraction of checks passed
    results: list[dict[str, Any]] = field(default_factory=list)  # per check: item, passed, error

    @property
    def success(self) -> bool:
        return bool(self.results) and all(r["passed"] for r in self.results)

    @property
    def errors(self) -> list[str]:
        return [r["error"] for r in self.results if r["error"]]


# Runs every check of a scenario in one sandboxed process, each in its own namespace: one
# process start per episode instead of one per check.
_ALL_CHECKS = """
def run_checks(sources, final_state):
    out = []
    for src in sources:
        ns = {"initial_state": initial_state}
        try:
            exec(compile(src, "<check function>", "exec"), ns)
            value = ns["check_func"](final_state)
            out.append({"ok": True, "bool": isinstance(value, bool), "value": value is True,
                        "type": type(value).__name__})
        except Exception as e:
            out.append({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
    return out
"""


def _result(item: str, ok: bool, is_bool: bool, value: bool, type_name: str, error: str) -> dict[str, Any]:
    if ok and not is_bool:
        return {"check_item": item, "passed": False, "error": f"check returned {type_name}, not a bool"}
    return {"check_item": item, "passed": bool(ok and value), "error": "" if ok else error}


def score_state(scenario: EnvScalerScenario, initial_state: dict[str, Any], final_state: dict[str, Any], *,
                sandbox: Sandbox, timeout_s: float = 10.0) -> CheckOutcome:
    checks = scenario.checks
    items = [c.get("check_item", "") for c in checks]
    results = []
    if checks:
        batch = sandbox.run_function(_ALL_CHECKS, "run_checks",
                                     {"sources": [c.get("check_func", "") for c in checks], "final_state": final_state},
                                     globals_={"initial_state": initial_state}, timeout_s=timeout_s)
        if batch.ok and isinstance(batch.value, list) and len(batch.value) == len(checks):
            results = [_result(item, r["ok"], r.get("bool", False), r.get("value", False), r.get("type", ""),
                               r.get("error", "")) for item, r in zip(items, batch.value)]
    if checks and not results:
        # the batch process died or hung (a check that exits or loops): judge each check alone
        for item, check in zip(items, checks):
            res = sandbox.run_function(check.get("check_func", ""), "check_func", {"final_state": final_state},
                                       globals_={"initial_state": initial_state}, timeout_s=timeout_s)
            results.append(_result(item, res.ok, isinstance(res.value, bool), res.value is True,
                                   type(res.value).__name__, res.error))
    reward = sum(r["passed"] for r in results) / len(results) if results else 0.0
    return CheckOutcome(reward=round(reward, 4), results=results)


class ClassEpisode:
    """One episode of a scenario: the environment class instance lives in the sandbox."""

    def __init__(self, env: EnvScalerEnv, scenario: EnvScalerScenario, *, sandbox: Sandbox, timeout_s: float = 30.0):
        self.env, self.scenario, self.sandbox = env, scenario, sandbox
        self.session: ClassSession = sandbox.open_class(env.class_code, scenario.class_name or env.class_name,
                                                        scenario.init_config, timeout_s=timeout_s)
        self.initial_state = self.session.state()
        self.tool_names = {t["function"]["name"] for t in env.tools}

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool message text (the method's result as `str`), or an error line for a name the
        environment does not list as a tool."""
        if name not in self.tool_names:
            return f"Error: unknown tool {name!r}"
        return self.session.call(name, arguments)

    def finish(self) -> CheckOutcome:
        try:
            final = self.session.state()
        finally:
            self.session.close()
        return score_state(self.scenario, self.initial_state, final, sandbox=self.sandbox)
