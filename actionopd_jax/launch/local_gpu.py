"""Local launcher: one process per host owning all its GPUs (JAX CUDA), optionally multi-node.

    # one host, all local GPUs (install first: pip install -e .[cuda])
    python launch/local_gpu.py --config configs/paper/qwen3_4b_h200x8.yaml train.steps=100
    # node i of N (run on every node with the same coordinator; i = 0 .. N-1)
    python launch/local_gpu.py --config ... --coordinator 10.0.0.2:1234 --num-processes N --process-id i
    # N processes on this machine (CPU rehearsal of the multi-host code path)
    python launch/local_gpu.py --config configs/tiny/tiny_cpu.yaml --local-processes 2 --platform cpu

Multi-process settings reach the trainer as ACTIONOPD_COORDINATOR / ACTIONOPD_NUM_PROCESSES /
ACTIONOPD_PROCESS_ID (read by `actionopd_jax.train.distributed_env.settings_from_env`).
Credentials are inherited from this shell's environment and never printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from actionopd_jax.launch.common import (GPU_ENV_DEFAULTS, LaunchError, PlannedCommand, find_repo_root,
                                         format_plan, merge_xla_flags, parse_env_assignments,
                                         resolve_config, train_command)
from actionopd_jax.train.distributed_env import DistributedSettings


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(*, platform: str, user_env: dict[str, str],
                settings: DistributedSettings | None) -> dict[str, str]:
    """Variables this launcher adds for one process (on top of the inherited environment)."""
    env = dict(GPU_ENV_DEFAULTS) if platform == "gpu" else {"JAX_PLATFORMS": "cpu"}
    env = merge_xla_flags(env, user_env)
    if settings is not None:
        env.update(settings.to_env())
    return env


def plan(argv: list[str], *, platform: str, user_env: dict[str, str], coordinator: str | None = None,
         num_processes: int = 1, process_id: int | None = None,
         local_processes: int = 0) -> list[PlannedCommand]:
    """One PlannedCommand per process started on this machine (all run concurrently)."""
    if local_processes:
        coordinator = coordinator or f"127.0.0.1:{free_port()}"
        return [PlannedCommand(f"process {i} of {local_processes}", tuple(argv), tuple(process_env(
            platform=platform, user_env=user_env,
            settings=DistributedSettings(coordinator, local_processes, i)).items()))
            for i in range(local_processes)]
    settings = None
    if num_processes > 1 or coordinator is not None:
        if coordinator is None or process_id is None:
            raise LaunchError("multi-node runs need --coordinator HOST:PORT, --num-processes N and "
                              "--process-id I (0 on the coordinator host) on every node")
        try:
            settings = DistributedSettings(coordinator, num_processes, process_id)
        except ValueError as err:
            raise LaunchError(str(err)) from None
    purpose = (f"process {process_id} of {num_processes}" if settings else "single process, all local devices")
    return [PlannedCommand(purpose, tuple(argv), tuple(process_env(
        platform=platform, user_env=user_env, settings=settings).items()))]


def run_concurrently(commands: list[PlannedCommand], *, timeout_s: float | None = None) -> int:
    """Start every command (argv lists, no shell) with its env on top of ours; wait for all.

    If one process fails the others are stopped: the survivors would block forever in a
    collective waiting for the dead peer.
    """
    procs = [subprocess.Popen(list(c.argv), env={**os.environ, **dict(c.env)}) for c in commands]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"local_gpu: processes still running after {timeout_s}s; stopping them", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/local_gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="training config, e.g. configs/paper/qwen3_4b_h200x8.yaml (8 GPUs)")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable, e.g. NCCL_SOCKET_IFNAME=eth0 or "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.8")
    p.add_argument("--coordinator", help="multi-node: HOST:PORT of node 0 (reachable from all nodes)")
    p.add_argument("--num-processes", type=int, default=1, help="multi-node: number of nodes")
    p.add_argument("--process-id", type=int, help="multi-node: this node's index (0 = coordinator)")
    p.add_argument("--local-processes", type=int, default=0,
                   help="start N processes on this machine (multi-host rehearsal)")
    p.add_argument("--repo-root", help="the local checkout (default: found from the current directory)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.local_processes and (args.num_processes != 1 or args.process_id is not None):
            raise LaunchError("--local-processes starts every process itself; do not combine it "
                              "with --num-processes / --process-id")
        if args.local_processes < 0:
            raise LaunchError("--local-processes must be >= 0")
        repo_root = Path(args.repo_root).resolve() if args.repo_root else find_repo_root()
        config = resolve_config(args.config, repo_root)
        commands = plan(train_command(config, args.overrides), platform=args.platform,
                        user_env=parse_env_assignments(args.env), coordinator=args.coordinator,
                        num_processes=args.num_processes, process_id=args.process_id,
                        local_processes=args.local_processes)
    except LaunchError as err:
        print(f"local_gpu: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(format_plan(commands))
        return 0
    os.chdir(repo_root)  # the config path is relative to the checkout
    return run_concurrently(commands)
