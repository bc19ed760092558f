"""Protocol rules a student candidate must obey beyond parsing, per environment: a candidate
that breaks one is Invalid (reward -1), like unparsable output.

tau2 (paper B.4): "a transfer notification without the preceding transfer call is treated as
invalid output with reward -1". tau2's policies ask the agent to call
`transfer_to_human_agents` first and then tell the user 'YOU ARE BEING TRANSFERRED TO A HUMAN
AGENT. PLEASE HOLD ON.'; a message carrying that notification is valid only right after the
transfer call, i.e. when the last assistant turn of the public conversation is that call.
"""

from __future__ import annotations

import re
from typing import Sequence

from actionopd_jax.types import Action, ChatMessage, Invalid, Message

TRANSFER_TOOL = "transfer_to_human_agents"
_NOTIFICATION = re.compile(r"you\s+are\s+being\s+transferred\s+to\s+a\s+human\s+agent", re.IGNORECASE)


def is_transfer_notification(text: str) -> bool:
    return _NOTIFICATION.search(text) is not None


def last_assistant_called(messages: Sequence[ChatMessage], tool: str) -> bool:
    """Whether the most recent assistant turn is a call of `tool`."""
    for m in reversed(messages):
        if m.get("role") != "assistant":
            continue
        calls = m.get("tool_calls") or []
        return any(isinstance(c, dict) and (c.get("function") or {}).get("name") == tool for c in calls)
    return False


def tau2_transfer_rule(action: Action, messages: Sequence[ChatMessage]) -> Action:
    if isinstance(action, Message) and is_transfer_notification(action.text) \
            and not last_assistant_called(messages, TRANSFER_TOOL):
        return Invalid(f"transfer notification without a preceding {TRANSFER_TOOL} call (paper B.4)")
    return action


# environment-name prefix -> rules, applied in order
RULES = {"tau2_": (tau2_transfer_rule,)}


def apply_protocol_rules(env_name: str, action: Action, messages: Sequence[ChatMessage]) -> Action:
    """`action`, or an Invalid saying which rule of `env_name` it breaks at this state."""
    for prefix, rules in RULES.items():
        if env_name.startswith(prefix):
            for rule in rules:
                action = rule(action, messages)
    return action
