"""The recipe's `eval:` section: how `actionopd eval --config RECIPE` scores a model, as the
paper's table 8 (evaluation rows) and B.3 state it. Every default here is the paper's; the
recipes name the benchmarks and splits they report.

- `student`: a trained or base Qwen3 student (`--checkpoint`, `--hf`, or an endpoint serving
  one with `--settings student`): thinking on, greedy, 4k new tokens per reply.
- `teacher`: a model evaluated directly behind its endpoint (table 1's "direct teacher
  evaluation"): thinking on, T=0.6, p=0.95 (Qwen3.7-Flash) or effort "max" (DeepSeek), 32k.
- `user`: tau2's evaluation user simulator (Qwen3.5-9B): thinking on, T=1, 8k. Not the
  training user of `env.user_*` (Qwen3.8-27B, thinking off, T=0.7): table 8 separates them.
- B.3: 4 trials per tau2 task (pass^1 and pass^4), BFCL's native 20 steps per turn with one
  trial, natural-language assertions off for every tau2 score (envs/tau2_score.py: always).
- tau2 runs on tau2's own harness prompts (`tau2_prompts`, envs/tau2_prompts.py).

A leaf of the config package, like config.schema that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EvalStudentConfig:
    temperature: float = 0.0  # table 8: greedy
    top_p: float | None = None  # null: not sent (greedy ignores it)
    top_k: int | None = None
    enable_thinking: bool | None = True  # table 8: thinking enabled; null: no switch sent
    max_tokens: int = 4096  # table 8: 4k per reply
    provider: str = ""  # an endpoint serving the student: how top_k / thinking are sent ("": openai)


@dataclass(frozen=True)
class EvalTeacherConfig:
    provider: str = ""  # as teacher.provider ("": openai)
    temperature: float | None = 0.6  # table 8, Qwen3.7-Flash; DeepSeek-V4-Flash: null + reasoning_effort
    top_p: float | None = 0.95
    top_k: int | None = None
    enable_thinking: bool | None = True
    reasoning_effort: str = ""  # DeepSeek-V4-Flash: "max"
    max_tokens: int = 32768  # table 8: 32k for both evaluated teachers


@dataclass(frozen=True)
class EvalUserConfig:
    model: str = ""  # table 8: Qwen3.5-9B
    base_url: str = ""
    api_key_env: str = ""  # the name of the variable holding the key, never the key
    provider: str = ""  # as teacher.provider ("": openai)
    temperature: float = 1.0  # table 8: T=1
    top_p: float | None = None
    top_k: int | None = None
    enable_thinking: bool | None = True  # table 8: the tau evaluation user thinks
    max_tokens: int = 8192  # table 8: 8k


@dataclass(frozen=True)
class EvalConfig:
    # `actionopd eval --bench` specs (eval/tasks.py): tau2 transfer scores the base splits
    # (`tau2_airline:base`, 50 / 114 / 114 tasks), the tau comparisons `:train` and `:test`
    benchmarks: tuple[str, ...] = ()
    trials: int = 4  # B.3: four trials per tau2 task; also per EnvScaler / AWM task
    bfcl_trials: int = 1  # B.3: BFCL's 800 tasks are run once
    bfcl_max_steps_per_turn: int = 20  # B.3: BFCL's native per-turn step limit
    # tau2's agent and user prompts: "tau2" (tau2's own harness prompts, as its leaderboard and
    # the paper's tables are scored) or "actionopd" (ours, the prompts training uses)
    tau2_prompts: str = "tau2"
    student: EvalStudentConfig = field(default_factory=EvalStudentConfig)
    teacher: EvalTeacherConfig = field(default_factory=EvalTeacherConfig)
    user: EvalUserConfig = field(default_factory=EvalUserConfig)


# Keys this section no longer has, with the value that meant what the section does now: a
# config (or a run's saved config.yaml) holding that value loads unchanged; another value is
# refused with where the setting went.
RETIRED_EVAL_KEYS: dict[str, tuple[object, str]] = {
    "every_steps": (0, "evaluation during training was never run; evaluate a checkpoint with `actionopd eval "
                       "--config RECIPE --checkpoint RUN` (remove eval.every_steps)"),
    "max_tokens": (4096, "the student's reply limit is eval.student.max_tokens (a directly evaluated teacher's: "
                         "eval.teacher.max_tokens)"),
}
