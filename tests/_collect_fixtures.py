"""Shared pieces for the collector tests: a small real environment (it implements the
`Environment` protocol and runs real tool logic), a scripted teacher and judge served by our
loopback OpenAI-compatible server (real aiohttp HTTP, real `openai` client), a fixed-text
sample function for hand-built cases, and the tiny real model + sampler for the rest.

Case scripts are keyed by a "case=<name>" label in the task's user message and by the
decision index (number of assistant turns so far), so teacher, judge and the fixed student
all know which hand-built state they are at, whatever the async arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from actionopd_jax.collect import CollectorConfig, Collector, SamplingSettings, sampler_fn
from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.rewards import RewardConfig
from actionopd_jax.sampling import Generation
from actionopd_jax.serve.openai_http import ChatChoice, OpenAIServer
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.teacher.cache import PersistentCache
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.openai_provider import OpenAITeacher, OpenAITeacherConfig
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.types import Action, Message, Observation, Task, ToolCall

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
NOTE_TOOL = {"type": "function", "function": {
    "name": "note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"], "additionalProperties": False}}}
TOOLS = [ADD_TOOL, NOTE_TOOL]
REPROMPT = "Please reply with exactly one tool call or a message."


class ToyEnv:
    """A small arithmetic assistant episode. ToolCall: runs the tool; Message: the episode
    ends; Invalid: an empty assistant turn and a re-prompt. Payload switches inject faults:
    fail_at (raise on that step), hang_at (never answer that step)."""

    name = "toy"

    def __init__(self) -> None:
        self.task: Task | None = None

    async def reset(self, task: Task) -> Observation:
        if task.payload.get("fail_reset"):
            raise RuntimeError("injected reset failure")
        self.task, self.steps, self.done, self.reason = task, 0, False, ""
        self.messages = [{"role": "system", "content": "You are a careful arithmetic assistant."},
                         {"role": "user", "content": task.payload["question"]}]
        self.calls = 0
        return self._obs()

    async def step(self, action: Action) -> tuple[Observation, bool]:
        assert self.task is not None and not self.done
        self.steps += 1
        if self.task.payload.get("fail_at") == self.steps:
            raise RuntimeError("injected environment failure")
        if self.task.payload.get("hang_at") == self.steps:
            await asyncio.sleep(3600)
        await asyncio.sleep(0)  # a real environment yields to the loop
        if isinstance(action, ToolCall):
            call_id = f"call_{self.calls}"
            self.calls += 1
            self.messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}]})
            result = str(action.arguments["a"] + action.arguments["b"]) if action.name == "add" else "noted"
            self.messages.append({"role": "tool", "tool_call_id": call_id, "name": action.name, "content": result})
        elif isinstance(action, Message):
            self.messages.append({"role": "assistant", "content": action.text})
            self.done, self.reason = True, "answered"
        else:
            self.messages.append({"role": "assistant", "content": ""})
            self.messages.append({"role": "user", "content": REPROMPT})
        return self._obs(), self.done

    def end(self, reason: str) -> Observation:
        if not self.done:
            self.done, self.reason = True, reason
        return self._obs()

    def score(self) -> dict[str, Any]:
        return {"reward": 1.0 if self.reason == "answered" else 0.0, "end_reason": self.reason or "running",
                "steps": self.steps}

    def _obs(self) -> Observation:
        return Observation(messages=[dict(m) for m in self.messages], tools=list(TOOLS), done=self.done)


def toy_task(task_id: str, case: str, **payload) -> Task:
    return Task(task_id=task_id, env="toy", payload={"question": f"case={case} What is 2 + 3, then add 1?", **payload})


def case_of(text: str) -> str:
    m = re.search(r"case=([a-z_0-9]+)", text)
    return m.group(1) if m else ""


def decision_of_messages(messages: list[dict]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


# --- actions as the teacher sends them and as the student writes them -------------------------

A = ToolCall("add", {"a": 2, "b": 3})
B = ToolCall("note", {"text": "remember five"})
C = ToolCall("add", {"a": 9, "b": 9})
FINAL = Message("The answer is 6.")


def teacher_choice(action) -> ChatChoice:
    if isinstance(action, ToolCall):
        return tool_call_choice(action.name, action.arguments)
    if isinstance(action, Message):
        return message_choice(action.text)
    return ChatChoice(content=None, tool_calls=[{"id": "bad", "type": "function",
                                                 "function": {"name": "add", "arguments": '{"a": '}}])


def student_text(action) -> str:
    if isinstance(action, ToolCall):
        return f'<tool_call>\n{json.dumps({"name": action.name, "arguments": action.arguments})}\n</tool_call>'
    if isinstance(action, Message):
        return action.text
    # two tool calls in one reply: invalid for the student
    return ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add"}\n</tool_call>')


BAD = object()  # a reply that does not parse (invalid for teacher and student)


@dataclass
class Script:
    """teacher[(case, decision)] = the n=K reply list (BAD = invalid), regen = the reply to a
    regeneration request; student[(case, decision)] = N actions (BAD = invalid)."""

    teacher: dict[tuple[str, int], list]
    student: dict[tuple[str, int], list]
    regen_invalid: bool = True


def teacher_backend(script: Script, default=(A, A, B)) -> ScriptedBackend:
    def reply(req):
        user = next((m["content"] for m in req.messages if m.get("role") == "user"), "")
        key = (case_of(user), decision_of_messages(req.messages))
        plan = script.teacher.get(key, list(default))
        if req.n == len(plan):
            return [teacher_choice(BAD if a is BAD else a) for a in plan]
        # a regeneration request for slots whose first reply was invalid
        return [teacher_choice(BAD if script.regen_invalid else plan[0]) for _ in range(req.n)]

    return ScriptedBackend("teacher", reply)


def judge_backend() -> ScriptedBackend:
    """MATCH when the student's call says SAME, a malformed reply when it says BROKEN,
    NO_MATCH otherwise."""

    def reply(req):
        prompt = req.messages[-1]["content"]
        call_a = prompt.split("## Call A", 1)[-1].split("## Call B", 1)[0] if "## Call A" in prompt else prompt
        if "BROKEN" in call_a:
            return message_choice("I think they might be similar")  # no verdict line -> unavailable
        return message_choice("VERDICT: MATCH" if "SAME" in call_a else "VERDICT: NO_MATCH")

    return ScriptedBackend("judge", reply)


FAST_RETRY = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.03, max_total_s=10.0)


@contextlib.contextmanager
def serve(*backends, middleware=None) -> Iterator[OpenAIServer]:
    server = OpenAIServer(list(backends), middleware=middleware)
    server.start()
    try:
        yield server
    finally:
        if hasattr(middleware, "release_hangs"):
            middleware.release_hangs()
        server.stop()


def _url(server) -> str:
    return server if isinstance(server, str) else server.base_url


def make_teacher(server, cache_path=None, **overrides) -> CachedTeacher:
    """`server`: our OpenAIServer or its base URL."""
    cfg = dict(model="teacher", base_url=_url(server), provider="vllm", api_key_env=None,
               request_timeout_s=2.0, retry=FAST_RETRY, temperature=0.6, top_p=0.95)
    cfg.update(overrides)
    cache = PersistentCache(cache_path) if cache_path is not None else None
    return CachedTeacher(OpenAITeacher(OpenAITeacherConfig(**cfg), rng=random.Random(0)), cache)


def make_matcher(server, **overrides) -> Matcher:
    cfg = dict(model="judge", base_url=_url(server), provider="vllm", api_key_env=None,
               request_timeout_s=2.0, retry=FAST_RETRY)
    cfg.update(overrides)
    return Matcher(LLMJudge(JudgeConfig(**cfg), rng=random.Random(0)))


# --- student sample functions ---------------------------------------------------------------------

def fixed_text_sample_fn(tokenizer, script: Script, eos_id: int) -> Callable:
    """The student's N replies at each hand-built state are fixed texts (tokenized, with the
    end token), so the tests can check rewards and commits against hand computation."""

    def run(prompts, keys):
        out = []
        for ids in prompts:
            text = tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
            key = (case_of(text), text.count("<|im_start|>assistant") - 1)
            gens = []
            for action in script.student[key]:
                toks = tokenizer.encode(student_text(action), add_special_tokens=False) + [eos_id]
                gens.append(Generation(np.asarray(toks, np.int32), np.full(len(toks), -0.5, np.float32), "stop"))
            out.append(gens)
        return out

    return run


def plan_student(tokenizer, plans: dict, find_task: Callable[[str], str], eos_id: int,
                 first: Callable = lambda ref: [ref]) -> Callable:
    """A student that follows each task's plan: at decision d of task `find_task(prompt text)`
    its candidates are [*first(plans[task][d]), a message, an unparsable reply] (`first`
    rewrites the reference action: the execution tests pass their variants)."""

    def run(prompts, keys):
        out = []
        for ids in prompts:
            text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
            ref = plans[find_task(text)][text.count("<|im_start|>assistant") - 1]
            gens = []
            for action in (*first(ref), Message("Something else."), BAD):
                toks = tokenizer.encode(student_text(action), add_special_tokens=False) + [eos_id]
                gens.append(Generation(np.asarray(toks, np.int32), np.full(len(toks), -0.5, np.float32), "stop"))
            out.append(gens)
        return out

    return run


def toy_run_config(run_dir, price, **keys):
    """A training run's config over the toy environment and a loopback teacher (the source is
    built by the test): tiny model, 4 task starts a step, 4 candidates against 3 teacher samples,
    priced `price` (USD per million input / cached / output tokens), no checkpoint but the
    last; `keys` (dotted) on top."""
    from actionopd_jax.config.load import from_dict, replace_keys

    c = {"kind": "actionopd", "num_candidates": 4, "teacher_samples": 3, "freq_bonus": 0.5,
         "max_response_tokens": 16, "max_prompt_tokens": 1024, "task_starts_per_step": 4, "concurrency": 4,
         "max_decisions": 2, "temperature": 1.0}
    cfg = from_dict({"collect": c, "model": {"preset": "tiny"}, "train": {"steps": 3, "max_seq_len": 2048},
                     "run": {"seed": 3, "progress": False, "tensorboard": False},
                     "teacher": {"kind": "openai", "provider": "vllm", "model": "teacher",
                                 "base_url": "http://127.0.0.1:9/v1", "max_tokens": 16},
                     "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}})
    return replace_keys(cfg, **{"run.dir": str(run_dir), "checkpoint.every_steps": 0, "checkpoint.async_save": False,
                                "teacher.price": list(price), **keys})


def collector_config(**overrides) -> CollectorConfig:
    kw = dict(seed=1234, n=4, reward=RewardConfig(k=3, lam=0.5), max_new_tokens=16, temperature=1.0,
              top_p=1.0, top_k=0, enable_thinking=False, max_prompt_tokens=1024, max_trajectories_in_flight=8,
              decision_limits=(("toy", 4),), teacher_timeout_s=20.0, matcher_timeout_s=20.0, env_timeout_s=5.0,
              progress=False)
    kw.update(overrides)
    return CollectorConfig(**kw)


def make_collector(cfg, tokenizer, teacher, matcher, sample_fn, env_factory=None) -> Collector:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Collector(cfg, tokenizer=tokenizer, teacher=teacher, matcher=matcher, sample_fn=sample_fn,
                     eos_ids=[eos], env_factory=env_factory or (lambda task: ToyEnv()))


def tiny_sampler(vocab_size: int, eos_id: int, *, seed: int = 0):
    """A tiny random Qwen3 and a Sampler with one bucket per axis (two compiled programs)."""
    from tests._sampler_fixtures import random_model

    from actionopd_jax.sampling import Buckets, Sampler

    model = random_model(seed, vocab_size=vocab_size, max_position_embeddings=2048)
    buckets = Buckets(prompt_len=(512,), prompts=(8,), samples=(4,), max_new=(16,), max_rows=32)
    return Sampler(model, eos_ids=[eos_id], buckets=buckets)


def real_sample_fn(sampler, cfg: CollectorConfig):
    return sampler_fn(sampler, SamplingSettings(n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                                top_p=cfg.top_p, top_k=cfg.top_k))


def group_signature(result) -> list[tuple]:
    """Everything a group carries except the logprobs, as comparable plain data (logprobs
    depend on the batch shape at the float-rounding level: compare them with `logprobs_of`)."""
    out = []
    for start, g in zip(result.group_starts, result.groups):
        out.append((start, g.task_id, g.decision_index, tuple(g.prompt_ids.tolist()), g.committed_index, g.retained,
                    g.drop_reason, tuple((tuple(c.token_ids.tolist()),
                                          c.text, repr(c.action), c.reward, tuple(c.verdicts), c.finish_reason)
                                         for c in g.candidates),
                    tuple((s.text, repr(s.action)) for s in g.teacher_samples)))
    return out


def collect_once(collector, tasks, **kwargs):
    """One collection, then the collector's event loop is closed."""
    with collector:
        return collector.collect(tasks, **kwargs)


