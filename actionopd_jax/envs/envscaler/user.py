"""The simulated user of a conversational EnvScaler task (our wording; the published harness
has its own prompt with the same contract): the LLM plays a person who wants the scenario's
task done, opens the conversation after the agent's greeting, reveals what it wants as the
agent asks, and ends with the stop marker when it is satisfied. It is our `UserSimulator`
(envs/user_sim.py) over HTTP; only the prompt differs from tau2's."""

from __future__ import annotations

from actionopd_jax.envs.user_sim import STOP

GREETING = "Hi! How can I help you today?"  # the agent's opening the user answers (as upstream)

_PROMPT = """You are a person asking an assistant for help. The assistant can act in a software system for you; you cannot. Stay in this role for the whole conversation.

How to behave:
- Write one short, natural message at a time.
- Start by saying what you want in your own words. Give the details the assistant asks for when it asks; do not recite everything at once.
- Use only what your goal below says. If the assistant asks for something it does not say, tell it you do not know. Never invent names, ids or facts.
- Do not do the assistant's work and do not describe tool calls.
- If your goal has several parts, make sure each part is handled before you finish.

When everything in your goal is done (or the assistant has clearly said it cannot be done), reply with only {stop}.

# Your goal
{task}"""


def user_system_prompt(task_text: str) -> str:
    return _PROMPT.format(stop=STOP, task=task_text.strip())
