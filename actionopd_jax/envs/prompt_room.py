"""How long the training tasks' first prompts are, measured before a run (`train --check`).

A trajectory whose first prompt does not fit `collect.max_prompt_tokens` ends with
context_overflow before its first decision: no sample, no teacher call, no update. A recipe
whose budget is below its tasks' prompts therefore trains nothing while every other check
passes (two shipped tau2 recipes did: 4,096 tokens against tau2 prompts of 4.8k-7.2k). So
the prompts are measured, under the student's chat template and tokenizer:

- tau2: per domain, the agent's system prompt (the domain policy), the greeting and the tool
  schemas, which every task of the domain shares; the user's first message comes on top, so
  this is a floor (it needs the user simulator, an LLM);
- BFCL: each task's first observation, rendered (the environment resets offline);
- AWM / EnvScaler: the counts `actionopd envs audit` wrote into the manifest;
- anything else (MCP task files): not measured, and said so.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from actionopd_jax.types import Task


@dataclasses.dataclass(frozen=True)
class PromptLength:
    """`tasks` training tasks whose first prompt is `tokens` long (`floor`: at least that)."""

    label: str
    tokens: int
    tasks: int = 1
    floor: bool = False


def tau2_floor(domain: str, tokenizer: Any) -> int:
    """Tokens of a tau2 domain's first prompt before the user speaks."""
    from actionopd_jax.chat.template import render_ids
    from actionopd_jax.envs.tau2_env import GREETING, agent_system_prompt
    from actionopd_jax.envs.tau2_tasks import environment_constructor

    env = environment_constructor(domain)()
    messages = [{"role": "system", "content": agent_system_prompt(env.get_policy())},
                {"role": "assistant", "content": GREETING}]
    return int(render_ids(tokenizer, messages, [t.openai_schema for t in env.get_tools()]).size)


def bfcl_length(task: Task, tokenizer: Any) -> int:
    from actionopd_jax.chat.template import render_ids
    from actionopd_jax.envs.bfcl import BFCLEnv

    obs = asyncio.run(BFCLEnv().reset(task))
    return int(render_ids(tokenizer, obs.messages, obs.tools or None).size)


def measure(task_sets: list[tuple[str, list[Task]]], tokenizer: Any, manifest_counts: dict[str, dict[str, int]]
            ) -> tuple[list[PromptLength], list[str]]:
    """(lengths, notes): the first-prompt lengths of every task of `task_sets` ((name, tasks)
    as envs.task_sets.training_task_sets gives them) and a note per set not measured.
    `manifest_counts`: {pool: {task id: tokens}} from the pools' manifest."""
    lengths: list[PromptLength] = []
    notes: list[str] = []
    domains: dict[str, int] = {}
    for name, tasks in task_sets:
        for task in tasks:
            if task.env.startswith("tau2_"):
                domains[task.env] = domains.get(task.env, 0) + 1
            elif task.env == "bfcl":
                lengths.append(PromptLength(f"bfcl {task.task_id}", bfcl_length(task, tokenizer)))
            elif task.env in manifest_counts and task.task_id in manifest_counts[task.env]:
                lengths.append(PromptLength(f"{task.env} {task.task_id}", int(manifest_counts[task.env][task.task_id])))
            else:
                notes.append(name)
                break
    for env, count in sorted(domains.items()):
        lengths.append(PromptLength(f"{env} (before the user speaks)",
                                    tau2_floor(env.removeprefix("tau2_"), tokenizer), tasks=count, floor=True))
    return lengths, sorted(set(notes))


def context_problem(prompt: int, reply: int, context: int, *, what: str, reply_key: str) -> str | None:
    """None when a `prompt`-token prompt plus a `reply`-token reply fits the model's `context`
    (its max_position_embeddings); else what does not fit, for a ConfigError (issue 43 item 2:
    a budget the model cannot hold ends every episode before its first action)."""
    if prompt + reply <= context:
        return None
    if prompt >= context:
        return (f"{what} is {prompt:,} tokens, the model's whole context is {context:,}: nothing fits beside it; use a "
                f"model with a longer context or lower the budget")
    return (f"{what} of {prompt:,} tokens plus {reply_key}={reply:,} is {prompt + reply:,} tokens, over the model's "
            f"{context:,}-token context: lower {reply_key} to at most {context - prompt:,} (or the prompt budget)")


__all__ = ["PromptLength", "bfcl_length", "context_problem", "measure", "tau2_floor"]
