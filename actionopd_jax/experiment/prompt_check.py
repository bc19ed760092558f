"""The main job's prompt room, for `train --check` and `compare --check` (issue 43 item 6).

The plain trainer's check measured its training tasks' first prompts (envs/prompt_room.py);
the main job (every configs/tiny/* config, and the compare presets built on it) skipped it:
`tiny_cpu` passed with a 256-token budget and `main_remote_teacher` with 1,024 against
prompts of ~2.4k. Here the job's own tasks (its sha256 train / held-out split) are measured
under the tokenizer the job will use:

- a random-init student: the job's tiny tokenizer (experiment/assets.py; built once into
  experiment.cache_dir, as the run itself does);
- a checkpoint student: its tokenizer when on this host, else the offline Qwen3 one.

and checked three ways:
- ActionOPD: every training task's first prompt within the job's budget
  (experiment.max_prompt_tokens, else collect.max_prompt_tokens);
- the budget plus a reply (collect.max_response_tokens) within the student's context;
- held-out evaluation: every held-out task's first prompt plus its reply budget
  (experiment.eval_max_new_tokens) within the student's context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.types import Task

BUDGET_KEYS = "experiment.max_prompt_tokens (0: collect.max_prompt_tokens)"


def job_tokenizer(cfg: Config, tasks: list[Task]) -> tuple[Any, str]:
    """(tokenizer, note): the one the job will render its prompts with."""
    from actionopd_jax.chat import load_tokenizer

    m = cfg.model
    if m.hf_path or (m.tokenizer and Path(m.tokenizer).exists()):
        from actionopd_jax.collect.source import _check_tokenizer

        return _check_tokenizer(cfg)
    from actionopd_jax.experiment.assets import build_job_tokenizer

    return load_tokenizer(build_job_tokenizer(cfg.experiment, tasks)), " (the job's tiny tokenizer)"


def check_job_prompts(cfg: Config, plan_cfg: Config, split: Any, context: int) -> list[str]:
    """Plan lines on the job's prompts; raises ConfigError naming what cannot fit. `plan_cfg`:
    the ActionOPD phase's config (env.task_ids = the training tasks, its prompt budget);
    `context`: the student's positions (max_position_embeddings)."""
    from actionopd_jax.collect.source import prompt_room
    from actionopd_jax.envs.prompt_room import context_problem, measure

    tokenizer, how = job_tokenizer(cfg, split.train + split.heldout)
    try:
        line = prompt_room(plan_cfg, tokenizer)[0]
    except ConfigError as e:
        raise ConfigError(f"{e}. The main job's budget is {BUDGET_KEYS}{how}") from None
    c = plan_cfg.collect
    problems = [context_problem(c.max_prompt_tokens, c.max_response_tokens, context,
                                what=f"the ActionOPD phase's prompt budget ({BUDGET_KEYS})",
                                reply_key="collect.max_response_tokens")]
    lines = [f"{line}{how}"] if line else []
    if split.heldout:
        lengths, _ = measure([("held-out", split.heldout)], tokenizer, {})
        longest = max(lengths, key=lambda x: x.tokens)
        reply = cfg.experiment.eval_max_new_tokens
        problems.append(context_problem(longest.tokens, reply, context,
                                        what=f"the longest held-out first prompt ({longest.label})",
                                        reply_key="experiment.eval_max_new_tokens"))
        lines.append(f"prompts    held-out: the longest first prompt ({longest.tokens:,} tokens, {longest.label}) plus "
                     f"{reply:,} new tokens fits the student's {context:,}-token context{how}")
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
    return lines


__all__ = ["check_job_prompts", "job_tokenizer"]
