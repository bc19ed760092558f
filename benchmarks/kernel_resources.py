"""Registers, spills and shared memory of the engine's Pallas GPU kernels as a Hopper compiler
builds them, without a GPU: COMPILER FACTS, not timings.

    pip install --target /tmp/triton triton==3.6.0      # once: the device image's Triton
    PYTHONPATH=. python benchmarks/kernel_resources.py --triton-path /tmp/triton

Each kernel is lowered for CUDA at Qwen3-4B's shapes (bf16 pool, 128-wide heads, 8 KV heads,
the H200 run's table of 272 pages of 16), which gives the Triton IR the device's XLA receives;
that IR is compiled here by the open-source Triton for sm_90a (H100 / H200) at each
(num_warps, num_stages), and ptxas -v reads the result: registers per thread, spill bytes,
shared memory, and how many blocks (and warps) one SM holds at that (65,536 registers,
228 KiB of shared memory, 64 warps). XLA bundles its own Triton, which may allocate
differently: a guide to the kernels' settings, not the device's own numbers.

Kernels: our paged_parts (model/attention/paged_gpu_parts.py) as the decode runs it (a row's
4 query heads padded to a block of 16; the shared pass has the same block) and as a prefill
chunk runs it (16 tokens x 4 heads = 64 queries), and jax's paged_attention (the per-slot
decode kernel the engine ran before). "*" marks the setting the project uses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

REGISTERS, SHARED, WARPS, BLOCKS = 65536, 228 * 1024, 64, 32   # one Hopper SM
MARK = "The Triton module for pallas_call"


def triton_ir(fn, *args) -> list[str]:
    """The Triton IR of every Pallas kernel `fn(*args)` lowers to for CUDA (Pallas prints it
    when a pallas_call is made with debug=True), without locations."""
    from jax.experimental import pallas

    from actionopd_jax.aot.lowering import cuda_stand_in, lowering_for

    real = pallas.pallas_call
    pallas.pallas_call = functools.partial(real, debug=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), lowering_for("gpu"), cuda_stand_in():
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pallas.pallas_call = real
    modules = []
    for part in out.getvalue().split(MARK)[1:]:
        text = part[part.index("\n") + 1:]
        text = re.sub(r' \[unknown\]| "[^"\n]*"\(#loc\d+\)| #loc\d+| loc\([^)\n]*\)', "", text)
        text = text[:re.search(r"\n}(\n|$)", text).end()]   # the module ends at its first "}" in column 0
        modules.append("\n".join(line for line in text.splitlines() if not line.startswith("#loc")))
    return modules


def resources(ir: str, warps: int, stages: int) -> dict:
    """Compile `ir` for sm_90a with Triton, then ptxas -v: registers, spills, shared memory and
    the occupancy they allow."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(ir)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    smem = int(kernel.metadata.shared)
    per_warp = -(-regs * 32 // 256) * 256                  # registers are allocated per warp, 256 at a time
    blocks = min(REGISTERS // (per_warp * warps), SHARED // (smem + 1024), WARPS // warps, BLOCKS)
    return {"registers": regs, "spill_bytes": spill, "shared_bytes": smem, "blocks_per_sm": blocks,
            "warps_per_sm": blocks * warps}


def kernels() -> list[tuple[str, object, tuple, tuple[int, int]]]:
    """(name, fn, args, the project's (num_warps, num_stages)) at Qwen3-4B's decode shapes; jax's
    paged_attention last, where this jax has it (0.12 removed it)."""
    from actionopd_jax.jax_compat import has_pallas_kernel, pallas_kernel
    from actionopd_jax.model.attention import paged_gpu_parts as parts
    from actionopd_jax.model.attention.paged_gpu import BLOCK_H, gpu_blocks

    rows, pps, kvh, hq, dh = 16, 272, 8, 32, 128
    sds = jax.ShapeDtypeStruct
    pages = sds((kvh, rows * pps + 1, 16, dh), jnp.bfloat16)
    lengths, table = sds((rows,), jnp.int32), sds((rows, pps), jnp.int32)
    ours = lambda q, k, v, n, t: parts.paged_parts_gpu(q, k, v, n, t)  # noqa: E731
    found = [("paged_parts, decode (16 queries)", ours, (sds((rows, 1, hq, dh), jnp.bfloat16), pages, pages,
                                                         lengths, table), (parts.NUM_WARPS, parts.NUM_STAGES)),
            ("paged_parts, prefill chunk (64 queries)", ours, (sds((rows, 16, hq, dh), jnp.bfloat16), pages, pages,
                                                                lengths, table), (parts.NUM_WARPS, parts.NUM_STAGES))]
    if has_pallas_kernel("gpu_paged_attention"):
        splits, block = gpu_blocks(pps, 16)
        theirs = functools.partial(pallas_kernel("gpu_paged_attention"), block_h=BLOCK_H, pages_per_compute_block=block,
                                   k_splits=splits, debug=True)     # it passes its own debug flag to pallas_call
        found.append(("jax paged_attention, decode (before)", lambda q, k, v, n, t: theirs(q, k, v, t, n),
                      (sds((rows, hq, dh), jnp.bfloat16), pages, pages, lengths, table), (8, 2)))   # jax's defaults, as paged_gpu.py calls it
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-path", default=None, help="a directory holding the `triton` package")
    args = ap.parse_args(argv)
    if args.triton_path:
        sys.path.insert(0, args.triton_path)
    try:
        import triton
    except ImportError:
        print("kernel_resources: needs the open-source Triton: pip install --target /tmp/triton triton==3.6.0, "
              "then --triton-path /tmp/triton", file=sys.stderr)
        return 2
    print(f"Triton {triton.__version__} for sm_90a (ptxas -v); jax {jax.__version__} lowering; compiler facts, "
          "not timings\n")
    print("| kernel | warps | stages | registers | spills, B | shared KiB | blocks / SM | warps / SM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, fn, fn_args, used in kernels():
        (ir,) = triton_ir(fn, *fn_args)
        for warps in (4, 8):
            for stages in (1, 2, 3):
                r = resources(ir, warps, stages)
                mark = " *" if (warps, stages) == used else ""
                print(f"| {name}{mark} | {warps} | {stages} | {r['registers']} | {r['spill_bytes']} | "
                      f"{r['shared_bytes'] / 1024:.0f} | {r['blocks_per_sm']} | {r['warps_per_sm']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
