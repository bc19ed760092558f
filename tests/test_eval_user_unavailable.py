"""Issue 43 item 1 through `actionopd eval`: a tau2 user simulator that fails is neither a score
nor a finished episode. Before, airline/0 scored 0.0 with the user's key unset (100 with it set),
the run exited 0 and a resume kept the zero. The user is our OpenAI-compatible server with a
scripted customer (real HTTP, the real `openai` client), requiring a bearer key: a wrong key is
an endpoint that answers nothing (HTTP 401, not retried, so the test needs no waits)."""

import json

from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.eval.runner import load_finished
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend
from tests._envs_fixtures import USER_MODEL, scripted_user_reply


def _args(server, out, *extra):
    return ["--reference", "--bench", "tau2_telecom:train", "--limit", "1", "--trials", "1",
            "--tau2-prompts", "actionopd", "--user-sim-url", server.base_url, "--user-sim-model", USER_MODEL,
            "--user-sim-provider", "actionopd", "--user-sim-api-key-env", "EVAL_TEST_USER_KEY",
            "--out", str(out), "--no-progress", *extra]


def test_a_failing_user_endpoint_is_unavailable_exits_1_and_reruns_on_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EVAL_TEST_USER_SERVER_KEY", "right")
    server = OpenAIServer(ScriptedBackend(USER_MODEL, scripted_user_reply), api_key_env="EVAL_TEST_USER_SERVER_KEY")
    server.start()
    out = tmp_path / "eval"
    try:
        monkeypatch.setenv("EVAL_TEST_USER_KEY", "wrong")
        assert eval_cli.main(_args(server, out)) == 1
        err = capsys.readouterr().err
        assert f"1 episode(s) unavailable: user simulator endpoint {server.base_url} (model {USER_MODEL}) x1" in err
        assert "AuthenticationError" in err
        assert load_finished(out / "episodes.jsonl") == []            # no score, no finished episode
        results = json.loads((out / "results.json").read_text())
        assert results["summary"] == [] and len(results["errors"]) == 1      # in no metric, listed as an error

        monkeypatch.setenv("EVAL_TEST_USER_KEY", "right")               # the endpoint is back: resume
        assert eval_cli.main(_args(server, out)) == 0
    finally:
        server.stop()
    (episode,) = load_finished(out / "episodes.jsonl")                  # the same episode, played now
    assert episode["score"]["reward"] == 1.0


def test_eval_check_names_a_missing_user_key(tmp_path, monkeypatch, capsys):
    """`eval --check` said nothing about the user's key or endpoint (issue 43 item 1)."""
    monkeypatch.delenv("EVAL_TEST_UNSET_USER_KEY", raising=False)
    code = eval_cli.main(["--check", "--reference", "--bench", "tau2_airline:test", "--limit", "1",
                          "--user-sim-url", "http://127.0.0.1:9/v1", "--user-sim-model", "u", "--user-sim-provider", "vllm",
                          "--user-sim-api-key-env", "EVAL_TEST_UNSET_USER_KEY"])
    out = capsys.readouterr().out
    # named, as train --check names an unset key (a planning host need not hold secrets)
    assert code == 0
    assert "user   http://127.0.0.1:9/v1 (model u), for 1 task(s): key $EVAL_TEST_UNSET_USER_KEY NOT SET" in out
    assert ("secrets    EVAL_TEST_UNSET_USER_KEY (the user simulator's API key, --user-sim-api-key-env or "
            "eval.user.api_key_env) is not set in this environment" in out)
    # a user simulator the tau2 tasks need and do not have fails the check
    assert eval_cli.main(["--check", "--reference", "--bench", "tau2_airline:test", "--limit", "1"]) == 2
    assert "MISSING: 1 task(s) need a user simulator: --user-sim-url and --user-sim-model" in capsys.readouterr().out
    # a run refuses to start instead of playing episodes that cannot finish
    assert eval_cli.main(["--reference", "--bench", "tau2_airline:test", "--limit", "1",
                          "--user-sim-url", "http://127.0.0.1:9/v1", "--user-sim-model", "u", "--user-sim-provider", "vllm",
                          "--user-sim-api-key-env", "EVAL_TEST_UNSET_USER_KEY", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "EVAL_TEST_UNSET_USER_KEY (the user simulator's API key" in err and "is not set: export it" in err
