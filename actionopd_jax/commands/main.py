"""`actionopd` command: one entry point per job, each subcommand in its own module.

Subcommand modules are imported lazily so `actionopd --help` stays fast and a broken
optional dependency of one job does not break the others.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("actionopd_jax.commands.train", "train a student with ActionOPD (or a baseline)"),
    "compare": ("actionopd_jax.experiment.compare_cli", "equal-budget comparison: ActionOPD vs KD vs ablations"),
    "eval": ("actionopd_jax.commands.eval", "evaluate a checkpoint or endpoint on BFCL / tau2"),
    "serve": ("actionopd_jax.serve.cli", "OpenAI-compatible server over a checkpoint"),
    "export": ("actionopd_jax.train.export_cli", "write a checkpoint as HF safetensors"),
    "generate": ("actionopd_jax.sampling.cli", "sample from a checkpoint (smoke test)"),
    "tokenizer": ("actionopd_jax.chat.tokenizer_cli", "build the offline Qwen3 tokenizer"),
    "envs": ("actionopd_jax.commands.envs",
             "audit and feasibility-screen AWM / EnvScaler task pools; write the admission manifest"),
    "tau2": ("actionopd_jax.commands.tau2", "tau2 helpers: `tau2 summaries` drafts Self-ActionOPD's privileged summaries"),
    "audit-matcher": ("actionopd_jax.matching.audit_cli", "re-judge a run's judged pairs with a second judge"),
}


def _usage() -> str:
    lines = ["usage: actionopd <command> [options]", "", "commands:"]
    width = max(map(len, SUBCOMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "run `actionopd <command> --help` for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()   # inside the try: a reader gone by now is a BrokenPipeError here, not at exit
        return code
    except BrokenPipeError:
        # the reader went away (`actionopd --help | head`): nothing left to say, and no
        # traceback; stdout goes to /dev/null so the interpreter's final flush is quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"actionopd: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from actionopd_jax.commands.native_noise import import_jax_quietly

    import_jax_quietly()  # first: importing aot.targets below imports jax
    from actionopd_jax.aot.targets import (quiet_cuda_plugin_without_gpus, quiet_libtpu_without_chips,
                                           take_usable_memory_share)

    take_usable_memory_share()   # every job: eval's and serve's pools are sized as train plans them
    quiet_libtpu_without_chips()  # before any subcommand starts jax's backends
    quiet_cuda_plugin_without_gpus()
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
