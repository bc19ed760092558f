"""The main job's parts (actionopd_jax/experiment): task split, reference-teacher preconditions,
per-step statistics (hand-computed), logits only where needed, the report, the remote-teacher
switch (offline, real loopback server and client), and `--check` on every shipped config."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config, replace_keys
from actionopd_jax.experiment import teacher as teacher_lib
from actionopd_jax.experiment.phases import step_stats
from actionopd_jax.experiment.tasks import job_tasks, opening_collisions, split_tasks, subset_tasks
from actionopd_jax.types import Candidate, Invalid, Message, StateGroup, Task, ToolCall
from tests._configs import CONFIGS as SHIPPED_CONFIGS, SHIPPED
from tests._subprocess_fixtures import xla_flags

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [SHIPPED_CONFIGS / name for name in SHIPPED]  # every training config, found recursively


# --- tasks ---------------------------------------------------------------------------------------

def test_split_is_deterministic_by_task_id_and_disjoint():
    cfg = load_config(None)
    a, b = job_tasks(cfg.experiment), job_tasks(cfg.experiment)
    assert [t.task_id for t in a.train] == [t.task_id for t in b.train]
    assert a.pool_size == 20  # the 20 BFCL base tasks that use only TradingBot
    assert len(a.heldout) == 7 and len(a.train) == 13  # round(0.33 * 20) held out, the rest trains
    assert not {t.task_id for t in a.train} & {t.task_id for t in a.heldout}
    # the split depends on the ids only, not on the order they come in
    pool = subset_tasks("base", ("TradingBot",))
    shuffled = [pool[i] for i in np.random.default_rng(3).permutation(len(pool))]
    s1, s2 = split_tasks(pool, 0.33), split_tasks(shuffled, 0.33)
    assert {t.task_id for t in s1.heldout} == {t.task_id for t in s2.heldout}
    assert len(s1.train) == 13 and {t.task_id for t in s1.train} >= {t.task_id for t in a.train}


def test_subset_and_split_errors_say_what_to_do():
    with pytest.raises(ValueError, match="exactly the classes"):
        subset_tasks("base", ("NoSuchAPI",))
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_tasks([Task("a", "bfcl"), Task("b", "bfcl")], 1.0)
    with pytest.raises(ConfigError, match="experiment.heldout_fraction must be in"):
        load_config(None, ["experiment.heldout_fraction=0"])
    with pytest.raises(ConfigError, match="experiment.teacher="):
        load_config(None, ["experiment.teacher=oracle"])


def test_reference_teacher_can_tell_the_job_tasks_apart():
    split = job_tasks(load_config(None).experiment)
    assert opening_collisions(split.train + split.heldout) == []
    t = split.train[0]
    assert opening_collisions([t, Task(t.task_id, "bfcl", payload=dict(t.payload))]) == [[t.task_id, t.task_id]]


def test_schema_tokens_keep_every_schema_verbatim_at_one_token_per_tool(tmp_path):
    from actionopd_jax.chat import load_tokenizer, render_ids, render_text
    from actionopd_jax.experiment import assets

    exp = load_config(None, [f"experiment.cache_dir={tmp_path}"]).experiment
    split = job_tasks(exp)
    tools = assets.job_tool_schemas(split.train + split.heldout)
    plain = load_tokenizer(assets.build_job_tokenizer(dataclasses.replace(exp, schema_tokens=False), split.train))
    tok = load_tokenizer(assets.build_job_tokenizer(exp, split.train))
    assert len(tools) == 20 and len(tok) == len(plain) + 20
    messages = [{"role": "user", "content": "What is on my watchlist?"}]
    ids, plain_ids = render_ids(tok, messages, tools), render_ids(plain, messages, tools)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == render_text(plain, messages, tools)
    schema_ids = set(range(len(plain), len(tok)))
    assert sum(int(i) in schema_ids for i in ids) == 20  # each tool line is one token ...
    assert len(ids) < 400 < 2000 < len(plain_ids)  # ... instead of ~120


# --- per-step statistics -----------------------------------------------------------------------

def _cand(action, reward, verdicts):
    c = Candidate(token_ids=np.ones(2, np.int32), logprobs=np.zeros(2, np.float32), text="", action=action,
                  reward=reward)
    c.verdicts = list(verdicts)
    return c


def test_step_stats_by_hand():
    call = ToolCall("get_watchlist", {})
    # K=3, lambda=0.5: 2 of 3 teacher samples match -> 1.25; valid no match 0; invalid -1
    g1 = StateGroup("t", 0, np.ones(3, np.int32), [
        _cand(call, 1.25, ["match", "match", "no_match"]), _cand(Message("hi"), 0.0, ["no_match"] * 3),
        _cand(Invalid("bad json"), -1.0, ["no_match"] * 3), _cand(call, 1.25, ["match", "match", "no_match"])],
        [], committed_index=0)
    g2 = StateGroup("t", 1, np.ones(3, np.int32), [_cand(Message("x"), 0.0, ["no_match"])] * 4, [],
                    committed_index=2, retained=False, drop_reason="equal_rewards")
    masked = StateGroup("t", 2, np.ones(3, np.int32), [_cand(call, 0.0, ["unavailable"])] * 4, [],
                        committed_index=-1, retained=False, drop_reason="unavailable")
    s = step_stats([g1, g2, masked])
    assert s["candidates"] == 8  # the masked group has no rewards and is not counted
    assert s["reward_mean"] == pytest.approx((1.25 + 0 - 1 + 1.25) / 8)
    assert s["match_rate"] == pytest.approx(2 / 8)
    assert s["invalid_rate"] == pytest.approx(1 / 8)
    assert s["partial_match_rate"] == pytest.approx(2 / 8)  # the two 2-of-3 matches; none is 3 of 3
    assert s["committed_reward_mean"] == pytest.approx((1.25 + 0.0) / 2)
    assert (s["groups"], s["groups_retained"]) == (3, 1)
    assert s["unavailable_rate"] == pytest.approx(1 / 3)  # 1 of 3 groups masked for unavailable supervision
    assert s["truncated_rate"] == 0.0


# --- logits only at the positions that need them ------------------------------------------------

def _all_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Shapes of every value a (closed) jaxpr and its sub-jaxprs produce."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in inner.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (list, tuple)) else [value]):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    out += _all_shapes(sub)
    return out


def test_logits_only_for_generated_tokens_and_the_last_prompt_position():
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3, make_mesh
    from actionopd_jax.sampling import decode
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.step import StepSettings, TrainStep, make_optimizer, split_params

    cfg = PRESETS["tiny"]
    V, T, R, P = cfg.vocab_size, 96, 16, 80
    graphdef, params = split_params(Qwen3(cfg, rngs=nnx.Rngs(0)))
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    step = TrainStep(graphdef, params, mesh, make_optimizer(lr=1e-3), StepSettings())
    rows = [Row(np.arange(70, dtype=np.int32) % V, np.arange(10, dtype=np.int32), 1.0, np.zeros(10, np.float32))]
    batch = pack_minibatch(rows, [0], microbatches=1, microbatch_rows=1, seq_len=T, resp_len=R).arrays
    batch["old_logp"] = batch["sampler_logp"]
    state = jax.eval_shape(step._init_impl, params)
    shapes = _all_shapes(jax.make_jaxpr(step._update_impl)(state, batch))
    assert any(V in s and R in s for s in shapes)  # the response positions are scored ...
    assert not any(V in s and T in s for s in shapes)  # ... and never the whole sequence

    rows_s = decode.RowSettings(keys=jax.random.split(jax.random.key(0), 2), temperature=jnp.ones(2),
                                top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2), max_new=jnp.full(2, 8))
    model_params = nnx.state(nnx.merge(graphdef, params))
    sampler_graphdef = nnx.graphdef(nnx.merge(graphdef, params))
    jaxpr = jax.make_jaxpr(lambda p, t, m, r: decode.prefill(sampler_graphdef, p, t, m, r, jnp.array([1]),
                                                            samples=2, max_new=8, cap=64))(
        model_params, jnp.ones((1, P), jnp.int32), jnp.ones((1, P), bool), rows_s)
    shapes = _all_shapes(jaxpr)
    assert any(V in s for s in shapes) and not any(V in s and P in s for s in shapes)


# --- report ----------------------------------------------------------------------------------------

def _summary(run_dir: Path) -> dict:
    h = [{"step": 0.0, "reward_mean": -0.5, "match_rate": 0.1, "invalid_rate": 0.5, "candidates": 40,
          "groups": 10, "groups_retained": 6, "committed_reward_mean": 0.2},
         {"step": 1.0, "reward_mean": 0.25, "match_rate": 0.4, "invalid_rate": 0.1, "candidates": 40,
          "groups": 10, "groups_retained": 5, "committed_reward_mean": 0.9}]
    ev = {"bfcl_accuracy": 0.0, "episode_valid_rate": 0.5, "valid_rate": 0.6, "same_tool_rate": 0.3,
          "agreement_rate": 0.1, "decisions": 20, "episodes": 2}
    return {"run_dir": str(run_dir),
            "teacher": {"label": "privileged reference teacher (embedded, 2 training tasks)", "privileged": True,
                        "matching": "rules only"},
            "tasks": {"category": "base", "classes": ["TradingBot"], "train": ["a", "b"], "heldout": ["c"]},
            "student": {"description": "random-init Qwen3"},
            "warm_start": {"summary": "2/2 teacher trajectories", "pretrain": {"losses": [7.0, 5.0]},
                           "kd": {"losses": [3.0, 2.0]}},
            "actionopd": {"history": h, "checkpoint_dir": str(run_dir / "checkpoints"), "checkpoint_step": 1,
                          "final_student": str(run_dir / "student_final")},
            "eval": {"before": ev, "after": {**ev, "agreement_rate": 0.2}},
            "timings": {"setup": 1.0, "kd": 2.0, "total": 3.0}}


def test_report_shows_curves_and_before_after(tmp_path):
    from actionopd_jax.experiment.report import summary_text, write_report

    paths = write_report(tmp_path, _summary(tmp_path))
    md = paths["markdown"].read_text()
    assert "privileged" in md and "| 1 | final (no update) | 40 | 0.250 | 40.0% | 10.0% |" in md
    assert "| agrees with reference action | 10.0% | 20.0% |" in md
    for key in ("curves", "heldout", "warm_start"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = summary_text(_summary(tmp_path))
    assert "-0.500 (warm start only) -> 0.250 (final)" in text and "10.0% -> 40.0%" in text
    assert "ActionOPD unavailable groups" in text and "per step (masked, never trained on)" in text
    assert "Asynchronous collection" not in md and "asynchronous collection" not in text   # a synchronous run
    # collect.max_staleness=1 (issue 44): the section from metrics.jsonl, the row from the summary
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "collect/async/max_staleness": 1, "collect/async/staleness_0": 3, "collect/async/staleness_1": 2,
         "collect/async/stale_dropped": 0, "collect/async/wait_s": 1.5}) + "\n")
    summary = dict(_summary(tmp_path), **{"async": {"max_staleness": 1, "trained_by_staleness": [3.0, 2.0],
                                                    "dropped": 0.0, "update_waited_s": 1.5}})
    paths = write_report(tmp_path, summary)
    md = paths["markdown"].read_text()
    assert "## Asynchronous collection" in md and "| groups trained at staleness 1 | 2 (40%) |" in md
    assert paths["async"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "eta=1: groups trained at staleness 3 / 2 (0..1), 0 dropped, update waited 1.5s" in summary_text(summary)


def test_report_links_the_matcher_audit_once_it_exists(tmp_path):
    from actionopd_jax.experiment.report import write_report

    assert "audit.md" not in write_report(tmp_path, _summary(tmp_path))["markdown"].read_text()
    (tmp_path / "audit.md").write_text("# Matcher audit\n")   # `actionopd audit-matcher` ran
    md = write_report(tmp_path, _summary(tmp_path))["markdown"].read_text()
    assert md.count("## Matcher audit") == 1 and "[audit.md](audit.md)" in md


# --- remote teacher switch (offline) -------------------------------------------------------------

def _remote_cfg(base_url="https://teacher.example/v1", key_env="ACTIONOPD_TEST_TEACHER_KEY", *extra):
    return load_config(SHIPPED_CONFIGS / "main_remote_teacher.yaml",
                       [f"teacher.base_url={base_url}", f"teacher.api_key_env={key_env}", *extra])


def test_remote_teacher_missing_key_names_the_variable(monkeypatch):
    monkeypatch.delenv("ACTIONOPD_TEST_TEACHER_KEY", raising=False)
    monkeypatch.setenv("DEEPSEEK_API_KEY", "x")
    cfg = _remote_cfg()
    assert teacher_lib.teacher_mode(cfg) == "endpoint"
    with pytest.raises(ConfigError, match=r"ACTIONOPD_TEST_TEACHER_KEY \(teacher.api_key_env\)") as e:
        teacher_lib.require_secrets(cfg)
    assert "DEEPSEEK_API_KEY" not in str(e.value)
    with pytest.raises(ConfigError, match="matcher.kind=rules"):
        teacher_lib.check_endpoint_settings(replace_keys(cfg, **{"matcher.base_url": ""}))
    with pytest.raises(ConfigError, match="teacher.base_url and teacher.model"):
        teacher_lib.check_endpoint_settings(replace_keys(cfg, **{"teacher.model": ""}))


def test_remote_teacher_runs_through_the_real_client_with_the_key_from_env(monkeypatch):
    """Endpoint mode against a loopback server of ours that requires a bearer key: the job's
    KD agent reads the key from the variable the config names (the server stands in for a
    remote provider; it serves the reference policy so the episode can succeed)."""
    from actionopd_jax.baselines.kd import teacher_trajectories
    from actionopd_jax.baselines.wiring import endpoint_agent
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.serve.reference_backend import ReferenceBackend

    task = job_tasks(load_config(None).experiment).train[0]
    monkeypatch.setenv("ACTIONOPD_TEST_SERVER_KEY", "s3cret")
    with OpenAIServer(ReferenceBackend([task], model_name="remote-model"),
                      api_key_env="ACTIONOPD_TEST_SERVER_KEY") as server:
        url = server.start()
        cfg = _remote_cfg(url, "ACTIONOPD_TEST_TEACHER_KEY", "teacher.model=remote-model", "matcher.kind=rules")
        monkeypatch.setenv("ACTIONOPD_TEST_TEACHER_KEY", "s3cret")
        endpoint = teacher_lib.start_teacher(cfg, [task])
        assert not endpoint.privileged and endpoint.base_url == url
        assert teacher_lib.teacher_overrides(cfg, endpoint) == {}  # the trainer uses teacher.* as configured

        def run():
            return asyncio.run(teacher_trajectories(endpoint_agent(cfg), [task], lambda t: make_environment(t.env),
                                                    keep_successful=False))
        (record,) = run()
        assert record["score"]["reward"] == 1.0 and server.request_count > 0
        monkeypatch.setenv("ACTIONOPD_TEST_TEACHER_KEY", "wrong")
        assert run() == []  # 401: the episode cannot finish, nothing is recorded


def test_reference_teacher_is_labelled_and_serves_training_tasks_only():
    import openai

    cfg = load_config(None)
    split = job_tasks(cfg.experiment)
    endpoint = teacher_lib.start_teacher(cfg, split.train[:2])
    try:
        assert endpoint.privileged and "privileged reference teacher" in endpoint.label
        over = teacher_lib.teacher_overrides(cfg, endpoint)
        assert over["matcher.kind"] == "rules" and over["teacher.base_url"] == endpoint.base_url
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="unused")
        from actionopd_jax.envs.bfcl_data import load_entry

        held = load_entry(split.heldout[0].task_id)["question"][0]
        with pytest.raises(openai.BadRequestError, match="does not recognise"):
            client.chat.completions.create(model=endpoint.model, messages=held)
    finally:
        endpoint.close()


def test_an_explicit_judge_beside_the_reference_teacher_is_honoured(capsys):
    """Issue 46 item 8: with the built-in reference teacher, matcher.kind=rules+llm naming a
    judge was replaced by rules-only matching while `--check` said OK. The named judge is now
    what the phase's matcher asks (a real request to a loopback judge), `--check` names it, a
    half-named judge is refused, and rules+llm naming none (the default) says it is rules only."""
    from actionopd_jax.commands import train as train_cli
    from actionopd_jax.matching.build import build_matcher
    from actionopd_jax.teacher.specs import judge_spec
    from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
    from tests._teacher_fixtures import serve
    from tests.test_matching_judge import PARIS, ROME

    backend = ScriptedBackend("judge", lambda req: message_choice("VERDICT: NO_MATCH"))
    with serve(backend) as server:
        judge = ["matcher.kind=rules+llm", "matcher.model=judge", f"matcher.base_url={server.base_url}",
                 "matcher.provider=vllm"]
        cfg = load_config(None, judge)
        split = job_tasks(cfg.experiment)
        endpoint = teacher_lib.start_teacher(cfg, split.train[:2])
        try:
            phase = replace_keys(cfg, **teacher_lib.teacher_overrides(cfg, endpoint))
        finally:
            endpoint.close()
        assert phase.teacher.base_url == endpoint.base_url and phase.matcher.kind == "rules+llm"
        matcher = build_matcher(judge_spec(phase.matcher))
        messages = [{"role": "user", "content": "the capital?"}]
        assert asyncio.run(matcher.verdict(ROME, PARIS, messages=messages, tools=[])) == "no_match"
        assert backend.requests and backend.requests[-1].raw["model"] == "judge"
        assert train_cli.main(["--check", *judge]) == 0
        out = capsys.readouterr().out
        assert f"matching: matcher.kind=rules+llm, judge judge at {server.base_url}" in out, out
    assert train_cli.main(["--check", "matcher.model=judge", "matcher.provider=vllm"]) == 2   # no URL: refused
    assert "set both matcher.base_url and matcher.model" in capsys.readouterr().err
    default = load_config(None)
    assert teacher_lib.teacher_overrides(default, teacher_lib.TeacherEndpoint(
        base_url="http://127.0.0.1:1/v1", model="m", api_key_env="", privileged=True, label=""))["matcher.kind"] == "rules"
    assert "rules only: matcher.kind=rules+llm names no judge" in teacher_lib.matching_label(default, True)


# --- --check on every shipped config, on a 1-device CPU ------------------------------------------

def _one_device_env():
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
    for name in ("DASHSCOPE_API_KEY", "DEEPSEEK_API_KEY", "TEACHER_API_KEY", "MATCHER_API_KEY"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# Every shipped config passes --check in process (tests/test_check_target.py::
# test_every_shipped_config_passes_check_for_its_target, which also checks each one's target plan).
# What only a subprocess shows -- the `actionopd_jax.commands train --check` entry point on a
# one-device host, no API keys set, nothing written to the working directory -- does not depend on
# which config is read, so it runs for the CPU recipe and a target-planned TPU recipe. The
# remote-teacher main job (keys named but unset; its --check measures every task's prompt, ~30 s
# alone) is started as a subprocess by test_remote_config_run_without_key_stops_at_once_naming_it.
# (All shipped configs as subprocesses took ~60 s of the suite.)
CHECKED_AS_SUBPROCESS = ("tiny_cpu.yaml", "qwen3_8b_tpu.yaml")


def test_check_as_a_subprocess_passes_for_the_cpu_and_a_tpu_recipe(tmp_path):
    assert set(CHECKED_AS_SUBPROCESS) <= set(SHIPPED)
    procs = {p.name: subprocess.Popen([sys.executable, "-m", "actionopd_jax.commands", "train", "--check", "--config",
                                       str(p)], cwd=tmp_path, env=_one_device_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
             for p in CONFIGS if p.name in CHECKED_AS_SUBPROCESS}
    assert set(procs) == set(CHECKED_AS_SUBPROCESS)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}:\n{out[-3000:]}"
        assert "config OK" in out, f"{name}:\n{out[-3000:]}"
    assert not list(tmp_path.iterdir())  # a check writes nothing


def test_remote_config_run_without_key_stops_at_once_naming_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "actionopd_jax.commands", "train", "--config",
                        str(SHIPPED_CONFIGS / "main_remote_teacher.yaml")], cwd=tmp_path, env=_one_device_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:]
    assert "DASHSCOPE_API_KEY (teacher.api_key_env)" in r.stdout and "DEEPSEEK_API_KEY (matcher.api_key_env)" in r.stdout
    assert not (tmp_path / "runs").exists()  # nothing was started
