"""Orbax checkpoints of a training run straight into eval, serve and export (issue 16): the run
is written on an 8-device (2, 2, 2) mesh (tests/_orbax_run_fixtures.py) and read back on one
device and on a (4, 2) mesh, as a run directory, its checkpoints/ folder or a step folder."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import openai
import pytest
import yaml
from flax import nnx

from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.model import make_mesh
from actionopd_jax.train import export_cli
from actionopd_jax.checkpoint import Checkpointer
from actionopd_jax.checkpoint import load_model
from tests._serve_fixtures import TOOL_CONVERSATION, WEATHER_TOOL
from tests._subprocess_fixtures import cli_env
from tests._orbax_run_fixtures import build_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return build_run(tmp_path_factory.mktemp("orbax_run"))


def _host(model):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _saved_params(run_dir, step):
    ckpt = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(None, step, params_only=True).params)]
    finally:
        ckpt.close()


def _eval(source, out, extra=()):
    args = [*source, "--bench", "bfcl:base", "--limit", "1", "--max-new-tokens", "12", "--no-progress",
            "--out", str(out), *extra]
    assert eval_cli.main(args) == 0
    return (json.loads((out / "results.json").read_text())["summary"],
            [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()])


def test_eval_checkpoint_on_one_device_matches_its_hf_export(run, tmp_path, capsys):
    """The run was written by 8 devices; eval restores it onto one device (the first local one)
    and plays the same greedy episodes, with the same scores, as its exported HF directory."""
    cfg, model, info = load_model(run["run"])
    assert info["step"] == 2 and info["tokenizer"] == run["run"] / "tokenizer"  # what the run recorded
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(nnx.state(model))} == {1}
    assert all(np.array_equal(a, b) for a, b in zip(_host(model), _saved_params(run["run"], 2)))

    assert export_cli.main(["--checkpoint", str(run["run"]), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()  # the run's tokenizer travels with the export
    ours, ours_traj = _eval(["--checkpoint", str(run["run"])], tmp_path / "from_orbax")
    theirs, their_traj = _eval(["--hf", str(tmp_path / "hf")], tmp_path / "from_hf")
    assert ours == theirs
    (a,), (b,) = ours_traj, their_traj
    assert a["actions"] >= 1 and a["messages"] == b["messages"] and a["verdict"] == b["verdict"]
    assert a["reason"] and a["scored_calls"]["ours"] == b["scored_calls"]["ours"]
    assert [m["role"] for m in a["messages"][:1]] == ["user"] and any(m["role"] == "assistant" for m in a["messages"])
    assert "loaded step 2 of" in capsys.readouterr().err


def test_load_on_a_4x2_mesh_as_bf16_and_from_each_kind_of_path(run):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    want = _saved_params(run["run"], 2)
    cfg, model, _ = load_model(run["run"] / "checkpoints", mesh=mesh)
    leaves = jax.tree.leaves(nnx.state(model))
    assert all(x.sharding.mesh.shape == {"fsdp": 4, "tensor": 2} for x in leaves)
    assert max(len(x.sharding.device_set) for x in leaves) == 8
    assert all(np.array_equal(a, b) for a, b in zip(_host(model), want))
    cfg16, model16, info = load_model(run["run"] / "checkpoints" / "1", mesh=mesh, dtype="bfloat16")
    assert info["step"] == 1 and cfg16.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model16))} == {np.dtype(jax.numpy.bfloat16)}
    one = _saved_params(run["run"], 1)
    assert all(np.array_equal(np.asarray(a, np.float32), b.astype(jax.numpy.bfloat16).astype(np.float32))
               for a, b in zip(_host(model16), one))


def test_half_written_step_is_skipped_and_bad_paths_say_what_to_do(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run["run"], copy)
    torn = copy / "checkpoints" / "3.orbax-checkpoint-tmp-1733000000"
    shutil.copytree(copy / "checkpoints" / "2", torn)  # a save of step 3 that never finished
    lines = []
    _, _, info = load_model(copy, announce=lines.append)
    assert info["step"] == 2 and lines == [f"skipping half-written checkpoint {torn} (a save that did not finish)"]

    base = ["--bench", "bfcl:base", "--limit", "1", "--no-progress", "--out", str(tmp_path / "x")]
    cases = {str(tmp_path / "missing"): "does not exist",
             str(torn): "half-written checkpoint",
             str(tmp_path / "x"): "no finished checkpoint"}
    (tmp_path / "x").mkdir()
    for path, message in cases.items():
        assert eval_cli.main(["--checkpoint", path, *base]) == 2
        assert message in capsys.readouterr().err
    assert eval_cli.main(["--checkpoint", str(copy), "--step", "7", *base]) == 2
    assert "step 7 is not in" in capsys.readouterr().err
    # a run whose checkpoint.dir pointed elsewhere is found through its config.yaml
    shutil.move(copy / "checkpoints", tmp_path / "elsewhere")
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["checkpoint"]["dir"] = str(tmp_path / "elsewhere")
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    _, _, info = load_model(copy, announce=lines.append)
    assert info["step"] == 2 and info["tokenizer"] == copy / "tokenizer"
    shutil.rmtree(copy / "tokenizer")  # then the tokenizer directory the run's config named
    assert load_model(copy, announce=lines.append)[2]["tokenizer"] == run["tokenizer"]


def test_generate_from_a_step_folder(run, capsys):
    from actionopd_jax.sampling import cli as generate_cli

    step1 = run["run"] / "checkpoints" / "1"
    assert generate_cli.main(["--checkpoint", str(step1), "--prompt", "Say hello.",
                              "--max-new-tokens", "4", "--temperature", "0", "--seed", "0"]) == 0
    captured = capsys.readouterr()
    assert "=== prompt: Say hello." in captured.out and f"loaded step 1 of {step1.parent}" in captured.err
    assert "read only" not in captured.err  # Orbax's read-only notices are kept out of the user's way
    assert generate_cli.main(["--checkpoint", str(run["run"]), "--step", "5"]) == 2
    assert "step 5 is not in" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_checkpoint_on_one_device_answers_an_sdk_request_with_tools(run):
    """`actionopd serve --checkpoint RUN` in a process that has a single device: the run's
    fitted tool call comes back through the openai SDK as a parsed tool call."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "actionopd_jax.commands", "serve", "--checkpoint", str(run["run"]), "--port", str(port),
         "--default-max-tokens", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(devices=1))
    try:
        deadline, seen = time.time() + 180, []
        while time.time() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "serving" in line or not line:
                break
        assert f"http://127.0.0.1:{port}/v1" in seen[-1], "".join(seen)[-3000:]
        assert any("loaded step 2 of" in x for x in seen)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [run["run"].name]
        # which step answers (issue 34: after a fallback nothing said so)
        (model,) = client.models.list().data
        source = model.model_extra["actionopd_source"]
        assert source["step"] == 2 and source["fallback_from"] is None and source["verified"] is True, source
        r = client.chat.completions.create(model=run["run"].name, messages=TOOL_CONVERSATION, tools=[WEATHER_TOOL],
                                           temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert os.environ.get("JAX_PLATFORMS") == "cpu"


def test_a_compare_folder_points_to_its_per_method_runs(tmp_path, capsys):
    (tmp_path / "compare.json").write_text("{}")
    for method in ("actionopd-s0", "kd-s0"):
        (tmp_path / method / "checkpoints" / "1").mkdir(parents=True)
    out = tmp_path / "eval"
    assert eval_cli.main(["--checkpoint", str(tmp_path), "--bench", "bfcl:base", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a comparison of several runs, not one run; pass one of its per-method runs" in err
    assert f"\n  {tmp_path / 'actionopd-s0'}" in err and f"\n  {tmp_path / 'kd-s0'}" in err


def test_readmes_evaluate_command_scores_every_episode_of_a_4096_position_student(run, tmp_path, capsys):
    """Issue 43 item 9: README's `actionopd eval --checkpoint runs/RUN --bench bfcl:base --limit 3`
    on a student that holds 4,096 positions, as the main job's does. Its default reply budget
    (table 8: 4,096 new tokens) cannot fit beside any prompt: every request was refused, every
    episode ended with context_budget before its first action, and the command exited 1. The
    budget is now fitted to the context each prompt leaves, and the scores' settings say so."""
    out = tmp_path / "readme"
    readme = ["--checkpoint", str(run["run"]), "--bench", "bfcl:base", "--limit", "3"]
    # --check reads the step's context and the run's tokenizer (no weights) and says what replies get
    assert eval_cli.main([*readme, "--check"]) == 0
    said = capsys.readouterr().out
    assert "context    the model's 4,096 tokens (step 2 of" in said and "its replies get at most" in said, said
    code = eval_cli.main([*readme, "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 and all(e["actions"] >= 1 and e["end_reason"] != "context_budget" for e in episodes)
    fit = json.loads((out / "results.json").read_text())["settings"]["reply_fit"]
    assert "4,096 new tokens does not fit the model's 4,096-token context" in fit
