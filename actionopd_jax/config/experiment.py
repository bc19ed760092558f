"""The `experiment:` section of the run config: the main job's settings, as plain data.

The main job is what `actionopd train` runs with the embedded defaults: a warm start with KD
on BFCL training tasks, ActionOPD steps, and an evaluation of the student before and after
ActionOPD on held-out tasks (see `actionopd_jax/experiment/job.py`). The trainer sections of
the config (train.*, collect.*, teacher.*, matcher.*, model.*) keep their meaning; this
section only says what the main job adds around them and where it departs from them.

A leaf of the config package (config.schema imports it); the section's checks are in
config/checks.py with the other checks.
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
class ReferenceTeacherSettings:
    """How the embedded privileged reference teacher disagrees with itself (issue 26 item 8;
    envs/reference_disagreement.py says what the alternative and wrong actions are). All 0:
    deterministic, its K samples of a state identical (c is 0 or K, lambda never acts)."""

    alternative: float = 0.0  # P(a sample is another reference call still due in the turn)
    wrong: float = 0.0  # P(a sample is a plausible wrong action)
    seed: int = 0
    # Seconds each answer waits before it is sent: a paid API's latency (the paper's median is
    # 12 s), so a schedule (collect.max_staleness) can be measured here. Answers are unchanged.
    latency_s: float = 0.0


@dataclass(frozen=True)
class ExperimentConfig:
    enabled: bool = True  # `actionopd train` runs the main job; false: the plain trainer run
    # Teacher. "auto": the embedded privileged reference teacher when teacher.kind=none, else
    # the teacher.* endpoint. "reference" / "endpoint" force one of them.
    teacher: str = "auto"
    reference: ReferenceTeacherSettings = field(default_factory=ReferenceTeacherSettings)
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

