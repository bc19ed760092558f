"""What the feasibility judge is shown and asked (paper B.1), and how its reply is read.

The judge sees one task: the goal, then the environment's description, tools, implementation,
initial data and verifier evidence (envs/task_sources.py). It is asked whether the environment
supports the goal and its success conditions -- not whether some policy would succeed. Sections
longer than the character budget are cut (the largest first, each keeping its head), and the cut
is said in the prompt and kept in the record.

Reply format: one JSON object {"verdict": "feasible" | "infeasible", "reason": str,
"confidence": number in [0, 1]}. It may sit in a ```json fence, after a closed <think> block or
after a line of prose; several objects with a verdict, an unknown verdict or an empty reason do
not parse (the caller asks again, then records an error). Confidence is optional and never
decides anything: a missing or out-of-range one is recorded as null.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from actionopd_jax.envs.task_sources import SECTIONS, TaskSource

PROMPT_VERSION = "feasibility-v1"  # bump when the prompt's meaning changes: cached verdicts stop matching

SYSTEM = """You review tasks of a tool-use training environment before they are used. For one task \
you are shown the user's goal, the environment's tools with their schemas, the code implementing \
them, the data every episode starts from, and the verifier that decides success.

Decide whether the environment supports the goal and its success conditions. A task is feasible \
when some sequence of tool calls, as implemented, can reach a final state that completes the goal \
as stated; the records the goal refers to exist in the initial data or can be created through the \
tools; and the verifier accepts such a final state. A task is infeasible when no sequence of tool \
calls can complete it (a needed operation does not exist or cannot have the needed effect, a \
referenced record is absent and cannot be made), or when the verifier would reject a correct \
completion or checks something the goal does not ask for. Judge the environment, not an agent: \
a long, hard or multi-step task is still feasible.

Reply with one JSON object and nothing else:
{"verdict": "feasible" or "infeasible", "reason": "one or two sentences naming the deciding evidence", \
"confidence": a number from 0 to 1}"""

RETRY_NOTE = ("Your reply was not one JSON object with \"verdict\" (\"feasible\" or \"infeasible\"), a non-empty "
              "\"reason\" and \"confidence\". Reply again with only that JSON object.")


def _fit(lengths: dict[str, int], budget: int) -> dict[str, int]:
    """Characters each section keeps so the total is within `budget`: sections shorter than an
    even share keep everything, the rest share what is left evenly."""
    if sum(lengths.values()) <= budget:
        return dict(lengths)
    keep, remaining = {}, max(budget, 0)
    order = sorted(lengths, key=lambda k: lengths[k])
    for i, name in enumerate(order):
        keep[name] = min(lengths[name], remaining // (len(order) - i))
        remaining -= keep[name]
    return keep


def build_prompt(source: TaskSource, max_chars: int) -> tuple[str, list[str]]:
    """(the user message, the sections that were cut). `max_chars` bounds the sections' text;
    the goal is always shown whole."""
    keep = _fit({k: len(v) for k, v in source.sections.items()}, max_chars)
    parts, cut = [f"## Task goal ({source.pool} task {source.task_id})\n{source.goal}"], []
    for name, heading in SECTIONS.items():
        text = source.sections.get(name, "")
        if len(text) > keep.get(name, 0):
            cut.append(name)
            text = text[:keep[name]] + f"\n[... {len(text) - keep[name]} characters cut]"
        parts.append(f"## {heading}\n{text}")
    parts.append("Does this environment support the task's goal and success conditions? Reply with the JSON object.")
    return "\n\n".join(parts), cut


@dataclass(frozen=True)
class ScreenReply:
    verdict: str                 # "feasible" | "infeasible"
    reason: str
    confidence: float | None     # diagnostic only


_LEADING_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def _objects(text: str) -> list[dict]:
    """Every JSON object that starts at a '{' of `text` and is not inside an earlier one."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = end
    return out


def parse_reply(reply: object) -> ScreenReply | None:
    """The judge's verdict, or None when the reply is not in the format."""
    if not isinstance(reply, str):
        return None
    found = [o for o in _objects(_LEADING_THINK.sub("", reply, count=1)) if "verdict" in o]
    if len(found) != 1:
        return None
    obj = found[0]
    verdict = obj["verdict"].strip().lower() if isinstance(obj["verdict"], str) else None
    reason = obj.get("reason").strip() if isinstance(obj.get("reason"), str) else ""
    if verdict not in ("feasible", "infeasible") or not reason:
        return None
    conf = obj.get("confidence")
    ok = isinstance(conf, (int, float)) and not isinstance(conf, bool) and 0.0 <= conf <= 1.0
    return ScreenReply(verdict, reason, float(conf) if ok else None)
