"""Which EnvScaler scenarios are conversational, decided per scenario from the data and the config
(issue 33 item 7; envs/envscaler/mode.py): published records carry no mode and play with the
user simulator; a record's own `conversational` mark, else `env.envscaler_conversational`
(all / none / ids) decides; `train --check` counts them and names the simulator, and refuses
conversational ones without one. A conversational scenario's gold sequence, played through the
config path with a scripted user behind our real HTTP server, scores 1.0; the same sequence
replayed one-turn scores 0.5 (the silent failure the issue reports)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _envs_fixtures import run

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.envs.envscaler.layout import load_envscaler
from actionopd_jax.envs.envscaler.mode import BY_DEFAULT, BY_MARK, BY_OVERRIDE, UnknownScenarioIds, parse_rule
from actionopd_jax.envs.envscaler.user import GREETING
from actionopd_jax.envs.mixture import mixture_pool_tasks
from actionopd_jax.envs.registry import env_factory_from
from actionopd_jax.envs.user_sim import STOP
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Message, ToolCall

ES = Path(__file__).parent / "data" / "envscaler_mini"
IDS = ["mini_clinic_1", "mini_clinic_2", "mini_clinic_3", "mini_locker_1", "mini_locker_2", "mini_locker_3"]


@pytest.fixture()
def published(tmp_path):
    """Our mini pool in the published form: no scenario record says its mode. Returns the
    directory and a manifest admitting every scenario."""
    root = tmp_path / "es"
    shutil.copytree(ES, root)
    path = root / "rl_scenario_metadata.json"
    items = json.loads(path.read_text())
    for item in items:
        item.pop("conversational")
    path.write_text(json.dumps(items))
    manifest = tmp_path / "admitted.json"
    manifest.write_text(json.dumps({"pools": {"envscaler": {"admitted": IDS}}}))
    return root, manifest


def _modes(data):
    return {tid: (s.conversational, s.conversational_by) for tid, s in data.scenarios.items()}


def test_the_rule_per_scenario_published_records_marks_and_the_override(published, tmp_path, capsys):
    root, _ = published
    assert _modes(load_envscaler(root)) == {tid: (True, BY_DEFAULT) for tid in IDS}
    # our mini data marks each record: only mini_clinic_3 plays with the user
    assert {tid for tid, (conv, by) in _modes(load_envscaler(ES)).items() if conv and by == BY_MARK} == {"mini_clinic_3"}
    assert all(by == BY_MARK for _, by in _modes(load_envscaler(ES)).values())
    # the override beats the marks: exactly the ids listed, or all, or none
    listed = _modes(load_envscaler(ES, conversational=["mini_locker_1"]))
    assert [tid for tid, (conv, _) in listed.items() if conv] == ["mini_locker_1"]
    assert listed["mini_clinic_3"] == (False, BY_OVERRIDE)
    assert {m for m in _modes(load_envscaler(root, conversational="none")).values()} == {(False, BY_OVERRIDE)}
    assert {m for m in _modes(load_envscaler(ES, conversational=["ALL"])).values()} == {(True, BY_OVERRIDE)}
    with pytest.raises(UnknownScenarioIds, match=r"\['mini_nope'\]"):
        load_envscaler(ES, conversational=["mini_clinic_1", "mini_nope"])
    for bad, words in ((["all", "mini_clinic_1"], "not a mix"), (["mini_clinic_1", " "], "an empty task id")):
        with pytest.raises(ValueError, match=words):
            parse_rule(bad)
    # a mark that is not a JSON boolean is refused, naming the record (a string "false" is truthy)
    items = json.loads((root / "rl_scenario_metadata.json").read_text())
    items[4]["conversational"] = "false"
    (root / "rl_scenario_metadata.json").write_text(json.dumps(items))
    with pytest.raises(ValueError, match="scenario 'mini_clinic_2'.*must be true or false"):
        load_envscaler(root)
    # the audit command says so in one paragraph and writes no manifest
    from actionopd_jax.commands.main import main

    manifest = tmp_path / "audited.json"
    assert main(["envs", "audit", "--env", "envscaler", "--dir", str(root), "--manifest", str(manifest)]) == 2
    assert not manifest.exists()
    err = capsys.readouterr().err
    assert "does not load as an EnvScaler pool" in err and "must be true or false" in err and "Traceback" not in err


def test_the_config_key_is_checked_and_unknown_ids_are_named(published):
    root, manifest = published
    base = ["env.name=envscaler", f"env.envscaler_dir={root}", f"env.manifest={manifest}"]
    with pytest.raises(ConfigError, match="not a mix"):
        load_config(None, base + ["env.envscaler_conversational=[all, mini_clinic_1]"])
    with pytest.raises(ConfigError, match="draws no EnvScaler pool"):
        load_config(None, ["env.name=bfcl", "env.envscaler_conversational=all"])
    with pytest.raises(ConfigError, match="unknown config key 'env.envscaler_conversationl'"):
        load_config(None, base + ["env.envscaler_conversationl=all"])
    cfg = load_config(None, base + ["env.envscaler_conversational=[mini_clinic_3, mini_nope, mini_zzz]"])
    with pytest.raises(ConfigError, match=r"names 2 task id\(s\) that are not scenarios .*\['mini_nope', 'mini_zzz'\]"):
        mixture_pool_tasks(cfg.env)
    cfg = load_config(None, base + ["env.envscaler_conversational=mini_clinic_3,mini_locker_1"])
    tasks = mixture_pool_tasks(cfg.env)["envscaler"]
    assert sorted(t.task_id for t in tasks if t.payload["conversational"]) == ["mini_clinic_3", "mini_locker_1"]


def _user_server(requests: list):
    """A scripted user: asks for the booking first, then for the cancellation, then stops."""
    turns = ["I'd like Dr. Hale's 09:00 slot, please. I'm Lena Roth.",
             "Thanks. Please also cancel my old appointment.", STOP]

    def reply(req):
        requests.append(req.raw)
        seen = [m for m in req.messages if m["role"] == "user"]  # the greeting, then each agent text
        assert seen[0]["content"] == GREETING
        return message_choice(turns[len(seen) - 1])

    return OpenAIServer(ScriptedBackend("scripted-user", reply))


# mini_clinic_3's gold conversation: book, report and ask, then cancel once asked, and report
GOLD = [ToolCall("book_slot", {"slot_id": "S1", "patient": "Lena Roth"}),
        Message("I booked Dr. Hale's 09:00 slot for you. Anything else?"),
        ToolCall("list_appointments", {"patient": "Lena Roth"}),
        ToolCall("cancel_appointment", {"appointment_id": "A0"}),
        Message("Your old appointment is cancelled.")]


def _replay(cfg, task_id):
    """The gold sequence through what a run builds from `cfg`: its pool's tasks and its
    environment factory (user simulator included). (score, actions played)."""
    task = next(t for t in mixture_pool_tasks(cfg.env)["envscaler"] if t.task_id == task_id)
    env = env_factory_from(cfg.env)(task)

    async def episode():
        obs = await env.reset(task)
        played = 0
        for action in GOLD:
            if obs.done:
                break
            obs, _ = await env.step(action)
            played += 1
        return played

    played = run(episode())
    return env.score(), played


@pytest.mark.parametrize("override", ["", "env.envscaler_conversational=[mini_clinic_3]",
                                      "env.envscaler_conversational=all"])
def test_a_conversational_gold_sequence_scores_one_through_the_config_path(published, override):
    root, manifest = published
    requests: list = []
    with _user_server(requests) as server:
        cfg = load_config(None, ["env.name=envscaler", f"env.envscaler_dir={root}", f"env.manifest={manifest}",
                                 "env.user_model=scripted-user", f"env.user_base_url={server.base_url}", "env.user_provider=actionopd",
                                 *([override] if override else [])])
        score, played = _replay(cfg, "mini_clinic_3")
    assert score["end_reason"] == "user_stop" and score["reward"] == 1.0 and score["success"], score
    assert played == len(GOLD) and score["tool_calls"] == 3
    assert len(requests) == 3  # the opening, the reply to each of the agent's two texts


def test_the_same_gold_sequence_replayed_one_turn_scores_half(published):
    """env.envscaler_conversational=none: the agent's first text ends the episode after the
    booking, so one of the two checks passes (the failure the issue saw, now only on request)."""
    root, manifest = published
    cfg = load_config(None, ["env.name=envscaler", f"env.envscaler_dir={root}", f"env.manifest={manifest}",
                             "env.envscaler_conversational=none"])
    score, played = _replay(cfg, "mini_clinic_3")
    assert score["end_reason"] == "completed" and played == 2 and score["reward"] == 0.5 and not score["success"]


def test_check_counts_conversational_scenarios_names_the_simulator_and_refuses_without_one(published, capsys):
    from actionopd_jax.commands import train as train_cli

    root, manifest = published
    base = ["--check", "experiment.enabled=false", "collect.kind=actionopd", "teacher.kind=reference",
            "matcher.kind=rules", "env.name=envscaler", f"env.envscaler_dir={root}", f"env.manifest={manifest}"]
    # published records without a user simulator: refused, saying how many, why, and what to set
    assert train_cli.main(base) == 2
    err = capsys.readouterr().err
    assert "6 EnvScaler task(s) are conversational (6 by the default (conversational)" in err
    assert "env.user_model and env.user_base_url" in err and "env.envscaler_conversational" in err
    user = ["env.user_model=sim-7", "env.user_base_url=http://127.0.0.1:9/v1", "env.user_provider=actionopd",
            "env.user_temperature=1.0"]
    assert train_cli.main(base + user + ["env.envscaler_conversational=[mini_clinic_3, mini_locker_2]"]) == 0
    out = capsys.readouterr().out
    assert ("envscaler  6 training scenario(s): 2 conversational (mini_clinic_3, mini_locker_2; 2 by "
            "env.envscaler_conversational), each played with the user simulator sim-7 at http://127.0.0.1:9/v1 "
            "(T=1, top_p=0.8, top_k=20, thinking off); 4 one-turn") in out
    assert "config OK" in out
    assert train_cli.main(base + ["env.envscaler_conversational=none"]) == 0
    assert "envscaler  6 training scenario(s): 0 conversational; 6 one-turn" in capsys.readouterr().out
