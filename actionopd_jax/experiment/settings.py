"""Settings of the main job (`experiment:` section of the run config), as plain data.

The main job is what `actionopd train` runs with the embedded defaults: a warm start with KD
on BFCL training tasks, ActionOPD steps, and an evaluation of the student before and after
ActionOPD on held-out tasks (see `actionopd_jax/experiment/job.py`). The trainer sections of
the config (train.*, collect.*, teacher.*, matcher.*, model.*) keep their meaning; this
section only says what the main job adds around them and where it departs from them.

This module imports nothing heavy: `actionopd_jax.config` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TEACHER_MODES = ("auto", "reference", "endpoint")


@dataclass(frozen=True)
class StudentShape:
    """Shape of the random-init student, used when model.hf_path is empty. The vocabulary is
    the tokenizer's size, rounded up to a multiple of 64. On CPU, dense attention costs most
    of the time and grows with heads x prompt length^2; with the schema tokens (prompts of
    ~350-1000 tokens) four heads are affordable and, unlike one, learn to read the state."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    init_seed: int = 0


@dataclass(frozen=True)
class ExperimentConfig:
    enabled: bool = True  # `actionopd train` runs the main job; false: the plain trainer run
    # Teacher. "auto": the embedded privileged reference teacher when teacher.kind=none, else
    # the teacher.* endpoint. "reference" / "endpoint" force one of them.
    teacher: str = "auto"
    # Tasks: BFCL multi-turn tasks of one category whose tools come from exactly these
    # classes; split into train / held-out deterministically by task id (sha256 order).
    bfcl_category: str = "base"
    bfcl_classes: tuple[str, ...] = ("TradingBot",)
    heldout_fraction: float = 0.33
    max_train_tasks: int = 0  # 0: every training task (ActionOPD starts each of them every step)
    max_heldout_tasks: int = 0  # 0: every held-out task
    # Tiny tokenizer (when model.tokenizer and model.hf_path are empty): byte-level BPE of this
    # size, trained on the package corpus plus the job's tool schemas (never on held-out text).
    tokenizer_vocab: int = 2048
    # One added token per tool-schema line of the tiny tokenizer (experiment/assets.py): the
    # prompt keeps every schema verbatim at ~1 token per tool. No effect with a real student.
    schema_tokens: bool = True
    cache_dir: str = ""  # tokenizer / random student cache (default ~/.cache/actionopd_jax/main_job)
    student: StudentShape = field(default_factory=StudentShape)
    # Warm start on the teacher's trajectories of the training tasks (experiment/warm_start.py):
    # next-token pretraining on the whole conversations, then KD on the teacher's turns
    # (0 epochs: that stage is skipped). Both use kd_lr and kd_examples_per_step.
    pretrain_epochs: int = 15
    kd_epochs: int = 12
    kd_lr: float = 3e-3
    kd_examples_per_step: int = 4  # examples per warm-start update
    # ActionOPD phase. opd_lr replaces train.lr for this job (0: use train.lr). The paper's
    # 1e-6 is for a pretrained 4B student; a random-init tiny student does not move with it.
    opd_lr: float = 3e-4
    # Context budget of the job's prompts (0: collect.max_prompt_tokens). train.max_seq_len is
    # raised to budget + collect.max_response_tokens when smaller.
    max_prompt_tokens: int = 3072
    # Evaluation (greedy) before and after ActionOPD on the held-out tasks.
    eval_max_new_tokens: int = 64
    eval_concurrency: int = 4
    # Shape buckets of the job's sampler (prompt lengths): few programs to compile.
    prompt_buckets: tuple[int, ...] = (512, 1024, 2048, 3072)


def validate_experiment(exp: ExperimentConfig, error: type[Exception] = ValueError) -> None:
    """Field checks of the `experiment:` section; `error` is the exception type to raise
    (the config loader passes its ConfigError)."""
    if exp.teacher not in TEACHER_MODES:
        raise error(f"experiment.teacher={exp.teacher!r}; expected one of {TEACHER_MODES}")
    if not 0.0 < exp.heldout_fraction < 1.0:
        raise error(f"experiment.heldout_fraction must be in (0, 1), got {exp.heldout_fraction}")
    if not exp.bfcl_classes:
        raise error("experiment.bfcl_classes must name at least one BFCL class (e.g. [TradingBot])")
    for key in ("max_train_tasks", "max_heldout_tasks", "pretrain_epochs", "kd_epochs", "max_prompt_tokens"):
        if getattr(exp, key) < 0:
            raise error(f"experiment.{key} must be >= 0, got {getattr(exp, key)}")
    for key in ("kd_examples_per_step", "eval_max_new_tokens", "eval_concurrency", "tokenizer_vocab"):
        if getattr(exp, key) < 1:
            raise error(f"experiment.{key} must be >= 1, got {getattr(exp, key)}")
    if exp.kd_lr <= 0 or exp.opd_lr < 0:
        raise error(f"experiment.kd_lr must be > 0 and experiment.opd_lr >= 0 (0: train.lr), "
                    f"got {exp.kd_lr} and {exp.opd_lr}")
    if list(exp.prompt_buckets) != sorted(set(exp.prompt_buckets)) or not exp.prompt_buckets \
            or exp.prompt_buckets[0] < 1:
        raise error(f"experiment.prompt_buckets must be strictly increasing positive lengths, got {exp.prompt_buckets}")
    s = exp.student
    if min(s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.num_attention_heads,
           s.num_key_value_heads, s.head_dim, s.max_position_embeddings) < 1:
        raise error("experiment.student: every size must be >= 1")
    if s.num_attention_heads % s.num_key_value_heads:
        raise error(f"experiment.student.num_attention_heads={s.num_attention_heads} must be a multiple of "
                    f"num_key_value_heads={s.num_key_value_heads}")
