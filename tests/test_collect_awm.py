"""The AWM pool end to end: a collection step of a tiny random Qwen3 student over mini AWM
tasks drawn from the admission manifest, with the privileged reference teacher and the judge
on a real OpenAI-compatible server on 127.0.0.1, matcher evidence read from the warmed servers;
and `actionopd eval` on the manifest's held-out tasks printing the verifier's success."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from actionopd_jax.collect.collector import CollectResult
from actionopd_jax.collect.metrics import StepMetrics
from actionopd_jax.config import EnvConfig, MatcherConfig
from actionopd_jax.config.load import load_config
from actionopd_jax.envs.awm.factory import awm_env_factory
from actionopd_jax.envs.task_sets import task_stream_from, training_task_sets, training_tasks_summary
from actionopd_jax.matching.build import build_matcher, tool_evidence_from
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Invalid, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (collect_once, collector_config, launchers_of_this_process, make_teacher,
                                    real_sample_fn, serve)

AWM = Path(__file__).parent / "data" / "awm_mini"
HELDOUT = ["gym_classes_3/1", "library_loans_1/3", "recipe_box_2/3"]  # recipe_box_2/3: SQL + judge


@pytest.fixture()
def manifest(tmp_path) -> Path:
    from actionopd_jax.envs.awm.layout import load_awm

    ids = [t.task_id for t in load_awm(AWM).tasks()]
    path = tmp_path / "admitted.json"
    path.write_text(json.dumps({"pools": {"awm": {"dir": str(AWM), "admitted": ids, "heldout": HELDOUT,
                                                  "verifier_modes": {"recipe_box_2/3": "sql",
                                                                     "gym_classes_3/3": "sql"}}}}))
    return path


def judge_backend() -> ScriptedBackend:
    """The run's judge: the matcher's verdict format, or the AWM verifier's JSON classification
    (complete when the quickest japanese recipe became a favourite)."""
    def reply(req):
        if "You grade whether an AI agent completed a task" in req.messages[0]["content"]:
            facts = json.loads(req.messages[-1]["content"])["check_output"]
            done = facts["quickest_japanese_recipe"] in facts["favourite_titles"]
            return message_choice(json.dumps({"classification": "complete" if done else "incomplete",
                                              "reasoning": "facts"}))
        return message_choice("VERDICT: NO_MATCH")

    return ScriptedBackend("judge", reply)


def test_training_draws_admitted_tasks_never_the_heldout_split_and_check_says_so(manifest):
    cfg = load_config(None, ["env.name=awm", f"env.awm_dir={AWM}", f"env.manifest={manifest}"])
    [(name, tasks)] = training_task_sets(cfg.env, needed_by="t")
    assert name == "awm:admitted" and len(tasks) == 12 and not {t.task_id for t in tasks} & set(HELDOUT)
    stream = task_stream_from(cfg.env, per_step=64, seed=0)
    drawn = {t.task_id for _ in range(3) for t in stream.next_step()}
    assert drawn <= {t.task_id for t in tasks} and len(drawn) == 12  # 192 draws with replacement hit all 12
    pools, warning = training_tasks_summary(cfg.env, needed_by="t").splitlines()
    assert pools == "pools      awm 12 admitted (1/step), 3 held out for eval; drawn with replacement"
    # an unscreened pool is never trained on without a word (issue 43 item 5)
    assert warning.startswith("warning: training on tasks the paper's B.1 feasibility screen has not kept")


def test_check_validates_the_awm_settings_and_prints_the_pool_sizes(manifest, tmp_path):
    """What `actionopd train --check` runs for the collection (baselines.wiring.check_collection,
    collect.source.check_training_tasks): the pool loads, the manifest matches it; nothing starts."""
    from actionopd_jax.baselines.wiring import check_collection
    from actionopd_jax.collect.source import check_training_tasks
    from actionopd_jax.config import ConfigError

    base = ["experiment.enabled=false", "collect.kind=actionopd", "teacher.kind=openai", "teacher.provider=vllm",
            "teacher.model=t",
            "teacher.base_url=http://127.0.0.1:9/v1", "matcher.kind=rules", "env.name=awm", f"env.awm_dir={AWM}"]
    cfg = load_config(None, base + [f"env.manifest={manifest}"])
    check_collection(cfg)
    assert check_training_tasks(cfg).splitlines()[0] == \
        "pools      awm 12 admitted (1/step), 3 held out for eval; drawn with replacement"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"pools": {"awm": {"admitted": ["library_loans_1/0", "e_commerce_33/4"]}}}))
    for bad, words in ((f"env.manifest={other}", "not in env.awm_dir"),
                       (f"env.manifest={tmp_path / 'missing.json'}", "not readable as an admission manifest"),
                       ("env.manifest=", "reads the admitted tasks from env.manifest")):
        with pytest.raises(ConfigError, match=words):
            check_training_tasks(load_config(None, base + [bad]))
    with pytest.raises(ConfigError, match="cannot load it as an (AWM|awm) pool"):
        check_collection(load_config(None, base + [f"env.manifest={manifest}", f"env.awm_dir={tmp_path}"]))


def test_a_tiny_model_collection_step_over_awm_with_the_reference_teacher(tiny_tokenizer, manifest, tmp_path):
    from tests._sampler_fixtures import random_model

    from actionopd_jax.collect import Collector
    from actionopd_jax.sampling import Buckets, Sampler

    env = EnvConfig(name="awm", awm_dir=str(AWM), manifest=str(manifest), mcp_pool_size=4)
    # bike_rental_4: the published FastAPI form, served over MCP / streamable HTTP
    tasks = [t for t in task_stream_from(env, per_step=4, seed=1).tasks
             if t.task_id in ("library_loans_1/0", "recipe_box_2/2", "gym_classes_3/0", "bike_rental_4/0")]
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # one decision per episode: the first state's prompt (system, task, tool schemas) fits 1024 tokens
    cfg = collector_config(n=2, max_new_tokens=8, max_prompt_tokens=1024, decision_limits=(("awm", 1),),
                           env_timeout_s=60.0, teacher_timeout_s=60.0)
    model = random_model(0, vocab_size=len(tiny_tokenizer), max_position_embeddings=1024)
    sampler = Sampler(model, eos_ids=[eos], buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(2,),
                                                            max_new=(8,), max_rows=8))
    with serve(ReferenceBackend(tasks), judge_backend()) as server:
        make = awm_env_factory(env, judge={"base_url": server.base_url, "model": "judge"},
                               cache_dir=str(tmp_path / "db"))
        try:
            m = MatcherConfig(model="judge", base_url=server.base_url)
            evidence = tool_evidence_from(m, tasks, make)  # warms one server per scenario
            assert set(evidence) == {"awm/library_loans_1", "awm/recipe_box_2", "awm/gym_classes_3", "awm/bike_rental_4"}
            matcher = build_matcher({"provider": "vllm", "model": "judge", "base_url": server.base_url, "api_key_env": None},
                                    evidence_by_env=evidence)
            collector = Collector(cfg, tokenizer=tiny_tokenizer, teacher=make_teacher(server, model=MODEL_NAME),
                                  matcher=matcher, eos_ids=[eos], env_factory=make,
                                  sample_fn=real_sample_fn(sampler, cfg))
            result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
            starts = make.runtime.pool.stats.starts
        finally:
            make.close()
    assert starts == 4  # the episodes ran on the warmed servers
    assert len(result.trajectories) == 4
    first_call = {"library_loans_1/0": "search_books", "recipe_box_2/2": "create_recipe",
                  "gym_classes_3/0": "list_classes", "bike_rental_4/0": "list_stations"}
    for rec in result.trajectories:
        assert rec.score["verifier_mode"] == "code" and rec.score["verdict"] in ("complete", "others")
        assert rec.score["reward"] == (1.0 if rec.score["verdict"] == "complete" else 0.0)
    for g in result.groups:
        # the reference teacher's K samples: the task's first reference call, through real HTTP
        assert [s.action.name for s in g.teacher_samples] == [first_call[g.task_id]] * 3
        assert all(isinstance(s.action, ToolCall) for s in g.teacher_samples)
        assert len(g.candidates) == 2 and 600 < g.prompt_ids.size <= 1024  # tool schemas are in the prompt
        # an unparsable reply of the random student is invalid: -1; a valid one without a match: 0
        assert all(c.reward == (-1.0 if isinstance(c.action, Invalid) else c.reward) for c in g.candidates)
    assert {g.task_id for g in result.groups} == set(first_call)


def test_eval_on_the_heldout_tasks_prints_verifier_success(manifest, tmp_path, capsys):
    from actionopd_jax.eval.cli import main

    with serve(judge_backend()) as server:
        code = main(["--reference", "--bench", "awm:heldout", "--manifest", str(manifest), "--judge-url",
                     server.base_url, "--judge-model", "judge", "--trials", "1", "--out", str(tmp_path / "out"),
                     "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    # the evaluation's AWM servers ended with it, not at this process's exit
    assert launchers_of_this_process() == []
    assert "| benchmark | group | episodes | success |" in out.splitlines()[0].replace(" pass^1 | reward |", "")
    assert "| awm | heldout | 3 | 100.0 |" in out
    records = [json.loads(line) for line in (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in records) == HELDOUT
    assert {r["task_id"]: r["score"]["verifier_mode"] for r in records}["recipe_box_2/3"] == "sql"
    assert all(r["score"]["success"] and r["score"]["verdict"] == "complete" for r in records)
    # no manifest: a clear error, not a traceback
    assert main(["--reference", "--bench", "awm", "--out", str(tmp_path / "o2")]) == 2
    assert "awm:heldout reads the admission manifest: pass --manifest" in capsys.readouterr().err


def test_the_runs_source_builds_awm_episodes_with_judge_evidence_and_a_warm_pool(manifest, tmp_path, tiny_tokenizer,
                                                                                  monkeypatch):
    """collect.kind=actionopd over env.name=awm (collect/source.py): the environment factory comes
    from env.*, its SQL verifier judge is the run's matcher endpoint, the matcher's evidence is
    read per scenario from the servers, and each step's drawn scenarios are warm before it."""
    from actionopd_jax.collect import ActionOPDGroupSource
    from actionopd_jax.envs.awm.runtime import AwmRuntime
    from actionopd_jax.sampling import Buckets
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    before = set(launchers_of_this_process())
    with serve(judge_backend()) as server:
        cfg = load_config(None, [
            "experiment.enabled=false", "collect.kind=actionopd", "collect.concurrency=3", "model.preset=tiny",
            "collect.task_starts_per_step=3", "teacher.kind=openai", "teacher.provider=actionopd",
            f"teacher.model={MODEL_NAME}",
            f"teacher.base_url={server.base_url}", f"matcher.base_url={server.base_url}", "matcher.model=judge",
            "matcher.provider=actionopd",
            "env.name=awm", f"env.awm_dir={AWM}", f"env.manifest={manifest}", f"run.dir={tmp_path / 'run'}"])
        ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path / "run"), tokenizer_path="",
                            process_index=0, process_count=1, mesh=build_mesh(cfg))
        source = ActionOPDGroupSource(cfg, ctx, tokenizer=tiny_tokenizer,
                                      buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,), max_new=(16,),
                                                      max_rows=16))
        make = source.collector.env_factory
        try:
            runtime = make.runtime
            assert isinstance(runtime, AwmRuntime) and runtime.pool_size == 3
            assert runtime.judge is not None and runtime.judge.model == "judge"
            assert runtime.modes["recipe_box_2/3"] == "sql"
            evidence = source.collector.matcher.evidence_by_env
            assert set(evidence) == {"awm/library_loans_1", "awm/recipe_box_2", "awm/gym_classes_3", "awm/bike_rental_4"}
            assert "def borrow_book" in evidence["awm/library_loans_1"]["borrow_book"]
            # the evidence started each of the 4 scenarios once (pool of 3: one was evicted since)
            assert runtime.pool.stats.keys_started.keys() == {"library_loans_1", "recipe_box_2", "gym_classes_3",
                                                              "bike_rental_4"}

            def warm_for_next_step() -> None:
                """The servers of the next step's draws start in the background (the first step's
                while the programs compile, each next one's while the device updates)."""
                upcoming = Counter(t.payload["scenario"] for t in source.stream.peek_step())
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not idle() >= upcoming:
                    time.sleep(0.1)
                assert runtime.pool._protect == set(upcoming) and idle() >= upcoming

            def idle() -> Counter:
                return Counter(runtime.pool.key_of(s) for s in runtime.pool._idle)

            warm_for_next_step()
            # the device collection is replaced here: it is not what this checks
            monkeypatch.setattr("actionopd_jax.collect.source.load_behaviour", lambda *a: None)
            monkeypatch.setattr(source.collector, "collect", lambda tasks, **kw: CollectResult(
                step=0, groups=[], group_starts=[], trajectories=[], metrics=StepMetrics()))
            source.collect(0, None)
            warm_for_next_step()
            assert set(launchers_of_this_process()) - before
        finally:
            source.close()
        # the pools the source built end with it (the trainer closes a source it built)
        assert set(launchers_of_this_process()) <= before
    trained = json.loads((tmp_path / "run" / "train_tasks.json").read_text())["tasks"]
    assert len(trained) == 12 and not {t["task_id"] for t in trained} & set(HELDOUT)
