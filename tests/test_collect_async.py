"""Asynchronous ActionOPD with a bounded staleness (issue 44, collect.max_staleness = eta): the
config's rules, the scheduler's version stamps across a weight swap in the middle of running
trajectories, and real trainer runs at eta=1 over the loopback teacher/judge and the small real
environment (staleness bound, the correction's batch, resume with the in-flight draws redone
from the teacher cache, a budget stop with no loop left running)."""

import threading

import numpy as np
import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import from_dict, replace_keys
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, BAD, C, ListTaskStream, Script, ToyEnv, case_of, collector_config,
                                     fixed_text_sample_fn, judge_backend, make_matcher, make_teacher, serve,
                                     teacher_backend, toy_run_config, toy_task)

PRICE = (1000.0, 0.0, 1000.0)
SCRIPT = Script(teacher={}, student={(f"async{i}", d): [A, B, C, BAD] for i in range(16) for d in range(4)})


def _cfg(tmp_path, name="run", **keys):
    return toy_run_config(tmp_path / name, PRICE, **{"train.steps": 2, "collect.concurrency": 8,
                                                    "collect.sampler": "static", "collect.max_staleness": 1, **keys})


def test_config_rules_and_the_synchronous_default(tmp_path):
    from actionopd_jax.baselines.wiring import collector_source_class
    from actionopd_jax.collect.async_source import AsyncActionOPDGroupSource
    from actionopd_jax.collect.source import ActionOPDGroupSource
    from actionopd_jax.train.batching import BATCH_FIELDS, Row, pack_minibatch, pack_shared_minibatch, share_prompts

    cfg = _cfg(tmp_path)
    assert cfg.collect.max_staleness == 1 and from_dict({}).collect.max_staleness == 0   # off by default
    # eta = 0 builds today's synchronous source, whose batches carry nothing new
    assert collector_source_class(replace_keys(cfg, **{"collect.max_staleness": 0})) is ActionOPDGroupSource
    assert collector_source_class(cfg) is AsyncActionOPDGroupSource
    rows = [Row(np.arange(1, 5, dtype=np.int32), np.arange(3, dtype=np.int32), 1.0, np.full(3, -0.5, np.float32),
                group=0, stale=True), Row(np.arange(1, 5, dtype=np.int32), np.arange(2, dtype=np.int32), -1.0,
                                         np.full(2, -0.5, np.float32), group=0)]
    assert set(pack_minibatch(rows, [0, 1], microbatches=1, microbatch_rows=2).arrays) == set(BATCH_FIELDS)
    marked = pack_minibatch(rows, [0, 1], microbatches=1, microbatch_rows=2, with_stale=True).arrays["stale"]
    assert marked[0, 0, :3].tolist() == [1, 1, 1] and marked[0, 0, 3:].sum() == 0 and marked[0, 1].sum() == 0
    shared = pack_shared_minibatch(share_prompts(rows), [0], microbatches=1, microbatch_rows=1, count=2,
                                   prompt_len=4, resp_len=4, with_stale=True).arrays["stale"]
    assert shared[0, 0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    from types import SimpleNamespace

    from actionopd_jax.commands.train import collection_mode
    from actionopd_jax.train.aot_check import _abstract_batch

    # `train --check --aot` compiles the update with the batch the run feeds it
    fake = SimpleNamespace(settings=SimpleNamespace(shared_prompt=0), row_sharding=None)
    assert _abstract_batch(fake, 8, 64, 16, behaviour=True)["behav_logp"].shape == (1, 8, 16)
    assert "behav_logp" not in _abstract_batch(fake, 8, 64, 16)

    assert "asynchronous, collect.max_staleness=1" in collection_mode(cfg)    # what train --check prints
    assert "synchronous" in collection_mode(replace_keys(cfg, **{"collect.max_staleness": 0}))
    # the memory plan counts the sampler's copy and a call's cache beside the update
    from actionopd_jax.train.plan import describe
    from actionopd_jax.train.setup import model_config

    text, _ = describe(cfg, model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1}, device_memory_gb=16.0)
    sync, _ = describe(replace_keys(cfg, **{"collect.max_staleness": 0}), model_config(cfg),
                       {"data": 1, "fsdp": 1, "tensor": 1}, device_memory_gb=16.0)
    assert "beside the update" in text and "peak update beside collection" in text
    assert "beside the update" not in sync
    for keys, words in [({"collect.max_staleness": -1}, "must be >= 0"),
                        ({"collect.kind": "synthetic", "teacher.kind": "none"}, "needs collect.kind=actionopd"),
                        ({"train.old_logprobs": "sampler"}, "needs train.old_logprobs=recompute"),
                        ({"teacher.kind": "self"}, "Self-ActionOPD")]:
        with pytest.raises(ConfigError, match=words):
            replace_keys(cfg, **keys)
    # the engine takes new weights while rows run: eta >= 1 runs on it (eta = 0 stays synchronous)
    engine = replace_keys(cfg, **{"collect.sampler": "engine"})
    assert collector_source_class(engine) is AsyncActionOPDGroupSource
    assert collector_source_class(replace_keys(engine, **{"collect.max_staleness": 0})) is ActionOPDGroupSource
    planned, _ = describe(engine, model_config(cfg), {"data": 1, "fsdp": 1, "tensor": 1}, device_memory_gb=16.0)
    assert "the engine keeps sampling while the update runs" in planned
    assert "keeps sampling" not in describe(replace_keys(engine, **{"collect.max_staleness": 0}), model_config(cfg),
                                            {"data": 1, "fsdp": 1, "tensor": 1}, device_memory_gb=16.0)[0]


