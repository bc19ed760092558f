"""The one attention switch: the list of implementations, the refusals (`resolve`), and the
call that runs the chosen kernel (`causal_self_attention`)."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from actionopd_jax.aot.lowering import traced_platform
from actionopd_jax.model.attention.cpu import causal_attend
from actionopd_jax.model.attention.cudnn import cudnn_attention, cudnn_refusal
from actionopd_jax.model.attention.names import ATTENTION_OUT
from actionopd_jax.model.attention.shared_prefix import SharedPrefix, shared_prefix_reference
from actionopd_jax.model.attention.splash import splash_attention
from actionopd_jax.model.attention.xla import xla_attention

SCOPE = "attention"   # the name scope of its ops in a compiled program (train/time_split.py reads it)

IMPLEMENTATIONS = ("auto", "splash", "cudnn", "xla", "cpu")
# kernels that keep only (output, log-sum-exp) for the backward, never the [T, T] scores
FUSED = ("splash", "cudnn")
_AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "xla", "cpu": "cpu"}
_GPU = ("gpu", "cuda")
_SPLASH_PLATFORMS = ("tpu", "cpu")  # cpu: Pallas interpret mode, for tests

# attention over the engine's page pool (paged.py): one name per backend
PAGED_IMPLEMENTATIONS = ("auto", "gather", "paged_tpu", "ragged_tpu", "paged_gpu")
_PAGED_AUTO = {"tpu": "paged_tpu", "gpu": "paged_gpu", "cuda": "paged_gpu", "cpu": "gather"}
_PAGED_PLATFORMS = {"paged_tpu": ("tpu", "cpu"), "ragged_tpu": ("tpu",), "paged_gpu": _GPU + ("cpu",)}


def target_platform(mesh=None) -> str:
    """Platform of the devices the program is traced for: an enclosing `aot.lowering_for`'s
    (lowering for CUDA over CPU stand-in devices), else `mesh`'s (else the ambient one's,
    `jax.set_mesh`), else the default backend (a CPU host compiling for a TPU mesh answers
    "tpu")."""
    if traced_platform():
        return traced_platform()
    mesh = abstract_mesh(mesh)
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def abstract_mesh(mesh=None):
    """`mesh` as an abstract mesh; None: the ambient one (`jax.set_mesh`, empty outside it)."""
    if mesh is None:
        return jax.sharding.get_abstract_mesh()
    return mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh


def resolve(impl: str, platform: str | None = None, *, shared_prefix: SharedPrefix | None = None,
            seq_len: int | None = None, shared_prompt: bool = False, heads: tuple[int, int, int] | None = None,
            dtype=None) -> str:
    """The concrete implementation "auto" (or an explicit choice) means on `platform`; every
    refusal of an attention setting is here. shared_prefix / seq_len: the layout and length of
    the rows to run (the layout must cover them exactly); shared_prompt: the rows will be packed
    shared-prefix (a config check, before any layout exists); heads (query heads, KV heads,
    head dim) and dtype (the compute dtype): checked against what cuDNN takes (cudnn.py)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention={impl!r}; expected one of {IMPLEMENTATIONS}")
    platform = platform or target_platform()
    auto = impl == "auto"
    if impl == "auto":
        impl = _AUTO.get(platform, "xla")
    elif impl == "cudnn" and platform not in _GPU:
        raise ValueError(f"attention='cudnn' needs an NVIDIA GPU; this program targets {platform!r} "
                         "(use 'auto', 'xla', or 'splash' on TPU)")
    elif impl == "splash" and platform not in _SPLASH_PLATFORMS:
        raise ValueError(f"attention='splash' is a TPU kernel (CPU runs it interpreted, for tests); "
                         f"this program targets {platform!r}")
    if shared_prefix is not None and seq_len is not None and shared_prefix.length != seq_len:
        raise ValueError(f"shared-prefix layout of {shared_prefix.length} tokens for rows of {seq_len}")
    if (shared_prefix is not None or shared_prompt) and impl == "cudnn":
        raise ValueError("shared-prefix rows need a kernel with arbitrary masks: splash (TPU) or xla; "
                         "cuDNN flash attention takes causal + padding only (set train.shared_prompt=false)")
    if impl == "cudnn" and (heads is not None or dtype is not None):
        refusal = cudnn_refusal(heads=heads, dtype=dtype)
        if refusal:
            chosen = f"'auto' picks cuDNN on {platform}" if auto else "'cudnn'"
            raise ValueError(f"attention={chosen}, but cuDNN flash attention cannot take {refusal}; "
                             "or use attention='xla' (materialises the scores)")
    return impl


def resolve_paged(impl: str, platform: str | None = None) -> str:
    """The paged-attention backend `impl` means on `platform` ("auto": the TPU paged kernel on
    TPU, the Pallas GPU kernel on NVIDIA GPUs, the gather path elsewhere); every refusal of a
    paged backend by platform is here (shape limits: the kernels' check_* functions)."""
    if impl not in PAGED_IMPLEMENTATIONS:
        raise ValueError(f"paged attention={impl!r}; expected one of {PAGED_IMPLEMENTATIONS}")
    platform = platform or target_platform()
    if impl == "auto":
        return _PAGED_AUTO.get(platform, "gather")
    allowed = _PAGED_PLATFORMS.get(impl)
    if allowed is not None and platform not in allowed:
        if impl == "ragged_tpu" and platform == "cpu":
            raise ValueError("paged attention='ragged_tpu' does not run on CPU: jax 0.10.2's TPU interpreter "
                             "cannot run its strided k/v loads; compile it for a TPU topology, or use 'paged_tpu' "
                             "(interpreted on CPU) or 'gather'")
        raise ValueError(f"paged attention={impl!r} runs on {' / '.join(allowed)} (cpu: Pallas interpret mode, "
                         f"for tests); this program targets {platform!r} (use 'auto' or 'gather')")
    return impl


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array, dtype,
                          impl: str = "auto", shared_prefix: SharedPrefix | None = None, *,
                          mesh=None) -> jax.Array:
    """Causal attention with padding keys excluded; see the package docstring for shapes.
    shared_prefix: the rows are packed that way (T == shared_prefix.length). mesh: the mesh the
    program is traced for (abstract or concrete); None: the ambient one (`jax.set_mesh`)."""
    mesh = abstract_mesh(mesh)
    platform = target_platform(mesh)
    impl = resolve(impl, platform, shared_prefix=shared_prefix, seq_len=q.shape[1],
                   heads=(q.shape[2] * q.shape[3], q.shape[2], q.shape[4]), dtype=dtype)
    with jax.named_scope(SCOPE):      # its ops, forward and backward, by name in the compiled step
        return _attend(q, k, v, key_mask, dtype, impl, shared_prefix, mesh, platform)


def _attend(q, k, v, key_mask, dtype, impl, shared_prefix, mesh, platform):
    if impl == "splash":
        return splash_attention(q, k, v, key_mask, dtype, mesh=mesh, interpret=platform == "cpu",
                                layout=shared_prefix)
    if shared_prefix is not None:
        out = shared_prefix_reference(q, k, v, key_mask, dtype, shared_prefix)
    elif impl == "cpu":
        out = causal_attend(q, k, v, key_mask, dtype)
    elif impl == "cudnn":
        out = cudnn_attention(q, k, v, key_mask, dtype)
    else:
        out = xla_attention(q, k, v, key_mask, dtype)
    return checkpoint_name(out, ATTENTION_OUT)
