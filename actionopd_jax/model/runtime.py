"""How a model runs, apart from what it is: the execution settings of a Qwen3 forward.

`Qwen3Config` (model/config.py) is the architecture: sizes, RoPE, norms, the parameters' storage
dtype -- what a checkpoint's weights need. `RuntimeOptions` is what may change from one run of
the same weights to the next: compute dtype, rematerialisation, attention kernel, layer-scan
unrolling. The model is built with both (`Qwen3(cfg, runtime=...)`) and keeps them as
`model.cfg` / `model.runtime`; the run config's `model.dtype`, `model.remat`,
`model.attention` and `model.scan_unroll` fill it (`from_section`).

Older checkpoints and run records hold one flat model dict with both kinds of keys:
`split_model_dict` separates them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from actionopd_jax.model.attention.dispatch import IMPLEMENTATIONS

DTYPES = ("float32", "bfloat16")
POLICIES = ("none", "full", "dots", "attn", "offload")  # model/qwen3.py _REMAT_POLICIES
# the config's model.remat: a policy, or "auto": the cheapest that fits the device's memory,
# resolved before the model is built (train/remat_choice.py); RuntimeOptions holds a policy
REMAT = POLICIES + ("auto",)


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    dtype: str = "float32"  # compute dtype of activations
    remat: str = "none"  # per-layer jax.checkpoint policy: "none" | "full" | "dots" | "attn" | "offload" (qwen3.py)
    attention: str = "auto"  # an attention.IMPLEMENTATIONS name (model/attention/)
    # layers per iteration of the layer scan (0: all). 1 keeps compile time flat in depth; more
    # removes loop overhead (on CPU the backward of a 4-layer scan ran 1.5x faster unrolled)
    scan_unroll: int = 1

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"RuntimeOptions.dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.remat == "auto":
            raise ValueError("RuntimeOptions.remat='auto' is a config setting, resolved from the device's memory "
                             "before the model is built (train/remat_choice.resolve_remat); pass the chosen policy")
        if self.remat not in POLICIES:
            raise ValueError(f"RuntimeOptions.remat={self.remat!r}; expected one of {POLICIES}")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"RuntimeOptions.attention={self.attention!r}; expected one of {IMPLEMENTATIONS}")
        if int(self.scan_unroll) < 0:
            raise ValueError(f"RuntimeOptions.scan_unroll must be >= 0 (0: unroll all layers), got {self.scan_unroll}")

    def replace(self, **kw) -> "RuntimeOptions":
        return dataclasses.replace(self, **kw)

    def layers_per_scan_step(self, num_layers: int) -> int:
        return num_layers if self.scan_unroll == 0 else min(self.scan_unroll, num_layers)

    @classmethod
    def from_section(cls, model_section: Any) -> "RuntimeOptions":
        """From the run config's `model` section (anything with these attribute names)."""
        return cls(**{f: getattr(model_section, f) for f in FIELDS})


FIELDS = tuple(f.name for f in dataclasses.fields(RuntimeOptions))


def split_model_dict(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(architecture keys, execution keys) of a flat model dict as older records stored it."""
    shape = {k: v for k, v in d.items() if k not in FIELDS}
    return shape, {k: v for k, v in d.items() if k in FIELDS}
