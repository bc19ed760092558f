"""benchmarks/device_check_shapes.py: the device check's shapes come from the lent device's
memory. An H100 (80 GB) and an H200 (141 GB) get different plans, every planned peak fits the
usable memory, the report names the figure, and the parent that plans never starts a jax
backend. Arithmetic only: no device, no compile."""

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check as dc  # noqa: E402
import device_check_report as report  # noqa: E402
import device_check_shapes as shapes  # noqa: E402
from test_device_check import _device_image_env  # noqa: E402

from actionopd_jax.sampling.budget import plan_chunks  # noqa: E402
from actionopd_jax.sampling.buckets import Buckets  # noqa: E402

MIB = 2 ** 20
H100, H200 = 81559 * MIB, 143771 * MIB     # nvidia-smi's memory.total of each (MiB)


def _planned_peaks(plan: dict) -> list[float]:
    return [t["plan_bytes"] for t in plan["train"]] + \
        [d[k] for d in plan["decode"].values() for k in ("engine_plan_bytes", "static_plan_bytes")]


def _expected_train(usable: float) -> list[tuple]:
    """What the choice must be by train --check's plan, whatever its current figures: first
    the steps under the remat policy auto picks where that is not the recipe's full (issue 42);
    then per step the first variant that fits, in the order recipe (float32 master weights)
    then bfloat16, the long step at its length then half."""
    out = []
    for seq in (4096, 16384):
        auto = shapes._auto_remat("qwen3-4b", "cudnn", seq, 512, usable)
        if auto and auto[0] != "full":
            out.append(("cudnn", seq, None))
    for attention, seq in (("cudnn", 4096), ("xla", 4096), ("cudnn", 16384)):
        variants = [(s, d) for s in ((seq, seq // 2) if seq == 16384 else (seq,)) for d in (None, "bfloat16")]
        fits = [(attention, s, d) for s, d in variants
                if shapes._train_plan("qwen3-4b", attention, s, 512, d) <= usable]
        out += fits[:1]
    return out


def test_an_h100_and_an_h200_get_different_shapes_each_within_its_memory():
    h100 = shapes.choose("device", "gpu", H100, "nvidia-smi memory.total")
    h200 = shapes.choose("device", "gpu", H200, "nvidia-smi memory.total")
    for plan, mem in ((h100, H100), (h200, H200)):
        assert plan["memory_bytes"] == mem and plan["usable_bytes"] == mem * 0.9 and not plan["dropped"]
        assert all(0 < peak <= plan["usable_bytes"] for peak in _planned_peaks(plan)), plan
        # each step is the first variant train --check's plan fits: the recipe's step where it
        # fits (the H200's float32 16k step only where its plan fits this device), else lighter
        assert [(t["attention"], t["seq"], t["param_dtype"]) for t in plan["train"]] == \
            _expected_train(plan["usable_bytes"])
    recipe_steps = [("cudnn", 4096, None), ("xla", 4096, None), ("cudnn", 16384, None)]
    auto200 = [(t["seq"], t["remat"]) for t in h200["train"] if t.get("remat")]
    assert [(t["attention"], t["seq"], t["param_dtype"]) for t in h200["train"] if not t.get("remat")] == recipe_steps
    # auto's rows come first, each the cheapest policy that fits (train/remat_choice): the
    # H200 holds the 4,096-token step without remat; the H100 needs more recompute than the H200
    assert auto200 and auto200[0] == (4096, "none") and h200["train"][0]["remat"] == "none"
    order = ("none", "dots", "attn", "full")
    auto100 = dict((t["seq"], t["remat"]) for t in h100["train"] if t.get("remat"))
    for seq, policy in auto200:
        assert order.index(auto100.get(seq, "full")) >= order.index(policy)
    names200 = [n for n, _, _, _ in dc.stages("device", "gpu", h200)]
    assert "train qwen3-4b cudnn 4096 remat none" in names200
    spec200 = {n: sp for n, _, _, sp in dc.stages("device", "gpu", h200)}
    assert spec200["train qwen3-4b cudnn 4096 remat none"]["remat"] == "none"
    assert spec200["train qwen3-4b cudnn 4096"]["remat"] is None      # the recipe's own (full)
    # a device whose usable memory is under the recipe's 4,096-token plan gets the lighter variant
    recipe = shapes._train_plan("qwen3-4b", "cudnn", 4096, 512, None)
    light = shapes._train_plan("qwen3-4b", "cudnn", 4096, 512, "bfloat16")
    assert light < recipe
    between = shapes.choose("device", "gpu", int((light + recipe) / 2 / 0.9), "--memory-gib")
    assert [t for t in between["train"] if not t.get("remat")][0] == \
        {"attention": "cudnn", "seq": 4096, "param_dtype": "bfloat16", "plan_bytes": light}
    # decode: the static sampler's 256 rows of Qwen3-4B plan 77.0 GiB in one call (run 2
    # measured a 76.6 GiB peak): one call on the H200, two on the H100, by its own budget
    big100, big200 = h100["decode"]["big"], h200["decode"]["big"]
    assert big200["static_calls"] == 1 and big200["static_token_budget"] is None
    assert abs(big200["static_plan_bytes"] / 2 ** 30 - 76.6) < 1.0
    assert big100["static_calls"] == 2
    lens = shapes.prompt_lengths(256, 4, 1024, 4096)
    chunks = plan_chunks([4] * len(lens), lens, [256] * len(lens), Buckets(), big100["static_token_budget"])
    assert [len(c) for c in chunks] == [32, 32]
    # the engine's pool: what the workload fills plus a quarter, the same on both (it fits both)
    assert big100["pool_pages"] == big200["pool_pages"] > big200["pool_pages_needed"]
    spec = {n: s for n, _, _, s in dc.stages("device", "gpu", h100)}
    assert spec["decode qwen3-4b static 256"]["token_budget"] == big100["static_token_budget"]
    assert spec["decode qwen3-4b engine 256"]["pool_pages"] == big100["pool_pages"]
    spec200 = {n: s for n, _, _, s in dc.stages("device", "gpu", h200)}
    assert spec200["decode qwen3-4b static 256"]["token_budget"] is None
    # transformers' generate: its static cache (every row at 4,352 positions) x 1.45: 64 rows a
    # call on either; the 256-row workload in 4 calls on the H100, 2 on the H200
    assert spec["generate qwen3-4b transformers 64"]["prompts_per_call"] == 16
    assert spec["generate qwen3-4b transformers 256"]["prompts_per_call"] == 16
    assert spec200["generate qwen3-4b transformers 256"]["prompts_per_call"] == 32
    (line,) = report._shapes_lines(h100)
    assert line.startswith("shapes planned for 79.6 GiB (nvidia-smi memory.total), usable 71.7 GiB") and \
        "static calls big 2" in line
    names = [n for n, _, _, _ in dc.stages("device", "gpu", between)]
    assert "train qwen3-4b cudnn 4096 bfloat16 weights" in names and "train qwen3-4b cudnn 4096" not in names


def test_a_device_too_small_leaves_out_what_fits_no_variant_and_says_why():
    small = shapes.choose("device", "gpu", 24 * 2 ** 30, "--memory-gib")
    left = {d["stage"]: d["why"] for d in small["dropped"]}
    assert set(left) >= {"train qwen3-4b cudnn 4096", "train qwen3-4b xla 4096", "train qwen3-4b cudnn 16384"}
    assert "no plan fits the usable 21.6 GiB" in left["train qwen3-4b cudnn 4096"] and \
        "4096 tokens bfloat16" in left["train qwen3-4b cudnn 4096"]
    names = {n for n, _, _, _ in dc.stages("device", "gpu", small)}
    assert not names & set(left) and not small["train"]
    assert all(peak <= small["usable_bytes"] for peak in _planned_peaks(small) if peak)
    lines = report._shapes_lines(small)
    assert any(line.startswith("not planned: train qwen3-4b xla 4096: no plan fits") for line in lines)


def test_without_a_memory_figure_the_shapes_are_the_defaults():
    plan = shapes.choose("device", "tpu", None)
    assert [(t["attention"], t["seq"]) for t in plan["train"]] == [("splash", 4096), ("xla", 4096), ("splash", 16384)]
    assert plan["usable_bytes"] is None and not plan["dropped"]
    assert all(d["pool_pages"] is None and d["static_token_budget"] is None for d in plan["decode"].values())
    spec = {n: s for n, _, _, s in dc.stages("device", "tpu", plan)}
    assert spec["decode qwen3-4b engine 256"]["pool_pages"] is None    # decode_timing's own rule
    assert report._shapes_lines(plan) == ["shapes: none (the default shapes)"]


def test_the_memory_figure_is_nvidia_smis_least_total_and_planning_starts_no_jax_backend(tmp_path):
    """A stand-in `nvidia-smi` on PATH (no GPU here) answers as an 8-GPU host does, one line a
    GPU in MiB; the plan is made in a fresh interpreter with only the device image's packages,
    which then has no jax backend."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '81559\\n81559\\n81557\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    probe = ("import sys; sys.path.insert(0, 'benchmarks')\n"
             "import device_check as dc, device_check_shapes as sh, jax._src.xla_bridge as xb\n"
             "m = sh.gpu_memory_bytes(); plan = dc.stages('device', 'gpu', sh.choose('device', 'gpu', m, 'x'))\n"
             "print(m, len(plan), xb.backends_are_initialized())")
    # as on the H200's image (test_device_check: every package it lacks hidden), so the parent's
    # planning imports nothing the device host does not have
    image = _device_image_env()
    env = {**image, "PATH": f"{tmp_path}{os.pathsep}{image['PATH']}"}
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    memory, stages, started = res.stdout.split()
    assert int(memory) == 81557 * MIB and int(stages) > 10 and started == "False"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\n")
    bad = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); "
                              "import device_check_shapes as sh; print(sh.gpu_memory_bytes())"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 0 and bad.stdout.strip() == "None", bad.stderr[-2000:]


def test_the_engine_stage_checks_its_pool_beside_the_programs_before_allocating(monkeypatch):
    """device_check_decode.pool_check on a device's free-memory figure (stated: the CPU reports
    none): XLA's memory analysis of the programs goes in the row, and a pool that would not fit
    beside them is refused with the numbers instead of running out of memory."""
    import pytest

    import actionopd_jax.sampling.budget as budget_lib
    import device_check_decode as dec
    from _engine_fixtures import engine

    eng = engine()
    extra = {}
    monkeypatch.setattr(budget_lib, "free_bytes_per_chip", lambda mesh=None: 2 ** 30)
    dec.pool_check(eng, extra)
    assert set(extra["pool_needs"]) == {"prefill chunk", "decode segment"} and eng.pool is None
    assert all(set(v) == {"temp", "generated_code", "output_not_aliased", "argument"}   # GiB (tiny: ~0)
               for v in extra["pool_needs"].values())
    monkeypatch.setattr(budget_lib, "free_bytes_per_chip", lambda mesh=None: 2 ** 16)
    with pytest.raises(RuntimeError, match=r"the planned pool \(48 pages, .* GiB\) and the programs' needs beside "
                                           r"their arguments .* exceed the free 0\.00 GiB"):
        dec.pool_check(eng, {})


def test_generate_falls_back_to_the_next_setting_and_halves_a_call_out_of_memory_saying_both(monkeypatch):
    """device_check_decode.transformers_timing: a setting generate cannot run (here: the static
    cache raising, as a failed compile would) gives the row the next setting, named with why;
    a call out of memory is halved and retried. Tiny model, CPU."""
    import transformers

    import device_check_decode as dec

    real = transformers.Qwen3ForCausalLM.generate
    calls = []

    def generate(self, **kw):
        calls.append((kw.get("cache_implementation"), kw["input_ids"].shape[0]))
        if kw.get("cache_implementation") == "static":
            raise RuntimeError("inductor: compile failed")
        if kw["input_ids"].shape[0] > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, **kw)

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "generate", generate)
    row = dec.transformers_timing("tiny", slots=4, samples=2, lo=16, hi=48, max_new=4, prompts_per_call=2)
    assert row["setting"] == "dynamic cache, eager" and not row["compiled"] and row["ok"]
    assert row["setting_errors"] == ["static: RuntimeError: inductor: compile failed",
                                     "dynamic: out of memory at 2 prompts a call; halved"]
    assert row["calls"] == 2 and row["prompts_per_call"] == 1 and row["generated_tokens"] == 4 * 4
    assert calls == [("static", 2), (None, 2), (None, 1), (None, 1), (None, 1)]   # warm-up, then 2 timed calls


def test_the_engines_timed_call_is_timed_again_where_it_compiled_and_prefills_every_prompt():
    """device_check_decode.decode_timing, engine: the first call reads only the WARM_PROMPTS
    longest prompts. Here (the CPU backend, whose decode programs are per row count) the timed
    call's 12 rows need a program those 8 rows did not, so it is timed once more, and each
    timed call prefills all 6 prompts: the prefix cache the calls before filled is dropped."""
    import device_check_decode as dec

    row = dec.decode_timing("tiny", slots=12, samples=2, lo=16, hi=48, max_new=4, sampler="engine")
    assert dec.WARM_PROMPTS == 4 and row["prompts"] == 6 and row["rows"] == 12
    assert len(row["timed_call_compiles"]) == 2 and row["timed_call_compiles"][0] > 0, row["timed_call_compiles"]
    assert row["timed_call_compiles"][1] == 0 and row["prefilled_tokens"] == row["prompt_tokens"] and row["ok"]
