"""Collector benchmark: the async schedule against its critical path and a naive loop.

    python benchmarks/collector.py                       # 16 trajectories x 5 decisions, 200 ms teacher/judge
    python benchmarks/collector.py --trajectories 32 --decisions 4 --json out.json

Set-up (all real parts): a teacher and an LLM judge behind our OpenAI-compatible loopback
server, each answering after an injected latency (default 200 ms per call); the real `openai`
client, Matcher and judge; the real on-device Sampler with a tiny random Qwen3 student
(preset "tiny") and an offline tiny tokenizer; a small deterministic environment (below) that
continues for a fixed number of decisions. The teacher always replies with a message, the
student's random text parses as a message too (truncated replies count as actions here), so
every state needs the judge: per state one teacher call, then judge calls, in sequence.

Reported:
- wall time of the async collection;
- critical path = max(total sampler busy time, the longest per-trajectory teacher -> judge
  chain): no schedule can finish faster; the ratio wall / critical path (target <= 1.25);
- the naive sequential loop (teacher, then student, then matcher, per state, one trajectory
  at a time) on the same task starts and keys, and whether both produced the same groups.
Compilation is excluded: every shape bucket is compiled before timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.collect import Collector, CollectorConfig, SamplingSettings, sampler_fn
from actionopd_jax.collect.naive import collect_sequential
from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.model import PRESETS, Qwen3
from actionopd_jax.rewards import RewardConfig
from actionopd_jax.sampling import Buckets, Sampler
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.types import Action, Message, Observation, Task, ToolCall

NOTE_TOOL = {"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class ChatterEnv:
    """Each decision appends the assistant turn and a user follow-up; the episode runs until
    the collector's decision limit."""

    name = "chatter"

    async def reset(self, task: Task) -> Observation:
        self.messages = [{"role": "system", "content": "You are a helpful assistant that keeps notes."},
                         {"role": "user", "content": task.payload["question"]}]
        self.done = False
        return self._obs()

    async def step(self, action: Action) -> tuple[Observation, bool]:
        text = action.text if isinstance(action, Message) else ""
        if isinstance(action, ToolCall):
            text = f"(called {action.name})"
        self.messages.append({"role": "assistant", "content": text[:200]})
        self.messages.append({"role": "user", "content": f"Thanks. Next item, please ({len(self.messages)})."})
        return self._obs(), False

    def end(self, reason: str) -> Observation:
        self.done = True
        return self._obs()

    def score(self) -> dict[str, Any]:
        return {"reward": 0.0, "end_reason": "limit"}

    def _obs(self) -> Observation:
        return Observation(messages=[dict(m) for m in self.messages], tools=[NOTE_TOOL], done=self.done)


def _latency_backend(name: str, latency_s: float, text: str) -> ScriptedBackend:
    async def reply(req):
        await asyncio.sleep(latency_s)
        return message_choice(text)

    return ScriptedBackend(name, reply)


