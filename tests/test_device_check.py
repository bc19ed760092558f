"""benchmarks/device_check.py --dry-run: every step of the device check on this CPU at tiny
shapes, run as it runs on the H200 host: from the repository on PYTHONPATH (no editable
install), installing nothing, with every package the host's image lacks hidden (openai, grain,
mcp, pydantic, google-*, tensorboardX, ...: benchmarks/device_image/). The JSON and markdown it
writes have the documented fields."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "benchmarks" / "device_image"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_image_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ACTIONOPD_DEVICE_HIDDEN", "OUT")}
    env.update(ACTIONOPD_DEVICE_IMAGE=str(IMAGE / "h200_packages.txt"), PYTHONPATH=f"{IMAGE}{os.pathsep}{ROOT}",
               JAX_PLATFORMS="cpu")
    return env


def test_the_image_hides_what_the_device_lacks_and_the_editable_install():
    """The blocker itself: the device's missing packages do not import, its present ones do,
    and actionopd_jax comes from PYTHONPATH (the checkout), not from the editable install."""
    probe = ("import importlib.util as u, importlib.metadata as m, actionopd_jax\n"
             "print(actionopd_jax.__file__)\n"
             "for n in ('openai', 'grain', 'mcp', 'pydantic', 'tensorboardX', 'google.cloud.aiplatform', "
             "'yaml', 'flax', 'optax', 'orbax.checkpoint', 'transformers'):\n"
             "    print(n, u.find_spec(n) is not None)\n"
             "print('dist openai', any(d.metadata['Name'] == 'openai' for d in m.distributions()))")
    res = subprocess.run([sys.executable, "-c", probe], env=_device_image_env(), cwd="/", capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert Path(lines[0]).resolve() == (ROOT / "actionopd_jax" / "__init__.py").resolve()
    found = dict(line.rsplit(" ", 1) for line in lines[1:])
    for name in ("openai", "grain", "mcp", "pydantic", "tensorboardX", "google.cloud.aiplatform", "dist openai"):
        assert found[name] == "False", (name, found)
    for name in ("yaml", "flax", "optax", "orbax.checkpoint", "transformers"):
        assert found[name] == "True", (name, found)


# the dry run in two calls (`--only`), each under the device image: the per-test limit is 120 s
# (tests/test_suite_budget.py); both measure the ceilings, which every ratio is taken against.
# One measurement of each kind runs: on the CPU the plan's other decodes (the 8- and 6-row
# workloads) and the longer train step are the same code at other sizes, each a compile of
# its own (~20 s under load); the plan itself is checked whole below.
HALVES = {"decode": ("ceilings", "decode tiny engine 4", "decode tiny static 4", "generate tiny transformers 4",
                     "split decode tiny engine 8"),
          "kernels and train": ("ceilings", "sampler parity", "attention parity", "kernels tiny 8", "train tiny cpu 64",
                                "train tiny xla 64", "train tiny cpu 64 flags cublas gemms", "train tiny cpu 64 unrolled remat none")}


def test_the_dry_run_plan_has_every_measurement_in_the_order_of_value():
    dc = _module()
    plan = [(name, section) for name, section, _, _ in dc.stages("dry-run", "cpu")]
    assert plan == [("ceilings", "ceilings"), ("decode tiny engine 8", "decode"), ("decode tiny static 8", "decode"),
                    ("decode tiny engine 4", "decode"), ("decode tiny static 4", "decode"),
                    ("generate tiny transformers 4", "decode"), ("sampler parity", "parity"),
                    ("train tiny cpu 64", "train_step"), ("split decode tiny engine 8", "decode_split"),
                    ("kernels tiny 8", "attention_kernels"), ("train tiny cpu 64 unrolled", "train_step"),
                    ("train tiny cpu 64 unrolled remat none", "train_step"),
                    ("generate tiny transformers 8", "decode"),
                    ("decode tiny engine 6", "decode"), ("decode tiny static 6", "decode"),
                    ("train tiny cpu 64 flags cublas gemms", "train_step"), ("attention parity", "parity"), ("train tiny xla 64", "train_step"),
                    ("train tiny cpu 128", "train_step")]


@pytest.mark.parametrize("half", list(HALVES))
def test_dry_run_on_the_device_image_writes_the_documented_report(tmp_path, half):
    dc = _module()
    plan = list(HALVES[half])
    assert set(plan) <= {name for name, _, _, _ in dc.stages("dry-run", "cpu")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--dry-run", "--no-install",
           "--out", str(tmp_path), "--only", ",".join(plan)]
    res = subprocess.run(cmd, env=_device_image_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    rep = json.loads((tmp_path / "device_check.json").read_text())
    assert rep["schema"] == 3 and rep["mode"] == "dry-run" and rep["platform"] == "cpu" and rep["ok"]
    assert rep["install"]["skipped"] == "dry run" and not rep["skipped"] and not rep["timed_out"] and not rep["errors"]
    assert list(rep["stage_s"]) == plan and plan[0] == "ceilings"
    (ceil,) = rep["ceilings"]
    assert ceil["copy_bytes_per_s"] > 0 and ceil["matmul_flops_per_s"] > 0
    assert rep["ceilings_used"] == {"flops_per_s": ceil["matmul_flops_per_s"], "bytes_per_s": ceil["copy_bytes_per_s"],
                                   "source": "measured"}
    md = (tmp_path / "device_check.md").read_text()
    assert "ALL OK" in md and res.stdout.rstrip().endswith("ALL OK")   # the short table is printed last
    assert "ceilings: start (jax" in res.stdout
    # the measuring processes shared the suite's compilation cache (the environment's), and each
    # row counts the programs its measurement loaded from it and compiled
    assert rep["compile_cache"] == _device_image_env()["JAX_COMPILATION_CACHE_DIR"]
    rows = [r for key in dc.SECTIONS for r in rep[key]]
    assert rows and all(set(r["compile_cache"]) == {"loaded", "compiled"} for r in rows), rows
    assert f"compile cache: {rep['compile_cache']}; programs loaded" in md
    if half == "decode":
        decodes = rep["decode"]
        assert [(d["sampler"], d["rows"]) for d in decodes] == [("engine", 4), ("static", 4), ("transformers", 4)]
        for dec in decodes:  # no end token: every row runs every step
            assert dec["decode_steps"] == 8 and dec["generated_tokens"] == 8 * dec["rows"], dec
            assert dec["decode_s"] > 0 and dec["decode_tokens"] == dec["rows"] * (7 if dec["sampler"] == "transformers" else 8)
            assert abs(dec["tokens_per_s"] - dec["decode_tokens"] / dec["decode_s"]) < 0.02 * dec["tokens_per_s"], dec
            bound = dec["rows"] * ceil["copy_bytes_per_s"] / (dec["weight_bytes"] + dec["kv_bytes_mean"])
            assert abs(dec["hbm_bound_tokens_per_s"] - bound) < 0.01 * bound + 0.1, dec
            assert 16 <= dec["prompt_tokens"] / dec["prompts"] <= 48
        # the timed calls compiled nothing and prefilled every prompt token: the engine's first
        # call filled its prefix cache with these prompts, which is dropped before the timed call
        for dec in decodes[:2]:
            assert dec["timed_call_compiles"] == [0] and dec["prefilled_tokens"] == dec["prompt_tokens"], dec
        assert "| tiny | engine | 4 | 16-48 + 8 |" in md and "| tiny | transformers | 4 | 16-48 + 8 |" in md
        # generate's fastest setting that runs here (the CPU: a static cache, not compiled), named,
        # in calls of the planned prompts (a dry run: one a call, so the calls add up)
        hf = decodes[2]
        assert hf["setting"].startswith("static cache") and not hf["compiled"] and hf["setting_errors"] == []
        assert hf["calls"] == hf["prompts"] == 2 and hf["prompts_per_call"] == 1 and hf["attention"] == "sdpa"
        assert "- transformers tiny 4 rows: static cache, torch.compile" in md and "2 call(s) of 1 prompts" in md
        # issue 41's diagnosis: the engine's programs under the profiler, their ops by the scopes
        # engine/programs.py names (every op event matched an instruction of its program)
        (sp,) = rep["decode_split"]
        assert sp["rows"] == 8 and sp["decode_steps"] == 8 and sp["ok"], sp
        segment = next(v for k, v in sp["programs"].items() if k.startswith("segment"))
        assert "chunk" in sp["programs"] and segment["unmatched_events"] == 0 and segment["ops"] > 0
        for kind in ("attention", "KV writes", "LM head and sampling", "matmuls"):
            assert segment["categories"][kind] > 0, (kind, segment)
        assert sp["programs"]["chunk"]["categories"]["LM head and sampling"] == 0   # prefill chooses no token
        assert "engine time split, tiny 8 rows" in md and "| decode step |" in md
        return
    # rollout first (issue 41: the device's token parity right after the decodes), the kernels last
    assert plan[1] == "sampler parity" and plan[2] == "attention parity" and plan[-1].startswith("train")
    # issue 41's attention candidates on one layer: ours (shared and per slot) and jax's kernel in
    # interpret mode, equal to the gather reference; cuDNN not run on a CPU, and said so
    kernels = {k["kernel"]: k for k in rep["attention_kernels"]}
    assert list(kernels) == ["gather", "ours, shared prompt", "ours, per slot", "jax paged kernel", "cuDNN paged"]
    for name in ("gather", "ours, shared prompt", "ours, per slot"):
        assert kernels[name]["ok"] and kernels[name]["s"] > 0 and kernels[name]["max_abs_err"] <= 0.05, kernels[name]
    assert "cuDNN" in kernels["cuDNN paged"]["not_run"] and kernels["gather"]["max_abs_err"] == 0
    assert "decode attention, one layer: 8 rows, 2 prompts" in md and "| ours, shared prompt |" in md
    checks = {p["check"]: p for p in rep["parity"]}
    attention = checks["attention cpu vs xla"]
    assert attention["forward_rel_err"] <= dc_tol()[0] and attention["grad_rel_err"] <= dc_tol()[1]
    for label in ("sampler", "engine"):
        exact = checks[f"{label} tokens float32 (xla) device vs CPU"]
        assert exact["exact_required"] and exact["rows_equal"] == exact["rows"] == 8  # 4 prompts x n=2
    trains = rep["train_step"]
    assert [(t["model"], t["attention"], t["seq_len"]) for t in trains] == [("tiny", "cpu", 64), ("tiny", "xla", 64)] + \
        [("tiny", "cpu", 64)] * 2
    # issue 42's XLA flag candidate: the first step again in a process of its own, under its flags
    # (an unknown flag would have aborted that process: XLA parses XLA_FLAGS at start-up)
    assert [t.get("xla_flags") for t in trains] == [None, None, "--xla_gpu_enable_triton_gemm=false", None]
    assert "| tiny | cpu, XLA_FLAGS=--xla_gpu_enable_triton_gemm=false | full | 1 x 64 |" in md
    # and its unrolled-layers candidate, with XLA's own rematerialization (remat none)
    assert [(t.get("scan_unroll"), t["remat"]) for t in trains] == [(None, "full")] * 3 + [(0, "none")]
    assert "| tiny | cpu | none, layers unrolled | 1 x 64 |" in md
    for t in trains:
        assert t["remat"] == ("none" if t.get("scan_unroll") == 0 else "full")   # the H200 recipe's, or the candidate's
        assert abs(t["tokens_per_s"] - t["rows"] * t["seq_len"] / t["step_s"]) < 0.01 * t["tokens_per_s"]
        # MFU against the matmul ceiling measured in this run
        assert abs(t["mfu"] - t["model_flops"] / (t["step_s"] * ceil["matmul_flops_per_s"])) < 1e-3 and t["plan_bytes"] > 0
    assert "| attention cpu vs xla | ok |" in md and "| tiny | xla | full | 1 x 64 |" in md
    # the first train step also ran under the profiler (train/time_split.py): every op of the
    # step matched an instruction, and each kind the scopes name took time
    split = trains[0]["split"]
    assert "split" not in trains[1] and split["ops"] > 0 and split["unmatched_events"] == 0, split
    for kind in ("attention forward", "attention backward", "matmuls forward", "LM head", "optimizer"):
        assert split["categories"][kind] > 0, (kind, split)
    assert abs(sum(split["categories"].values()) - split["ops_s"]) < 1e-5
    assert "time split of the tiny cpu 1 x 64, remat full step" in md and "| LM head |" in md
    assert {t["recipe_microbatches"] for t in trains} == {256}   # the H200 recipe's 256 rows, one a microbatch


def test_a_rerun_loads_what_the_first_call_compiled_from_the_shared_cache(tmp_path):
    """The measuring processes share a persistent compilation cache, which on a warm device
    machine outlives the call: the rerun's measurement loads every program the first call
    compiled, and the report counts both (the cache's misses and hits)."""
    cache = tmp_path / "cache"
    env = {**_device_image_env(), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}   # the tiny programs too
    counts = []
    for call in ("first", "rerun"):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--dry-run", "--no-install",
               "--out", str(tmp_path / call), "--only", "ceilings", "--compile-cache", str(cache)]
        res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
        rep = json.loads((tmp_path / call / "device_check.json").read_text())
        assert rep["compile_cache"] == str(cache)
        counts.append(rep["ceilings"][0]["compile_cache"])
    first, rerun = counts
    assert first["compiled"] > 0 and first["loaded"] == 0, first
    assert rerun == {"loaded": first["compiled"], "compiled": 0}, counts
    md = (tmp_path / "rerun" / "device_check.md").read_text()
    assert f"compile cache: {cache}; programs loaded {first['compiled']}, compiled 0 (loaded in: ceilings)" in md


