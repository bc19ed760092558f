"""Where training groups come from and who scores them: the `collect:` (with its synthetic
stand-in), `kd:`, `teacher:` and `matcher:` sections of the run config.

A leaf of the config package (config.schema assembles `Config` from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SyntheticConfig:
    """The deterministic stand-in group source (collect.kind=synthetic)."""

    groups_per_step: int = 4
    prompt_tokens_min: int = 8
    prompt_tokens_max: int = 48
    response_tokens_min: int = 2
    response_tokens_max: int = 16


@dataclass(frozen=True)
class CollectConfig:
    kind: str = "synthetic"  # "synthetic" | "actionopd" (the state-group collector) | "kd" | "opd" (baselines)
    num_candidates: int = 4  # N
    teacher_samples: int = 3  # K
    freq_bonus: float = 0.5  # lambda
    reward: str = "actionopd"  # "actionopd" | "binary" | "validity"
    commit: str = "argmax"  # "argmax" (uniform tie-break) | "random"
    task_starts_per_step: int = 4
    max_decisions: int = 20  # decisions per trajectory
    # consecutive steps in which no task start got a single teacher answer (an outage, a wrong
    # URL or key) before the run stops with that message (0: never stop)
    max_outage_steps: int = 2
    # eta of issue 44: 0 = the paper's synchronous loop (collect, then update); >= 1 = episodes
    # keep running on a background loop across updates, and a state group is trained on only
    # while the policy that sampled it is at most eta updates old (collect/async_source.py)
    max_staleness: int = 0
    temperature: float = 1.0  # rollout temperature (also used to score old/new logprobs)
    top_p: float = 1.0
    top_k: int = 0
    max_response_tokens: int = 64
    max_prompt_tokens: int = 1024
    enable_thinking: bool = False
    concurrency: int = 16  # trajectories in flight
    # tokens one sampler device call may hold (padded prompt tokens x 1.25 + generated cache slots;
    # sampling/budget.py): "auto" = from the accelerator's free memory (no budget on CPU),
    # "none", or a number. States beyond it go to the next call.
    sampler_token_budget: str = "auto"
    # how the student is sampled: "engine" (continuous batching over a paged cache, engine/:
    # each state back as soon as its own samples are done) or "static" (states batched into
    # device calls, sampling/: the oracle the engine's tests are held to); "auto": the engine,
    # except on NVIDIA GPUs, where the H200 measured it slower (config/rollout.py).
    # The engine's shapes: decode slots (0: concurrency x num_candidates), decode steps per
    # segment, tokens per page
    sampler: str = "auto"
    engine_slots: int = 0
    engine_segment: int = 16
    engine_page_size: int = 16
    # the engine's paged attention: "auto" (TPU: the Pallas paged kernel, NVIDIA GPU: the Pallas
    # GPU kernel, CPU: the gather path over live pages), "paged_tpu", "paged_gpu" or "gather"
    engine_attention: str = "auto"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass(frozen=True)
class KDConfig:
    """KD baseline (collect.kind=kd, train.loss=kd; paper B.4, baselines/kd_fresh.py)."""

    # empty: B.4's schedule, fresh teacher (teacher.*) episodes every step on the run's task
    # starts; a JSONL of recorded teacher episodes: train on those, collected once
    trajectories: str = ""
    trials: int = 4  # fresh teacher episodes per task start per step (paper: four)
    min_reward: float = 1.0  # keep episodes whose score reward is at least this (successful ones)
    examples_per_step: int = 0  # recorded schedule only: demonstrated turns per step (0: train.minibatch_rows)


@dataclass(frozen=True)
class TeacherConfig:
    # "openai" (an OpenAI-compatible endpoint) | "vertex" | "local" (teacher.model = an HF Qwen3
    # directory sampled in-process) | "self" (Self-ActionOPD) | "none"
    kind: str = "none"
    model: str = ""
    base_url: str = ""
    api_key_env: str = ""  # name of the environment variable holding the key (never the key)
    # kind=openai: which server speaks there (teacher/endpoint.py PROVIDERS: vllm, sglang, deepseek,
    # dashscope, openrouter, openai, actionopd); it decides how enable_thinking is sent. "": openai
    provider: str = ""
    reasoning_effort: str = ""  # sent as the request's reasoning_effort when set (e.g. DeepSeek "max")
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 8192
    enable_thinking: bool | None = True  # null: send no thinking switch (the endpoint's default)
    retries: int = 2  # per requested sample, for parser/schema-invalid output
    # kind=self on tau2: the prepared per-task summaries of the users' private goals (paper B.5;
    # JSON lines, docs/formats.md "Privileged summaries"). A relative path in a config file is
    # relative to that file.
    privileged_summaries: str = ""
    cache_dir: str = ""  # default: <run dir>/cache/teacher
    timeout_s: float = 600.0
    concurrency: int = 32
    # USD per million tokens [input, cached input, output]; empty: none (tokens are still
    # counted). No price is built in: providers change them. `train --check` estimates spend.
    price: tuple[float, ...] = ()


@dataclass(frozen=True)
class MatcherConfig:
    kind: str = "rules+llm"  # "rules+llm" | "rules"
    model: str = ""
    base_url: str = ""
    api_key_env: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    cache_dir: str = ""
    timeout_s: float = 120.0
    concurrency: int = 32
    provider: str = ""  # as teacher.provider ("": openai)
    enable_thinking: bool | None = False  # paper table 8: matcher thinking off; null: send no switch
    tool_evidence: bool = True  # the judge sees each tool's source + docstring; a judged pair without it: unavailable
    context_window: int = 32768  # the judge's window in tokens (prompt + max_tokens): sizes the conversation it sees
    context_chars: int = 0  # a fixed character budget for that conversation instead (0: sized to context_window)
    format_retries: int = 2  # re-asks after a reply outside the verdict format; then unavailable (paper A.3)
    # the execution stage (issue 45): "auto" decides same-name tool-call pairs by running both on
    # forks of the episode's state where its environment can fork (EnvScaler, BFCL, AWM); "off": rules, then judge
    execution: str = "auto"
    price: tuple[float, ...] = ()  # as teacher.price
