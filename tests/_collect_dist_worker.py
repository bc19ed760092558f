"""One process of the two-process collection test (run as a script by
tests/test_collect_distributed.py): joins jax.distributed on CPU, builds the same tiny student
as every other process, collects ITS share of the task starts against the parent's loopback
teacher/judge server, and writes its groups as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--base-url", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--tasks", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--compile-cache", default=None)
    args = p.parse_args()

    import jax

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    from actionopd_jax.chat import load_tokenizer
    from tests._collect_fixtures import (collect_once, collector_config, make_collector, make_matcher, make_teacher,
                                         real_sample_fn, signature_json, tiny_sampler, toy_task)

    tokenizer = load_tokenizer(args.tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = tiny_sampler(len(tokenizer), eos)  # sampling on this process's own default device
    cfg = collector_config(max_trajectories_in_flight=4, max_prompt_tokens=512, decision_limits=(("toy", 3),))
    collector = make_collector(cfg, tokenizer, make_teacher(args.base_url), make_matcher(args.base_url),
                               real_sample_fn(sampler, cfg))
    tasks = [toy_task(f"t{i}", f"dist{i % 3}") for i in range(args.tasks)]
    result = collect_once(collector, tasks, step=2)  # process index/count from jax.distributed
    devices = {str(d.platform) for d in jax.local_devices()}
    with open(args.out, "w") as f:
        json.dump({"process_index": jax.process_index(), "process_count": jax.process_count(),
                   "local_devices": len(jax.local_devices()), "global_devices": len(jax.devices()),
                   "platforms": sorted(devices), "groups": signature_json(result),
                   "trajectory_starts": [r.task_start for r in result.trajectories]}, f)
    return 0


if __name__ == "__main__":
    from tests._subprocess_fixtures import leave_jax_cluster

    leave_jax_cluster(main())
