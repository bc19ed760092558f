"""benchmarks/kernel_resources.py reads each Pallas GPU kernel's Triton IR from the CUDA
lowering (what the device's XLA compiles) as one module of text a Triton compiler parses:
no location attributes, nothing after the module's closing brace (Pallas prints more there).
Compiling it needs the open-source Triton, which the suite does not install."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kernel_resources  # noqa: E402
from actionopd_jax.cuda_plugin import cuda_plugin  # noqa: E402
from actionopd_jax.jax_compat import has_pallas_kernel  # noqa: E402
from tests._required import REQUIRE_CUDA, skip_or_fail  # noqa: E402


def test_each_kernel_gives_one_clean_triton_module_named_for_its_block():
    if cuda_plugin() is None:
        skip_or_fail(REQUIRE_CUDA, "jax's CUDA plugin is not installed: lowering for CUDA needs it")
    found = {}
    for name, fn, args, (warps, stages) in kernel_resources.kernels():
        (ir,) = kernel_resources.triton_ir(fn, *args)
        assert ir.startswith("module @") and ir.rstrip().endswith("}") and "#loc" not in ir and "[unknown]" not in ir
        assert ir.count("tt.func public") == 1 and ir.count("tt.dot") == 2, name      # q.k and p.v
        found[name] = ir.split()[1]
        assert (warps, stages) == (8, 2), name
    jaxs = ["@paged_attention_block_h_16_pages_per_compute_block_8"] if has_pallas_kernel("gpu_paged_attention") else []
    assert list(found.values()) == ["@paged_parts_m16_pages8", "@paged_parts_m64_pages8", *jaxs]
