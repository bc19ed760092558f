"""The collector as the trainer's group source (`collect.kind: actionopd`): config mapping,
clear errors, and one real training step (collect -> advantages -> update) of the trainer
loop over collected groups, with the loopback teacher/judge and the small real environment."""

import jax
import numpy as np
import pytest

from actionopd_jax.collect import ActionOPDGroupSource
from actionopd_jax.collect.source import collector_config_from, train_task_stream
from actionopd_jax.teacher.specs import judge_spec, teacher_spec
from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import from_dict, replace_keys
from actionopd_jax.sampling import Buckets
from actionopd_jax.train.advantages import assign_advantages
from actionopd_jax.train.batching import rows_from_groups
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, BAD, C, ListTaskStream, collect_once, Script, ToyEnv, collector_config,
                                     fixed_text_sample_fn, judge_backend, make_collector, make_matcher, make_teacher,
                                     serve, teacher_backend, toy_task)


def _cfg(**collect):
    c = {"kind": "actionopd", "num_candidates": 4, "teacher_samples": 3, "freq_bonus": 0.5,
         "max_response_tokens": 16, "max_prompt_tokens": 1024, "task_starts_per_step": 4, "concurrency": 4,
         "max_decisions": 2, "temperature": 1.0}
    c.update(collect)
    return from_dict({"collect": c, "model": {"preset": "tiny"}, "train": {"steps": 1, "max_seq_len": 2048},
                      "run": {"seed": 3, "progress": False, "tensorboard": False},
                      "teacher": {"kind": "openai", "provider": "vllm", "model": "teacher",
                                  "base_url": "http://127.0.0.1:9/v1"},
                      # BFCL tasks are evaluation tasks: these wiring tests opt in explicitly
                      "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}})


def test_config_mapping_and_errors():
    cfg = _cfg(reward="validity", commit="random")
    cc = collector_config_from(cfg)
    assert (cc.seed, cc.n, cc.k, cc.reward.lam, cc.reward.mode, cc.commit) == (3, 4, 3, 0.5, "validity", "random")
    assert cc.decision_limit("bfcl") == 2 and cc.decision_limit("tau2_airline") == 2
    spec = teacher_spec(cfg.teacher)
    assert spec["model"] == "teacher" and spec["max_regenerations"] == 2 and spec["api_key_env"] is None
    assert judge_spec(replace_keys(cfg, **{"matcher.kind": "rules"}).matcher) is None
    with pytest.raises(ConfigError, match="teacher.kind"):
        teacher_spec(replace_keys(cfg, **{"teacher.kind": "none"}).teacher)
    with pytest.raises(ConfigError, match="env.name"):
        train_task_stream(replace_keys(cfg, **{"env.name": "synthetic"}))
    with pytest.raises(ConfigError, match="env.domains"):
        train_task_stream(replace_keys(cfg, **{"env.name": "tau2", "env.domains": []}))
    # every process builds the same stream: the same global task starts per step
    a, b = train_task_stream(cfg), train_task_stream(cfg)
    first = [t.task_id for t in a.next_step()]
    assert first == [t.task_id for t in b.next_step()] and len(first) == 4
    assert all(t.startswith("multi_turn_base_") for t in first)


SCRIPT = Script(teacher={}, student={(f"src{i}", d): [A, B, C, BAD] for i in range(2) for d in range(3)})


def test_collected_groups_feed_the_trainer_batching(tiny_tokenizer):
    """Retained groups become N rows each with group-centred, batch-whitened advantages."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(decision_limits=(("toy", 2),))
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos))
        result = collect_once(collector, [toy_task(f"s{i}", f"src{i}") for i in range(2)], step=0,
                                   process_index=0, process_count=1)
    groups = result.groups
    assert len(groups) == 4 and all(g.retained for g in groups)
    stats = assign_advantages(groups)
    rows = rows_from_groups(groups)
    assert len(rows) == 16
    # rewards [1.25, 1, 0, -1] in every group: centred [0.9375, 0.6875, -0.3125, -1.3125]
    centred = np.array([1.25, 1.0, 0.0, -1.0]) - 0.3125  # group mean 0.3125
    sigma = np.sqrt(np.mean(centred ** 2))
    assert stats["sigma"] == pytest.approx(sigma)
    np.testing.assert_allclose(groups[0].advantages, centred / (sigma + 1e-8), rtol=1e-6)
    assert rows[0].prompt.dtype == np.int32 and rows[0].response[-1] == eos


def test_one_trainer_step_over_the_collector(tiny_tokenizer, tmp_path):
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    cfg = replace_keys(_cfg(), **{"run.dir": str(tmp_path / "run")})
    qcfg = model_config(cfg)
    assert qcfg.vocab_size >= len(tiny_tokenizer)
    ctx = SourceContext(model_config=qcfg, run_dir=str(tmp_path / "run"), tokenizer_path="", process_index=0,
                        process_count=1, mesh=build_mesh(cfg))
    tasks = [toy_task(f"t{i}", f"trainer{i}") for i in range(4)]
    with serve(teacher_backend(Script({}, {})), judge_backend()) as server:
        source = ActionOPDGroupSource(cfg, ctx, teacher=make_teacher(server), matcher=make_matcher(server),
                                      stream=ListTaskStream(tasks, per_step=4), env_factory=lambda task: ToyEnv(),
                                      tokenizer=tiny_tokenizer,
                                      buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,), max_new=(16,),
                                                      max_rows=16))
        trainer = Trainer(cfg, run_dir=tmp_path / "run", source=source)
        metrics = trainer.train_step()
    assert trainer.step == 1
    assert source.last is not None and len(source.last.trajectories) == 4
    assert metrics["collect/trajectories"] == 4.0
    assert metrics["collect/groups_kept"] + metrics["collect/groups_dropped"] == len(source.last.groups) >= 4
    assert all(len(g.candidates) == 4 and g.candidates[0].logprobs.size > 0 for g in source.last.groups)
    # the teacher's spend meter (issue 35): the step's usage counted, its totals in the source's
    # state (the checkpoint), and a restored source counts on from them
    used = source.last.metrics.teacher
    assert used.http_calls > 0 and used.prompt_tokens > 0
    state = source.state_dict()
    assert state["next_index"] == 4 and state["meter"]["requests"] == used.http_calls
    assert state["meter"]["prompt_tokens"] == used.prompt_tokens and state["meter"]["spend_usd"] == 0.0
    assert metrics["collect/teacher/requests_total"] == used.http_calls and "collect/teacher/spend_usd" not in metrics
    # the judge and the user simulator have meters of their own, in the same state
    judged = source.last.metrics.judge
    assert metrics["collect/matcher/requests_total"] == judged.http_calls == state["meters"]["matcher"]["requests"]
    assert metrics["collect/judge/prompt_tokens"] == judged.prompt_tokens
    assert metrics["collect/user/requests_total"] == 0.0 == state["meters"]["user"]["requests"]  # toy env: no user
    source.meters.teacher.load({"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cache_hits": 0, "spend_usd": 0})
    source.load_state_dict(state)
    assert source.meters.teacher.state() == state["meter"] and source.stream.get_state()["next_index"] == 4
    assert source.meters.by_role["matcher"].state() == state["meters"]["matcher"]


def test_sampling_settings_have_one_source():
    """The student's sampling settings come from the run config alone: a default Config and a
    paper recipe reach the collector unchanged (collect/config.py keeps no defaults of its own)."""
    from actionopd_jax.config.load import load_config

    fields = ("temperature", "top_p", "top_k", "enable_thinking")
    for cfg in (from_dict({}), load_config("configs/paper/qwen3_4b_h200x8.yaml")):
        cc = collector_config_from(cfg)
        assert tuple(getattr(cc, f) for f in fields) == tuple(getattr(cfg.collect, f) for f in fields)
        assert cc.max_new_tokens == cfg.collect.max_response_tokens
        assert cc.max_prompt_tokens == cfg.collect.max_prompt_tokens
    # the tiny job's defaults and table 8's recipe values, pinned so a changed default shows here
    assert (from_dict({}).collect.temperature, from_dict({}).collect.top_k) == (1.0, 0)
    assert tuple(getattr(collector_config_from(cfg), f) for f in fields) == (0.6, 0.95, 20, True)


def test_a_teacher_that_answers_nothing_stops_the_run_after_max_outage_steps(tiny_tokenizer, tmp_path, caplog):
    """Issue 34: a teacher answering 500 to every request read as a healthy run (exit 0, an
    unavailable rate of 0.0). Each step with no teacher answer for any task start is logged as
    an error; at collect.max_outage_steps (default 2) in a row the run stops (RunStop:
    `actionopd train` prints it and exits 1)."""
    import logging

    from actionopd_jax.serve.faults import FaultInjector, FaultRates
    from actionopd_jax.teacher.transport import RetryPolicy
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import RunStop, SourceContext

    cfg = replace_keys(_cfg(), **{"run.dir": str(tmp_path / "run"), "train.steps": 3})
    assert cfg.collect.max_outage_steps == 2
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path / "run"), tokenizer_path="",
                        process_index=0, process_count=1, mesh=build_mesh(cfg))
    tasks = [toy_task(f"t{i}", f"outage{i}") for i in range(12)]
    with serve(teacher_backend(Script({}, {})), judge_backend(),
               middleware=FaultInjector(FaultRates(server_error=1.0), seed=0)) as server:
        teacher = make_teacher(server, retry=RetryPolicy(max_attempts=1, base_delay_s=0.01, max_delay_s=0.01,
                                                         max_total_s=2.0))
        source = ActionOPDGroupSource(cfg, ctx, teacher=teacher, matcher=make_matcher(server),
                                      stream=ListTaskStream(tasks, per_step=4), env_factory=lambda task: ToyEnv(),
                                      tokenizer=tiny_tokenizer,
                                      buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,), max_new=(16,),
                                                      max_rows=16))
        trainer = Trainer(cfg, run_dir=tmp_path / "run", source=source)
        with caplog.at_level(logging.ERROR, logger="actionopd_jax.collect.source"):
            trainer.train_step()                              # step 0: no answer, logged, goes on
            assert f"step 0: none of 4 task starts got an answer from teacher endpoint {server.base_url}" in caplog.text
            assert "1 such step(s) in a row; the run stops at 2" in caplog.text
            # issue 46 item 5: the outage's states are unavailable supervision (this read 0.0)
            m = trainer.source.metrics()
            assert m["unavailable_group_rate"] == 1.0 and m["unavailable_states"] == 4
            with pytest.raises(RunStop, match="answered none of the task starts of 2 steps in a row") as stop:
                trainer.train_step()
    assert {r.end_reason for r in source.last.trajectories} == {"teacher_error"}
    # the stop names the endpoint (URL, model), the error class and the counts
    text = str(stop.value)
    assert server.base_url in text and "(model teacher)" in text and "InternalServerError HTTP 500" in text
    assert "12 sample(s) lost past the transport retries" in text   # 4 starts x K=3


def test_the_spend_meter_prices_tokens_and_adds_up():
    """teacher.price = [2, 0.5, 10] USD per million: a step of 1,000 prompt and 200 completion
    tokens costs (1000 x 2 + 200 x 10) / 1e6 = $0.004; totals add over steps."""
    from actionopd_jax.collect.spend import SpendMeter
    from actionopd_jax.teacher.base import UsageReport

    meter = SpendMeter(price=(2.0, 0.5, 10.0))
    step = UsageReport(http_calls=3, cache_hits=1, prompt_tokens=1000, completion_tokens=200)
    first = meter.add(step)
    assert first["teacher/spend_usd"] == pytest.approx(0.004) and first["teacher/spend_usd_total"] == pytest.approx(0.004)
    second = meter.add(step)
    assert second["teacher/spend_usd_total"] == pytest.approx(0.008) and second["teacher/requests_total"] == 6
    assert meter.state() == {"requests": 6, "cache_hits": 2, "prompt_tokens": 2000, "completion_tokens": 400,
                             "cached_prompt_tokens": 0, "spend_usd": pytest.approx(0.008), "last_step_usd": pytest.approx(0.004),
                             "last_step_tokens": 1200, "saved_calls": 0}


def test_the_meters_price_each_role_add_up_for_the_budget_and_read_older_state():
    from actionopd_jax.collect.spend import SpendMeters
    from actionopd_jax.teacher.base import UsageReport

    meters = SpendMeters({"teacher": (2.0, 0.5, 10.0), "matcher": (1.0, 0.0, 4.0), "user": ()})
    out = meters.add({"teacher": UsageReport(http_calls=2, prompt_tokens=1000, completion_tokens=200),
                      "matcher": UsageReport(http_calls=5, cache_hits=3, prompt_tokens=3000, completion_tokens=50),
                      "user": UsageReport(http_calls=4, prompt_tokens=800, completion_tokens=100)})
    # teacher: (1000 x 2 + 200 x 10) / 1e6 = 0.004; judge: (3000 x 1 + 50 x 4) / 1e6 = 0.0032; user: unpriced
    assert out["teacher/spend_usd"] == pytest.approx(0.004) and out["matcher/spend_usd"] == pytest.approx(0.0032)
    assert "user/spend_usd" not in out and out["user/prompt_tokens_total"] == 800.0
    assert out["matcher/cache_hits_total"] == 3.0 and out["spend_usd_total"] == pytest.approx(0.0072)
    # the budget sums the money of every role, and counts each role's tokens (total, last step)
    assert meters.budget_figures() == [pytest.approx(0.0072), pytest.approx(0.0072), 1200.0, 1200.0,
                                       3050.0, 3050.0, 900.0, 900.0]
    restored = SpendMeters({"teacher": (2.0, 0.5, 10.0), "matcher": (1.0, 0.0, 4.0)})
    restored.load(meters.state())
    assert restored.state() == meters.state() and restored.spend_usd == pytest.approx(0.0072)
    older = SpendMeters({"teacher": (2.0, 0.5, 10.0)})
    older.load({"meter": meters.state()["meter"]})   # a checkpoint from before the judge and user meters
    assert older.spend_usd == pytest.approx(0.004) and older.by_role["matcher"].requests == 0