def test_a_program_loaded_from_the_cache_counts_as_a_compile_in_a_timed_call(tmp_path):
    """A decode's timed call that loads a program from the cache is not a clean timing either
    (device_check_decode.compiles): a load counts like a compile."""
    probe = f"""
import jax, jax.numpy as jnp
from actionopd_jax.compile_cache import enable_compile_cache
import device_check_decode as dec
enable_compile_cache({str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("/cache_hits") else None)
x = jnp.ones(7)
f = lambda x: jnp.sin(x) * 3.0 + 1.0
start = dec.compiles()
jax.jit(f)(x).block_until_ready()
jax.clear_caches()
jax.jit(f)(x).block_until_ready()
print(dec.compiles() - start, len(hits))
"""
    env = {**_device_image_env(), "PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{ROOT}"}
    res = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["2", "1"]   # one compile, then one load (a cache hit): both counted


def dc_tol():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device_check_work as w

    return w.FWD_TOL, w.GRAD_TOL


def test_a_measurement_over_its_time_limit_is_killed_and_reported(tmp_path, capsys):
    """The per-measurement limit holds even when the measurement never returns: its process is
    killed at the limit and the report says "timed out" (0.5 s: less than the tiny engine's
    first compile). An unknown --only name is refused with the list of names."""
    dc = _module()
    t0 = __import__("time").time()
    assert dc.main(["--dry-run", "--out", str(tmp_path), "--only", "decode tiny engine 4", "--stage-timeout-s", "0.5"]) == 1
    assert __import__("time").time() - t0 < dc.STARTUP_LIMIT_S
    rep = json.loads((tmp_path / "device_check.json").read_text())
    assert rep["timed_out"] == ["decode tiny engine 4"] and not rep["ok"] and not rep["skipped"]
    (dec,) = rep["decode"]
    # (the last step it printed, if it got that far: "; last step: tiny built on cpu (at 0.3 s)")
    assert dec["timed_out"] and re.fullmatch(r"timed out after [\d.]+ s \(limit 0\.5 s\)(; last step: .+ \(at [\d.]+ s\))?",
                                             dec["error"]), dec
    md = (tmp_path / "device_check.md").read_text()
    assert "| decode tiny engine 4 | FAILED: timed out after" in md and "SOME CHECK FAILED" in md
    assert dc.main(["--dry-run", "--out", str(tmp_path), "--only", "ceilings,warp drive"]) == 2
    assert "--only warp drive: no such measurement" in capsys.readouterr().err