def test_version_stamps_follow_a_weight_swap_in_the_middle_of_running_trajectories(tiny_tokenizer):
    """The swap waits for the device call that is running, every state sampled after it carries
    the new version, and trajectories are not drained: one episode has groups of both."""
    from actionopd_jax.collect.async_scheduler import AsyncCollector, AsyncScheduler, VersionedSampling

    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    inner = fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos)
    entered, release, calls = threading.Event(), threading.Event(), []

    def gated(prompts, keys):
        calls.append([tuple(int(t) for t in p) for p in prompts])
        if len(calls) == 2:      # the second device call holds the sampler until released
            entered.set()
            assert release.wait(30)
        return inner(prompts, keys)

    sampling = VersionedSampling(gated)
    sampling.swap(lambda: None, 0)
    cfg = collector_config(decision_limits=(("toy", 4),), sampler_coalesce_s=0.0, sampler_max_wait_s=0.0)
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        collector = AsyncCollector(cfg, tokenizer=tiny_tokenizer, teacher=make_teacher(server),
                                   matcher=make_matcher(server), sample_fn=sampling, eos_ids=[eos],
                                   env_factory=lambda task: ToyEnv())
        scheduler = AsyncScheduler(collector, concurrency=2, worker_kwargs=dict(max_states_per_call=1))
        collector.scheduler = scheduler
        scheduler.start()
        scheduler.admit(0, [(i, toy_task(f"s{i}", f"async{i}")) for i in range(2)])
        assert entered.wait(30)
        swapped = threading.Thread(target=sampling.swap, args=(lambda: None, 1))
        swapped.start()
        swapped.join(0.2)
        assert swapped.is_alive()       # blocked behind the running call, not interrupting it
        release.set()
        swapped.join(30)
        draw = scheduler.wait(0)
        collector.close()
    assert not scheduler.running and not any(t.name == "async-collect" for t in threading.enumerate())
    by_prompt = {}
    for i, prompts in enumerate(calls):
        for p in prompts:
            by_prompt[p] = 0 if i < 2 else 1     # calls up to the gated one ran under version 0
    groups = [g for _, g, _ in draw.outcomes]
    assert len(groups) == 8 and len(draw.records) == 2
    for g in groups:
        assert g.policy_version == by_prompt[tuple(g.prompt_ids.tolist())]
    # a trajectory's 4th state follows its own 3 device calls, so it comes after the swap; one of
    # the first states went into the first call: that episode ran on across the swap
    versions = {(g.task_id, g.decision_index): g.policy_version for g in groups}
    assert versions[("s0", 3)] == versions[("s1", 3)] == 1
    assert min(versions[("s0", 0)], versions[("s1", 0)]) == 0


