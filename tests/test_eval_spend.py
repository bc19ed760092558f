"""Issue 46 (one spend meter for every paid call): `actionopd eval` with an endpoint meters the
evaluated endpoint, the tau2 user simulator and the AWM judge on the paid-call ledger training
uses (paid_calls.py), ends with its spend table, writes spend.md and results.json's "spend",
and holds `--budget-usd` as a hard cap (exit 3, nothing sent past it, the episode played on
resume). Before, eval printed no spend and had no price or cap. The endpoints are our
OpenAI-compatible server on 127.0.0.1 with scripted replies whose usage it reports (real HTTP,
the real `openai` client), so every figure is checked against what the server saw."""

from __future__ import annotations

import dataclasses
import json

from actionopd_jax.eval import cli as eval_cli
from actionopd_jax.eval.runner import load_finished
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from tests._collect_fixtures import serve
from tests._envs_fixtures import USER_MODEL, scripted_user_reply
from tests.test_collect_awm import judge_backend, manifest  # noqa: F401 (the AWM pool's manifest fixture)

AGENT_MODEL = "eval-agent"


def _with_completion(reply, tokens):
    """A scripted reply whose usage reports `tokens` completion tokens per choice."""
    return lambda req: dataclasses.replace(reply(req), completion_tokens=tokens)


