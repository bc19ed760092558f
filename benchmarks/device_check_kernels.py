"""Issue 41's attention candidates, timed side by side on the device: one layer's decode
attention at the 256-row workload's shapes (64 prompts of 1,024-4,096 tokens x 4 samples, each
row 128 tokens into its reply), every candidate on the same keys and values.

  ours, shared prompt   engine/prompt_sharing.shared_attend on our Pallas GPU kernel: each
                        prompt's pages read once for its 4 samples (the engine's decode);
  ours, per slot        our kernel (model/attention/paged_gpu_parts.py), each row its own table;
  jax paged kernel      jax's Pallas GPU paged attention, per slot (where this jax has it);
  cuDNN paged           cuDNN's paged attention through jax (jax._src.cudnn), per slot, on a
                        pool in its own layout ([blocks, page, KV heads, Dh], blocks = rows x
                        pages a row, as it requires);
  gather                the pages gathered by XLA, then dense attention: the reference.

Each row: milliseconds a call (20 calls queued back to back, the best of 3 rounds, as the copy
ceiling is timed, so the two compare), the bytes the HBM bound counts (every prompt once, every
reply once; the per-slot kernels read each prompt 4 times) over that time against the copy
ceiling, and the largest difference from the gather reference. A candidate that fails (an unsupported shape, a jax without it) is a row with its
error: issue 41 records the losers with their numbers. On the CPU (a dry run) the Pallas
kernels run in interpret mode at tiny shapes, and cuDNN is not run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

REPLY = {"device": 128, "dry-run": 16}    # tokens each row is into its reply
PAGE = 16


def layout(prompt_lens: list[int], samples: int, reply: int, page: int = PAGE):
    """Page ids of a one-layer pool (page 0 the null page): each prompt's whole pages once,
    then every row's own reply pages. Returns (per-row tables [rows, pages a row], lengths
    [rows], the shared Groups' fields (table, length, own_start, own_table), pages used)."""
    rows = len(prompt_lens) * samples
    width = max(prompt_lens) // page + -(-reply // page)
    table = np.zeros((rows, width), np.int32)
    own_table = np.zeros((rows, width), np.int32)
    shared = np.zeros((len(prompt_lens), width), np.int32)
    lengths, own_start = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    nxt = 1
    for b, n in enumerate(prompt_lens):
        ids = np.arange(nxt, nxt + n // page, dtype=np.int32)
        nxt += len(ids)
        shared[b, :len(ids)] = ids
        for s in range(samples):
            r = b * samples + s
            own = np.arange(nxt, nxt + -(-reply // page), dtype=np.int32)
            nxt += len(own)
            table[r, :len(ids)], table[r, len(ids):len(ids) + len(own)] = ids, own
            own_table[r, :len(own)] = own
            lengths[r], own_start[r] = n + reply, n
    return table, lengths, (shared, np.asarray(prompt_lens, np.int32), own_start, own_table), nxt


def kernel_timing(mode: str, *, prompts: int, samples: int, lo: int, hi: int, kv_heads: int, q_heads: int,
                  head_dim: int, reps: int = 20) -> list[dict]:
    """One row per candidate (module docstring)."""
    from device_check_work import queued_time   # timed as the copy ceiling is: calls queued, one wait

    from actionopd_jax.engine.prompt_sharing import Groups, shared_attend
    from actionopd_jax.jax_compat import has_pallas_kernel
    from actionopd_jax.model.attention.paged import paged_attention
    from actionopd_jax.model.attention.paged_gpu import paged_attention_gpu
    from actionopd_jax.model.attention.paged_gpu_parts import paged_parts_gpu
    from actionopd_jax.model.attention.paged_live import merge_parts

    device = jax.local_devices()[0]
    cpu = device.platform == "cpu"
    reply = REPLY[mode]
    lens = [int(n) // PAGE * PAGE for n in np.linspace(lo, hi, prompts)]
    table, lengths, (st, sl, os_, ot), pages = layout(lens, samples, reply)
    rows = len(lengths)
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    with jax.default_device(device):
        pk = jnp.asarray(rng.standard_normal((kv_heads, pages, PAGE, head_dim)), dt)
        pv = jnp.asarray(rng.standard_normal((kv_heads, pages, PAGE, head_dim)), dt)
        q = jnp.asarray(rng.standard_normal((rows, 1, q_heads, head_dim)), dt)
        t, n = jnp.asarray(table), jnp.asarray(lengths)
        groups = Groups(table=jnp.asarray(st), length=jnp.asarray(sl), own_start=jnp.asarray(os_),
                        own_table=jnp.asarray(ot))
    kv_bytes = (sum(lens) + rows * reply) * kv_heads * head_dim * 2 * 2     # k and v, bf16: the bound's count
    args = (q, pk, pv, n, t)
    candidates = {
        "gather": (lambda q, pk, pv, n, t: paged_attention(q, pk, pv, n, t, impl="gather"), args),
        "ours, shared prompt": (lambda q, pk, pv, n, t: shared_attend(q, pk, pv, n, groups, 0, "paged_gpu"), args),
        "ours, per slot": (lambda q, pk, pv, n, t: merge_parts([paged_parts_gpu(q, pk, pv, n, t, interpret=cpu)],
                                                               q.dtype), args),
        "jax paged kernel": ((lambda q, pk, pv, n, t: paged_attention_gpu(q, pk, pv, n, t, interpret=cpu)), args)
        if has_pallas_kernel("gpu_paged_attention") else "this jax has no Pallas GPU paged kernel",
        "cuDNN paged": _cudnn(args) if not cpu else "cuDNN runs on NVIDIA GPUs only (a dry run)",
    }
    out, reference = [], None      # gather's output, the first candidate's
    for name, candidate in candidates.items():
        row = {"kernel": name, "rows": rows, "prompts": prompts, "prompt_lens": [lens[0], lens[-1]], "reply": reply,
               "kv_heads": kv_heads, "q_heads": q_heads, "head_dim": head_dim, "kv_bytes": int(kv_bytes)}
        if isinstance(candidate, str):
            out.append({**row, "ok": True, "not_run": candidate})
            continue
        try:
            fn, call_args = candidate() if callable(candidate) else candidate
            jitted = jax.jit(fn)
            got = np.asarray(jitted(*call_args), np.float32)
            reference = got if name == "gather" else reference
            # bf16 outputs of unit-scale values; None where the reference itself failed
            row["max_abs_err"] = None if reference is None else float(np.max(np.abs(got - reference)))
            row["s"] = queued_time(lambda a, f=jitted: f(*a), call_args, reps if not cpu else 2)
            row["ok"] = row["max_abs_err"] is None or row["max_abs_err"] <= 0.05
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
            # jax's and cuDNN's kernels are candidates: their failure is recorded, not ours
            row.update(ok=name in EXTERNAL, error=f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}")
        out.append(row)
    return out


def _cudnn(args):
    """() -> (cuDNN's paged attention, its arguments): the pool copied once into its layout,
    [blocks, page, KV heads, Dh] with blocks = rows x pages a row (it requires exactly that)."""
    def prepare():
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, paged_attention as cudnn_paged

        q, pk, pv, n, t = args
        blocks = t.shape[0] * t.shape[1]
        to = jax.jit(lambda x: jnp.pad(jnp.transpose(x, (1, 2, 0, 3)),
                                       ((0, blocks - x.shape[1]), (0, 0), (0, 0), (0, 0))))
        kc, vc = to(pk), to(pv)

        def fn(q, kc, vc, n, t):
            table = t[:, None, :, None]
            return cudnn_paged(q, kc, vc, jnp.ones(n.shape, jnp.int32), n, table, table,
                               scale=1.0 / float(np.sqrt(q.shape[-1])), mask_type=MaskType.PADDING,
                               qkv_layout="BTNH")
        return fn, (q, kc, vc, n, t)
    return prepare


EXTERNAL = ("jax paged kernel", "cuDNN paged")


def kernel_stage(mode: str, preset: str, *, slots: int, lo: int, hi: int) -> list[dict]:
    """kernel_timing at a decode workload's shapes (device_check_shapes.DECODE), with the
    preset's heads, its rows in prompts of the engine's SHARE_WIDTH samples (the device's
    workload has 4, the width; a dry run's 2)."""
    from actionopd_jax.engine.prompt_sharing import SHARE_WIDTH
    from actionopd_jax.model import PRESETS

    c = PRESETS[preset]
    return kernel_timing(mode, prompts=max(1, slots // SHARE_WIDTH), samples=SHARE_WIDTH, lo=lo, hi=hi,
                         kv_heads=c.num_key_value_heads, q_heads=c.num_attention_heads, head_dim=c.head_dim)
__all__ = ["EXTERNAL", "kernel_stage", "kernel_timing", "layout"]
