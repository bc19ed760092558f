"""The student and how it learns: the `model:`, `mesh:` and `train:` sections of the run config.

A leaf of the config package (config.schema assembles `Config` from it).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # devices of this host kept for the sampler's rollout copy (0: rollout and training share every
    # device). k > 0: the trainer's mesh is built on the first D - k devices, the sampler samples on
    # the last k ("tensor" mesh), the weights moved there each step by one reshard (one process only)
    rollout_devices: int = 0


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
