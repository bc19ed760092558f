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


def score_state(scenario: EnvScalerScenario, initial_state: dict[str, Any], final_state: dict[str, Any], *,
                sandbox: Sandbox, timeout_s: float = 10.0) -> CheckOutcome:
    results = []
    for check in scenario.checks:
        res = sandbox.run_function(check.get("check_func", ""), "check_func", {"final_state": final_state},
                                   globals_={"initial_state": initial_state}, timeout_s=timeout_s)
        if res.ok and not isinstance(res.value, bool):
            res_ok, passed, err = False, False, f"check returned {type(res.value).__name__}, not a bool"
        else:
            res_ok, passed, err = res.ok, bool(res.ok and res.value), res.error
        results.append({"check_item": check.get("check_item", ""), "passed": passed, "error": "" if res_ok else err})
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
