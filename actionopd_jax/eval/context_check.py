"""`actionopd eval --check`: the benchmarks' first prompts and the reply budget against the
evaluated model's own context (issue 43 items 2 and 9), read without loading its weights.

The in-process student evaluated in a fixed 8,192 tokens: a tau2 prompt plus a 4,096-token
reply could not fit and every episode ended before its first action, while --check said
nothing. Now the context is the model's own (its config's max_position_embeddings, narrowed
only by --engine-max-len), a reply that does not fit beside a prompt is fitted to what the
prompt leaves (eval/cli.py), and --check measures each benchmark's first prompts
(envs/prompt_room.py) under the model's tokenizer:

- a first prompt that fills the whole context cannot be played at all: refused (exit 2);
- a first prompt that leaves less than the reply budget: said, with the reply it will get.

An endpoint's context is its server's: not measured, and said so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from actionopd_jax.types import Task


def model_context(args: argparse.Namespace) -> tuple[int, Any, str] | None:
    """(context in tokens, tokenizer, what was read) of --hf / --checkpoint, from the model's
    config and the recorded tokenizer (no weights read); None for --endpoint / --reference."""
    from actionopd_jax.chat import load_tokenizer

    source = args.hf or args.checkpoint
    if not source:
        return None
    path = Path(source)
    if (path / "config.json").is_file():
        context = int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
        tok = Path(args.tokenizer) if args.tokenizer else path
        return context, load_tokenizer(tok), f"{path}/config.json"
    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.checkpoint.run import locate, recorded_tokenizer

    found = locate(path, args.step, announce=lambda _line: None)
    ckpt = Checkpointer(found.ckpt_dir, read_only=True, allow_unverified=True)
    try:
        step = found.step if found.step is not None else ckpt.steps()[-1]
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    tok = Path(args.tokenizer) if args.tokenizer else recorded_tokenizer(found, meta)
    if tok is None:
        raise ValueError(f"{source}: the run recorded no tokenizer; pass --tokenizer DIR")
    context = int(meta["model_config"]["max_position_embeddings"])
    return context, load_tokenizer(tok), f"step {step} of {found.ckpt_dir}"


def context_lines(args: argparse.Namespace, reply: int, task_sets: list[tuple[str, list[Task]]]
                  ) -> tuple[list[str], list[str]]:
    """(plan lines, problems): each benchmark's longest first prompt plus `reply` new tokens
    against the model's context; a problem per benchmark with a prompt that cannot fit at all."""
    from actionopd_jax.envs.prompt_room import measure

    got = model_context(args)
    if got is None:
        why = ("an endpoint's context is its server's (what does not fit is refused there)" if args.endpoint else
               "the reference policy generates nothing" if args.reference else
               "no model named: give --checkpoint or --hf to measure the prompts against its context")
        return [f"context    not measured: {why}"], []
    context, tokenizer, what = got
    how = f"the model's {context:,} tokens ({what})"
    if args.engine_max_len and args.engine_max_len < context and getattr(args, "sampler", "auto") != "static":
        context, how = args.engine_max_len, f"--engine-max-len {args.engine_max_len:,} (the model holds {context:,})"
    lines, problems = [f"context    {how}; {reply:,} new tokens per reply, fitted to what a prompt leaves"], []
    for name, tasks in task_sets:
        lengths, unmeasured = measure([(name, tasks)], tokenizer, {})
        if not lengths:
            lines.append(f"  {name:<22} first prompts not measured ({', '.join(unmeasured) or 'no tasks'})")
            continue
        longest = max(lengths, key=lambda x: x.tokens)
        at_least = "at least " if longest.floor else ""
        over = [x for x in lengths if x.tokens >= context]
        if over:
            n = sum(x.tasks for x in over)
            problems.append(f"{name}: the first prompt of {n} of {sum(x.tasks for x in lengths)} task(s) fills the "
                            f"whole context ({how}; longest {at_least}{longest.tokens:,} tokens, {longest.label}): "
                            "those episodes could not take one action. Evaluate a model with a longer context "
                            "(or no lower --engine-max-len), or leave these tasks out")
            continue
        left = context - longest.tokens
        fit = (f"fits with {reply:,} new tokens" if left >= reply else
               f"leaves {left:,} tokens: its replies get at most that many, not {reply:,}")
        lines.append(f"  {name:<22} longest first prompt {at_least}{longest.tokens:,} tokens ({longest.label}): {fit}")
    return lines, problems


__all__ = ["context_lines", "model_context"]
