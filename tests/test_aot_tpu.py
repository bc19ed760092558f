"""The train step compiled ahead of time for a TPU topology on this CPU host (libtpu from the
test extra): TPU lowering, layout and memory errors surface here, not on a rented slice.
Small models only; the paper-scale numbers are in docs/measurements_compiler.md (`actionopd train --check --aot`)."""

import contextlib
import io

import pytest

from actionopd_jax.commands import train as cli
from tests._required import need_libtpu


@pytest.fixture(autouse=True)
def _libtpu():
    """libtpu (the tpu/test extra) compiles for TPU topologies: skip without it, fail in CI."""
    need_libtpu()


RECIPE = "configs/paper/qwen3_4b_tpu.yaml"
# the tiny model holds 4,096 positions: a prompt budget that fits beside its replies (train --check refuses one that cannot)
TINY = ["model.preset=tiny", "model.hf_path=", "collect.max_prompt_tokens=1024", "collect.max_response_tokens=128",
        "train.shared_prompt=false"]


def _run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue()


def test_tiny_train_step_compiles_for_v5p_with_splash_attention():
    code, text = _run(["--config", RECIPE, "--check", "--aot", "--target", "v5p-8", *TINY,
                       "train.max_seq_len=512"])
    assert code == 0, text
    row = next(line for line in text.splitlines() if line.startswith("4 x 512 |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[1] == "splash" and cells[2] == "fits", row      # auto -> splash on a TPU target
    assert float(cells[8]) > 0 and cells[10].endswith("%"), row   # extrapolated FLOPs, MFU printed
    assert "AOT OK" in text


def test_out_of_memory_is_reported_as_the_compilers_verdict():
    """Dense (xla) attention over 4 x 131,072 tokens needs ~256 GiB of scores per chip: the
    check prints the TPU compiler's out-of-memory verdict and exits 1 instead of crashing."""
    code, text = _run(["--config", RECIPE, "--check", "--aot", "--target", "v5p-8", "--no-cost", *TINY,
                       "model.attention=xla", "train.max_seq_len=131072"])
    assert code == 1, text
    assert "| OOM |" in text and "out of HBM" in text, text


def test_gpu_targets_compile_here_and_an_unknown_target_says_why():
    """8 H200s by XLA's deviceless GPU compiler (aot/gpu_topology.py): FSDP over 8, rows split."""
    code, text = _run(["--config", RECIPE, "--check", "--aot", "--target", "h200x8", "--no-cost", *TINY,
                       "train.max_seq_len=512", "train.microbatch_rows=8"])  # rows split over 8 GPUs
    assert code == 0 and "compiled on this host by the GPU compiler" in text, text
    assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1}" in text and "8 x 512 | cudnn | fits" in text, text
    assert cli.main(["--config", RECIPE, "--check", "--aot", "--target", "v9-1", *TINY]) == 2


def test_shared_prompt_rows_compile_for_v5p():
    """The shared-prefix mask is computed inside the splash kernel: Mosaic must lower it."""
    code, text = _run(["--config", RECIPE, "--check", "--aot", "--target", "v5p-8", "--no-cost", *TINY,
                       "train.max_seq_len=1024", "collect.max_prompt_tokens=512", "train.shared_prompt=true"])
    assert code == 0, text
    assert "4 x 1,024 (512 + 4 x 128) | splash | fits" in text, text