def reported_prompt_tokens(req) -> int:
    """What ScriptedBackend reports as a request's prompt tokens (serve/scripted.py)."""
    return max(1, sum(len(str(m.get("content") or "")) for m in req.messages) // 4)


def _args(server, out, *extra):
    return ["--endpoint", server.base_url, "--model", AGENT_MODEL, "--provider", "vllm", "--thinking", "none",
            "--max-new-tokens", "64", "--bench", "tau2_telecom:train", "--limit", "1", "--trials", "1",
            "--tau2-prompts", "actionopd", "--user-sim-url", server.base_url, "--user-sim-model", USER_MODEL,
            "--user-sim-provider", "actionopd", "--out", str(out), "--no-progress", *extra]


def _backends():
    agent = ScriptedBackend(AGENT_MODEL, _with_completion(lambda req: message_choice("I cannot help with that."), 7))
    user = ScriptedBackend(USER_MODEL, _with_completion(scripted_user_reply, 3))
    return agent, user


def test_eval_meters_the_agent_and_the_user_and_prices_them_as_the_server_counted(tmp_path, capsys):
    agent, user = _backends()
    out = tmp_path / "eval"
    with serve(agent, user) as server:
        code = eval_cli.main(_args(server, out, "--price", "agent=1000,100,2000", "--price", "user=500,50,4000"))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert agent.requests and user.requests
    a_prompt = sum(reported_prompt_tokens(r) for r in agent.requests)
    u_prompt = sum(reported_prompt_tokens(r) for r in user.requests)
    a_usd = (a_prompt * 1000 + 7 * len(agent.requests) * 2000) / 1e6      # by hand: no cached tokens reported
    u_usd = (u_prompt * 500 + 3 * len(user.requests) * 4000) / 1e6
    agent_line = (f"| agent (evaluated endpoint) | {len(agent.requests):,} | 0 | {a_prompt:,} | "
                  f"{7 * len(agent.requests):,} | ${a_usd:,.4f} |")
    user_line = f"| user simulator | {len(user.requests):,} | 0 | {u_prompt:,} | {3 * len(user.requests):,} | ${u_usd:,.4f} |"
    total_line = f"| **total** | | | | | **${a_usd + u_usd:,.4f}** |"
    for text in (printed.out, (out / "spend.md").read_text(), (out / "report.md").read_text()):
        assert agent_line in text and user_line in text and total_line in text, text
    spend = json.loads((out / "results.json").read_text())["spend"]
    assert spend["agent (evaluated endpoint)"]["requests"] == len(agent.requests)
    assert spend["agent (evaluated endpoint)"]["prompt_tokens"] == a_prompt
    assert spend["user simulator"]["completion_tokens"] == 3 * len(user.requests)
    assert abs(spend["total_usd"] - (a_usd + u_usd)) < 1e-12
    assert "judge (AWM SQL verifier)" not in spend                       # no judge was asked


def test_eval_budget_usd_is_a_hard_cap_that_stops_with_exit_3_and_resumes(tmp_path, capsys):
    """A cap below the agent's first request's worst case: exit 3, nothing sent, no episode; the
    same command with a cap that buys the episode plays it."""
    agent, user = _backends()
    out = tmp_path / "eval"
    with serve(agent, user) as server:
        code = eval_cli.main(_args(server, out, "--price", "agent=1,0,1", "--budget-usd", "0.000001"))
        err = capsys.readouterr().err
        assert code == 3, err
        assert ("budget: the paid models (teacher, judge, user simulator) have cost $0.0000 of --budget-usd=$0.0000; "
                "the next evaluated endpoint (agent) request batch reserves up to $") in err
        assert "Finished episodes are kept in episodes.jsonl" in err and "Saved at step" not in err
        assert agent.requests == [] and user.requests == [] and load_finished(out / "episodes.jsonl") == []
        assert eval_cli.main(_args(server, out, "--price", "agent=1,0,1", "--budget-usd", "5")) == 0
    assert agent.requests and len(load_finished(out / "episodes.jsonl")) == 1


def test_eval_refuses_a_bad_price_or_a_cap_without_one(tmp_path, capsys):
    assert eval_cli.main(["--reference", "--bench", "bfcl", "--out", str(tmp_path / "o"), "--price", "agent=1,2"]) == 2
    assert "expected three USD prices per million tokens" in capsys.readouterr().err
    assert eval_cli.main(["--reference", "--bench", "bfcl", "--out", str(tmp_path / "o"), "--budget-usd", "1"]) == 2
    assert "--budget-usd 1 needs a price" in capsys.readouterr().err


def test_eval_budget_stops_within_the_run_keeping_finished_episodes_within_the_cap(tmp_path, capsys):
    """Two tau2 episodes one at a time, priced so the first fits the cap and the second's agent
    request (its worst case: prompt bound plus max tokens) does not: exit 3, the first episode
    kept, spend within the cap and equal to what the server counted; a higher cap plays the other."""
    agent, user = _backends()
    out = tmp_path / "eval"
    prices = ("--price", "agent=1000,0,1000", "--price", "user=1000,0,1000", "--limit", "2", "--concurrency", "1")
    with serve(agent, user) as server:
        code = eval_cli.main(_args(server, out, *prices, "--budget-usd", "34"))
        printed = capsys.readouterr()
        assert code == 3, printed.err
        assert "which would pass the cap: so the run stops" in printed.err
        assert "| agent (evaluated endpoint) | 1 |" in printed.err           # the table ends the stop message
        assert len(load_finished(out / "episodes.jsonl")) == 1
        ledger = json.loads((out / "paid_calls.json").read_text())["totals"]
        assert ledger["teacher"]["requests"] == len(agent.requests) == 1
        assert ledger["user"]["requests"] == len(user.requests)
        spent = sum(t["spend_usd"] for t in ledger.values())
        assert 0 < spent <= 34
        assert eval_cli.main(_args(server, out, *prices, "--budget-usd", "100")) == 0
    assert len(load_finished(out / "episodes.jsonl")) == 2
    spend = json.loads((out / "results.json").read_text())["spend"]
    assert spend["agent (evaluated endpoint)"]["requests"] == len(agent.requests) == 2   # counted on over the resume


def test_eval_meters_the_awm_judge(manifest, tmp_path, capsys):
    """The AWM SQL verifiers' judge (envs/awm/judge.py, the `openai` client) is the ledger's
    judge role: its row counts the requests the server saw, at --price judge=..."""
    path = manifest
    judge = ScriptedBackend("judge", _with_completion(judge_backend()._reply, 11))
    with serve(judge) as server:
        code = eval_cli.main(["--reference", "--bench", "awm:heldout", "--manifest", str(path), "--judge-url",
                              server.base_url, "--judge-model", "judge", "--trials", "1", "--out", str(tmp_path / "out"),
                              "--no-progress", "--price", "judge=2000,0,3000"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    n = len(judge.requests)
    assert n >= 1
    prompt = sum(reported_prompt_tokens(r) for r in judge.requests)
    usd = (prompt * 2000 + 11 * n * 3000) / 1e6
    assert f"| judge (AWM SQL verifier) | {n:,} | 0 | {prompt:,} | {11 * n:,} | ${usd:,.4f} |" in printed.out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["spend"]["judge (AWM SQL verifier)"]["requests"] == n


def test_eval_check_shows_the_prices_and_the_cap(capsys):
    assert eval_cli.main(["--check", "--reference", "--bench", "bfcl", "--limit", "1", "--price", "user=1,0.1,2",
                          "--budget-usd", "3"]) == 0
    assert ("spend      user $1/$0.1/$2 per million input/cached/output tokens; --budget-usd $3.0000 (a hard cap: "
            "exit 3 at the first request that could pass it)") in capsys.readouterr().out
    assert eval_cli.main(["--check", "--reference", "--bench", "bfcl", "--limit", "1", "--price", "agent=1"]) == 2
    assert "--price 'agent=1': expected three USD prices" in capsys.readouterr().err


def test_the_progress_line_shows_the_spend_so_far_from_the_installed_ledger():
    """eval's progress bar carries training's spend field (dollars where priced, else tokens)."""
    from actionopd_jax import paid_calls
    from actionopd_jax.eval.runner import _spend_postfix

    class Bar:   # records what the runner sets on its tqdm bar
        postfix: dict = {}

        def set_postfix(self, fields, refresh=True):
            self.postfix = dict(fields)

    bar, ledger = Bar(), paid_calls.Ledger({}, {"user": (1000.0, 0.0, 2000.0)})
    previous = paid_calls.install(ledger)
    try:
        _spend_postfix(bar)
        assert bar.postfix == {}                                         # nothing asked yet
        ledger.record("user", requests=1, prompt_tokens=1000, completion_tokens=500)
        _spend_postfix(bar)
        assert bar.postfix == {"spent": "$2.00"}                         # (1000 * 1000 + 500 * 2000) / 1e6
    finally:
        paid_calls.install(previous)
