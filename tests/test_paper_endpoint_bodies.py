"""Paper table 8's generation settings reach the endpoints: for every recipe in configs/paper,
its teacher, matcher and user simulator (where it has one) send a request to a real
OpenAI-compatible server on 127.0.0.1 (our server, the real `openai` client), and the JSON
body that server receives carries table 8's values. A setting the configured provider cannot
send is refused by config validation and `--check`, naming the providers that can.

The expected values are written out here from table 8, by (role, model); they are not read
from the recipes. A new recipe whose (role, model) has no row here fails until its row is
added. The thinking switch is read from whichever vendor field the body carries (exactly one
must be there), so a dropped switch fails for every provider.
"""

from __future__ import annotations

import asyncio

import pytest

from actionopd_jax.baselines.wiring import endpoint_agent
from actionopd_jax.commands import train as train_cli
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import load_config
from actionopd_jax.envs.registry import user_sim_config
from actionopd_jax.envs.user_sim import UserSimulator
from actionopd_jax.matching.build import build_matcher
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.teacher.factory import build_teacher
from actionopd_jax.teacher.specs import judge_spec, teacher_spec
from actionopd_jax.types import Message, Observation, Task
from tests._configs import CONFIG_DIR
from tests._teacher_fixtures import STATE, TOOLS

PAPER_RECIPES = sorted(p.name for p in (CONFIG_DIR / "paper").glob("*.yaml"))

# Table 8 (paper B.2), by role and model (lower case, organisation prefix dropped). None: the
# table states no value for that setting, so the request must not set it (top_k absent, top_p
# absent or the neutral 1.0). "thinking": the switch the request must carry.
TABLE8 = {
    ("teacher", "qwen3.7-flash"): dict(thinking=True, temperature=0.6, top_p=0.95, top_k=None, max_tokens=8 * 1024),
    ("teacher", "deepseek-v4-flash"): dict(thinking=True, reasoning_effort="max", top_k=None, max_tokens=4 * 1024),
    ("matcher", "deepseek-v4-flash"): dict(thinking=False, temperature=0.0, top_p=None, top_k=None, max_tokens=128),
    ("user", "deepseek-v4-flash"): dict(thinking=False, temperature=1.0, top_p=None, top_k=None),
    ("teacher", "qwen3-32b"): dict(thinking=True, temperature=0.6, top_p=0.95, top_k=20, max_tokens=8 * 1024),
    ("matcher", "qwen3.8-27b"): dict(thinking=False, temperature=0.7, top_p=0.8, top_k=20, max_tokens=32 * 1024),
    ("user", "qwen3.8-27b"): dict(thinking=False, temperature=0.7, top_p=0.8, top_k=20, max_tokens=8 * 1024),
}
# Table 8's "Self Teacher" (B.5): the student samples itself in-process, so there is no request
# body; its settings are checked where the in-process sampler takes them.
SELF_TEACHER = dict(enable_thinking=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=4 * 1024)


def thinking_sent(body: dict) -> bool:
    """The thinking switch of a request body, whichever vendor spelling it uses."""
    found = []
    if "chat_template_kwargs" in body:                                   # vLLM / SGLang / ours
        found.append(body["chat_template_kwargs"]["enable_thinking"])
    if "enable_thinking" in body:                                        # DashScope
        found.append(body["enable_thinking"])
    if "thinking" in body:                                               # DeepSeek
        found.append({"enabled": True, "disabled": False}[body["thinking"]["type"]])
    if "reasoning" in body:                                              # OpenRouter
        found.append(body["reasoning"]["enabled"])
    assert len(found) == 1, f"expected exactly one thinking switch in the body, got {found}: {body}"
    assert isinstance(found[0], bool)
    return found[0]


def assert_table8(body: dict, role: str, model: str) -> None:
    row = TABLE8.get((role, model.split("/")[-1].lower()))
    assert row is not None, f"no table-8 row for the {role} {model!r}: add it to TABLE8"
    for key, want in row.items():
        if key == "thinking":
            assert thinking_sent(body) is want, (role, model, body)
        elif want is None and key == "top_p":
            assert body.get("top_p", 1.0) == 1.0, (role, model, body)
        elif want is None:
            assert key not in body, (role, model, key, body)
        else:
            assert body.get(key) == want, (role, model, key, body)