def _groups_equal(a, b) -> bool:
    if len(a.groups) != len(b.groups) or a.group_starts != b.group_starts:
        return False
    for ga, gb in zip(a.groups, b.groups):
        fields = ("decision_index", "committed_index", "drop_reason")
        if [getattr(ga, f) for f in fields] != [getattr(gb, f) for f in fields]:
            return False
        for ca, cb in zip(ga.candidates, gb.candidates):
            if not np.array_equal(ca.token_ids, cb.token_ids) or ca.reward != cb.reward or ca.verdicts != cb.verdicts:
                return False
            if not np.allclose(ca.logprobs, cb.logprobs, atol=1e-4):
                return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--decisions", type=int, default=5)
    p.add_argument("--latency-ms", type=float, default=200.0, help="teacher and judge latency per call")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--states-per-call", type=int, default=0, help="max states in one device call (0: all)")
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--json", default="", help="also write the numbers here")
    args = p.parse_args()

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/actionopd_jax/jax_bench_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    tok_dir = build_tiny_tokenizer(os.path.join(tempfile.gettempdir(), "actionopd_bench_tiny_tokenizer"))
    tokenizer = load_tokenizer(tok_dir)
    eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    qcfg = PRESETS["tiny"]
    model = Qwen3(qcfg, rngs=nnx.Rngs(params=args.seed))
    t = args.trajectories
    prompts_buckets = tuple(2 ** i for i in range((max(t, 1) - 1).bit_length() + 1))  # 1, 2, 4, ... >= t
    buckets = Buckets(prompt_len=(512, 1024), prompts=prompts_buckets, samples=(args.n,),
                      max_new=(args.max_new_tokens,), max_rows=prompts_buckets[-1] * args.n)
    sampler = Sampler(model, qcfg, eos_ids=[eos], buckets=buckets)
    settings = SamplingSettings(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    sample = sampler_fn(sampler, settings)

    t0 = time.perf_counter()
    for n_prompts in prompts_buckets:  # compile every bucket before timing
        for length in (300, 700):
            sample([np.full(length, 7, np.int32)] * n_prompts, [jax.random.key(i) for i in range(n_prompts)])
    compile_s = time.perf_counter() - t0

    latency = args.latency_ms / 1000.0
    server = OpenAIServer([_latency_backend("teacher", latency, "Let me note that down."),
                           _latency_backend("judge", latency, "Different wording and content.\nVERDICT: NO_MATCH")])
    base_url = server.start()
    retry = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2, max_total_s=60.0)
    teacher = OpenAITeacher(OpenAITeacherConfig(model="teacher", base_url=base_url, provider="vllm", api_key_env=None,
                                                request_timeout_s=30.0, retry=retry, max_concurrency=64),
                            rng=random.Random(0))
    judge = LLMJudge(JudgeConfig(model="judge", base_url=base_url, provider="vllm", api_key_env=None,
                                 request_timeout_s=30.0, retry=retry, max_concurrency=64), rng=random.Random(0))
    cfg = CollectorConfig(seed=args.seed, n=args.n, reward=RewardConfig(k=args.k, lam=0.5),
                          max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                          enable_thinking=False, truncated_is_invalid=False, max_prompt_tokens=1024,
                          max_trajectories_in_flight=t, max_states_per_call=args.states_per_call or t,
                          decision_limits=(("chatter", args.decisions),), progress=False)
    tasks = [Task(task_id=f"bench-{i}", env="chatter", payload={"question": f"Please keep notes on item {i}."})
             for i in range(t)]

    def collector() -> Collector:
        # A fresh matcher per run: its in-memory verdict reuse must not carry over.
        return Collector(cfg, tokenizer=tokenizer, teacher=teacher, matcher=Matcher(judge), sample_fn=sample,
                         eos_ids=[eos], env_factory=lambda task: ChatterEnv())

    async def both():
        # One event loop for both runs: the HTTP clients stay bound to it.
        starts = list(enumerate(tasks))
        fast = await collector().collect_async(starts, step=1, progress=False)
        naive = None if args.skip_naive else await collect_sequential(collector(), starts, step=1)
        return fast, naive

    try:
        compiled_before = sampler.compile_count
        fast, naive = asyncio.run(both())
        compiled_during = sampler.compile_count - compiled_before
    finally:
        server.stop()

    m = fast.metrics
    out = {
        "trajectories": t, "decisions_per_trajectory": args.decisions, "n": args.n, "k": args.k,
        "teacher_and_judge_latency_ms": args.latency_ms, "max_new_tokens": args.max_new_tokens,
        "devices": str(jax.devices()[0].platform), "compile_s_excluded": round(compile_s, 2),
        "programs_compiled_during_timing": compiled_during,
        "groups": len(fast.groups),
        "async_wall_s": round(m.wall_s, 3),
        "sampler_busy_s": round(m.sampler_busy_s, 3),
        "sampler_calls": m.sampler_calls,
        "states_per_sampler_call": round(m.sampler_states / max(m.sampler_calls, 1), 2),
        "longest_teacher_matcher_chain_s": round(m.longest_chain_s, 3),
        "chain_teacher_part_s": round(max(fast.trajectories, key=lambda r: r.external_chain_s).teacher_s, 3),
        "chain_matcher_part_s": round(max(fast.trajectories, key=lambda r: r.external_chain_s).matcher_s, 3),
        "critical_path_s": round(m.critical_path_s, 3),
        "wall_over_critical_path": round(m.wall_s / m.critical_path_s, 3),
        "teacher_http_calls": m.teacher.http_calls,
        "judge_calls": m.matcher.get("judge_calls", 0),
    }
    if naive is not None:
        out.update(naive_wall_s=round(naive.metrics.wall_s, 3),
                   naive_sampler_busy_s=round(naive.metrics.sampler_busy_s, 3),
                   speedup_vs_naive=round(naive.metrics.wall_s / m.wall_s, 2),
                   same_groups_as_naive=_groups_equal(fast, naive))
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