def _source(cfg, tmp_path, tokenizer, server, tasks, cache, fixed_student=True, per_step=4):
    from actionopd_jax.collect.async_source import AsyncActionOPDGroupSource
    from actionopd_jax.sampling import Buckets
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    ctx = SourceContext(model_config=model_config(cfg), run_dir=cfg.run.dir, tokenizer_path="", process_index=0,
                        process_count=1, mesh=build_mesh(cfg))
    source = AsyncActionOPDGroupSource(cfg, ctx, teacher=make_teacher(server, cache_path=cache, max_tokens=16),
                                       matcher=make_matcher(server), stream=ListTaskStream(tasks, per_step=per_step),
                                       env_factory=lambda task: ToyEnv(), tokenizer=tokenizer,
                                       buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,), max_new=(16,),
                                                       max_rows=16))
    # the student's replies are fixed texts (its weights still swap and version every state),
    # so a redone episode asks the teacher the same prompts
    if fixed_student:
        source.sampling.sample_fn = fixed_text_sample_fn(tokenizer, SCRIPT,
                                                         tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return source


def _alive() -> bool:
    return any(t.name == "async-collect" and t.is_alive() for t in threading.enumerate())


def test_eta_1_trains_within_the_bound_resumes_in_flight_draws_from_the_cache_and_stops_on_budget(
        tiny_tokenizer, tmp_path):
    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.collect.async_scheduler import Draw
    from actionopd_jax import paid_calls
    from actionopd_jax.paid_calls import BudgetReached, Ledger
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.sources import Policy, RunStop
    from actionopd_jax.train.spend_report import progress_fields

    tasks = [toy_task(f"t{i}", f"async{i}") for i in range(16)]
    teacher = teacher_backend(SCRIPT)
    with serve(teacher, judge_backend()) as server:
        cfg = _cfg(tmp_path)
        source = _source(cfg, tmp_path, tiny_tokenizer, server, tasks, tmp_path / "teacher.sqlite")
        trainer = Trainer(cfg, run_dir=cfg.run.dir, source=source)
        trained = []
        orig = source.collect

        def spy(step, policy):
            groups = orig(step, policy)
            trained.append((step, [(g.task_id, g.policy_version, g.retained) for g in groups]))
            return groups

        source.collect = spy
        history = []

        def on_step(step, metrics):
            history.append(metrics)
            if step == 2:   # the in-flight draw 2 ends (its answers cached) before the run's stop
                source.scheduler.wait(2)

        assert trainer.run(on_step=on_step) == 0
        assert not _alive() and not source.scheduler.running   # the run's end stops the loop
        # no group older than eta is trained on; each step trains its own draw, in order
        for step, groups in trained:
            assert groups and all(0 <= step - v <= 1 for _, v, _ in groups)
            assert {t for t, _, _ in groups} == {f"t{4 * step + i}" for i in range(4)}
        m = history[-1]
        kept = sum(m[f"collect/async/staleness_{a}"] for a in (0, 1))
        assert kept == m["collect/groups_kept"] and m["collect/async/stale_dropped"] == 0
        assert m["collect/async/max_staleness"] == 1 and "collect/async/wait_s" in m
        assert 0 <= m["collect/async/sampler_busy_frac"] <= 1 and m["collect/async/draws_ahead"] == 1
        assert {"stale", "wait", "spent"} <= set(progress_fields(m))   # the progress line shows them
        # the checkpoint of step 2 draws the in-flight draw 2 again (its teacher was asked)
        assert source.state_dict()["next_index"] == 8
        ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True)
        assert ckpt.read_meta(2)["data"][0]["next_index"] == 8
        ckpt.close()
        asked = {case_of(str(r.messages)) for r in teacher.requests}
        assert {f"async{i}" for i in range(8, 12)} <= asked
        trainer.close()
        # the filter itself: a group sampled more than eta steps ago is dropped and counted
        old = [(0, g, None) for g in source.last.groups[:2]]
        old[0][1].policy_version, old[1][1].policy_version = 3, 4
        assert len(source._result(5, Draw(step=5, starts=[], outcomes=old)).groups) == 1
        assert source._async["stale_dropped"] == 1.0

        # resume: step 2 trains draw 2 again, its teacher answers from the cache
        before = len(teacher.requests)
        cfg3 = replace_keys(cfg, **{"train.steps": 3})
        source = _source(cfg3, tmp_path, tiny_tokenizer, server, tasks, tmp_path / "teacher.sqlite")
        trainer = Trainer(cfg3, run_dir=cfg.run.dir, source=source, resume="latest")
        assert trainer.run() == 0 and trainer.step == 3
        assert {g.task_id for g in source.last.groups} == {f"t{i}" for i in range(8, 12)}
        draw_2 = {f"async{i}" for i in range(8, 12)}
        redone = [r for r in teacher.requests[before:] if case_of(str(r.messages)) in draw_2]
        assert redone == []
        assert source.last.metrics.teacher.cache_hits > 0
        trainer.close()
        assert not _alive()

        # a budget stop within a step (run.budget_usd's ledger refuses a request in the background):
        # collect raises it with no loop left running and the stream back at the step's draw
        capped = _source(cfg, tmp_path, tiny_tokenizer, server, tasks, tmp_path / "capped.sqlite")
        ledger = Ledger({"usd": 10.0}, {"teacher": PRICE}, {"teacher": 16})
        ledger.begin_step(0, 0.0, {})
        previous = paid_calls.install(ledger)
        try:
            with pytest.raises(BudgetReached):
                capped.collect(0, Policy(trainer.graphdef, trainer.state["params"], trainer.qcfg, 0))
        finally:
            paid_calls.install(previous)
        assert not _alive() and not capped.scheduler.running and capped.state_dict()["next_index"] == 0
        assert 0 < ledger.spend_usd <= 10.0, ledger.largest
        capped.close()
        # a teacher outage stops the run as it does today (RunStop), with no loop left running
        down = _source(cfg, tmp_path, tiny_tokenizer, "http://127.0.0.1:9/v1", tasks, None)
        down.max_outage_steps = 1
        with pytest.raises(RunStop, match="answered none of the task starts"):
            down.collect(0, Policy(trainer.graphdef, trainer.state["params"], trainer.qcfg, 0))
        assert not _alive() and down.state_dict()["next_index"] == 0
        down.close()
        # the correction's behaviour log-probs: the sampler's on a stale row, the recomputed elsewhere
        rows = [Row(np.arange(1, 5, dtype=np.int32), np.arange(3, dtype=np.int32), 1.0, np.full(3, -0.5, np.float32),
                    stale=True), Row(np.arange(1, 5, dtype=np.int32), np.arange(3, dtype=np.int32), -1.0,
                                     np.full(3, -0.5, np.float32))]
        batch = trainer.step_fn.put_batch(pack_minibatch(rows, [0, 1], microbatches=1, microbatch_rows=8,
                                                         with_stale=True).arrays)
        batch["old_logp"] = batch["sampler_logp"] - 1.0
        trainer.step_fn.add_behaviour(batch)
        behav = np.asarray(batch["behav_logp"])[0, :, :3]
        assert "stale" not in batch and behav[0].tolist() == [-0.5] * 3 and behav[1].tolist() == [-1.5] * 3


