"""`actionopd train --check` plans for the config's declared target (mesh.target) from this CPU
host, runs the run's own start-up checks for that target, and plans the collection phase.
A layout the run refuses is refused by the check with the same message."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from actionopd_jax.aot.targets import USABLE_MEMORY_FRACTION
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.config.rollout import rollout_sampler
from actionopd_jax.launch.common import GPU_ENV_DEFAULTS
from actionopd_jax.commands import train as train_cli
from tests._subprocess_fixtures import cli_env

from tests._configs import CONFIGS, SHIPPED  # found recursively under configs/, by file name
# the tiny job names no target: it plans for this host
EXPECTED_TARGET = {"qwen3_4b_tpu.yaml": "v5p-8", "qwen3_8b_tpu.yaml": "v5p-8", "tau2_qwen3_4b_tpu.yaml": "v5p-8",
                   "qwen3_4b_h200x8.yaml": "h200x8", "qwen3_4b_h200.yaml": "h200x1",
                   "tau2_qwen3_4b_h200.yaml": "h200x1", "main_remote_teacher.yaml": "h200x1"}
LAYOUT_ERROR = ("train.microbatch_rows=1 must be a multiple of 8 (rows are split over mesh data x fsdp = 8 "
                "and over 1 process(es))")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_passes_check_for_its_target(name, capsys, monkeypatch):
    for var in ("DASHSCOPE_API_KEY", "DEEPSEEK_API_KEY", "TEACHER_API_KEY", "MATCHER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    code = train_cli.main(["--config", str(CONFIGS / name), "--check"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "config OK" in out.out
    # where the tasks are on this host, their first prompts were measured and fit (issue 33)
    # (the main job also measures its held-out prompts plus the eval reply against the student's context)
    assert all(" fit collect.max_prompt_tokens=" in x or " fits the student's " in x
               for x in out.out.splitlines() if x.startswith("prompts ")), out.out
    target = load_config(CONFIGS / name).mesh.target
    if name in EXPECTED_TARGET:
        assert target == EXPECTED_TARGET[name]
    if target:  # planned for the target's chips whatever this host has (8 CPU devices here)
        assert f"planned for mesh.target {target}" in out.out
        assert f"device(s) of {target}" in out.out
        assert f"x {USABLE_MEMORY_FRACTION:.2f} usable" in out.out and "-> fits" in out.out
        assert "collection per device" in out.out  # the sampler's phase is planned too


def test_a_layout_the_target_cannot_run_is_refused_as_the_run_refuses_it(tmp_path, capsys):
    """The issue's case: the single-H200 recipe on an 8-GPU machine (fsdp -1 -> 8, one-row
    microbatches). --check for h200x8 exits 2 with the run's message; the run itself, on this
    host's 8 CPU devices, stops at start-up with the very same line."""
    cfg = tmp_path / "h200_on_8.yaml"
    cfg.write_text(f"base: {CONFIGS / 'qwen3_4b_h200.yaml'}\nmesh:\n  target: h200x8\n")
    assert train_cli.main(["--config", str(cfg), "--check"]) == 2
    check_err = capsys.readouterr().err.strip()
    assert check_err == f"actionopd train: config error: {LAYOUT_ERROR}"

    run = subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "train", "--config", str(cfg),
                          f"run.dir={tmp_path / 'run'}", "run.tensorboard=false"], cwd=tmp_path,
                         env=cli_env(devices=8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert check_err in run.stderr.splitlines(), run.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_check_plans_for_the_target_not_this_host(capsys):
    """On this host's 8 CPU devices the single-H200 recipe would be split 8 ways (and refused);
    planned for h200x1 it is one GPU with the H200's memory."""
    assert train_cli.main(["--config", str(CONFIGS / "qwen3_4b_h200.yaml"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "{'data': 1, 'fsdp': 1, 'tensor': 1} = 1 device(s) of h200x1" in out
    assert "attention cudnn (auto on gpu)" in out
    assert re.search(r"device memory\s+140\.40 GiB x 0\.90 usable = 126\.36 GiB", out), out   # 143,771 MiB


def test_auto_is_the_static_sampler_on_gpus_and_the_engine_elsewhere(capsys):
    """collect.sampler=auto (the default): the static sampler on NVIDIA GPUs, where the H200
    measured the engine slower (config/rollout.py), the engine on CPU and TPU; `--check` says
    which and why."""
    assert [rollout_sampler("auto", p) for p in ("cpu", "tpu", "gpu", "cuda")] == \
        ["engine", "engine", "static", "static"]
    assert rollout_sampler("engine", "gpu") == "engine" and rollout_sampler("static", "cpu") == "static"
    with pytest.raises(ValueError, match="expected one of"):
        rollout_sampler("paged", "cpu")
    assert train_cli.main(["--config", str(CONFIGS / "qwen3_4b_h200.yaml"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "(static sampler: auto on gpu)" in out and "KV page pool" not in out, out
    assert "collection per device (analytic estimate; the static sampler" in out


def test_check_names_the_engine_and_plans_its_pool_beside_an_update(capsys):
    """The engine (on a GPU, chosen explicitly): `--check` names it and plans its page pool from
    what is left of the usable memory after the trainer's state, the rollout copy and an
    update's reserve (x budget.SAFETY), so an update beside the resident pool still fits."""
    assert train_cli.main(["--config", str(CONFIGS / "qwen3_4b_h200.yaml"), "--check", "collect.sampler=engine"]) == 0
    out = capsys.readouterr().out
    assert "(engine sampler)" in out and "  sampler            engine: " in out, out
    got = {name: float(re.search(rf"  {name}\s+([\d.]+) GiB", out).group(1))
           for name in ("params \\+ AdamW", "rollout copy", "update reserve", "KV page pool")}
    free = 126.36 - got["params \\+ AdamW"] - got["rollout copy"] - got["update reserve"]
    assert abs(got["KV page pool"] - 0.85 * free) < 0.05, (got, out)
    total = float(re.search(r"total \(an update\)\s+([\d.]+) GiB", out).group(1))
    assert total <= 126.36 and "-> fits" in out


def test_collection_can_be_the_peak_that_does_not_fit(capsys):
    """A fixed static-sampler budget bigger than what is left after the trainer's state: the
    plan names collection as the peak and the check exits 1."""
    code = train_cli.main(["--config", str(CONFIGS / "qwen3_4b_h200.yaml"), "--check", "collect.sampler=static",
                           "collect.sampler_token_budget=2000000"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "peak collection" in out and "DOES NOT FIT" in out


def test_one_usable_memory_fraction():
    assert GPU_ENV_DEFAULTS["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{USABLE_MEMORY_FRACTION:.2f}"
    for name in SHIPPED:  # no recipe carries its own idea of the usable share
        assert "0.95" not in re.sub(r"p=0\.95|top_p: 0\.95|p 0\.95", "", (CONFIGS / name).read_text()), name


def test_target_errors(capsys):
    with pytest.raises(ConfigError, match="known targets"):
        load_config(None, ["mesh.target=v9-1"])


@pytest.mark.parametrize("config, message", [
    # 8 chips on 2 hosts: rows split over fsdp 8 and 2 processes
    ("qwen3_4b_tpu.yaml", "train.microbatch_rows=4 must be a multiple of 8 (rows are split over mesh data x fsdp = 8 "
                          "and over 2 process(es))"),
    # a fixed 4-chip mesh on a 2-host slice leaves the second host's chips out
    ("qwen3_8b_tpu.yaml", "uses 4 of 8 devices; a multi-process run must use all of them"),
])
def test_multi_host_targets_get_the_runs_process_checks(config, message, capsys):
    assert train_cli.main(["--config", str(CONFIGS / config), "--check", "mesh.target=v5p-16"]) == 2
    assert message in capsys.readouterr().err


def test_check_runs_the_baseline_sources_config_checks(tmp_path, capsys):
    kd = ["collect.kind=kd", "train.loss=kd", "experiment.enabled=false"]
    assert train_cli.main(["--check", *kd, f"kd.trajectories={tmp_path / 'none.jsonl'}"]) == 2
    assert "KD trajectories file" in capsys.readouterr().err
    assert train_cli.main(["--check", *kd, "env.name=bfcl"]) == 2  # no recorded episodes and no teacher
    assert "KD without kd.trajectories runs the teacher first" in capsys.readouterr().err


def test_collection_estimate_by_hand():
    """h200x1, Qwen3-4B: params f32 + AdamW (3 x 4 bytes x N) resident, a bf16 copy (2N), and
    the sampler's 'auto' budget: 85% of what is left of 90% of the GPU, in KV-cache tokens."""
    from actionopd_jax.model import PRESETS, count_params
    from actionopd_jax.sampling import budget as sb
    from actionopd_jax.train.plan import estimate_collection

    cfg = load_config(CONFIGS / "qwen3_4b_h200.yaml")
    q = PRESETS["qwen3-4b"].replace(param_dtype="float32")
    assert (cfg.model.dtype, cfg.model.remat) == ("bfloat16", "full")  # the execution settings come from cfg
    usable = 141e9 * USABLE_MEMORY_FRACTION
    est = estimate_collection(cfg, q, {"data": 1, "fsdp": 1, "tensor": 1}, chips_per_host=1, usable_bytes=usable,
                              platform="gpu")
    n = count_params(q)["total"]
    assert est.resident == pytest.approx(12 * n) and est.rollout_copy == pytest.approx(2 * n)
    per_token = 2 * 36 * 8 * 128 * 2                     # k and v, 36 layers, 8 KV heads x 128, bf16
    assert est.budget_tokens == int((usable - 14 * n) * sb.SAFETY // per_token)
    assert est.state_tokens == 1.25 * 24576 + 4 * 4096     # B.5: 24,576-token prompts, 4,096 new (table 8)
    assert est.states_per_call == int(est.budget_tokens // est.state_tokens)
    assert est.total <= usable


def test_check_names_missing_keys_and_a_kd_run_without_one_is_a_config_error(capsys, monkeypatch):
    """Issue 33: `--check` on a KD override printed a traceback when TEACHER_API_KEY was unset.
    Now every path of `--check` names each key the run will read that is not set here (a
    planning host need not hold secrets) and passes; the run itself refuses with a message."""
    from actionopd_jax.baselines.wiring import endpoint_agent

    for var in ("DASHSCOPE_API_KEY", "DEEPSEEK_API_KEY", "TEACHER_API_KEY", "MATCHER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    recipe = str(CONFIGS / "tau2_qwen3_4b_h200.yaml")
    for extra in ([], ["collect.kind=kd", "train.loss=kd"]):
        assert train_cli.main(["--config", recipe, "--check", *extra]) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "config OK" in out.out
        assert "secrets    TEACHER_API_KEY (the teacher API key) is not set in this environment" in out.out
        assert "secrets    MATCHER_API_KEY (the matcher and user simulator API key) is not set" in out.out
    with pytest.raises(ConfigError, match="TEACHER_API_KEY .* is not set: export it before `actionopd train`"):
        endpoint_agent(load_config(recipe, ["collect.kind=kd", "train.loss=kd"]))
    monkeypatch.setenv("TEACHER_API_KEY", "sk-test-not-a-real-key")
    monkeypatch.setenv("MATCHER_API_KEY", "sk-test-not-a-real-key")
    assert train_cli.main(["--config", recipe, "--check"]) == 0
    assert "secrets " not in capsys.readouterr().out


def test_cli_output_on_a_cpu_host_is_free_of_plugin_tracebacks_and_broken_pipes():
    """Issue 34: on a CPU host with the CUDA plugin installed (the test extra) every command
    printed jax's plugin-error traceback; `actionopd --help | head` ended in a BrokenPipe
    traceback."""
    env = cli_env(1)
    env.pop("JAX_PLATFORMS")   # let jax probe its plugins, as a user's shell does
    run = subprocess.run([sys.executable, "-m", "actionopd_jax.commands.main", "train", "--config",
                          str(CONFIGS / "tiny_cpu.yaml"), "--check"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "plugin configuration error" not in run.stderr, run.stderr[-3000:]
    # issue 46 item 8: nor the CUDA plugin's native no-driver lines (commands/native_noise.py)
    assert "Could not find cuda drivers" not in run.stderr, run.stderr[-3000:]
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-m', 'actionopd_jax.commands.main', "
            "'--help'], stdout=subprocess.PIPE, stderr=subprocess.PIPE); p.stdout.close(); "
            "err = p.stderr.read().decode(); p.wait(); print(p.returncode); print(err)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert out.splitlines()[0] == "0" and "BrokenPipeError" not in out, out
