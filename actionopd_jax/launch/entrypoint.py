"""Job entrypoint on a remote worker: fetch secrets by reference, set up env, exec the trainer.

    python -m actionopd_jax.launch.entrypoint \
        [--secret ENV=projects/P/secrets/S/versions/V ...] [--vertex-cluster-spec] \
        -- actionopd train --config configs/x.yaml ...

Launchers put this in front of the training command so that job specs and ssh command lines
carry only secret *names*; values are read here, on the worker, and passed to the trainer's
environment (never printed). `--vertex-cluster-spec` turns Vertex AI's CLUSTER_SPEC into the
ACTIONOPD_* multi-process variables (GPU pools; TPU pods need nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Mapping

from actionopd_jax.launch import distributed_env
from actionopd_jax.launch.common import LaunchError
from actionopd_jax.launch.secret_refs import SecretRef, access_secret, parse_secret_flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m actionopd_jax.launch.entrypoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--secret", action="append", default=[], metavar="ENV=projects/P/secrets/S/versions/V",
                   help="environment variable to fill from a Secret Manager secret version")
    p.add_argument("--vertex-cluster-spec", action="store_true",
                   help="derive ACTIONOPD_COORDINATOR/NUM_PROCESSES/PROCESS_ID from $CLUSTER_SPEC")
    p.add_argument("--coordinator-port", type=int, default=None,
                   help="port for the JAX coordinator (default: the one in CLUSTER_SPEC)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    return p


def prepare_environment(secrets: list[SecretRef], *, vertex_cluster_spec: bool,
                        coordinator_port: int | None, environ: Mapping[str, str],
                        fetch: Callable[[SecretRef], str] = access_secret) -> dict[str, str]:
    """The environment the command runs with: `environ` plus secret values and multi-process vars."""
    env = dict(environ)
    for ref in secrets:
        env[ref.env_name] = fetch(ref)
    if vertex_cluster_spec:
        if not environ.get("CLUSTER_SPEC"):
            raise LaunchError("--vertex-cluster-spec given but $CLUSTER_SPEC is not set "
                              "(it is set by Vertex AI on multi-replica jobs)")
        settings = distributed_env.settings_from_vertex_cluster_spec(
            environ["CLUSTER_SPEC"], coordinator_port=coordinator_port)
        env.update(settings.to_env())
    return env


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("entrypoint: nothing to run; put the command after --", file=sys.stderr)
        return 2
    try:
        # the worker has no default project: references must be full resource paths
        secrets = parse_secret_flags(args.secret, default_project=None)
        env = prepare_environment(secrets, vertex_cluster_spec=args.vertex_cluster_spec,
                                  coordinator_port=args.coordinator_port, environ=os.environ)
    except (LaunchError, ValueError, RuntimeError) as err:
        print(f"entrypoint: {err}", file=sys.stderr)
        return 2
    for ref in secrets:
        print(f"entrypoint: {ref.env_name} <- {ref.resource}", file=sys.stderr)
    sys.stderr.flush()
    # exec: the trainer becomes this process (signals from the job scheduler reach it directly)
    os.execvpe(command[0], command, env)
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
