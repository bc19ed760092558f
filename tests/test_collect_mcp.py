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
