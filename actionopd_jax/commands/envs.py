"""`actionopd envs audit --env awm|envscaler --dir D`: the task admission of appendix B.1 for a
pool directory in the published layout (envs/admission.py). Prints the funnel table and writes
(or updates) the manifest of admitted task ids that training reads as env.manifest; one file
holds every audited pool under "pools". `actionopd envs screen` then runs the static
feasibility screen over the admitted tasks (commands/envs_screen.py); an audit that rewrites a
screened pool keeps its screening records and applies them again, so a re-audit never
re-admits a task the screen rejected.

Untrusted dataset code (verifiers, check functions, environment classes) runs in a subprocess
sandbox (envs/sandbox.py); `--server-probe` is left to the MCP runtime (not wired here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd envs", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    a = sub.add_parser("audit", help="integrity audit + context selection; writes the admission manifest")
    a.add_argument("--env", required=True, choices=("awm", "envscaler"), help="which pool layout --dir holds")
    a.add_argument("--dir", required=True, help="the pool directory (published layout, docs/formats.md)")
    a.add_argument("--manifest", default="",
                   help="manifest JSON to write or update (default: one per pool directory in the user's cache, "
                        "~/.cache/actionopd_jax/admission/; the pool directory is only read)")
    a.add_argument("--tokenizer", default="",
                   help="the student's HF tokenizer dir (default: the offline Qwen3 tokenizer, built once)")
    a.add_argument("--max-prompt-tokens", type=int, default=16_000, help="context selection budget (paper: 16000)")
    a.add_argument("--cache-dir", default="",
                   help="AWM initial-database cache (default: the one training uses, ~/.cache/actionopd_jax/awm_db)")
    a.add_argument("--verifier-mode", default="auto", choices=("auto", "code", "sql"),
                   help="AWM verifier to require: code, sql, or auto (code where present, else sql)")
    a.add_argument("--timeout-s", type=float, default=30.0, help="wall-clock limit per sandboxed call")
    a.add_argument("--heldout-fraction", type=float, default=0.0,
                   help="keep this fraction of the admitted tasks as the pool's evaluation split (`eval --bench "
                        "awm:heldout`); training never draws them (default 0: none; chosen by id hash)")
    from actionopd_jax.commands.envs_screen import add_parser

    add_parser(sub)
    return p


def _tokenizer(path: str):
    from actionopd_jax.chat.tokenizer import build_qwen3_tokenizer, load_tokenizer

    if path:
        return load_tokenizer(path)
    return load_tokenizer(build_qwen3_tokenizer(Path.home() / ".cache" / "actionopd_jax" / "qwen3_tokenizer"))


def audit(args: argparse.Namespace) -> int:
    from actionopd_jax.envs.admission import audit_awm, audit_envscaler
    from actionopd_jax.envs.sandbox import SubprocessSandbox

    if not 0.0 <= args.heldout_fraction < 1.0:
        print(f"actionopd envs audit: --heldout-fraction must be in [0, 1), got {args.heldout_fraction}",
              file=sys.stderr)
        return 2
    if args.env == "envscaler":  # bad records are a clear error here, before any tokenizer or sandbox starts
        from actionopd_jax.envs.envscaler.layout import load_envscaler

        try:
            load_envscaler(args.dir)
        except (FileNotFoundError, ValueError, KeyError) as err:
            print(f"actionopd envs audit: {args.dir} does not load as an EnvScaler pool: {err}", file=sys.stderr)
            return 2
    from actionopd_jax.envs.admission import default_manifest

    manifest = Path(args.manifest) if args.manifest else default_manifest(args.dir)
    tok = _tokenizer(args.tokenizer)
    sandbox = SubprocessSandbox()
    if args.env == "awm":
        from actionopd_jax.envs.awm.runtime import DEFAULT_CACHE
        from actionopd_jax.envs.awm.serve import server_probe

        cache = Path(args.cache_dir) if args.cache_dir else DEFAULT_CACHE
        result = audit_awm(args.dir, sandbox=sandbox, tokenizer=tok, cache_dir=cache,
                           max_prompt_tokens=args.max_prompt_tokens, verifier_mode=args.verifier_mode,
                           timeout_s=args.timeout_s, server_probe=server_probe(start_timeout_s=args.timeout_s))
    else:
        result = audit_envscaler(args.dir, sandbox=sandbox, tokenizer=tok, max_prompt_tokens=args.max_prompt_tokens,
                                 timeout_s=args.timeout_s)
    combined = {"pools": {}}
    if manifest.is_file():
        old = json.loads(manifest.read_text(encoding="utf-8"))
        combined["pools"] = dict(old.get("pools") or ({old["pool"]: old} if "pool" in old else {}))
    entry = result.manifest()
    from actionopd_jax.envs.admission import heldout_split

    entry["heldout"] = heldout_split(result.admitted, args.heldout_fraction)
    entry.update({"tokenizer": args.tokenizer or "qwen3 (offline build)", "max_prompt_tokens": args.max_prompt_tokens})
    screened = (combined["pools"].get(args.env) or {}).get("screening")
    if isinstance(screened, dict):  # the screen's verdicts still hold for tasks whose source is unchanged
        from actionopd_jax.envs.screen_manifest import apply_screening

        entry["screening"] = screened
        apply_screening(entry)
    combined["pools"][args.env] = entry
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(combined, indent=1) + "\n", encoding="utf-8")
    print(result.table())
    if "screening" in entry:
        from actionopd_jax.envs.screen_manifest import SCREEN_STAGE

        row = entry["funnel"][-1]
        print(f"| {SCREEN_STAGE} (earlier verdicts) | {row['kept']} | {len(result.admitted) - row['kept']} | "
              + "; ".join(f"{r} ({n})" for r, n in row["reasons"].items()) + " |")
    held = f", {len(entry['heldout'])} of them held out for evaluation" if entry["heldout"] else ""
    print(f"\nadmitted {len(entry['admitted'])} of {result.funnel.kept[result.funnel.stages[0]]} tasks{held}; "
          f"manifest: {manifest} (set env.manifest to it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.action == "audit":
        return audit(args)
    if args.action == "screen":
        from actionopd_jax.commands.envs_screen import screen

        return screen(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
