"""Multi-host collection shape on CPU: two local processes under jax.distributed each collect
their own share of the task starts on their own devices (no cross-process collective during
collection), against one loopback teacher/judge server. Their union equals a single-process
collection of all task starts: keys depend on the global task-start index, not on the host."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (Script, collect_once, collector_config, judge_backend, make_collector,
                                     make_matcher, make_teacher, real_sample_fn, serve, signature_json, teacher_backend,
                                     tiny_sampler, toy_task)
from tests._subprocess_fixtures import finish_all, xla_flags

REPO = Path(__file__).resolve().parents[1]
N_TASKS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_logprobs(groups):
    return [{**g, "candidates": [{k: v for k, v in c.items() if k != "logprobs"} for c in g["candidates"]]}
            for g in groups]


def test_two_processes_collect_disjoint_shares_equal_to_one_process(tiny_tokenizer, tiny_tokenizer_dir, tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    cache = os.environ.get("ACTIONOPD_TEST_JAX_CACHE", os.path.expanduser("~/.cache/actionopd_jax/jax_test_cache"))
    with serve(teacher_backend(Script({}, {})), judge_backend()) as server:
        procs = []
        for pid in range(2):
            cmd = [sys.executable, str(REPO / "tests" / "_collect_dist_worker.py"),
                   "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(pid), "--base-url", server.base_url,
                   "--tokenizer", str(tiny_tokenizer_dir), "--tasks", str(N_TASKS),
                   "--out", str(tmp_path / f"p{pid}.json"), "--compile-cache", cache]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        finish_all(procs, timeout=420)
        # the same collection in one process (this one), over all task starts
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        cfg = collector_config(max_trajectories_in_flight=4, max_prompt_tokens=512, decision_limits=(("toy", 3),))
        collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   real_sample_fn(tiny_sampler(len(tiny_tokenizer), eos), cfg))
        tasks = [toy_task(f"t{i}", f"dist{i % 3}") for i in range(N_TASKS)]
        single = signature_json(collect_once(collector, tasks, step=2, process_index=0, process_count=1))

    shares = [json.loads((tmp_path / f"p{pid}.json").read_text()) for pid in range(2)]
    for pid, share in enumerate(shares):
        assert share["process_index"] == pid and share["process_count"] == 2
        assert share["local_devices"] == 2 and share["global_devices"] == 4  # really one distributed runtime
        assert share["trajectory_starts"] == list(range(pid, N_TASKS, 2))
        assert {g["start"] % 2 for g in share["groups"]} <= {pid}
    union = sorted(shares[0]["groups"] + shares[1]["groups"], key=lambda g: (g["start"], g["decision"]))
    assert len(union) == len(single) >= N_TASKS
    assert _strip_logprobs(union) == _strip_logprobs(single)
    for a, b in zip(union, single):
        for ca, cb in zip(a["candidates"], b["candidates"]):
            np.testing.assert_allclose(ca["logprobs"], cb["logprobs"], atol=1e-5)
