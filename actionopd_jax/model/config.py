"""Qwen3 dense decoder configuration: plain data, HF config.json conversion, presets, size/FLOP helpers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from actionopd_jax.model.rope import RopeYarn, rope_from_hf
from actionopd_jax.model.runtime import DTYPES as _DTYPES  # one list of dtypes (model/runtime.py)

_SUPPORTED_ARCH = "Qwen3ForCausalLM"
# transformers' Qwen3Config defaults for fields a config.json may leave out
_HF_DEFAULTS = {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rope_yarn: RopeYarn | None = None  # YaRN context extension (model/rope.py); None: plain RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    param_dtype: str = "float32"  # "float32" | "bfloat16": storage dtype of the parameters
    # execution settings (compute dtype, remat, attention, scan unroll) are not here: runtime.py

    def __post_init__(self):
        if self.param_dtype not in _DTYPES:
            raise ValueError(f"Qwen3Config.param_dtype={self.param_dtype!r}; expected one of {_DTYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.rope_yarn is not None and not isinstance(self.rope_yarn, RopeYarn):
            raise ValueError(f"Qwen3Config.rope_yarn must be a model.rope.RopeYarn or None, got {self.rope_yarn!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def replace(self, **kw) -> "Qwen3Config":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "tuple[Qwen3Config, dict[str, Any]]":
        """(config, execution keys) of a flat dict of this class's fields as records before the
        runtime split stored them (with dtype / remat / attention / scan_unroll among them):
        those go to `runtime.RuntimeOptions(**execution keys)`, the rest build the config."""
        from actionopd_jax.model.runtime import split_model_dict

        shape, execution = split_model_dict(d)
        if isinstance(shape.get("rope_yarn"), dict):
            shape["rope_yarn"] = RopeYarn(**shape["rope_yarn"])
        return cls(**shape), execution

    # ---- Hugging Face config.json --------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> "Qwen3Config":
        """Build from a HF `config.json` dict of a `Qwen3ForCausalLM` checkpoint.

        The parameter dtype follows the checkpoint's `dtype`/`torch_dtype` when it is float32 or
        bfloat16, so load -> export keeps the file dtype (the compute dtype is a RuntimeOptions
        field: weights.load_hf defaults it to this); `overrides` win over everything.
        """
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if (archs and _SUPPORTED_ARCH not in archs) or (not archs and model_type not in (None, "qwen3")):
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: only {_SUPPORTED_ARCH} "
                f"(model_type 'qwen3', dense) is implemented")
        if d.get("attention_bias"):
            raise ValueError("unsupported Qwen3 config: attention_bias=true (Qwen3 checkpoints have no q/k/v biases)")
        if d.get("use_sliding_window"):
            raise ValueError("unsupported Qwen3 config: use_sliding_window=true (only full attention is implemented)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported Qwen3 config: hidden_act={act!r} (only 'silu')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks required Qwen3 fields: {missing}")
        file_dtype = d.get("dtype") or d.get("torch_dtype")
        dt = file_dtype if file_dtype in _DTYPES else "float32"
        # absent fields take transformers' Qwen3Config defaults (not values derived from other
        # fields), so a config means here what it means there
        try:
            max_pos = int(d.get("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]))
            theta, yarn = rope_from_hf(d, max_pos)
            kv = d.get("num_key_value_heads", _HF_DEFAULTS["num_key_value_heads"])
            kw = dict(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d["num_attention_heads"] if kv is None else kv),
                head_dim=int(d.get("head_dim", _HF_DEFAULTS["head_dim"])),
                rope_theta=theta,
                rope_yarn=yarn,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                param_dtype=dt,
            )
        except TypeError as e:  # e.g. "head_dim": null
            raise ValueError(f"unsupported Qwen3 config: a size field is null or not a number ({e})") from e
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_json(cls, path, **overrides) -> "Qwen3Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no Hugging Face config.json at {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from e
        return cls.from_hf_dict(d, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers' Qwen3ForCausalLM (4.x and 5.x) reads."""
        return {
            "architectures": [_SUPPORTED_ARCH],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            # transformers 5.x reads rope_scaling first, 4.x only rope_scaling: same dict in both
            "rope_scaling": self.rope_yarn.to_hf(self.rope_theta) if self.rope_yarn else None,
            "rope_parameters": (self.rope_yarn.to_hf(self.rope_theta) if self.rope_yarn
                                else {"rope_theta": self.rope_theta, "rope_type": "default"}),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }

    # ---- size helpers ---------------------------------------------------------------------
    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def count_params(cfg: Qwen3Config) -> dict[str, int]:
    """Parameter counts: total, embedding (input table + untied head) and per-layer."""
    d, i, h, kv, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim)
    attn = d * h * dh + 2 * d * kv * dh + h * dh * d + 2 * dh
    mlp = 3 * d * i
    layer = attn + mlp + 2 * d
    embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    total = embed + cfg.num_hidden_layers * layer + d
    return {"total": total, "embedding": embed, "per_layer": layer,
            "non_embedding": total - embed}


def flops_per_token(cfg: Qwen3Config, context_len: int, *, training: bool = False,
                    with_lm_head: bool = True) -> float:
    """Approximate matmul FLOPs per token (2 per multiply-add).

    context_len is the mean number of keys each query attends to (about T/2 for a causal
    sequence of T tokens).  Training counts forward + backward as 3x the forward.
    """
    d, i, h, kv, dh, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
    proj = d * h * dh + 2 * d * kv * dh + h * dh * d + 3 * d * i
    attn = 2 * h * dh * context_len  # scores + weighted values
    fwd = 2 * L * (proj + attn) + (2 * d * cfg.vocab_size if with_lm_head else 0)
    return float(fwd * (3 if training else 1))


_BENCH_VOCAB = 151669  # the Qwen3 vocabulary the peer benchmark workload uses

PRESETS: dict[str, Qwen3Config] = {
    # tiny test size: small enough for CPU unit tests, vocab large enough for a small trained tokenizer
    # plus the Qwen3 special tokens.
    "tiny": Qwen3Config(vocab_size=2176, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=4096),
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                              head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, tie_word_embeddings=False),
    "bench-tiny": Qwen3Config(vocab_size=_BENCH_VOCAB, hidden_size=256, intermediate_size=768,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096),
    "bench-small": Qwen3Config(vocab_size=_BENCH_VOCAB, hidden_size=512, intermediate_size=1536,
                               num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096),
}
