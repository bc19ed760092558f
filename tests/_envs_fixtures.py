"""Shared helpers for the environment tests: a scripted tau2 user served over real HTTP by the
project's OpenAI-compatible server, and episode drivers.

The scripted user is a real backend behind a real server; the environment's user simulator
talks to it with the real `openai` client. Its script:
- to the agent's greeting: state the reason for calling (taken from the system prompt);
- to "Please do this on your device: NAME with {json}.": call device tool NAME with those
  arguments, then (after the tool result) say "Done.";
- to anything else: end the conversation with ###STOP###.
"""

from __future__ import annotations

import asyncio
import json
import re

from actionopd_jax.envs.reference import reference_policy
from actionopd_jax.envs.tau2_env import GREETING
from actionopd_jax.serve.openai_http import ChatRequest, OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice

USER_MODEL = "scripted-user"
_REQUEST = re.compile(r"^Please do this on your device: (\w+)(?: with (\{.*\}))?\. Tell me when it is done\.$", re.DOTALL)


def scripted_user_reply(req: ChatRequest):
    last = req.messages[-1]
    if last["role"] == "tool":
        return message_choice("Done.")
    text = last.get("content") or ""
    if text == GREETING:
        system = req.messages[0]["content"]
        match = re.search(r"## Why you are contacting the agent\n(.*?)(?:\n## |\Z)", system, re.DOTALL)
        return message_choice(match.group(1).strip() if match else "I need help.")
    request = _REQUEST.match(text)
    if request:
        return tool_call_choice(request.group(1), json.loads(request.group(2) or "{}"))
    return message_choice("###STOP###")


def start_user_server(reply=scripted_user_reply) -> tuple[OpenAIServer, ScriptedBackend]:
    backend = ScriptedBackend(USER_MODEL, reply)
    server = OpenAIServer(backend)
    server.start()
    return server, backend


async def run_reference(env, task, *, corrupt=None, max_decisions: int = 200):
    """Drive `env` with the task's reference policy; `corrupt(obs, action)` may replace an
    action. Returns (final observation, actions taken)."""
    policy = reference_policy(task)
    obs = await env.reset(task)
    actions, done = [], obs.done
    while not done and len(actions) < max_decisions:
        action = policy.next_action(obs)
        if corrupt is not None:
            action = corrupt(obs, action)
        actions.append(action)
        obs, done = await env.step(action)
    return obs, actions


def run(coro):
    return asyncio.run(coro)
