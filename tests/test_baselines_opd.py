"""Token-level OPD baseline (paper B.4): teacher log-probabilities on the student's sampled
tokens (from a local Flax teacher or from our server's vLLM-style echo scoring) and the
sampled-token reverse-KL update through the trainer."""

import jax
import numpy as np
import openai
import pytest
from flax import nnx

from actionopd_jax.baselines.opd import EndpointScorer, LocalTeacherScorer
from actionopd_jax.baselines.opd_source import OPDGroupSource, scorer_from_config
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.config.load import replace_keys
from actionopd_jax.engine import Engine
from actionopd_jax.model import PRESETS, Qwen3
from actionopd_jax.model.weights import save_hf
from actionopd_jax.sampling import Buckets, Sampler
from actionopd_jax.serve.model_backend import ModelBackend
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.train.loop import Trainer
from actionopd_jax.train.setup import build_mesh, model_config
from actionopd_jax.train.sources import SourceContext
from tests._baselines_fixtures import direct_target_logprobs, full_logprobs, tiny_run_config, toy_env_factory, toy_tasks
from tests._collect_fixtures import ListTaskStream

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def teacher():
    return Qwen3(TINY, rngs=nnx.Rngs(11))


@pytest.fixture(scope="module")
def teacher_server(teacher, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampler = Sampler(teacher, eos_ids=[eos], buckets=Buckets(prompt_len=(64,), prompts=(1,), samples=(1,), max_new=(16,)))
    backend = ModelBackend(sampler, tok, model_name="teacher", max_context=1024)
    with OpenAIServer([backend, ScriptedBackend("chat-only", lambda r: message_choice("hi"))]) as srv:
        yield srv


def test_echo_scoring_endpoint_matches_log_softmax_of_a_full_forward(teacher, teacher_server, tok):
    client = openai.OpenAI(base_url=teacher_server.base_url, api_key="unused", max_retries=0)
    rng = np.random.default_rng(0)
    for length in (7, 200):  # one bucket below and one above the 128-position LM-head chunk
        ids = rng.integers(0, len(tok), length).tolist()
        r = client.completions.create(model="teacher", prompt=ids, max_tokens=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == length and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        direct = full_logprobs(teacher, np.asarray(ids))
        expected = direct[np.arange(length - 1), ids[1:]]
        np.testing.assert_allclose(np.asarray(lp.token_logprobs[1:]), expected, atol=2e-5, rtol=1e-5)
        # top_logprobs: the actual token and the model's most likely one, with its logprob
        i = 5
        best = int(np.argmax(direct[i - 1]))
        top = lp.top_logprobs[i]
        assert top[tok.decode([best], skip_special_tokens=False)] == pytest.approx(float(direct[i - 1, best]), abs=2e-5)
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert r.usage.prompt_tokens == length and r.usage.completion_tokens == 0
    bad = [dict(model="teacher", prompt=[1, 2, 3], max_tokens=3, echo=True, logprobs=1),  # generation: not served
           dict(model="teacher", prompt="some text", max_tokens=0, echo=True, logprobs=1),  # not token ids
           dict(model="teacher", prompt=[1, 2, 3], max_tokens=0, echo=False, logprobs=1),
           dict(model="teacher", prompt=[1, len(tok) + 999], max_tokens=0, echo=True, logprobs=1),
           dict(model="chat-only", prompt=[1, 2, 3], max_tokens=0, echo=True, logprobs=1)]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kwargs)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nobody", prompt=[1, 2], max_tokens=0, echo=True, logprobs=1)


def test_local_and_endpoint_scorers_give_the_teachers_logprobs_at_the_students_tokens(
        teacher, teacher_server, tok, tok_dir, tmp_path):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, len(tok), n).astype(np.int32) for n in (30, 90, 5)]
    responses = [rng.integers(0, len(tok), n).astype(np.int32) for n in (12, 1, 40)]
    expected = [direct_target_logprobs(teacher, p, r) for p, r in zip(prompts, responses)]
    via_http = EndpointScorer(teacher_server.base_url, "teacher").score(prompts, responses)
    local = LocalTeacherScorer(teacher, max_rows=2).score(prompts, responses)
    for e, h, l in zip(expected, via_http, local):
        assert h.shape == l.shape == e.shape
        np.testing.assert_allclose(h, e, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(l, e, atol=2e-5, rtol=1e-5)

    # teacher.kind=local from the config: an HF directory with the student's vocabulary
    save_hf(teacher, TINY, tmp_path / "teacher")
    cfg = tiny_run_config(tmp_path, "collect.kind=opd", "train.loss=opd", "teacher.kind=local",
                          f"teacher.model={tmp_path / 'teacher'}")
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path), tokenizer_path="", process_index=0,
                        process_count=1, mesh=build_mesh(cfg))
    from_config = scorer_from_config(cfg, ctx).score(prompts[:1], responses[:1])
    np.testing.assert_allclose(from_config[0], expected[0], atol=2e-5, rtol=1e-5)
    from actionopd_jax.config import ConfigError

    with pytest.raises(ConfigError, match="shared token space"):
        scorer_from_config(replace_keys(cfg, **{"model.preset": "bench-tiny"}),
                           SourceContext(model_config=PRESETS["bench-tiny"], run_dir="", tokenizer_path="",
                                         process_index=0, process_count=1, mesh=ctx.mesh))
    with pytest.raises(ConfigError, match="teacher.kind must be local or openai"):
        scorer_from_config(replace_keys(cfg, **{"teacher.kind": "none"}), ctx)
    # issue 33: the teacher's log-probs at the student's rollout temperature (one temperature in
    # the token reward); an endpoint, whose echo scoring is at T=1, only at T=1
    cold = replace_keys(cfg, **{"collect.temperature": 0.6})
    at_06 = scorer_from_config(cold, ctx).score(prompts[:1], responses[:1])[0]
    seq = np.concatenate([prompts[0], responses[0]]).astype(np.int32)
    import jax
    import jax.numpy as jnp

    hidden, _ = teacher(jnp.asarray(seq[None]), jnp.arange(seq.size)[None])
    lp06 = np.asarray(jax.nn.log_softmax(teacher.logits(hidden)[0].astype(jnp.float32) / 0.6, axis=-1))
    p0 = len(prompts[0])
    want06 = lp06[np.arange(p0 - 1, p0 - 1 + len(responses[0])), responses[0]]
    np.testing.assert_allclose(at_06, want06, atol=2e-5, rtol=1e-5)
    assert np.abs(at_06 - expected[0]).max() > 1e-2            # not the T=1 log-probs
    endpoint = replace_keys(cold, **{"teacher.kind": "openai", "teacher.base_url": teacher_server.base_url,
                                     "teacher.model": "teacher"})
    with pytest.raises(ConfigError, match=r"compares log-probs at T=1 .* collect.temperature=0.6"):
        scorer_from_config(endpoint, ctx)
    # `actionopd train collect.kind=opd ...` builds this source through the trainer's factory
    from actionopd_jax.baselines.wiring import build_source

    cli_cfg = replace_keys(cfg, **{"env.name": "bfcl", "env.domains": ["base"], "env.allow_eval_overlap": True,
                                   "collect.task_starts_per_step": 1,
                                   "model.tokenizer": str(tok_dir)})
    source = build_source(cli_cfg, SourceContext(model_config=model_config(cli_cfg), run_dir=str(tmp_path),
                                                 tokenizer_path=str(tok_dir), process_index=0, process_count=1,
                                                 mesh=ctx.mesh))
    assert isinstance(source, OPDGroupSource) and isinstance(source.scorer, LocalTeacherScorer)
    assert source.stream.next_step()[0].env == "bfcl" and source.trajectories_per_start == 4


