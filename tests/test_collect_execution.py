"""A real ActionOPD collection step over the AWM + EnvScaler mixture (our mini data: contained
MCP servers, sandboxed class processes) with the matcher's execution stage (issue 45): the
collector hands each live episode's fork point to the matcher, so a student call written
differently from the teacher's (an AWM catalogue search in lower case: SQLite's LIKE ignores the
case, so the rows are the same) is matched by its effect on a fork, where the rules alone would
call it no match. The student is scripted, the teacher is the
privileged reference server. The same over BFCL multi-turn (the real bfcl_eval classes, forks
are deep copies of the episode's instances): a `cd` written with a trailing slash is the same
directory change."""

from __future__ import annotations

from actionopd_jax.collect import Collector
from actionopd_jax.envs.mixture import mixture_stream_from
from actionopd_jax.envs.registry import pool_env_factory
from actionopd_jax.matching.execution import ExecutionStage
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.types import Message, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import collect_once, collector_config, make_teacher, serve
from tests.test_collect_envscaler import env_cfg, scripted_student  # noqa: F401 (fixture)


def _rewritten(action):
    """The same search written in lower case; other actions as they are."""
    if isinstance(action, ToolCall) and action.name == "search_books":
        return ToolCall(action.name, {"title_query": action.arguments["title_query"].lower()})
    return action


def _student(tokenizer, tasks, eos):
    """Candidates [the reference action, searches in lower case; a message; unparsable] at every state."""
    return scripted_student(tokenizer, tasks, eos, first=lambda ref: [_rewritten(ref)])


def test_a_collection_step_matches_rewritten_calls_by_execution(tiny_tokenizer, env_cfg):  # noqa: F811
    stream = mixture_stream_from(env_cfg, per_step=4, seed=3)
    tasks = [t for t in stream.tasks if t.task_id in ("library_loans_1/0", "library_loans_1/3")]
    assert len(tasks) == 2
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=3, max_prompt_tokens=4096, max_new_tokens=64, env_timeout_s=60.0,
                           teacher_timeout_s=60.0, matcher_timeout_s=120.0, decision_limits=(("awm", 8),))
    matcher = Matcher(None, execution=ExecutionStage())  # rules only: without execution, no match
    envs = pool_env_factory(env_cfg)
    with serve(ReferenceBackend(stream.tasks)) as server:
        try:
            collector = Collector(cfg, tokenizer=tiny_tokenizer,
                                  teacher=make_teacher(server, model=MODEL_NAME, provider="actionopd"),
                                  matcher=matcher, eos_ids=[eos], env_factory=envs,
                                  sample_fn=_student(tiny_tokenizer, stream.tasks, eos))
            result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
        finally:
            envs.close()   # its AWM servers now, not at this worker's exit
    rewritten = [g for g in result.groups if g.candidates[0].action != g.teacher_samples[0].action]
    assert len(rewritten) == 2  # one search per task
    for g in rewritten:
        assert [c.reward for c in g.candidates] == [1.5, 0.0, -1.0] and g.committed_index == 0
    for rec in result.trajectories:  # the committed lower-case searches did not get in the way
        assert rec.score["success"], rec.score
    stats = result.metrics.matcher
    assert stats["execution_match"] == 3 * len(rewritten)  # K=3 teacher samples, one distinct question each
    assert stats["judge_calls_saved"] == len(rewritten) and stats["execution_forks"] >= 2 * len(rewritten)


def _bfcl_student(tokenizer, tasks, eos, openings):
    """Candidates [the reference call, `cd` written with a trailing slash (BFCL strips it, so the
    same directory); a message; unparsable] at every state of a one-turn BFCL task."""
    from actionopd_jax.envs.reference import BFCL_DONE, BFCLReference
    from tests._collect_fixtures import plan_student

    def slash(ref):
        if isinstance(ref, ToolCall) and ref.name == "cd":
            return [ToolCall("cd", {"folder": ref.arguments["folder"] + "/"})]
        return [ref]

    plans = {t.task_id: BFCLReference(t).turns[0] + [Message(BFCL_DONE)] for t in tasks}
    return plan_student(tokenizer, plans, lambda text: next(t for t, o in openings.items() if o in text), eos,
                        first=slash)


def test_a_bfcl_collection_step_matches_a_rewritten_path_by_execution(tiny_tokenizer):  # noqa: F811
    import dataclasses

    from actionopd_jax.collect import default_env_factory
    from actionopd_jax.envs.bfcl_data import bfcl_tasks, load_entry

    # two one-turn BFCL tasks that start with `cd` (base_0: cd, mkdir, mv; base_2: cd, touch)
    tasks = [dataclasses.replace(t, payload={**(t.payload or {}), "max_turns": 1})
             for t in bfcl_tasks(["base"]) if t.task_id in ("multi_turn_base_0", "multi_turn_base_2")]
    assert len(tasks) == 2
    openings = {t.task_id: load_entry(t.task_id)["question"][0][0]["content"][:200] for t in tasks}
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = collector_config(n=3, max_prompt_tokens=12000, max_new_tokens=64, env_timeout_s=60.0,
                           teacher_timeout_s=60.0, matcher_timeout_s=120.0, decision_limits=(("bfcl", 8),))
    matcher = Matcher(None, execution=ExecutionStage())  # rules only: without execution, no match
    with serve(ReferenceBackend(tasks)) as server:
        collector = Collector(cfg, tokenizer=tiny_tokenizer,
                              teacher=make_teacher(server, model=MODEL_NAME, provider="actionopd"),
                              matcher=matcher, eos_ids=[eos], env_factory=default_env_factory(),
                              sample_fn=_bfcl_student(tiny_tokenizer, tasks, eos, openings))
        result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    rewritten = [g for g in result.groups if g.candidates[0].action != g.teacher_samples[0].action]
    assert len(rewritten) == 2  # one `cd` per task
    for g in rewritten:  # matched on forks: same directory, same answer
        assert [c.reward for c in g.candidates] == [1.5, 0.0, -1.0] and g.committed_index == 0
    for rec in result.trajectories:  # the committed `cd .../` led where the reference's did
        assert rec.score["turns_completed"] == 1 and rec.score["reward"] == 1.0, rec.score
    stats = result.metrics.matcher
    assert stats["execution_match"] == 3 * len(rewritten) and stats["execution_abstain"] == 0
    assert stats["judge_calls_saved"] == len(rewritten) and stats["execution_forks"] >= 2 * len(rewritten)
    tool_pairs = sum(isinstance(g.teacher_samples[0].action, ToolCall) for g in result.groups)
    print(f"bfcl step: {len(result.groups)} groups, {tool_pairs} with a tool call, "
          f"{len(rewritten)} decided by execution; fork latencies {sorted(matcher.fork_latencies_s)}")