def _point_at(cfg_path, url: str):
    cfg = load_config(cfg_path)
    overrides = [f"matcher.base_url={url}"] + ([f"teacher.base_url={url}"] if cfg.teacher.kind == "openai" else [])
    if cfg.env.user_model:
        overrides.append(f"env.user_base_url={url}")
    return load_config(cfg_path, overrides)


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_every_paper_recipe_sends_table8_settings(name, monkeypatch):
    path = CONFIG_DIR / "paper" / name
    cfg = load_config(path)
    for env_name in {cfg.teacher.api_key_env, cfg.matcher.api_key_env, cfg.env.user_api_key_env} - {""}:
        monkeypatch.setenv(env_name, "test-key")  # the keys are read from the environment only
    assert cfg.teacher.kind in ("openai", "self") and cfg.matcher.kind == "rules+llm", name
    remote_teacher = cfg.teacher.kind == "openai"
    if not remote_teacher:  # Self-ActionOPD: table 8's self-teacher row reaches the in-process sampler
        from actionopd_jax.baselines.self_opd import self_teacher_settings

        settings = self_teacher_settings(cfg)
        assert {k: getattr(settings, k) for k in SELF_TEACHER} == SELF_TEACHER, name
    backends: dict[str, ScriptedBackend] = {}
    for model in {cfg.teacher.model if remote_teacher else "", cfg.matcher.model, cfg.env.user_model} - {""}:
        backends[model] = ScriptedBackend(model, lambda req: message_choice("VERDICT: MATCH"))
    server = OpenAIServer(list(backends.values()))
    server.start()
    try:
        cfg = _point_at(path, server.base_url)

        async def ask_all():
            bodies = {}
            if remote_teacher:
                teacher = build_teacher(teacher_spec(cfg.teacher))
                await teacher.sample(STATE, TOOLS, 1)
                bodies["teacher"] = backends[cfg.teacher.model].requests[-1].raw
                # the KD warm start's teacher episodes (baselines/wiring.endpoint_agent) ask the
                # same endpoint: the same table-8 body, spelled for the same provider
                agent = endpoint_agent(cfg)
                await agent.act(Observation(list(STATE), TOOLS),
                                task=Task("t", cfg.env.name), trial=0)
                bodies["kd teacher"] = backends[cfg.teacher.model].requests[-1].raw
            matcher = build_matcher(judge_spec(cfg.matcher))
            await matcher.verdict(Message("It is 20 C."), Message("Twenty degrees."), messages=STATE, tools=TOOLS)
            bodies["matcher"] = backends[cfg.matcher.model].requests[-1].raw
            if cfg.env.user_model:
                await UserSimulator(user_sim_config(cfg.env)).reply("You are a customer.", [
                    {"role": "user", "content": "Hi! How can I help you today?"}])
                bodies["user"] = backends[cfg.env.user_model].requests[-1].raw
            return bodies

        bodies = asyncio.run(ask_all())
    finally:
        server.stop()
    if remote_teacher:
        assert_table8(bodies["teacher"], "teacher", cfg.teacher.model)
        assert_table8(bodies["kd teacher"], "teacher", cfg.teacher.model)
    assert_table8(bodies["matcher"], "matcher", cfg.matcher.model)
    if cfg.env.user_model:
        assert_table8(bodies["user"], "user", cfg.env.user_model)
    if cfg.env.name == "tau2":
        assert "user" in bodies  # a tau2 recipe without its simulator's settings would be caught here


@pytest.mark.parametrize("override, message", [
    ("teacher.provider=openai", r"teacher.top_k=20 cannot be sent to provider 'openai'.*actionopd, dashscope, "
                                r"openrouter, sglang, vllm"),
    ("matcher.provider=openai", r"matcher.top_k=20 cannot be sent to provider 'openai'"),
    ("env.user_provider=deepseek", r"env.user_top_k=20 cannot be sent to provider 'deepseek'"),
    ("env.user_provider=openai", r"env.user_top_k=20 cannot be sent to provider 'openai'"),
])
def test_a_setting_the_provider_cannot_send_is_refused(override, message, capsys):
    path = CONFIG_DIR / "paper" / "tau2_qwen3_4b_tpu.yaml"
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])
    assert train_cli.main(["--config", str(path), "--check", override]) == 2  # --check refuses it alike
    assert "cannot be sent" in capsys.readouterr().err


def test_the_thinking_switch_is_refused_where_no_field_exists(capsys):
    path = CONFIG_DIR / "paper" / "qwen3_4b_tpu.yaml"
    with pytest.raises(ConfigError, match=r"matcher.enable_thinking=False cannot be sent to provider 'openai'.*"
                                          r"deepseek.*or set matcher.enable_thinking: null"):
        load_config(path, ["matcher.provider=openai"])
    with pytest.raises(ConfigError, match=r"teacher.enable_thinking=True cannot be sent to provider 'openai'"):
        load_config(path, ["teacher.provider=openai"])
    # null sends no switch at all: then nothing is dropped, and the openai provider is accepted
    cfg = load_config(path, ["teacher.provider=openai", "teacher.enable_thinking=null"])
    assert cfg.teacher.enable_thinking is None
    assert train_cli.main(["--config", str(path), "--check", "matcher.provider=openai"]) == 2
    assert "matcher.enable_thinking=False cannot be sent" in capsys.readouterr().err


def test_the_judge_window_must_hold_its_reply():
    path = CONFIG_DIR / "paper" / "tau2_qwen3_4b_tpu.yaml"
    # table 8: 32k-token matcher replies; a 32k window would leave no room for the prompt
    with pytest.raises(ConfigError, match=r"matcher.context_window=32768 leaves no room .* matcher.max_tokens=32768"):
        load_config(path, ["matcher.context_window=32768"])
    spec = judge_spec(load_config(path).matcher)
    assert (spec["context_window"], spec["context_chars"], spec["format_retries"]) == (131072, None, 2)
    assert judge_spec(load_config(path, ["matcher.context_chars=9000"]).matcher)["context_chars"] == 9000


def test_the_awm_sql_verifier_judge_sends_the_matcher_settings(monkeypatch):
    """AWM's SQL verifier asks the run's judge endpoint (envs/awm/judge.py) with the matcher's
    table-8 settings, spelled for its provider; its reply budget is at least 512 tokens."""
    from actionopd_jax.envs.awm.judge import MIN_TOKENS, endpoint_judge

    path = CONFIG_DIR / "paper" / "qwen3_4b_tpu.yaml"
    monkeypatch.setenv(load_config(path).matcher.api_key_env, "test-key")
    backend = ScriptedBackend("deepseek-v4-flash", lambda req: message_choice("yes"))
    server = OpenAIServer(backend)
    server.start()
    try:
        judge = endpoint_judge(judge_spec(load_config(path, [f"matcher.base_url={server.base_url}"]).matcher))
        assert judge([{"role": "user", "content": "Does the SQL state satisfy the task?"}]) == "yes"
    finally:
        server.stop()
    body = backend.requests[-1].raw
    assert thinking_sent(body) is False and body["temperature"] == 0.0 and "top_k" not in body
    assert body["max_tokens"] == MIN_TOKENS == 512