def test_without_an_accelerator_the_device_mode_says_to_dry_run(tmp_path, capsys):
    dc = _module()
    if dc.detect_platform() != "cpu":
        pytest.skip("this host has an accelerator: the device mode would run")
    assert dc.main(["--out", str(tmp_path)]) == 2
    assert "--dry-run runs the same steps on the CPU" in capsys.readouterr().err


def test_a_spent_budget_lists_what_it_left_with_the_only_argument_and_out_defaults_to_OUT(tmp_path, monkeypatch,
                                                                                         capsys):
    """On the device the call returns only what is under $OUT and the end of the output: the
    report goes to $OUT without --out, and what the budget left unstarted is printed last with
    the `--only` argument that runs it in the next call."""
    dc = _module()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert dc.main(["--dry-run", "--budget-s", "0"]) == 1
    rep = json.loads((tmp_path / "device_check.json").read_text())
    plan = [name for name, _, _, _ in dc.stages("dry-run", "cpu")]
    assert rep["skipped"] == plan and not rep["ok"]
    tail = capsys.readouterr().out.rstrip().splitlines()
    assert tail[-3] == f"run them: --only '{','.join(plan)}'" and tail[-1].endswith("SOME CHECK FAILED")


def test_a_measurement_starts_only_with_half_its_limit_left_and_a_cut_one_is_rerun(tmp_path, capsys):
    """The budget's end is not a measurement's failure: one that could not have finished in the
    time left is not started (device time spent for nothing), and one the deadline cuts goes on
    the rerun list like those left unstarted; over its own limit it is a timeout."""
    dc = _module()
    plan = ["ceilings", "attention parity"]
    assert dc.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "100", "--stage-timeout-s", "1000",
                    "--only", ",".join(plan)]) == 1
    rep = json.loads((tmp_path / "device_check.json").read_text())
    assert rep["skipped"] == plan and rep["stage_s"] == {} and not rep["timed_out"] and not rep["errors"]
    assert capsys.readouterr().out.rstrip().splitlines()[-3] == f"run them: --only '{','.join(plan)}'"
    assert dc.budget_cut(began=10.0, limit=60.0, deadline=50.0) and not dc.budget_cut(10.0, 30.0, 50.0)
