"""teacher.* from the run config to the request: `teacher.provider` and `teacher.reasoning_effort`
reach the HTTP body (a real server on 127.0.0.1 records it), and `teacher.kind: local` builds an
in-process teacher from an HF directory that the collector's source uses."""

import asyncio

import pytest
from flax import nnx

from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.collect.source import ActionOPDGroupSource
from actionopd_jax.teacher.specs import judge_spec, teacher_spec
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import replace_keys
from actionopd_jax.model import PRESETS, Qwen3
from actionopd_jax.model.weights import save_hf
from actionopd_jax.sampling import Buckets
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.matching.build import build_matcher
from actionopd_jax.teacher.factory import build_teacher
from actionopd_jax.teacher.local_provider import LocalTeacher
from actionopd_jax.train.setup import build_mesh, model_config
from actionopd_jax.train.sources import SourceContext
from tests._baselines_fixtures import tiny_run_config, toy_env_factory, toy_tasks
from tests._collect_fixtures import ListTaskStream
from tests._teacher_fixtures import STATE, TOOLS, serve


def _endpoint_cfg(tok_dir, url, *extra):
    return tiny_run_config(tok_dir, "collect.kind=actionopd", "teacher.kind=openai", "teacher.model=big",
                           f"teacher.base_url={url}", "teacher.enable_thinking=true", *extra)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def test_reasoning_effort_and_provider_reach_the_request(tok_dir):
    backend = ScriptedBackend("big", lambda req: tool_call_choice("get_weather", {"city": "Paris"}))
    with serve(backend) as server:
        cfg = _endpoint_cfg(tok_dir, server.base_url, "teacher.provider=deepseek", "teacher.reasoning_effort=max",
                            "teacher.top_k=0")
        teacher = build_teacher(teacher_spec(cfg.teacher))
        samples = asyncio.run(teacher.sample(STATE, TOOLS, 1))
        assert len(samples) == 1 and samples[0].action.name == "get_weather"
        body = backend.requests[-1].raw
        assert body["reasoning_effort"] == "max"
        assert body["thinking"] == {"type": "enabled"}  # DeepSeek's switch, from enable_thinking
        assert teacher.identity["decoding"]["reasoning_effort"] == "max"
        # the default provider (openai) has no top_k and no thinking switch: asked for them, the
        # run is refused; without them no reasoning_effort and no vendor thinking field is sent
        with pytest.raises(ConfigError, match="teacher.top_k=20 cannot be sent to provider 'openai'"):
            _endpoint_cfg(tok_dir, server.base_url)
        plain = build_teacher(teacher_spec(_endpoint_cfg(tok_dir, server.base_url, "teacher.top_k=0",
                                                         "teacher.enable_thinking=null").teacher))
        asyncio.run(plain.sample(STATE, TOOLS, 1))
        body = backend.requests[-1].raw
        assert "reasoning_effort" not in body and "thinking" not in body and "top_k" not in body
        # vLLM-style servers get the chat-template switch
        vllm = build_teacher(teacher_spec(_endpoint_cfg(tok_dir, server.base_url, "teacher.provider=vllm").teacher))
        asyncio.run(vllm.sample(STATE, TOOLS, 1))
        assert backend.requests[-1].raw["chat_template_kwargs"] == {"enable_thinking": True}
    with pytest.raises(ConfigError, match="teacher.provider='nope'; expected one of"):
        _endpoint_cfg(tok_dir, "http://127.0.0.1:9/v1", "teacher.provider=nope")


def test_matcher_provider_reaches_the_judge_request(tok_dir):
    backend = ScriptedBackend("judge", lambda req: message_choice("VERDICT: NO_MATCH"))
    with serve(backend) as server:
        cfg = _endpoint_cfg(tok_dir, server.base_url, "teacher.provider=vllm", "matcher.kind=rules+llm", "matcher.model=judge",
                            f"matcher.base_url={server.base_url}", "matcher.provider=dashscope")
        m = build_matcher(judge_spec(cfg.matcher))
        from tests.test_matching_judge import PARIS, ROME

        assert asyncio.run(m.verdict(ROME, PARIS, messages=STATE, tools=TOOLS)) == "no_match"
        assert backend.requests[-1].raw["enable_thinking"] is False  # DashScope's own switch


def test_local_teacher_kind_builds_an_in_process_teacher(tok_dir, tmp_path):
    hf = tmp_path / "teacher_hf"
    tiny = PRESETS["tiny"]
    save_hf(Qwen3(tiny, rngs=nnx.Rngs(5)), tiny, hf)
    cfg = tiny_run_config(tok_dir, "collect.kind=actionopd", "teacher.kind=local", f"teacher.model={hf}",
                          "teacher.max_tokens=8", "teacher.temperature=1.0", "matcher.kind=rules")
    assert teacher_spec(cfg.teacher) == {"provider": "local", "model": str(hf)}
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path / "run"), tokenizer_path=str(tok_dir),
                        process_index=0, process_count=1, mesh=build_mesh(cfg))
    buckets = Buckets(prompt_len=(256,), prompts=(1,), samples=(2,), max_new=(8,))
    source = ActionOPDGroupSource(cfg, ctx, stream=ListTaskStream(toy_tasks(2, "local"), per_step=1),
                                  env_factory=toy_env_factory, tokenizer=load_tokenizer(tok_dir), buckets=buckets)
    teacher = source.collector.teacher
    assert isinstance(teacher, CachedTeacher) and isinstance(teacher.inner, LocalTeacher)
    assert teacher.identity["provider"] == "local" and str(hf.resolve()) in teacher.identity["model"]
    # the teacher samples in-process: two replies per request (a random tiny model's text, which
    # rarely parses, so slots are regenerated up to teacher.retries times)
    batch = asyncio.run(teacher.inner.sample_detailed(STATE, TOOLS, 2))
    assert batch.requested == 2 and teacher.inner.usage.http_calls >= 1
    assert len(batch.samples) + batch.invalid_replies >= 2
    with pytest.raises(ConfigError, match="teacher.kind=local needs teacher.model"):
        ActionOPDGroupSource(replace_keys(cfg, **{"teacher.model": str(tmp_path)}), ctx,
                             stream=ListTaskStream(toy_tasks(1, "x"), per_step=1), env_factory=toy_env_factory,
                             tokenizer=load_tokenizer(tok_dir), buckets=buckets)
