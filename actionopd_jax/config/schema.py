"""Run configuration schema: nested frozen dataclasses whose defaults are the tiny CPU job.

This module is the data only: the sections, `Config`, and `build_section`, which turns a
plain tree into them (unknown keys are errors that name the key and suggest the closest
valid one; values are checked against the field types). Building a checked config from
the defaults, a YAML file and `a.b=c` overrides is config/load.py; the cross-field checks
are config/checks.py. `Config.to_dict()` is what gets written to a run directory and into
every checkpoint; `experiment_changes` compares two of those trees (resume), so the trainer
reads it from here without importing the front end.

Paper settings (ActionOPD, sec. 3 and appendix B): N=4 candidates, K=3 teacher samples,
lambda=0.5, PPO clip 0.2, dual clip 3, one PPO epoch over minibatches, student sampling
T=0.6 / p=0.95 / k=20 with 4k-token responses (configs/paper/*.yaml). The optimizer (AdamW,
lr 1e-6 constant, no warmup) is ours: the paper's table 7 is not in the text we have.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from actionopd_jax.config.errors import ConfigError
from actionopd_jax.config.eval_section import RETIRED_EVAL_KEYS, EvalConfig
from actionopd_jax.config.experiment import ExperimentConfig


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # key of actionopd_jax.model.PRESETS, used when hf_path is empty
    hf_path: str = ""  # HF checkpoint dir (config.json + safetensors) to start from
    tokenizer: str = ""  # tokenizer dir (default: hf_path; the tiny job builds one)
    dtype: str = "float32"  # compute dtype ("bfloat16": bf16 compute, master weights stay param_dtype)
    param_dtype: str = "float32"  # master weights
    remat: str = "none"  # "none" | "full" | "dots" | "attn" | "offload": per-layer rematerialisation
    # "auto" (splash on TPU, cudnn on GPU, the blocked path on CPU) | "splash" | "cudnn" | "xla" | "cpu"
    attention: str = "auto"
    scan_unroll: int = 1  # layers per layer-scan iteration (0: all; 1: compile time flat in depth)
    init_seed: int = 0  # random init when there is no hf_path


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1  # -1: all devices the other axes leave
    tensor: int = 1
    device_memory_gb: float = 0.0  # for --check without the devices (0: read from the device)
    # the hardware the recipe is for (actionopd_jax/aot/targets.py: v5p-8, v5p-16, v5p-32, v5e-16,
    # v5e-64, v6e-8, h100x8, h200x1, h200x8): `train --check` plans for it whatever this host is,
    # `train --check --aot` compiles for it
    target: str = ""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3  # collection steps (each: collect, then one PPO epoch of updates)
    loss: str = "actionopd"  # "actionopd" | "kd" | "opd"
    lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.01  # veRL's actor default (the paper builds on verl-agent; not stated)
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping (veRL default)
    clip_eps: float = 0.2  # PPO clip width eta
    dual_clip: float = 3.0  # dual-clip constant c for negative advantages
    ppo_epochs: int = 1  # the paper: one epoch over the collected candidates
    minibatch_rows: int = 16  # rows (prompt + one candidate) per optimizer update, all processes
    microbatch_rows: int = 8  # rows per forward/backward; gradients accumulate over microbatches
    sort_by_length: bool = True  # minibatches of similar-length rows (less padding)
    bucket_multiple: int = 64  # sequence widths are rounded up to buckets of this granularity
    max_seq_len: int = 2048  # prompt + response tokens of one row
    logits_chunk: int = 0  # score response tokens in chunks of this many (0: all at once)
    # >0: fused LM head + log-softmax over this many vocabulary rows at a time; never holds the
    # [tokens, vocab] logits (train/head_logprobs.py). Wins on CPU; 0 keeps the plain head.
    vocab_chunk: int = 0
    old_logprobs: str = "recompute"  # "recompute" (trainer forward) | "sampler"
    # pack the N candidates of a state behind one copy of their prompt (model/attention.SharedPrefix):
    # a 24k-token prompt is computed once, not N times. microbatch_rows then counts packed rows
    # (states); minibatch_rows still counts candidates. Needs splash (TPU) or xla attention.
    shared_prompt: bool = False


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
    price: tuple[float, ...] = ()  # as teacher.price


@dataclass(frozen=True)
class EnvConfig:
    name: str = "synthetic"  # "bfcl" | "tau2" | "mcp" | "awm" | "envscaler" | "synthetic"
    domains: tuple[str, ...] = ()
    split: str = "train"  # tau2: official "train" (178 tasks) | "test" (100) | "base"; BFCL has no splits
    # explicit training tasks (ids of the env's tasks; empty: all of domains/split) and the tasks
    # this run's own evaluation scores; an explicit disjoint pair is the way to train on BFCL
    task_ids: tuple[str, ...] = ()
    heldout_task_ids: tuple[str, ...] = ()
    # training on tasks `eval` scores (all of BFCL, tau2's test split) is refused unless this is set
    allow_eval_overlap: bool = False
    user_model: str = ""
    user_base_url: str = ""
    user_api_key_env: str = ""
    user_temperature: float = 0.7
    user_top_p: float = 0.8
    user_top_k: int = 20
    user_max_tokens: int = 8192
    user_provider: str = ""  # as teacher.provider ("": openai): how top_k and the thinking switch are sent
    user_enable_thinking: bool | None = False  # paper table 8: user simulator thinking off; null: no switch
    user_price: tuple[float, ...] = ()  # as teacher.price
    # env.name=mcp: any MCP tool server (actionopd_jax/envs/mcp). The server is a sandboxed
    # stdio command (mcp_command, an argv; an argument "{port}" makes it an HTTP server on a
    # free loopback port) or an existing streamable-HTTP endpoint (mcp_url). Tasks come from a
    # JSON-lines file (tasks_file; env.split selects a split, "all" every task).
    mcp_command: tuple[str, ...] = ()
    mcp_url: str = ""
    mcp_reset: str = "fresh"  # between episodes: "fresh" (new server) | "tool:NAME" | "command:ARGV"
    mcp_call_timeout_s: float = 30.0  # per tools/call (then the server is replaced), per EnvScaler method call
    mcp_pool_size: int = 0  # servers at most; 0: collect.concurrency (a url-only server shares its
    # state across sessions unless it keeps state per session: give it a pool of 1)
    # matcher evidence (paper A.3) beyond each tool's description + input schema: a JSON / YAML
    # file mapping tool name -> its implementation's source, as a file path (relative to the
    # mapping file) or the source text itself (several lines); "" = schemas only
    mcp_tool_sources: str = ""
    tasks_file: str = ""
    # AWM / EnvScaler pools (docs/formats.md): directories in the published layouts, the manifest of
    # admitted task ids `actionopd envs audit` writes, and the per-step mixture as "<pool>:<count>"
    # entries (paper: ["awm:59", "envscaler:5"]; empty: the whole step from env.name's pool)
    awm_dir: str = ""
    envscaler_dir: str = ""
    manifest: str = ""
    mixture: tuple[str, ...] = ()
    # which EnvScaler scenarios are played with the user simulator (env.user_*): "all", "none", or
    # task ids (exactly those); empty: each record's own "conversational" mark, else conversational,
    # as the paper plays the pool (the published records carry no mode: envs/envscaler/mode.py)
    envscaler_conversational: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 1
    keep: int = 3
    async_save: bool = True
    save_on_sigterm: bool = True
    dir: str = ""  # default: <run dir>/checkpoints


@dataclass(frozen=True)
class DistributedConfig:
    mode: str = "auto"  # "auto" (initialize on a TPU pod / when an address is given) | "on" | "off"
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    initialization_timeout_s: int = 300


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny_cpu"
    root: str = "runs"
    dir: str = ""  # explicit run directory (default: <root>/<utc>-<name>)
    seed: int = 0  # every PRNG key of the run is folded from this
    log_every: int = 1
    tensorboard: bool = True
    wandb_project: str = ""  # W&B logging when set and wandb is installed
    progress: bool = True
    # JAX's persistent compile cache ("": JAX_COMPILATION_CACHE_DIR if set, else
    # ~/.cache/actionopd_jax/jax_compile; "none": off); see actionopd_jax/compile_cache.py
    compile_cache_dir: str = ""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # caps over the whole run (resumes included); 0: none. budget_usd: the money of every priced
    # role (teacher.price, matcher.price, env.user_price); budget_<role>_tokens: that role's
    # prompt + completion tokens (the judge is the matcher's). Checked before each step against
    # what the last step took: the run stops at a step boundary, saved, exit 3; raise and rerun
    budget_usd: float = 0.0
    budget_teacher_tokens: int = 0
    budget_matcher_tokens: int = 0
    budget_user_tokens: int = 0


@dataclass(frozen=True)
class Config:
    """The whole run config. Build a checked one with config.load (load_config, from_dict);
    a copy with dotted keys changed, checked again: config.load.replace_keys(cfg, **changes)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    matcher: MatcherConfig = field(default_factory=MatcherConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)  # the main job (actionopd_jax/experiment)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    return f"; valid keys here: {', '.join(prefix + v for v in sorted(valid))}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check (and gently convert) a value against a field type; errors name the key."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # e.g. a budget given as a number
            return str(value)
        if value is None:
            return ""
        raise ConfigError(f"{where}: expected a string, got {value!r} ({type(value).__name__})")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(others) != 1 or len(typing.get_args(hint)) != 2:
            raise ConfigError(f"{where}: unsupported union type")  # only `X | None` is used
        return None if value is None else _coerce(value, others[0], where)
    raise ConfigError(f"{where}: unsupported field type {hint}")


