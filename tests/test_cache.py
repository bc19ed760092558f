"""Persistent teacher cache: keys, multiplicity, zero-call warm rerun, single flight,
kill -9 safety, and secrets kept out of the file."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from actionopd_jax.serve.faults import FaultInjector, FaultRates
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from actionopd_jax.teacher.cache import PersistentCache, teacher_cache_key
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.transport import RetryPolicy
from actionopd_jax.types import Message, TeacherSample, ToolCall
from tests._teacher_fixtures import STATE, TOOLS, serve, teacher_for

IDENT = {"provider": "vllm", "model": "t", "prompt_version": "v1", "decoding": {"temperature": 0.6}}


def test_multiset_roundtrip_keeps_order_and_multiplicity(tmp_path):
    a = TeacherSample("<tool_call>A</tool_call>", ToolCall("f", {"x": 1}), reasoning="r", prompt_tokens=10, completion_tokens=4)
    b = TeacherSample("B", Message("hello"), completion_tokens=2)
    with PersistentCache(tmp_path / "c.sqlite") as cache:
        cache.put_samples("k", [a, a, b], provider="vllm", model="t")
        cache.put_samples("empty", [], provider="vllm", model="t")
        got = cache.get_samples("k")
        assert [s.action for s in got] == [ToolCall("f", {"x": 1}), ToolCall("f", {"x": 1}), Message("hello")]
        assert all(s.from_cache for s in got) and got[0].reasoning == "r" and got[0].prompt_tokens == 10
        assert cache.get_samples("empty") == [] and cache.get_samples("missing") is None
        assert cache.summary() == {"teacher_entries": 2, "verdict_entries": 0,
                                   "stored_prompt_tokens": 20, "stored_completion_tokens": 10}
        cache.put_verdict("v", "match", model="judge")
        assert cache.get_verdict("v") == "match"
        with pytest.raises(ValueError, match="definite"):
            cache.put_verdict("u", "unavailable", model="judge")
        assert cache.integrity_ok()


def test_key_covers_everything_that_changes_the_answer():
    base = dict(messages=STATE, tools=TOOLS, identity=IDENT, k=3, key_info={"task": "t1"})
    k0 = teacher_cache_key(**base)
    # dict key order does not matter
    assert k0 == teacher_cache_key(**{**base, "identity": dict(reversed(list(IDENT.items())))})
    variants = [
        {"messages": STATE + [{"role": "user", "content": "and Rome?"}]},
        {"tools": []},
        {"identity": {**IDENT, "model": "other"}},
        {"identity": {**IDENT, "provider": "deepseek"}},
        {"identity": {**IDENT, "prompt_version": "v2"}},
        {"identity": {**IDENT, "decoding": {"temperature": 0.7}}},
        {"k": 2},
        {"key_info": {"task": "t2"}},
    ]
    keys = {teacher_cache_key(**{**base, **v}) for v in variants}
    assert len(keys) == len(variants) and k0 not in keys


def test_second_run_makes_zero_http_calls(tmp_path):
    backend = ScriptedBackend("teacher", lambda r: tool_call_choice("get_weather", {"city": "Paris"}))
    states = [STATE, STATE + [{"role": "user", "content": "And in Rome?"}]]
    with serve(backend) as server:
        first_cache = PersistentCache(tmp_path / "c.sqlite")
        t1 = CachedTeacher(teacher_for(server), first_cache)

        async def run_all(teacher):
            return [await teacher.sample(s, TOOLS, 3, key_info={"task": "t"}) for s in states]

        first = asyncio.run(run_all(t1))
        calls_after_first = server.request_count
        assert calls_after_first == 2 and t1.usage.cache_misses == 2 and t1.usage.cache_hits == 0
        first_cache.close()
        # a new process would open the file again: do the same with a fresh teacher object
        t2 = CachedTeacher(teacher_for(server), PersistentCache(tmp_path / "c.sqlite"))
        second = asyncio.run(run_all(t2))
        assert server.request_count == calls_after_first  # zero HTTP calls
        assert t2.usage.cache_hits == 2 and t2.usage.http_calls == 0
        assert [[s.action for s in g] for g in second] == [[s.action for s in g] for g in first]
        assert all(s.from_cache for g in second for s in g)


def test_single_flight_identical_concurrent_requests_cost_one_call(tmp_path):
    async def slow_reply(req):
        await asyncio.sleep(0.2)
        return message_choice("Sunny, 21 C.")

    backend = ScriptedBackend("teacher", slow_reply)
    with serve(backend) as server:
        teacher = CachedTeacher(teacher_for(server), PersistentCache(tmp_path / "c.sqlite"))

        async def many():
            return await asyncio.gather(*(teacher.sample(STATE, TOOLS, 3) for _ in range(8)))

        results = asyncio.run(many())
    assert server.request_count == 1
    assert all([s.action for s in r] == [Message("Sunny, 21 C.")] * 3 for r in results)
    assert teacher.usage.cache_misses == 1 and teacher.usage.single_flight_joins == 7


def test_transport_losses_are_not_cached_but_no_supervision_is(tmp_path):
    backend = ScriptedBackend("teacher", lambda r: message_choice("ok"))
    injector = FaultInjector(FaultRates(server_error=1.0), seed=0)
    with serve(backend, middleware=injector) as server:
        cache = PersistentCache(tmp_path / "c.sqlite")
        teacher = CachedTeacher(teacher_for(server, retry=RetryPolicy(max_attempts=2, base_delay_s=0.01)), cache)
        assert asyncio.run(teacher.sample(STATE, TOOLS, 2)) == []
        assert cache.summary()["teacher_entries"] == 0  # a transport loss is not the teacher's answer
        server.middleware = FaultInjector(FaultRates(invalid_tool_call=1.0), seed=0)
        assert asyncio.run(teacher.sample(STATE, TOOLS, 2)) == []
        assert cache.summary()["teacher_entries"] == 1  # all-invalid after regeneration IS cached (empty)
        before = server.middleware.requests_seen
        assert asyncio.run(teacher.sample(STATE, TOOLS, 2)) == []
        assert server.middleware.requests_seen == before


_WRITER = textwrap.dedent(
    """
    import sys
    from actionopd_jax.teacher.cache import PersistentCache
    from actionopd_jax.types import TeacherSample, ToolCall
    cache = PersistentCache(sys.argv[1], synchronous=sys.argv[2])
    big = "x" * 20000  # large rows make a kill inside a write likely
    i = 0
    while True:
        s = TeacherSample(big, ToolCall("f", {"i": i}))
        cache.put_samples(f"key-{i}", [s, s], provider="p", model="m")
        print(i, flush=True)  # printed only after the commit returned
        i += 1
    """
)


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
def test_sigkill_mid_write_keeps_every_completed_entry(tmp_path, synchronous):
    path = tmp_path / "c.sqlite"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), synchronous], stdout=subprocess.PIPE, env=env)
    completed = []
    deadline = time.monotonic() + 60
    while len(completed) < 40 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        completed.append(int(line))
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up, possibly inside a transaction
    proc.wait()
    completed += [int(x) for x in proc.stdout.read().split()]  # lines already flushed before the kill
    assert len(completed) >= 40, "writer did not get going"
    with PersistentCache(path) as cache:
        assert cache.integrity_ok()
        for i in completed:
            got = cache.get_samples(f"key-{i}")
            assert got is not None and [s.action for s in got] == [ToolCall("f", {"i": i})] * 2
        assert cache.summary()["teacher_entries"] >= len(completed)


def test_secret_never_reaches_the_cache_file(tmp_path, monkeypatch):
    secret = "sk-cache-SECRET-91b2"
    monkeypatch.setenv("ACTIONOPD_TEST_CACHE_KEY", secret)
    backend = ScriptedBackend("teacher", lambda r: tool_call_choice("get_weather", {"city": "Paris"}))
    with serve(backend, api_key_env="ACTIONOPD_TEST_CACHE_KEY") as server:
        cache = PersistentCache(tmp_path / "c.sqlite")
        teacher = CachedTeacher(teacher_for(server, api_key_env="ACTIONOPD_TEST_CACHE_KEY"), cache)
        assert len(asyncio.run(teacher.sample(STATE, TOOLS, 3))) == 3
        cache.close()
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"Paris" in blob  # the scan really covers the stored samples
    assert secret.encode() not in blob and "ACTIONOPD_TEST_CACHE_KEY".encode() not in blob
