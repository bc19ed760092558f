"""Attention, all of it: one file per kernel, one list of implementations, one switch.

`RuntimeOptions.attention` (model/runtime.py; config: `model.attention`) picks the implementation
of whole-sequence causal self-attention (`causal_self_attention`, dispatch.py):

- "auto": splash on TPU, cudnn on GPU, cpu on CPU, decided by the platform of the mesh the
  program is traced under (`jax.set_mesh`), so a CPU host compiling for a TPU topology picks
  the TPU kernel; without a mesh, by `jax.default_backend()`.
- "splash" (splash.py): Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
  causal, grouped-query (one MQA kernel per KV head), padding through segment ids. Never
  materialises a [T, T] score matrix. On CPU it runs in Pallas interpret mode (tests only).
- "cudnn" (cudnn.py): cuDNN flash attention through `jax.nn.dot_product_attention`; padding by
  sequence lengths, so rows must be right-padded (the trainer's layout).
- "xla" (xla.py): `jax.nn.dot_product_attention(implementation="xla")`, the reference: materialises
  the scores, any padding.
- "cpu" (cpu.py): `causal_attend`, the blocked path that is fastest on CPU XLA.

Every implementation takes q [B, T, KVH, G, Dh], k/v [B, T, KVH, Dh], key_mask bool [B, T]
(False = padding key) and returns [B, T, KVH, G, Dh] in `dtype`: the same result at every
query that sees at least one key (tests/test_attention_impls.py checks forward and
gradients against `attend`, reference.py). Queries of padding positions get some finite value.

Shared-prefix rows (`SharedPrefix`, shared_prefix.py): one packed row holds a state's prompt once, then its N
candidate responses in fixed-width regions; a response token sees the prompt and the earlier
tokens of its own response only. The N rows of a state then cost one prompt instead of N
(a 24k-token prompt with 4 x 4k responses: 40k tokens instead of 4 x 28k).

`resolve` (dispatch.py) is the only place that refuses a setting: an unknown name, a kernel
the target platform lacks, a layout the rows do not match, shared-prefix rows on cuDNN.
Decode-time attention (one new token against a cache) is decode.py.
Attention over the engine's page pool is its own switch, paged.py (`resolve_paged`): the plain
gather path (paged_gather.py) and jax's Pallas TPU / GPU paged kernels (paged_tpu.py, paged_gpu.py).
"""

from actionopd_jax.model.attention.cpu import causal_attend, causal_blocks
from actionopd_jax.model.attention.decode import shared_prompt_blocks, shared_prompt_step
from actionopd_jax.model.attention.dispatch import (FUSED, IMPLEMENTATIONS, abstract_mesh, causal_self_attention,
                                                    resolve, target_platform)
from actionopd_jax.model.attention.names import ATTENTION_OUT
from actionopd_jax.model.attention.reference import MASK_VALUE, attend
from actionopd_jax.model.attention.shared_prefix import SharedPrefix

__all__ = ["ATTENTION_OUT", "FUSED", "IMPLEMENTATIONS", "MASK_VALUE", "SharedPrefix", "abstract_mesh", "attend",
           "causal_attend", "causal_blocks", "causal_self_attention", "resolve", "shared_prompt_blocks",
           "shared_prompt_step", "target_platform"]
