"""The whole collector with collect.sampler = "engine": against a real teacher and judge over
HTTP, on a tiny random student, it records the same state groups as with the static sampler
(tokens, actions, rewards, verdicts; logprobs to the "checked" head's rounding)."""

import numpy as np

from actionopd_jax.collect.engine_worker import EngineSampling
from actionopd_jax.collect.sampler_worker import SamplingSettings
from actionopd_jax.engine import Engine, EngineConfig
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (Script, collect_once, collector_config, group_signature, judge_backend,
                                     logprobs_of, make_collector, make_matcher, make_teacher, real_sample_fn, serve,
                                     teacher_backend, tiny_sampler, toy_task)

def test_the_collector_on_the_engine_records_the_static_samplers_groups(tiny_tokenizer, tmp_path):
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = tiny_sampler(len(tiny_tokenizer), eos)
    cfg = collector_config(max_trajectories_in_flight=4, max_prompt_tokens=512, decision_limits=(("toy", 3),))
    settings = SamplingSettings(n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k)
    engine = Engine(sampler.model, eos_ids=[eos], config=EngineConfig(slots=16, page_size=16, max_len=528, chunk=128,
                                                                       prefill_lanes=4, segment=4))
    tasks = [toy_task(f"t{i}", f"real{i % 3}") for i in range(4)]
    results = {}
    with serve(teacher_backend(Script(teacher={}, student={})), judge_backend()) as server:
        for name, fn in (("static", real_sample_fn(sampler, cfg)), ("engine", EngineSampling(engine, settings))):
            teacher = make_teacher(server, cache_path=tmp_path / "teacher.sqlite")
            collector = make_collector(cfg, tiny_tokenizer, teacher, make_matcher(server), fn)
            results[name] = collect_once(collector, tasks, step=3, process_index=0, process_count=1)
            teacher.cache.close()
    assert len(results["engine"].groups) >= 4
    assert group_signature(results["engine"]) == group_signature(results["static"])
    for a, b in zip(logprobs_of(results["engine"]), logprobs_of(results["static"])):
        np.testing.assert_allclose(a, b, atol=5e-4)
    # a trajectory's later states found its history in the prefix cache
    assert engine.stats.prefix_hit_tokens > 0
