"""`actionopd audit-matcher --run-dir D --judge-base-url U --judge-model M [--sample N]`: how often
the run's LLM judge is wrong, measured by a second judge (issue 35, item 4).

It reads the run's judged-pair log (matching/judged_log.py), draws a seeded sample stratified
by who decided each pair, its verdict and its action type (matching/audit.py), asks the audit
judge the matcher's own question about every sampled pair -- the rules-decided ones included
(matching/audit_judge.py, answers cached in D/audit/) -- and writes D/audit.json and
D/audit.md, with a link from D/report.md when the run has one. Exit 0 when written, 1 when the
audit judge answered none of the sampled pairs, 2 on bad input (nothing is written then).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

PROG = "actionopd audit-matcher"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory (it holds judged-p*.jsonl)")
    p.add_argument("--judge-base-url", required=True, help="the audit judge's OpenAI-compatible endpoint")
    p.add_argument("--judge-model", required=True, help="the audit judge's model name")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding its API key; 'none' for an endpoint without one")
    p.add_argument("--judge-provider", default="openai", help="how to talk to it (as matcher.provider)")
    p.add_argument("--judge-max-tokens", type=int, default=128, help="reply limit (as matcher.max_tokens)")
    p.add_argument("--judge-context-window", type=int, default=32768,
                   help="its window in tokens: sizes the conversation shown (as matcher.context_window)")
    p.add_argument("--judge-concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--sample", type=int, default=400, help="pairs to re-judge, spread over the strata (default 400)")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    return p


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return _fail(f"--run-dir {run_dir} is not a directory. Give the directory of a training run "
                     "(the one holding config.yaml and metrics.jsonl).")
    if args.sample < 1:
        return _fail(f"--sample must be at least 1, got {args.sample}.")
    from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
    from actionopd_jax.matching.judged_log import read_judged

    states, read = read_judged(run_dir)
    if not states:
        return _fail(f"{run_dir} holds no judged pairs (judged-p*.jsonl: {read.files} file(s), {read.lines} line(s)). "
                     "The collector writes them during ActionOPD collection; a run from before the log existed, or "
                     "one that never collected a group, has nothing to audit.")
    key_env = None if args.judge_api_key_env.lower() in ("none", "") else args.judge_api_key_env
    try:
        cfg = JudgeConfig(model=args.judge_model, base_url=args.judge_base_url, provider=args.judge_provider,
                          api_key_env=key_env, max_tokens=args.judge_max_tokens,
                          context_window=args.judge_context_window, max_concurrency=args.judge_concurrency)
        judge = LLMJudge(cfg)
    except ValueError as err:  # an unknown provider, a missing API key, a window too small
        return _fail(f"the audit judge's settings are refused: {err}. Fix the --judge-* flags and run again; "
                     "answers already cached are kept.")
    return _audit(run_dir, states, read, judge, args)


def _audit(run_dir: Path, states, read, judge, args) -> int:
    from dataclasses import asdict

    from actionopd_jax.matching.audit import evaluate, population, stratified_sample, summary
    from actionopd_jax.matching.audit_judge import AuditJudge
    from actionopd_jax.matching.audit_report import write_audit
    from actionopd_jax.matching.judge import JUDGE_PROMPT_VERSION
    from actionopd_jax.matching.judged_log import resolve_context
    from actionopd_jax.teacher.cache import PersistentCache

    strata, definite = population(states)
    sample = stratified_sample(strata, args.sample, args.seed)
    refs = [r for s in sorted(sample) for r in sample[s]]
    # only the sampled states' context is read (a long run's log need not fit in memory)
    resolve_context(run_dir, [states[i] for i in sorted({r.state for r in refs})], read)
    askable = [r for r in refs if states[r.state].resolved]
    with PersistentCache(run_dir / "audit" / "verdicts.sqlite") as cache:
        asker = AuditJudge(judge, cache)

        async def ask():
            try:
                return await asker.verdicts(states, askable)
            finally:
                await judge.aclose()

        second = asyncio.run(ask())
    result = evaluate(states, strata, definite, sample, second)
    doc = {
        "run_judge": _run_judge(run_dir),
        "audit_judge": {"model": judge.cfg.model, "base_url": judge.cfg.base_url, "provider": judge.cfg.provider,
                        "prompt_version": JUDGE_PROMPT_VERSION, "requests": asdict(asker.stats)},
        "log": {**asdict(read), "states": len(states)},
        "sample": {"requested": args.sample, "seed": args.seed, "by_stratum": {s: len(r) for s, r in sample.items()}},
        "summary": summary(states, result, second, sample),
    }
    paths = write_audit(run_dir, doc)
    print(f"{PROG}: {len(refs)} sampled pairs, {len(second)} answered ({asker.stats.asked} asked, "
          f"{asker.stats.cached} from the cache), {len(result.disagreements)} disagreements; wrote "
          + ", ".join(str(p) for p in paths.values()))
    if refs and not second:
        print(f"{PROG}: the audit judge answered none of the sampled pairs (see the warnings above); the report has "
              "no measurement. Check --judge-base-url / --judge-model and run again.", file=sys.stderr)
        return 1
    return 0


def _run_judge(run_dir: Path) -> str:
    """The run's judge as its config.yaml names it (matcher.model at matcher.base_url)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return "the run's matcher (no config.yaml in the run directory)"
    import yaml

    try:
        m = (yaml.safe_load(path.read_text()) or {}).get("matcher") or {}
    except yaml.YAMLError:
        return "the run's matcher (config.yaml unreadable)"
    return f"`{m.get('model') or '?'}` at {m.get('base_url') or '?'}" if isinstance(m, dict) else "the run's matcher"


if __name__ == "__main__":
    sys.exit(main())