def logprobs_of(result) -> list[np.ndarray]:
    return [c.logprobs for g in result.groups for c in g.candidates]


def signature_json(result) -> list[dict]:
    """Groups as JSON-able dicts (for comparing across processes)."""
    out = []
    for start, g in zip(result.group_starts, result.groups):
        out.append({"start": start, "task_id": g.task_id, "decision": g.decision_index,
                    "prompt": g.prompt_ids.tolist(), "committed": g.committed_index, "retained": g.retained,
                    "drop_reason": g.drop_reason,
                    "candidates": [{"tokens": c.token_ids.tolist(), "logprobs": c.logprobs.tolist(), "text": c.text,
                                    "action": repr(c.action), "reward": c.reward, "verdicts": list(c.verdicts)}
                                   for c in g.candidates],
                    "teacher": [s.text for s in g.teacher_samples]})
    return out


class ListTaskStream:
    """A task stream over a fixed list (the `envs.tasks.TaskStream` interface the group
    source uses: next_step / get_state / set_state)."""

    def __init__(self, tasks: list[Task], per_step: int):
        self.tasks, self.per_step, self.next_index = list(tasks), per_step, 0

    def next_step(self) -> list[Task]:
        out = [self.tasks[(self.next_index + i) % len(self.tasks)] for i in range(self.per_step)]
        self.next_index += self.per_step
        return out

    def get_state(self) -> dict:
        return {"next_index": self.next_index}

    def set_state(self, state: dict) -> None:
        self.next_index = int(state["next_index"])


def launchers_of_this_process() -> list[int]:
    """Live children of this process that are sandbox launchers (envs/mcp/launcher.py), read
    with the stray reaper's own /proc parser."""
    from actionopd_jax.envs.mcp.strays import _stat

    out = []
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        stat = _stat(pid)   # (parent, state, start), None once gone
        if stat is not None and stat[0] == os.getpid() and stat[1] != "Z":
            try:
                if b"launcher.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                pass
    return out


def servers_under(root: str) -> list[int]:
    """Live processes (not this one, not zombies) whose command line names `root`: a sandboxed
    server's launcher names its work directory."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if root.encode() in Path(f"/proc/{entry}/cmdline").read_bytes() and \
                        "State:\tZ" not in Path(f"/proc/{entry}/status").read_text():
                    out.append(int(entry))
            except OSError:
                pass
    return out


def wait_for_servers(root: str, *, gone: bool, within_s: float) -> list[int]:
    """`servers_under(root)` once it is empty (`gone`) or not, or `within_s` has passed: servers
    start after their directory is made, and die of a parent-death signal asynchronously."""
    deadline = time.monotonic() + within_s
    while bool(found := servers_under(root)) == gone and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


__all__ = [n for n in dir() if not n.startswith("_")]
