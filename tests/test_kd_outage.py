"""Issue 46 items 4 and 5 on KD's path (baselines/kd_fresh.py, the warm start's
teacher_trajectories): a teacher that never answers is an outage that names its endpoint and
stops the run as ActionOPD's collector stops it, never "0 successful -> 0 examples" and exit 0.
Real parts: a closed 127.0.0.1 port, or our OpenAI-compatible server refusing a wrong key,
reached through the real `openai` client."""

import gc
import logging
import socket

import pytest

from actionopd_jax.baselines.kd_fresh import FreshKDSource
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.envs.tasks import TaskSource, TaskStream
from actionopd_jax.eval.agents import EndpointAgent
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.train.sources import RunStop
from tests._baselines_fixtures import toy_env_factory, toy_tasks

FAST = RetryPolicy(max_attempts=2, base_delay_s=0.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


def test_a_dead_teacher_stops_kd_after_max_outage_steps_naming_it(tok, tmp_path, caplog):
    with socket.socket() as s:   # bound, never listening: every connection is refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        stream = TaskStream([(TaskSource("toy", toy_tasks(2)), 2)], seed=0)
        source = FreshKDSource(lambda: EndpointAgent(url, "kd-teacher", retry=FAST, role="teacher"), stream,
                               toy_env_factory, tok, out_dir=tmp_path / "kd", trials=2, max_prompt_tokens=512,
                               max_actions=3, max_outage_steps=2)
        with caplog.at_level(logging.ERROR, logger="actionopd_jax.baselines.kd_fresh"):
            assert source.collect(0) == []       # step 0: logged as an outage step, goes on
            assert "no teacher episode finished" in caplog.text and "the run stops at 2" in caplog.text
            assert source.metrics()["kd/episodes_unavailable"] == 4.0
            with pytest.raises(RunStop) as stop:
                source.collect(1)
    text = str(stop.value)
    assert "2 steps in a row" in text and "4 episode(s) unavailable" in text
    assert f"teacher endpoint {url} (model kd-teacher)" in text and "APIConnectionError" in text


def test_kd_through_the_cli_with_a_teacher_that_never_answers_exits_1(tmp_path, monkeypatch, capsys):
    """`actionopd train collect.kind=kd` against a teacher that refuses every request (a wrong
    key: HTTP 401, not retried): it exited 0 after two "update skipped" steps."""
    from actionopd_jax.commands import train as cli

    monkeypatch.setenv("KD_OUTAGE_SERVER_KEY", "right")
    monkeypatch.setenv("KD_OUTAGE_TEACHER_KEY", "wrong")
    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    backend = ScriptedBackend("kd-teacher", lambda req: message_choice("never sent"))
    with OpenAIServer(backend, api_key_env="KD_OUTAGE_SERVER_KEY") as srv:
        args = ["model.preset=tiny", f"model.tokenizer={tok_dir}", "train.steps=3", "collect.kind=kd",
                "train.loss=kd", "env.name=bfcl", "env.allow_eval_overlap=true", "collect.task_starts_per_step=2", "kd.trials=1",
                "teacher.kind=openai", "teacher.provider=vllm", f"teacher.base_url={srv.base_url}", "teacher.model=kd-teacher",
                "teacher.api_key_env=KD_OUTAGE_TEACHER_KEY", "run.progress=false", "run.tensorboard=false",
                "experiment.enabled=false", "--run-dir", str(tmp_path / "run")]
        code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "stopped: KD: no teacher episode finished in 2 steps in a row" in err
    assert f"teacher endpoint {srv.base_url} (model kd-teacher)" in err and "AuthenticationError" in err


def test_sigterm_in_a_kd_phase_is_a_clean_stop_with_the_trainers_exit_code(tmp_path, monkeypatch, capsys):
    """Issue 46 item 8: SIGTERM in the main job's KD warm start (`run_kd`) ended in a
    RuntimeError traceback and exit 1. Now the trainer finishes its step and saves it, and the
    phase raises StoppedEarly with the trainer's SIGTERM exit code, which `actionopd train`
    returns without a traceback. The signal is real (signal.raise_signal), sent during step 0's
    collection, so the handler the trainer installed is what receives it."""
    import signal

    from actionopd_jax.baselines.kd import KDGroupSource, kd_examples, run_kd
    from actionopd_jax.commands import train as cli
    from actionopd_jax.train.loop import SIGTERM_EXIT_CODE
    from actionopd_jax.train.sources import StoppedEarly
    from tests._baselines_fixtures import tiny_run_config, toy_teacher_backend, toy_trajectories

    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    with OpenAIServer(toy_teacher_backend()) as srv:
        records = toy_trajectories(srv.base_url, toy_tasks(4))
    examples = kd_examples(records, load_tokenizer(tok_dir), max_prompt_tokens=512)   # the KD test's shapes
    collect = KDGroupSource.collect

    def collect_then_sigterm(self, step, policy=None):
        if step == 0:
            signal.raise_signal(signal.SIGTERM)
        return collect(self, step, policy)

    monkeypatch.setattr(KDGroupSource, "collect", collect_then_sigterm)
    with pytest.raises(StoppedEarly) as stop:
        run_kd(tiny_run_config(tok_dir), examples, run_dir=tmp_path / "kd", steps=3, examples_per_step=8)
    assert stop.value.code == SIGTERM_EXIT_CODE and "stopped early at step 1" in str(stop.value)
    assert (tmp_path / "kd" / "checkpoints" / "1").is_dir()    # the finished step is saved

    # `actionopd train` returns that code and prints the message, no traceback
    def stopped(cfg, args):
        raise stop.value

    monkeypatch.setattr(cli, "train", stopped)
    # an earlier test's HTTP clients, collected late, may log their own closing tracebacks into
    # the captured stderr: collect them now and read only what the command itself prints
    gc.collect()
    capsys.readouterr()
    assert cli.main(["experiment.enabled=false", "--run-dir", str(tmp_path / "run")]) == SIGTERM_EXIT_CODE
    err = capsys.readouterr().err
    assert "stopped early at step 1" in err and "Traceback" not in err


def test_an_opd_scoring_outage_stops_the_run_naming_the_endpoint():
    """OPD's teacher scores the student's tokens over /v1/completions: a dead endpoint ended the
    run in an APIConnectionError traceback; it is a RunStop (exit 1) naming URL, model and class."""
    import numpy as np

    from actionopd_jax.baselines.opd import EndpointScorer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with pytest.raises(RunStop) as stop:
            EndpointScorer(url, "opd-teacher", max_retries=0).score([np.arange(3)], [np.arange(2)])
    text = str(stop.value)
    assert f"endpoint {url} (model opd-teacher)" in text and "APIConnectionError" in text


def test_malformed_teacher_replies_are_retried_and_the_counts_agree(tmp_path, caplog):
    """Issue 46 item 4: at 3% malformed 200 bodies, 8 of 13 warm-start episodes were lost and the
    log said "13 episodes, 13 kept" before "none succeeded". Here 30% of the reference teacher's
    bodies are malformed (serve/faults.py): every episode still finishes, the malformed bodies are
    counted, and the log's counts are the episodes' own."""
    import asyncio

    from actionopd_jax.baselines.kd import teacher_trajectories
    from actionopd_jax.envs.registry import make_environment
    from actionopd_jax.eval.tasks import select_tasks
    from actionopd_jax.serve.faults import FaultInjector, FaultRates
    from actionopd_jax.serve.reference_backend import ReferenceBackend

    tasks = select_tasks("bfcl:base", limit=3)
    server = OpenAIServer(ReferenceBackend(tasks), middleware=FaultInjector(FaultRates(malformed=0.3), seed=0))
    server.start()
    try:
        agent = EndpointAgent(server.base_url, "reference-teacher-privileged", role="teacher",
                              retry=RetryPolicy(max_attempts=10, base_delay_s=0.0))
        with caplog.at_level(logging.INFO, logger="actionopd_jax.baselines.kd"):
            kept = asyncio.run(teacher_trajectories(agent, tasks, lambda t: make_environment(t.env),
                                                    keep_successful=False, out_jsonl=tmp_path / "t.jsonl"))
    finally:
        server.stop()
    assert len(kept) == 3 and all(r["score"]["reward"] == 1.0 for r in kept)
    assert agent.usage.malformed_replies > 0
    assert (f"teacher trajectories: 3 finished, 3 successful (reward >= 1.0), 3 returned; 0 not finished; the "
            f"endpoint: {agent.usage.http_calls} request(s), {agent.usage.transport_retries} retried, "
            f"{agent.usage.malformed_replies} malformed bod(ies)") in caplog.text


def test_the_warm_start_stops_naming_the_endpoint_when_episodes_are_unavailable(tmp_path):
    """The warm start imitated whatever finished; an unavailable episode now stops it (exit 1)
    with the endpoint and the counts, and the finished ones stay for the rerun."""
    from actionopd_jax.config.load import load_config
    from actionopd_jax.eval.tasks import select_tasks
    from actionopd_jax.experiment.warm_start import warm_start

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        agent = EndpointAgent(url, "warm-teacher", role="teacher", retry=FAST)
        with pytest.raises(RunStop) as stop:
            warm_start(load_config(None, []), agent=agent, tasks=select_tasks("bfcl:base", limit=2), tokenizer=None,
                       tokenizer_dir=tmp_path, student_dir=tmp_path, run_dir=tmp_path / "ws", progress=False)
    text = str(stop.value)
    assert text.startswith(f"warm start: 2 episode(s) unavailable: teacher endpoint {url} (model warm-teacher) x2 "
                           "of 2 teacher episodes")
    assert "APIConnectionError" in text and "The 0 finished ones are kept" in text
