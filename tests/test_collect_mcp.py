"""The collector over real sandboxed MCP servers: a server that dies mid-episode ends that
trajectory with the server's own reason, the group already collected at it (its teacher
samples paid for) is kept, and the other trajectory runs to its end."""

import sys

from actionopd_jax.envs.mcp.client import ServerSpec
from actionopd_jax.envs.mcp.env import McpEnv
from actionopd_jax.envs.mcp.pool import McpPool
from actionopd_jax.types import Message, Task, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (Script, collect_once, collector_config, fixed_text_sample_fn, judge_backend,
                                     make_collector, make_matcher, make_teacher, serve, teacher_backend)
from tests.test_env_mcp import NOTES

ADD = ToolCall("add_note", {"text": "x"})
CRASH = ToolCall("crash", {})
DONE = Message("Stored.")
SCRIPT = Script(teacher={("ok", 0): [ADD] * 3, ("ok", 1): [DONE] * 3, ("crash", 0): [CRASH] * 3},
                student={("ok", 0): [ADD] * 4, ("ok", 1): [DONE] * 4, ("crash", 0): [CRASH] * 4})


def test_a_server_dying_mid_episode_ends_only_its_trajectory(tiny_tokenizer):
    tasks = [Task(f"{case}", "mcp", payload={"prompt": f"case={case} store a note",
                                                    "tools": ["add_note", "crash"]}) for case in ("ok", "crash")]
    cfg = collector_config(env_timeout_s=20.0, max_prompt_tokens=4096)
    with McpPool(ServerSpec(command=(sys.executable, NOTES), call_timeout_s=10), size=2, reset="tool:reset_db") as pool, \
            serve(teacher_backend(SCRIPT), judge_backend()) as server:
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos), env_factory=lambda t: McpEnv(pool))
        result = collect_once(collector, tasks, step=0, process_index=0, process_count=1)
    trajs = {r.task_id: r for r in result.trajectories}
    assert trajs["crash"].end_reason == "mcp_connection_lost"
    assert trajs["crash"].score["end_reason"] == "mcp_connection_lost" and trajs["crash"].score["fault"]
    assert trajs["ok"].end_reason == "env_done" and trajs["ok"].score["end_reason"] == "completed"
    crash_groups = [g for g in result.groups if g.task_id == "crash"]
    assert len(crash_groups) == 1 and [s.action for s in crash_groups[0].teacher_samples] == [CRASH] * 3
    assert len([g for g in result.groups if g.task_id == "ok"]) == 2
    assert result.metrics.trajectory_ends["mcp_connection_lost"] == 1


def test_a_generic_mcp_runs_judge_reads_the_servers_tool_evidence(tiny_tokenizer, tmp_path):
    """env.name=mcp: the matcher's evidence is each listed tool's description and input schema
    (the reset tool left out), plus the source env.mcp_tool_sources gives (a file, or inline
    text); the judge, over HTTP, receives it for a judged pair of the real server's tool."""
    import pytest

    from actionopd_jax.config import ConfigError, EnvConfig, MatcherConfig
    from actionopd_jax.envs.registry import env_factory_from
    from actionopd_jax.matching.build import tool_evidence_from
    from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
    from actionopd_jax.matching.matcher import Matcher
    from tests._collect_fixtures import FAST_RETRY

    (tmp_path / "impl").mkdir()
    (tmp_path / "impl" / "add_note.py").write_text("def add_note(text):\n    db.insert(text)  # ADD-NOTE-SOURCE\n")
    sources = tmp_path / "sources.yaml"
    sources.write_text("add_note: impl/add_note.py\nlist_notes: |\n  def list_notes():\n    return rows  # INLINE\n")
    env = EnvConfig(name="mcp", mcp_command=(sys.executable, NOTES), mcp_reset="tool:reset_db", mcp_pool_size=1,
                    mcp_tool_sources=str(sources))
    task = Task("ev", "mcp", payload={"prompt": "case=ev store a note", "tools": ["add_note", "list_notes"]})
    make = env_factory_from(env)
    try:
        evidence = tool_evidence_from(MatcherConfig(), [task], make)["mcp"]
        assert "reset_db" not in evidence and {"add_note", "list_notes", "count-notes"} <= set(evidence)
        assert "ADD-NOTE-SOURCE" in evidence["add_note"] and '"text"' in evidence["add_note"]
        assert "# INLINE" in evidence["list_notes"] and "# implementation" not in evidence["count-notes"]
        other = ToolCall("add_note", {"text": "y"})  # same tool, other arguments: the judge decides
        script = Script(teacher={("ev", 0): [ADD] * 3}, student={("ev", 0): [other] * 4})
        judge = judge_backend()
        with serve(teacher_backend(script), judge) as server:
            matcher = Matcher(LLMJudge(JudgeConfig(model="judge", base_url=server.base_url, provider="vllm",
                                                   api_key_env=None, request_timeout_s=5.0, retry=FAST_RETRY)),
                              evidence_by_env={"mcp": evidence})
            eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
            collector = make_collector(collector_config(decision_limits=(("mcp", 1),), max_prompt_tokens=4096),
                                       tiny_tokenizer, make_teacher(server), matcher,
                                       fixed_text_sample_fn(tiny_tokenizer, script, eos), env_factory=make)
            result = collect_once(collector, [task], step=0, process_index=0, process_count=1)
            collector.close()
        assert result.groups[0].candidates[0].verdicts == ["no_match"] * 3
        assert matcher.stats.missing_evidence == 0 and judge.requests
        assert all("ADD-NOTE-SOURCE" in r.messages[-1]["content"] for r in judge.requests)
    finally:
        make.close()
    sources.write_text("add_note: impl/missing.py\n")
    with pytest.raises(ConfigError, match="tool 'add_note': cannot read its source file .*relative to the mapping"):
        env_factory_from(env)
    sources.write_text("- add_note\n")
    with pytest.raises(ConfigError, match="expected a mapping of tool name -> source file path or source text"):
        env_factory_from(env)
    sources.write_text("nope: |\n  def nope():\n    pass\n")
    make = env_factory_from(env)
    try:
        with pytest.raises(ConfigError, match=r"gives sources for \['nope'\], which the server does not list"):
            make.tool_evidence([task])
    finally:
        make.close()
