"""Issue 46 (one spend meter for every paid call): `actionopd envs screen` (the B.1 judge) and
`actionopd tau2 summaries` (the drafter) meter their requests on the paid-call ledger training
uses (paid_calls.py) and end with the same spend table (train/spend_report.ledger_table):
requests, tokens and, with a price, USD. Before, they printed their own token counts and no
money. The endpoints are our OpenAI-compatible server on 127.0.0.1 with scripted replies whose
usage it reports (real HTTP, the real `openai` client); the table is checked against what the
server saw and dollars computed by hand."""

from __future__ import annotations

import shutil

from actionopd_jax.commands import tau2 as tau2_cli
from actionopd_jax.commands.main import main
from actionopd_jax.serve.scripted import ScriptedBackend
from tests._teacher_fixtures import serve
from tests.test_envs_screen import DATA, FAX_ES, JUDGE, Judge, tok_dir  # noqa: F401 (tok_dir: a fixture)
from tests.test_eval_spend import _with_completion, reported_prompt_tokens
from tests.test_tau2_summaries import Drafter
from tests.test_tau2_summaries import _args as summaries_args


def _row(label: str, backend: ScriptedBackend, completion: int, price: tuple[float, float, float]) -> str:
    n = len(backend.requests)
    prompt = sum(reported_prompt_tokens(r) for r in backend.requests)
    usd = (prompt * price[0] + completion * n * price[2]) / 1e6   # the server reports no cached tokens
    return f"| {label} | {n:,} | 0 | {prompt:,} | {completion * n:,} | ${usd:,.4f} |"


def test_the_screen_ends_with_the_judges_spend_table(tmp_path, tok_dir, capsys):  # noqa: F811
    root = tmp_path / "es"
    shutil.copytree(DATA / "envscaler_mini", root)
    manifest = tmp_path / "pools.json"
    assert main(["envs", "audit", "--env", "envscaler", "--dir", str(root), "--manifest", str(manifest),
                 "--tokenizer", tok_dir]) == 0
    capsys.readouterr()
    backend = ScriptedBackend(JUDGE, _with_completion(Judge().reply, 9))
    with serve(backend) as server:
        assert main(["envs", "screen", "--env", "envscaler", "--manifest", str(manifest), "--judge-url",
                     server.base_url, "--judge-model", JUDGE, "--judge-price", "300,30,1200"]) == 0
        assert server.request_count == len(backend.requests) == 6
    out = capsys.readouterr().out
    assert _row("screen judge", backend, 9, (300, 30, 1200)) in out, out
    # a bad price is refused before anything is asked
    assert main(["envs", "screen", "--env", "envscaler", "--manifest", str(manifest), "--judge-url",
                 "http://127.0.0.1:9/v1", "--judge-model", JUDGE, "--judge-price", "1,x,3"]) == 2
    assert "expected three USD prices per million tokens" in capsys.readouterr().err


def test_the_summaries_drafter_ends_with_its_spend_table(tmp_path, capsys):
    backend = ScriptedBackend("drafter-x", _with_completion(Drafter(), 5))
    with serve(backend) as server:
        code = tau2_cli.main(summaries_args(server.base_url, tmp_path / "s.jsonl", "--price", "100,10,700"))
        assert code == 1 and server.request_count == len(backend.requests) == 6   # as test_tau2_summaries: 1 + 2 + 3
    out = capsys.readouterr().out
    assert _row("summaries drafter", backend, 5, (100, 10, 700)) in out, out
    assert tau2_cli.main(summaries_args("http://127.0.0.1:9/v1", tmp_path / "t.jsonl", "--price", "1")) == 2