def test_eta_1_on_the_engine_swaps_weights_in_through_its_thread_and_stamps_groups_within_the_bound(
        tiny_tokenizer, tmp_path):
    """collect.sampler=engine at eta=1: the loop's worker is the engine's, each step's weights
    reach it through the worker's thread (stamped with the step), every group carries the
    version of the oldest weights it depends on, none is more than eta steps old, and the
    sampler's counters and busy fraction come from the engine worker."""
    import jax

    from actionopd_jax.collect.async_scheduler import EngineVersions
    from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
    from actionopd_jax.engine import Engine, EngineConfig
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.sources import Policy

    tasks = [toy_task(f"e{i}", f"real{i}") for i in range(16)]
    with serve(teacher_backend(Script(teacher={}, student={})), judge_backend()) as server:
        cfg = _cfg(tmp_path, "engine", **{"collect.sampler": "engine", "collect.concurrency": 2,
                                          "collect.max_prompt_tokens": 384, "collect.task_starts_per_step": 2,
                                          "collect.max_decisions": 1})
        source = _source(cfg, tmp_path, tiny_tokenizer, server, tasks, None, fixed_student=False, per_step=2)
        assert isinstance(source.sampling, EngineVersions) and isinstance(source.sampler, Engine)
        # an engine of fewer programs than the config's (one segment program, short prefill chunks):
        # compiling them is most of this test's time on a CPU
        built, loads = source.sampler, []
        engine = Engine(None, built.cfg, eos_ids=built.eos_ids.tolist(), dtype=str(built.dtype),
                        config=EngineConfig(slots=4, page_size=16, max_len=400, chunk=128, prefill_lanes=2, segment=8,
                                            pages=2 * 25 + 1))
        source.sampler = engine
        source.collector.sample_fn = EngineSampling(engine, source.collector.sample_fn.settings)
        load = engine.load_policy

        def spy(*args, version=None, **kwargs):
            loads.append((version, threading.current_thread().name))
            return load(*args, version=version, **kwargs)

        engine.load_policy = spy
        trainer = Trainer(cfg, run_dir=cfg.run.dir, source=source)
        params = trainer.state["params"]
        try:
            for step in range(3):   # each step's own weights (what an update would make)
                policy = Policy(trainer.graphdef, jax.tree.map(lambda x: x * (1 + 0.01 * step), params),
                                trainer.qcfg, step)
                groups = source.collect(step, policy)
                assert groups and all(0 <= step - g.policy_version <= 1 for g in groups)
                assert {g.task_id for g in groups} <= {f"e{2 * step + i}" for i in range(2)}
                assert isinstance(source.scheduler.worker, EngineWorker) and source.scheduler.running
                assert source.last.metrics.sampler_calls > 0 and source.last.metrics.sampler_states > 0
                m = source.metrics()
                assert sum(m[f"async/staleness_{a}"] for a in (0, 1)) == sum(g.retained for g in groups)
                assert 0 < m["async/sampler_busy_frac"] <= 1 and m["async/stale_dropped"] == 0
        finally:
            source.close()
            trainer.close()
        # stamped with the step; the first before the loop runs (here), the others on the engine's thread
        assert [v for v, _ in loads] == [0, 1, 2]
        assert loads[0][1] == threading.current_thread().name and {t for _, t in loads[1:]} == {"engine"}
        assert engine.version == 2 and not _alive()


def test_the_samplers_copy_never_shares_memory_with_the_donated_parameters():
    """A reshard to the same sharding (what rollout_params may do on one CPU process) returns a
    new Array object over the same buffer: the copy must see through it, or the update's
    donation deletes the sampler's weights under it."""
    import jax
    import jax.numpy as jnp

    from actionopd_jax.collect.async_source import own_copy

    donated = {"w": jnp.arange(16.0).reshape(4, 4), "b": jnp.zeros(3)}
    view = jax.device_put(donated["w"], donated["w"].sharding)
    assert view is not donated["w"] and view.unsafe_buffer_pointer() == donated["w"].unsafe_buffer_pointer()
    fresh = jnp.ones(2)
    out = own_copy({"w": view, "b": donated["b"], "c": fresh}, donated)
    assert out["w"].unsafe_buffer_pointer() != donated["w"].unsafe_buffer_pointer()
    assert out["b"].unsafe_buffer_pointer() != donated["b"].unsafe_buffer_pointer()
    assert out["c"] is fresh    # not the donated memory: kept as it is
    assert (out["w"] == donated["w"]).all()
