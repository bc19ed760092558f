"""The AWM / EnvScaler admission audit on our mini datasets (tests/data/awm_mini, envscaler_mini):
the funnel and its manifest, `actionopd envs audit`, the server stage (each generated server
started contained over MCP stdio), and the manifest the pools' episodes need. Split from
test_env_pools.py (loaders, DB cache, verifiers, sandbox, mixture); only these tests need the
tokenizer fixture."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from actionopd_jax.envs.admission import audit_awm, audit_envscaler, read_manifest
from actionopd_jax.envs.awm import db as awm_db
from actionopd_jax.envs.awm.layout import load_awm, normalize_name
from actionopd_jax.envs.sandbox import SubprocessSandbox

DATA = Path(__file__).parent / "data"
AWM, ES = DATA / "awm_mini", DATA / "envscaler_mini"


@pytest.fixture(scope="module")
def sandbox():
    return SubprocessSandbox()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from actionopd_jax.chat.tiny_tokenizer import build_tiny_tokenizer
    from actionopd_jax.chat.tokenizer import load_tokenizer

    return load_tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny"))


def test_awm_audit_funnel_and_manifest(tmp_path, sandbox, tokenizer):
    root = tmp_path / "awm"
    shutil.copytree(AWM, root)
    # break things: a verifier that accepts the initial state, a missing verifier, a bad DDL, a long task
    rows = [json.loads(x) for x in (root / "gen_verifier.pure_code.jsonl").read_text().splitlines()]
    rows[1]["verification"]["code"] = "def verify_task_completion(initial_db_path, final_db_path):\n    return {'result': 'complete'}\n"
    rows = [r for r in rows if not (r["scenario"] == "recipe_box_2" and r["task_idx"] == 0)]
    (root / "gen_verifier.pure_code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = [json.loads(x) for x in (root / "gen_db.jsonl").read_text().splitlines()]
    db[2]["db_schema"]["tables"][0]["ddl"] = "CREATE TABLE classes (oops"
    (root / "gen_db.jsonl").write_text("".join(json.dumps(r) + "\n" for r in db))
    tasks = [json.loads(x) for x in (root / "gen_tasks.jsonl").read_text().splitlines()]
    tasks[1]["tasks"][1] = "Please " + "really " * 3000 + "remove 'Slow Ragu' from my favourites."
    (root / "gen_tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tasks))
    result = audit_awm(root, sandbox=sandbox, tokenizer=tokenizer, cache_dir=tmp_path / "cache",
                       max_prompt_tokens=2000)
    assert result.dropped == {
        "recipe_box_2/0": "no verifier",
        "gym_classes_3/0": "database build failed (7/8 statements)", "gym_classes_3/1": "database build failed (7/8 statements)",
        "gym_classes_3/2": "database build failed (7/8 statements)", "gym_classes_3/3": "database build failed (7/8 statements)",
        "library_loans_1/1": "verifier accepts the untouched initial state",
        "recipe_box_2/1": "initial prompt over 2000 tokens",
    }
    assert len(result.admitted) == 8 and result.verifier_modes["recipe_box_2/3"] == "sql"
    assert [result.funnel.kept[s] for s in result.funnel.stages] == [15, 14, 10, 10, 9, 8]
    table = result.table()
    assert "| database builds | 10 | 4 |" in table and "not run (no MCP runtime given)" in table
    assert max(result.prompt_tokens.values()) > 2000 >= sorted(result.prompt_tokens.values())[-2]
    manifest = read_manifest(result.write_manifest(tmp_path / "m.json"))
    assert manifest["admitted"]["awm"] == set(result.admitted)
    # a server probe (the MCP runtime's) gates scenarios and supplies the listed tools
    def probe(scenario, db_path):
        if scenario.name == "recipe_box_2":
            raise ConnectionError("no server")
        return scenario.tool_schemas()[:1]

    probed = audit_awm(AWM, sandbox=sandbox, tokenizer=tokenizer, cache_dir=tmp_path / "cache2", server_probe=probe)
    assert len(probed.admitted) == 11 and set(probed.dropped.values()) == {"server did not start or list tools (ConnectionError)"}


def test_envscaler_audit_and_the_command(tmp_path, sandbox, tokenizer, capsys):
    root = tmp_path / "es"
    shutil.copytree(ES, root)
    items = json.loads((root / "rl_scenario_metadata.json").read_text())
    items[0]["checklist_with_func"][0]["check_func"] = "def check_func(final_state):\n    return final_state['nope']\n"
    items[1]["checklist_with_func"] = [{"check_item": "x", "check_func": "def check_func(final_state):\n    return True\n"}]
    items[2]["env_class_name"] = "NoSuchClass"
    (root / "rl_scenario_metadata.json").write_text(json.dumps(items))
    result = audit_envscaler(root, sandbox=sandbox, tokenizer=tokenizer)
    assert result.dropped == {"mini_locker_1": "a check function fails on the initial state",
                              "mini_locker_2": "checks accept the untouched initial state",
                              "mini_locker_3": "environment class does not start (NameError)"}
    assert result.admitted == ["mini_clinic_1", "mini_clinic_2", "mini_clinic_3"]
    # the command writes one manifest holding every audited pool
    from actionopd_jax.commands.main import main

    tok_dir = tokenizer.name_or_path
    manifest = tmp_path / "admitted.json"
    for env, d in (("awm", AWM), ("envscaler", ES)):
        assert main(["envs", "audit", "--env", env, "--dir", str(d), "--manifest", str(manifest),
                     "--tokenizer", tok_dir, "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "| initial prompt fits 16000 tokens | 15 | 0 |" in out and "admitted 6 of 6 tasks" in out
    admitted = read_manifest(manifest)["admitted"]
    assert {k: len(v) for k, v in admitted.items()} == {"awm": 15, "envscaler": 6}


def test_the_audit_leaves_the_pool_directory_alone(tmp_path, tokenizer, monkeypatch, capsys):
    # without --manifest the manifest goes to the user's cache: a published pool may be
    # read-only or shared (issue 34), so the audit only reads it
    from actionopd_jax.envs.admission import default_manifest
    from actionopd_jax.commands.main import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "es"
    shutil.copytree(ES, root)
    before = sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))
    assert main(["envs", "audit", "--env", "envscaler", "--dir", str(root), "--tokenizer", tokenizer.name_or_path]) == 0
    assert sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*")) == before
    manifest = default_manifest(root)
    assert manifest.parent.parent == tmp_path / "home" / ".cache" / "actionopd_jax" / "admission"
    assert manifest.parent.name.startswith("es-") and manifest != default_manifest(ES)
    assert len(read_manifest(manifest)["admitted"]["envscaler"]) == 6
    assert f"manifest: {manifest}" in capsys.readouterr().out


def test_mini_awm_servers_serve_their_spec_tools_over_mcp_stdio(tmp_path):
    """The generated-style servers of the mini pool run under the official MCP SDK: tools/list
    gives the spec's tools and a call changes the episode's database copy (not the cache)."""
    pytest.importorskip("mcp")
    import asyncio
    import sys

    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    sc = load_awm(AWM).scenarios["library_loans_1"]
    cache = awm_db.DbCache(tmp_path / "cache")
    db = cache.episode_copy(sc, tmp_path / "ep")
    server = tmp_path / "server.py"
    server.write_text(sc.server_code)

    async def episode():
        params = StdioServerParameters(command=sys.executable, args=[str(server)], cwd=str(tmp_path),
                                       env={"DATABASE_PATH": f"sqlite:///{db}", "MCP_TRANSPORT": "stdio",
                                            "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        # errlog given: the SDK binds its default (sys.stderr) when first imported, which may be an
        # earlier test's captured stream
        async with stdio_client(params, errlog=sys.stderr) as (r, w):
            async with ClientSession(r, w) as session:
                await session.initialize()
                names = [t.name for t in (await session.list_tools()).tools]
                ok = await session.call_tool("borrow_book", {"book_id": 2})
                full = await session.call_tool("borrow_book", {"book_id": 2})
                return names, ok, full

    names, ok, full = asyncio.run(asyncio.wait_for(episode(), 60))
    assert names == [t["function"]["name"] for t in sc.tool_schemas()]
    assert not ok.is_error and "no copy available" in full.content[0].text
    assert awm_db.table_counts(db)["loans"] == 3 and awm_db.table_counts(cache.initial(sc))["loans"] == 2


def test_audit_starts_each_awm_server_contained_and_lists_its_tools(tmp_path, sandbox, tokenizer):
    """The audit's server stage through the MCP sandbox (envs/awm/serve.py): every mini scenario's
    generated server starts contained over stdio and lists its spec's tools; a scenario whose
    server code crashes at start is dropped with the reason, the others stay admitted."""
    pytest.importorskip("mcp")
    from actionopd_jax.envs.awm.serve import list_tools, server_probe

    sc = load_awm(AWM).scenarios["library_loans_1"]
    cache = awm_db.DbCache(tmp_path / "cache")
    names = [t["function"]["name"] for t in list_tools(sc, cache.initial(sc), start_timeout_s=60)]
    assert names == [t["function"]["name"] for t in sc.tool_schemas()]

    broken = tmp_path / "awm"
    shutil.copytree(AWM, broken)
    envs_file = broken / "gen_envs.jsonl"
    rows = [json.loads(line) for line in envs_file.read_text().splitlines() if line.strip()]
    rows[0]["full_code"] = "raise SystemExit('generated server broke at import')\n"
    envs_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = audit_awm(broken, sandbox=sandbox, tokenizer=tokenizer, cache_dir=tmp_path / "c2",
                       server_probe=server_probe(start_timeout_s=60))
    bad = normalize_name(rows[0]["scenario"])
    lost = {t: why for t, why in result.dropped.items() if why.startswith("server did not start")}
    assert lost and all(t.startswith(bad + "/") for t in lost)
    assert result.admitted and not any(t.startswith(bad + "/") for t in result.admitted)


def test_pool_episodes_need_a_manifest():
    """Building the pools' environments reads the manifest's training tasks: without one, a
    ConfigError saying how to write it (never an unknown-environment failure inside collection)."""
    from actionopd_jax.config import ConfigError, EnvConfig
    from actionopd_jax.envs.registry import env_factory_from

    for env in (EnvConfig(name="envscaler", envscaler_dir=str(ES)),
                EnvConfig(name="awm", awm_dir=str(AWM), envscaler_dir=str(ES), mixture=("awm:3", "envscaler:1"))):
        with pytest.raises(ConfigError, match="env.manifest.*actionopd envs audit"):
            env_factory_from(env)
