"""The matcher's execution stage (issue 45) inside real collection steps: the share of a
step's pairs each stage decides, the judge calls it saves, fork latency, and the step's wall
clock, with `matcher.execution` auto against off on the same tasks.

    python benchmarks/execution_step.py [--steps 2] [--student scripted|tiny] [--json OUT]

What is real: the Collector, the AWM mini pool (tests/data/awm_mini: contained MCP servers
over SQLite, each fork a server on a copy of the episode's database) and the EnvScaler mini
pool (sandboxed class processes, each fork a copy of the state), drawn by the mixture stream;
the teacher is the privileged reference server and the judge a stand-in LLM server, both
OpenAI-compatible HTTP on 127.0.0.1 through the real `openai` client. The stand-in judge says
MATCH when the two calls' texts agree ignoring case, so its verdicts are not a real judge's:
only the number of calls it gets, and the loopback latency of each, are measured here (a real
judge's latency per call would be added to every call execution saves).

Students: `scripted` writes, at every state, [the reference call with its strings in lower
case, the reference call with its first argument off (a string extended, a number +1), a
message, an unparsable reply], so each state has two same-name pairs per teacher sample for the
stages after the rules; `tiny` is the random-init tiny Qwen3 through the real sampler (what a
step-0 student writes: almost never a parsable call, so nearly every pair ends at the rules).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU measurement: no accelerator plugin probing

DATA = ROOT / "tests" / "data"
ES, AWM = DATA / "envscaler_mini", DATA / "awm_mini"
HELD_OUT = ("mini_locker_2", "mini_clinic_2", "mini_clinic_3")  # as tests/test_collect_envscaler.py
AWM_SQL = ("recipe_box_2/3", "gym_classes_3/3")  # verified by SQL + judge: kept out, as there


def env_config(tmp: Path, mixture: tuple[str, ...] = ("awm:2", "envscaler:2")):
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.layout import load_awm
    from actionopd_jax.envs.envscaler.layout import load_envscaler

    manifest = tmp / "admitted.json"
    manifest.write_text(json.dumps({"pools": {
        "envscaler": {"admitted": sorted(t.task_id for t in load_envscaler(ES).tasks())},
        "awm": {"dir": str(AWM), "admitted": sorted(t.task_id for t in load_awm(AWM).tasks()),
                "heldout": list(AWM_SQL)}}}))
    return EnvConfig(name="awm", awm_dir=str(AWM), envscaler_dir=str(ES), manifest=str(manifest),
                     mixture=mixture, heldout_task_ids=HELD_OUT, mcp_pool_size=2)


def rewritten(call):
    """The same call with its string arguments in lower case."""
    from actionopd_jax.types import ToolCall

    return ToolCall(call.name, {k: v.lower() if isinstance(v, str) else v for k, v in call.arguments.items()})


def one_off(call):
    """The same call with its first string or number argument changed."""
    from actionopd_jax.types import ToolCall

    args = dict(call.arguments)
    for k, v in args.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, str):
            args[k] = v + " X"
            break
        if isinstance(v, (int, float)):
            args[k] = v + 1
            break
    return ToolCall(call.name, args)


def scripted_student(tokenizer, tasks, eos):
    """The tests' scripted student with two rewrites of each reference call first: one that
    executes the same, one that does not."""
    from actionopd_jax.types import ToolCall
    from tests.test_collect_envscaler import scripted_student as student

    return student(tokenizer, tasks, eos,
                   first=lambda ref: [rewritten(ref), one_off(ref)] if isinstance(ref, ToolCall) else [ref, ref])


def _section(prompt: str, head: str) -> str:
    part = prompt.split(head, 1)[-1] if head in prompt else ""
    return part.split("\n## ", 1)[0].strip()


def standin_judge():
    """MATCH when Call A and Call B read the same ignoring case (a stand-in, see the docstring)."""
    from actionopd_jax.serve.scripted import ScriptedBackend, message_choice

    def reply(req):
        prompt = req.messages[-1]["content"]
        same = _section(prompt, "## Call A").lower() == _section(prompt, "## Call B").lower()
        return message_choice("VERDICT: MATCH" if same else "VERDICT: NO_MATCH")

    return ScriptedBackend("judge", reply)


def stage_counts(stats: dict) -> dict:
    """Pairs per deciding stage, from MatcherStats.as_dict()."""
    rules = stats["invalid_or_cross_kind"] + stats["name_mismatch"] + stats["programmatic_match"]
    execution = stats["execution_match"] + stats["execution_no_match"]
    return {"pairs": stats["pairs"], "rules": rules, "execution": execution,
            "judge": stats["pairs"] - rules - execution,
            "judge_calls": stats["judge_calls"], "judge_reused": stats["judge_reused"],
            "saved": stats["judge_calls_saved"], "forks": stats["execution_forks"]}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _env_tagging_matcher():
    """A Matcher that also notes which environment each fork run's time belongs to."""
    from actionopd_jax.matching.matcher import Matcher

    class EnvTagged(Matcher):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.fork_s_by_env: dict[str, list[float]] = {}
            self.abstained: dict[str, int] = {}  # why execution left a question to the judge

        async def _execute(self, candidates, teacher_actions, messages, fork):
            executed = await super()._execute(candidates, teacher_actions, messages, fork)
            if executed is not None:  # the group's environment, noted by match_group below
                self.fork_s_by_env.setdefault(getattr(fork, "env_name", "?"), []).extend(executed.fork_s)
                for why in executed.abstained.values():  # digits out: one line per kind of reason
                    why = re.sub(r"\d+", "N", str(why))[:90]
                    self.abstained[why] = self.abstained.get(why, 0) + 1
            return executed

        async def match_group(self, candidates, teacher_actions, *, env=None, fork=None, **kw):
            if fork is not None:  # tag the fork callable with the environment (per group, no shared state)
                async def tagged(live=fork):
                    return await live()
                tagged.env_name = (env or "?").split("/")[0]  # the pool, not the scope
                fork = tagged
            return await super().match_group(candidates, teacher_actions, env=env, fork=fork, **kw)

    return EnvTagged