def test_opd_collects_student_trajectories_and_trains_on_sampled_token_reverse_kl(teacher, teacher_server, tok_dir,
                                                                                   tok, tmp_path):
    """Two steps of `train.loss=opd` on the toy environment: per task start N=2 student
    trajectories; every sampled token carries the served teacher's logprob (== a direct
    teacher forward); the first update's loss is the per-token mean of log pi_old - log pi_T."""
    cfg = tiny_run_config(tok_dir, "collect.kind=opd", "train.loss=opd", "collect.num_candidates=2",
                          "collect.task_starts_per_step=2", "collect.max_decisions=2", "collect.max_response_tokens=16",
                          "train.minibatch_rows=32",
                          "train.lr=1e-3", "model.init_seed=5", "run.seed=3", "teacher.kind=openai",
                          f"teacher.base_url={teacher_server.base_url}", "teacher.model=teacher",
                          "collect.engine_slots=4")   # the 4 trajectories of a step (fewer row programs on CPU)
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path), tokenizer_path=str(tok_dir),
                        process_index=0, process_count=1, mesh=build_mesh(cfg))
    source = OPDGroupSource(cfg, ctx, stream=ListTaskStream(toy_tasks(4, "opd"), per_step=2),
                            env_factory=toy_env_factory, tokenizer=tok,
                            buckets=Buckets(prompt_len=(512,), prompts=(8,), samples=(1,), max_new=(32,), max_rows=8))
    assert isinstance(source.scorer, EndpointScorer)  # teacher.kind=openai -> echo scoring over HTTP
    # the student's rollouts go the way ActionOPD's do (collect.sampler=auto: the engine on CPU)
    assert source.sampler_kind == "engine" and isinstance(source.sampler, Engine)
    trainer = Trainer(cfg, run_dir=tmp_path / "run", source=source)
    try:
        before = jax.tree.map(np.asarray, trainer.state["params"])
        m1 = trainer.train_step()
        trajs = source.last_trajectories
        assert [(t.task_start, t.index) for t in trajs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(1 <= len(t.states) <= 2 for t in trajs)   # collect.max_decisions=2 (2 keeps the suite quick)
        n_states = sum(len(t.states) for t in trajs)
        assert m1["rows"] == n_states and m1["updates"] == 1
        # the two trajectories of one task start are independent samples
        assert not np.array_equal(trajs[0].states[0].token_ids, trajs[1].states[0].token_ids)
        s = trajs[2].states[0]
        groups_lp = source.scorer.score([s.prompt_ids], [s.token_ids])[0]
        np.testing.assert_allclose(groups_lp, direct_target_logprobs(teacher, s.prompt_ids, s.token_ids), atol=2e-5)
        src = source.metrics()
        assert m1["loss"] == pytest.approx(src["reverse_kl_estimate"], abs=1e-3)
        assert m1["collect/reverse_kl_estimate"] == src["reverse_kl_estimate"]
        after = jax.tree.map(np.asarray, trainer.state["params"])
        assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        m2 = trainer.train_step()
        assert np.isfinite(m2["loss"]) and m2["updates"] == 1
        assert source.stream.get_state() == {"next_index": 4}
        # an explicit choice holds: the static sampler, with the buckets it is given
        static = OPDGroupSource(replace_keys(cfg, **{"collect.sampler": "static"}), ctx, stream=source.stream,
                                env_factory=toy_env_factory, tokenizer=tok, buckets=Buckets(max_rows=8))
        assert static.sampler_kind == "static" and isinstance(static.sampler, Sampler)
        assert static.sampler.buckets.max_rows == 8
    finally:
        trainer.close()
