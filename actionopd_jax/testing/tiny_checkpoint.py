"""Tiny random Qwen3 checkpoints in Hugging Face format, built locally (nothing downloads).

`make_tiny_hf_checkpoint` goes through transformers' PyTorch `Qwen3ForCausalLM` (needs torch,
the test extra); `make_tiny_numpy_checkpoint` writes random safetensors + config.json with
numpy only, for tests that must not need torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actionopd_jax.model.config import Qwen3Config

TINY_DEFAULTS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                     tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-6)


def tiny_config(**overrides) -> Qwen3Config:
    """Our config with the tiny defaults above (overrides win); `dtype` sets the parameter dtype
    (the compute dtype is the model's RuntimeOptions)."""
    kw = dict(TINY_DEFAULTS)
    dtype = overrides.pop("dtype", None)
    kw.update(overrides)
    if dtype is not None:
        kw.update(param_dtype=dtype)
    return Qwen3Config(**kw)


def make_tiny_hf_checkpoint(out_dir, *, seed: int, dtype: str = "float32", init_std: float = 0.02,
                            **overrides) -> Path:
    """Random `Qwen3ForCausalLM` saved with `save_pretrained` (safetensors) into `out_dir`.

    Norm weights are randomised too (HF initialises them to 1), so a test catches a norm that is
    loaded into the wrong place.  Returns the directory.
    """
    import torch
    import transformers

    cfg = tiny_config(**overrides)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "torch_dtype", "dtype",
                                                      "rope_scaling", "rope_parameters")})
    hf_cfg.architectures = ["Qwen3ForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = model.to(torch_dtype).eval()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_numpy_checkpoint(out_dir, *, seed: int, dtype: str = "float32", init_std: float = 0.02,
                               shard_bytes: int | None = None, **overrides) -> Path:
    """Random HF-format Qwen3 checkpoint written with numpy + safetensors (no torch).

    With `shard_bytes`, tensors are split over several files with a model.safetensors.index.json.
    """
    import json

    import ml_dtypes
    from safetensors.numpy import save_file

    from actionopd_jax.model.hf_names import tensor_specs

    cfg = tiny_config(**overrides, dtype=dtype)
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {}
    for s in tensor_specs(cfg):
        if s.hf_name.endswith("norm.weight"):
            x = 1.0 + 0.1 * rng.standard_normal(s.hf_shape)
        else:
            x = init_std * rng.standard_normal(s.hf_shape)
        tensors[s.hf_name] = x.astype(np.float32).astype(np_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        groups: list[dict] = [{}]
        size = 0
        for name, x in tensors.items():
            if groups[-1] and size + x.nbytes > shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = x
            size += x.nbytes
        weight_map = {}
        for k, g in enumerate(groups):
            fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(g, str(out / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in g})
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
             "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    return out
