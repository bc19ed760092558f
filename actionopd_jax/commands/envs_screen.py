"""`actionopd envs screen --env awm|envscaler --manifest M --judge-url U --judge-model J`: the static
feasibility screen of appendix B.1 over the tasks the audit admitted. Each task's goal, tools,
implementation, initial data and verifier evidence go to the judge endpoint, which says whether
the environment supports the goal and its success conditions; the pool's manifest entry gets
every task's source hash and screening record (model, verdict, reason, confidence, time), and
its admitted list keeps only the tasks judged feasible (envs/screen_manifest.py).

Verdicts are cached next to the manifest (`--cache`): a re-run asks only for tasks without a
verdict for their current source, so no paid request is repeated. The judge's API key is read
from the environment variable `--judge-api-key-env` names, never from a flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

PROG = "actionopd envs screen"


def add_parser(sub: Any) -> None:
    from actionopd_jax.providers import PROVIDERS
    from actionopd_jax.screening.run import DEFAULT_MAX_CHARS

    s = sub.add_parser("screen", help="static feasibility screen of the admitted tasks by an LLM judge (B.1)",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("--env", required=True, choices=("awm", "envscaler"), help="which pool of the manifest to screen")
    s.add_argument("--manifest", default="", help="the manifest `envs audit` wrote (default: where the audit of --dir "
                                                  "writes it without --manifest, in the user's cache)")
    s.add_argument("--dir", default="", help="the pool directory (default: the one the manifest was audited from)")
    s.add_argument("--judge-url", required=True, help="the judge's OpenAI-compatible base URL (…/v1)")
    s.add_argument("--judge-model", required=True, help="the judge's model name (paper: DeepSeek-V4-Flash)")
    s.add_argument("--judge-api-key-env", default="",
                   help="NAME of the environment variable holding the judge's API key (none: no authentication)")
    s.add_argument("--judge-provider", default="openai", choices=sorted(PROVIDERS),
                   help="how the endpoint spells vendor settings (providers.py)")
    s.add_argument("--judge-thinking", choices=("on", "off"), default=None,
                   help="send the provider's thinking switch (default: send none)")
    s.add_argument("--judge-temperature", type=float, default=0.0)
    s.add_argument("--judge-max-tokens", type=int, default=1024,
                   help="reply limit (the reason is one or two sentences)")
    s.add_argument("--judge-timeout-s", type=float, default=120.0, help="per request")
    s.add_argument("--judge-price", default="", metavar="IN,CACHED,OUT",
                   help="the judge's USD per million input, cached input and output tokens (the end-of-run spend "
                        "table shows money; requests and tokens are counted either way)")
    s.add_argument("--format-retries", type=int, default=2, help="asks after a reply outside the JSON format")
    s.add_argument("--concurrency", type=int, default=8, help="judge requests in flight")
    s.add_argument("--max-evidence-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help="characters of tools / code / data / verifier shown per task; longer sections are cut")
    s.add_argument("--cache", default="", help="verdict cache (default: <manifest dir>/screen_cache.sqlite)")
    s.add_argument("--stop-after-errors", type=int, default=8,
                   help="stop sending when the endpoint fails (refused / unreachable) for this many tasks in a row")
    s.add_argument("--progress-every", type=int, default=25, help="print a progress line every N tasks")


class _Refused(Exception):
    """Bad input: the message says what is wrong and what to do."""


def _load(args: argparse.Namespace) -> tuple[Path, dict[str, Any], dict[str, Any], Any, list]:
    """(manifest path, whole manifest, the pool's entry, the dataset, the audited tasks)."""
    if not args.manifest and not args.dir:
        raise _Refused("give --manifest (the file `actionopd envs audit` wrote), "
                       "or --dir when the audit ran without --manifest")
    from actionopd_jax.envs.admission import default_manifest

    path = Path(args.manifest) if args.manifest else default_manifest(args.dir)
    if not path.is_file():
        raise _Refused(f"no manifest at {path}; run `actionopd envs audit --env {args.env} --dir DIR --manifest "
                       f"{path}` first (the screen reads the tasks the audit admitted)")
    try:
        whole = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _Refused(f"{path} is not readable as JSON ({e}); "
                       "pass the manifest `actionopd envs audit` wrote") from None
    pools = whole.get("pools") if isinstance(whole, dict) else None
    entry = pools.get(args.env) if isinstance(pools, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("admitted"), list):
        raise _Refused(f"{path} has no audited {args.env} pool; run `actionopd envs audit --env {args.env} --dir DIR "
                       f"--manifest {path}` first")
    root = args.dir or entry.get("dir") or ""
    try:
        if args.env == "awm":
            from actionopd_jax.envs.awm.layout import load_awm

            data = load_awm(root)
        else:
            from actionopd_jax.envs.envscaler.layout import load_envscaler

            data = load_envscaler(root)
    except (OSError, ValueError, KeyError) as e:
        raise _Refused(f"cannot read the {args.env} pool at {root!r} ({e}); pass its directory with --dir") from None
    by_id = {t.task_id: t for t in data.tasks()}
    audited = list(entry.get("audited") or entry["admitted"])
    stray = [t for t in audited if t not in by_id]
    if stray:
        raise _Refused(f"{path} admits {len(stray)} {args.env} task(s) that {root} does not hold (e.g. {stray[:3]}): "
                       "the manifest was written for another directory; pass that one with --dir, or audit this one")
    return path, whole, entry, data, [by_id[t] for t in audited]


def _judge(args: argparse.Namespace):
    from actionopd_jax.screening.judge import ScreenJudge, ScreenJudgeConfig

    if args.concurrency < 1 or args.max_evidence_chars < 1000 or args.judge_max_tokens < 16:
        raise _Refused("--concurrency must be >= 1, --max-evidence-chars >= 1000 and --judge-max-tokens >= 16")
    try:
        cfg = ScreenJudgeConfig(model=args.judge_model, base_url=args.judge_url, provider=args.judge_provider,
                                api_key_env=args.judge_api_key_env or None,
                                thinking=None if args.judge_thinking is None else args.judge_thinking == "on",
                                temperature=args.judge_temperature, max_tokens=args.judge_max_tokens,
                                request_timeout_s=args.judge_timeout_s, max_concurrency=args.concurrency,
                                format_retries=args.format_retries)
        return ScreenJudge(cfg)
    except ValueError as e:  # an unset key variable, a setting the provider cannot send
        raise _Refused(str(e)) from None


def _write(path: Path, whole: dict[str, Any]) -> None:
    """Replace the manifest in one step: a stopped write leaves the old file, never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(whole, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summary(env: str, run: Any, restale: int, entry: dict[str, Any]) -> str:
    c = run.counts
    lines = [f"{env} feasibility screen", "",
             "| tasks | from cache | asked now | re-asked (source changed) | feasible | rejected | errors | "
             "judge requests |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {c.total} | {c.cached} | {c.asked} | {restale} | {c.feasible} | {c.infeasible} | {c.errors} | "
             f"{run.requests} |"]
    bad = [(t, r) for t, r in run.records.items() if r["verdict"] != "feasible"]
    if bad:
        lines += ["", "| task | verdict | reason |", "|---|---|---|"]
        lines += [f"| {t} | {r['verdict']} | {r['reason'][:160]} |" for t, r in bad[:50]]
        if len(bad) > 50:
            lines.append(f"| ... {len(bad) - 50} more in the manifest | | |")
    from actionopd_jax.envs.screen_manifest import funnel_table

    return "\n".join(lines) + "\n\n" + funnel_table(entry, f"{env} admission ({entry.get('dir', '')})")


def screen(args: argparse.Namespace) -> int:
    from actionopd_jax.envs.screen_manifest import apply_screening
    from actionopd_jax.envs.task_sources import awm_sources, envscaler_sources
    from actionopd_jax.screening.cache import ScreenCache
    from actionopd_jax.screening.run import screen_sources

    from actionopd_jax import paid_calls

    try:
        path, whole, entry, data, tasks = _load(args)
        judge = _judge(args)
        price = paid_calls.parse_price(args.judge_price) if args.judge_price else ()
    except (_Refused, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    # every judge request metered on the paid-call ledger, as training's (paid_calls.py)
    ledger = paid_calls.Ledger({}, {"matcher": price})
    sources = (awm_sources(data, tasks, entry.get("verifier_modes")) if args.env == "awm"
               else envscaler_sources(data, tasks))
    old = ((entry.get("screening") or {}).get("records") or {})
    restale = sum(1 for t, s in sources.items() if t in old and old[t].get("source_hash") != s.source_hash)
    every = max(1, args.progress_every)

    def progress(c) -> None:
        if c.done % every == 0 or c.done == c.total:
            print(f"{PROG}: {c.line()}", file=sys.stderr, flush=True)

    previous = paid_calls.install(ledger)
    try:
        with ScreenCache(Path(args.cache or path.parent / "screen_cache.sqlite")) as cache:
            run = asyncio.run(screen_sources(sources, judge, cache, max_chars=args.max_evidence_chars,
                                             progress=progress, stop_after_api_errors=max(1, args.stop_after_errors)))
    finally:
        paid_calls.install(previous)
    entry.setdefault("source_hashes", {}).update({t: s.source_hash for t, s in sources.items()})
    entry["screening"] = {"judge": {"model": judge.cfg.model, "provider": judge.cfg.provider,
                                    "identity": judge.identity, "max_evidence_chars": args.max_evidence_chars},
                          "records": run.records}
    apply_screening(entry)
    _write(path, whole)
    print(summary(args.env, run, restale, entry))
    print(f"\njudge tokens this run: {run.tokens['prompt']} prompt, {run.tokens['completion']} completion")
    from actionopd_jax.train.spend_report import ledger_table

    table = ledger_table(ledger, {"matcher": "screen judge"})
    if table:
        print(f"\nwhat the judge cost this run (cached verdicts are not asked again):\n{table}")
    print(f"admitted {len(entry['admitted'])} of {len(tasks)} audited {args.env} tasks; manifest: {path}")
    if run.counts.errors:
        print(f"{PROG}: {run.counts.errors} task(s) got no verdict and are not admitted; run the same command again "
              "to ask for them (verdicts already made are not asked again)", file=sys.stderr)
        return 1
    return 0