def retired_key(dotted: str, value: Any) -> bool:
    """True for a key the schema no longer has, given the value that meant what the code does
    now (an older config, or a run's saved config.yaml, loads unchanged: the key is dropped);
    ConfigError saying where the setting went for any other value; False for any other key."""
    section, _, key = dotted.partition(".")
    if section != "eval" or key not in RETIRED_EVAL_KEYS:
        return False
    meant, where = RETIRED_EVAL_KEYS[key]
    if value == meant:
        return True
    raise ConfigError(f"{dotted}={value!r} is no longer a setting: {where}")


def build_section(cls, data: dict[str, Any], prefix: str):
    """`cls` (a section dataclass or `Config`) from a plain tree, keys and types checked; the
    cross-field checks are not run here (config.load.from_dict runs them)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names and retired_key(full, value):
            continue
        if key not in names:
            raise ConfigError(f"unknown config key {full!r}" + suggest(key, names, prefix))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_section(hint, value or {}, f"{full}.")
        else:
            kwargs[key] = _coerce(value, hint, full)
    return cls(**kwargs)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that may differ between a checkpoint and the config that resumes it: they change how
# the run executes (layout, paths, logging, endpoints), not what experiment it is.
RESUME_SAFE_PREFIXES: tuple[str, ...] = (
    "mesh.", "checkpoint.", "eval.", "run.name", "run.root", "run.dir", "run.log_every",
    "run.tensorboard", "run.wandb_project", "run.progress", "run.compile_cache_dir", "run.distributed.",
    "train.steps", "train.microbatch_rows", "train.logits_chunk", "train.vocab_chunk", "model.remat", "model.scan_unroll", "model.attention", "model.hf_path",
    "model.tokenizer", "collect.concurrency", "teacher.base_url", "teacher.api_key_env",
    "teacher.cache_dir", "teacher.timeout_s", "teacher.concurrency", "matcher.base_url",
    "matcher.api_key_env", "matcher.cache_dir", "matcher.timeout_s", "matcher.concurrency",
    "env.user_base_url", "env.user_api_key_env",
    # pool paths: a moved directory is the same experiment (the mixture stream's fingerprint
    # covers the admitted tasks themselves, so changed content still refuses to resume)
    "env.awm_dir", "env.envscaler_dir", "env.manifest",
    # what the teacher costs and how much of it a run may spend: the experiment is the same
    "run.budget_", "teacher.price", "matcher.price", "env.user_price", "collect.max_outage_steps",
)


def experiment_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose change would make a resumed run a different experiment ('key: old -> new')."""
    a, b = flatten(saved), flatten(current)
    # a key the checkpoint predates ran at the value the code then had, which is the default a
    # key is added with (a new setting must not change what an old config meant): absent =
    # default, so adding a key does not make every older checkpoint a different experiment
    defaults = flatten(Config().to_dict())
    out = []
    for key in sorted(set(a) | set(b)):
        old = a[key] if key in a else defaults.get(key)
        if key.startswith(RESUME_SAFE_PREFIXES) or old == b.get(key):
            continue
        out.append(f"{key}: {old!r} -> {b.get(key)!r}")
    return out