def run_steps(mode: str, steps: int, student: str, tokenizer, env_cfg, sample_fn_for) -> list[dict]:
    """`steps` collection steps (fresh tasks each, the same draw for either mode)."""
    from actionopd_jax.collect import Collector
    from actionopd_jax.envs.mixture import mixture_stream_from
    from actionopd_jax.envs.registry import pool_env_factory
    from actionopd_jax.matching.execution import ExecutionStage
    from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
    from tests._collect_fixtures import collect_once, collector_config, make_teacher, serve
    from tests.test_matching_judge import make_judge

    Matcher = _env_tagging_matcher()
    per_step = sum(int(m.split(":")[1]) for m in env_cfg.mixture)
    stream = mixture_stream_from(env_cfg, per_step=per_step, seed=3)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    n = 4 if student == "scripted" else 2
    cfg = collector_config(n=n, max_prompt_tokens=4096 if student == "scripted" else 2048, max_new_tokens=64 if student == "scripted" else 16,
                           env_timeout_s=60.0, teacher_timeout_s=60.0, matcher_timeout_s=120.0,
                           decision_limits=(("envscaler", 8), ("awm", 8)))
    rows = []
    with serve(ReferenceBackend(stream.tasks)) as teacher_server, serve(standin_judge()) as judge_server:
        for step in range(steps):
            tasks = stream.next_step()
            matcher = Matcher(make_judge(judge_server, request_timeout_s=60.0),
                              execution=ExecutionStage() if mode == "auto" else None)
            collector = Collector(cfg, tokenizer=tokenizer,
                                  teacher=make_teacher(teacher_server, model=MODEL_NAME, provider="actionopd",
                                                       request_timeout_s=60.0),
                                  matcher=matcher, eos_ids=[eos], env_factory=pool_env_factory(env_cfg),
                                  sample_fn=sample_fn_for(stream.tasks, cfg))
            before = judge_server.request_count
            t0 = time.perf_counter()
            result = collect_once(collector, tasks, step=step, process_index=0, process_count=1)
            wall = time.perf_counter() - t0
            row = stage_counts(result.metrics.matcher)
            row.update(mode=mode, step=step, wall_s=wall, judge_requests=judge_server.request_count - before,
                       groups=len(result.groups), fork_s=list(matcher.fork_latencies_s),
                       envs=sorted({t.env for t in tasks}), fork_s_by_env=matcher.fork_s_by_env,
                       end_reasons=sorted(r.end_reason for r in result.trajectories), abstained=matcher.abstained)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Per mode: pairs per stage, judge calls per step, forks and their p50/p99, wall per step."""
    lines = [f"{'execution':9} {'steps':>5} {'pairs':>6} {'rules':>6} {'exec':>6} {'judge':>6} "
             f"{'judge calls/step':>16} {'saved/step':>10} {'forks':>6} {'fork p50 ms':>11} {'fork p99 ms':>11} "
             f"{'wall s/step':>11}"]
    summary = {}
    for mode in ("off", "auto"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        tot = {k: sum(r[k] for r in mine) for k in ("pairs", "rules", "execution", "judge", "judge_calls", "saved", "forks")}
        fork_s = [t for r in mine for t in r["fork_s"]]
        k = len(mine)
        summary[mode] = (tot["judge_calls"] / k, sum(r["wall_s"] for r in mine) / k)
        lines.append(f"{mode:9} {k:5d} {tot['pairs']:6d} {tot['rules']:6d} {tot['execution']:6d} {tot['judge']:6d} "
                     f"{tot['judge_calls'] / k:16.1f} {tot['saved'] / k:10.1f} {tot['forks']:6d} "
                     f"{percentile(fork_s, 50) * 1e3:11.1f} {percentile(fork_s, 99) * 1e3:11.1f} "
                     f"{summary[mode][1]:11.2f}")
    auto = [r for r in rows if r["mode"] == "auto"]
    for env in sorted({e for r in auto for e in r["fork_s_by_env"]}):
        times = [t for r in auto for t in r["fork_s_by_env"][env]]
        lines.append(f"  forks on {env}: {len(times)}, p50 {percentile(times, 50) * 1e3:.1f} ms, "
                     f"p99 {percentile(times, 99) * 1e3:.1f} ms")
    reasons: dict[str, int] = {}
    for r in auto:
        for why, n in r.get("abstained", {}).items():
            reasons[why] = reasons.get(why, 0) + n
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"  left to the judge ({n} distinct questions): {why}")
    if "off" in summary and "auto" in summary:
        (off_calls, off_wall), (on_calls, on_wall) = summary["off"], summary["auto"]
        saved = f"{1 - on_calls / off_calls:.0%} saved" if off_calls else "none to save"
        lines.append(f"judge calls per step: off {off_calls:.1f} -> auto {on_calls:.1f} ({saved}); "
                     f"wall per step: off {off_wall:.2f} s -> auto {on_wall:.2f} s ({on_wall - off_wall:+.2f} s)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--student", choices=("scripted", "tiny"), default="scripted")
    ap.add_argument("--mixture", default="awm:2,envscaler:2", help="pools and tasks per step")
    ap.add_argument("--json", default="", help="also write the per-step rows here")
    args = ap.parse_args()
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="exec-step-") as tmp:
        tmp = Path(tmp)
        tokenizer = load_tokenizer(build_tiny_tokenizer(tmp / "tok"))
        env_cfg = env_config(tmp, tuple(args.mixture.split(",")))
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if args.student == "scripted":
            def sample_fn_for(tasks, cfg):
                return scripted_student(tokenizer, tasks, eos)
        else:
            from actionopd_jax.sampling import Buckets, Sampler
            from tests._collect_fixtures import real_sample_fn
            from tests._sampler_fixtures import random_model

            model = random_model(0, vocab_size=len(tokenizer), max_position_embeddings=4096)
            sampler = Sampler(model, eos_ids=[eos], buckets=Buckets(prompt_len=(2048,), prompts=(4,), samples=(2,),
                                                                    max_new=(16,), max_rows=8))

            def sample_fn_for(tasks, cfg):
                return real_sample_fn(sampler, cfg)
        rows = []
        for mode in ("off", "auto"):
            rows += run_steps(mode, args.steps, args.student, tokenizer, env_cfg, sample_fn_for)
    print(f"student: {args.student}; pools (tasks a step): {args.mixture}; teacher: reference server; "
          "judge: stand-in server on 127.0.0.1")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
