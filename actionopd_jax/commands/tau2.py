"""`actionopd tau2 summaries`: draft Self-ActionOPD's privileged summaries (paper B.5) for the
tau2 training tasks with an LLM behind any OpenAI-compatible endpoint, into one reviewable
JSONL (baselines/summary_drafts.py). Resumable: tasks with a summary in --out are skipped, so
a re-run pays for nothing twice. Every draft says "reviewed": false until a human reads it;
training refuses unreviewed drafts.

    actionopd tau2 summaries --base-url https://api.deepseek.com --model deepseek-v4-flash \\
        --provider deepseek --api-key-env DEEPSEEK_API_KEY --out summaries_train.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

import actionopd_jax

SHIPPED_EXAMPLES = Path(actionopd_jax.__file__).resolve().parents[1] / "configs" / "paper" / \
    "self_actionopd_tau2_summaries.jsonl"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd tau2", description="tau2-bench helpers")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("summaries", help="draft Self-ActionOPD's privileged summaries of the training tasks",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("--base-url", required=True, help="the drafting model's OpenAI-compatible endpoint (…/v1)")
    s.add_argument("--model", required=True, help="the model name the endpoint serves (paper: DeepSeek-V4-Flash)")
    s.add_argument("--out", required=True, help="the summaries JSONL to write or extend (resumable)")
    s.add_argument("--provider", default="openai",
                   help="how to spell vendor extensions (actionopd_jax/providers.py): openai, deepseek, vllm, ...")
    s.add_argument("--api-key-env", default="", help="NAME of the environment variable holding the API key "
                   "(the key is never read from a flag or a file); empty: no key")
    s.add_argument("--temperature", type=float, default=0.2, help="sampling temperature (default 0.2, ours)")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--max-tokens", type=int, default=4096, help="response limit per request, reasoning included")
    s.add_argument("--thinking", choices=("on", "off"), default=None, help="the provider's thinking switch "
                   "(default: the provider's own behaviour)")
    s.add_argument("--reasoning-effort", default=None)
    s.add_argument("--domains", default="airline,retail,telecom", help="comma-separated tau2 domains")
    s.add_argument("--tasks", default="", help="comma-separated training task ids (e.g. airline/3,retail/2); "
                   "default: every training task of --domains")
    s.add_argument("--limit", type=int, default=0, help="draft at most this many tasks in this run (0: all)")
    s.add_argument("--attempts", type=int, default=3, help="requests per task before an error line is written")
    s.add_argument("--retry-errors", action="store_true", help="draft again the tasks an earlier run left as errors")
    s.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    s.add_argument("--timeout-s", type=float, default=300.0, help="one HTTP attempt's limit")
    s.add_argument("--price", default="", metavar="IN,CACHED,OUT",
                   help="the drafter's USD per million input, cached input and output tokens (the end-of-run spend "
                        "table shows money; requests and tokens are counted either way)")
    s.add_argument("--examples", default=str(SHIPPED_EXAMPLES),
                   help="reviewed summaries shown as the style example of each domain and copied for their own "
                        "tasks (default: the shipped six; '' for none)")
    return p


def _fail(message: str) -> int:
    print(f"actionopd tau2 summaries: {message}", file=sys.stderr)
    return 2


def _training_tasks(args: argparse.Namespace):
    from actionopd_jax.envs.tau2_tasks import DOMAINS, tau2_tasks

    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    bad = [d for d in domains if d not in DOMAINS]
    if bad or not domains:
        raise ValueError(f"--domains {args.domains!r}: choose from {', '.join(DOMAINS)}")
    tasks = [t for d in domains for t in tau2_tasks(d, "train")]
    if not args.tasks:
        return tasks
    wanted = [x.strip() for x in args.tasks.split(",") if x.strip()]
    by_id = {t.task_id: t for t in tasks}
    unknown = [x for x in wanted if x not in by_id]
    if unknown:
        raise ValueError(f"--tasks: {unknown[:3]} {'is' if len(unknown) == 1 else 'are'} not tau2 training task(s) "
                         f"of {', '.join(domains)} (ids look like airline/3 or retail/12; the test split is never "
                         "summarised, its tasks are what evaluation scores)")
    return [by_id[x] for x in dict.fromkeys(wanted)]


def _table(rows: dict[str, Counter]) -> str:
    cols = ("tasks", "had summary", "copied", "drafted", "errors", "earlier errors", "left")
    head = f"{'domain':<10}" + "".join(f"{c:>16}" for c in cols)
    lines = [head, "-" * len(head)]
    total: Counter = Counter()
    for domain, c in rows.items():
        total.update(c)
        lines.append(f"{domain:<10}" + "".join(f"{c[k]:>16}" for k in cols))
    lines.append(f"{'total':<10}" + "".join(f"{total[k]:>16}" for k in cols))
    return "\n".join(lines)


def summaries(args: argparse.Namespace) -> int:
    from actionopd_jax.baselines.summary_drafts import (
        DraftEndpointSettings, SummaryDrafter, copy_examples, existing_output)
    from actionopd_jax.baselines.summary_file import read_summary_file
    from actionopd_jax.teacher.endpoint import ChatEndpoint

    if args.limit < 0 or args.attempts < 1 or args.concurrency < 1 or args.max_tokens < 1:
        return _fail("--limit must be >= 0 and --attempts, --concurrency, --max-tokens >= 1")
    from actionopd_jax import paid_calls

    try:   # every drafting request metered on the paid-call ledger, as training's (paid_calls.py)
        ledger = paid_calls.Ledger({}, {"teacher": paid_calls.parse_price(args.price) if args.price else ()})
    except ValueError as e:
        return _fail(f"--price: {e}")
    try:
        tasks = _training_tasks(args)
    except ValueError as e:
        return _fail(str(e))
    examples: dict[str, str] = {}
    if args.examples:
        try:
            examples = read_summary_file(args.examples).reviewed
        except (OSError, ValueError) as e:
            return _fail(f"--examples: {e}; pass --examples '' to draft without examples")
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        before = existing_output(out)
    except (OSError, ValueError) as e:
        return _fail(f"--out: {e}. Nothing was changed; fix or move that file and run again")
    rows: dict[str, Counter] = {}
    pending = []
    for t in tasks:
        c = rows.setdefault(t.task_id.split("/", 1)[0], Counter())
        c["tasks"] += 1
        if before.has_summary(t.task_id):
            c["had summary"] += 1
        elif t.task_id in before.failed and not args.retry_errors:
            c["earlier errors"] += 1
        else:
            pending.append(t)
    to_draft = [t for t in pending if t.task_id not in examples]
    left = to_draft[args.limit:] if args.limit else []
    to_draft = to_draft[:args.limit] if args.limit else to_draft
    endpoint = None
    if to_draft:  # built before anything is written: a missing key or bad setting changes nothing
        settings = DraftEndpointSettings(
            model=args.model, base_url=args.base_url, provider=args.provider, api_key_env=args.api_key_env or None,
            thinking=None if args.thinking is None else args.thinking == "on", reasoning_effort=args.reasoning_effort,
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
            request_timeout_s=args.timeout_s, max_concurrency=args.concurrency)
        try:
            endpoint = ChatEndpoint(settings, who=f"summary drafter {args.provider}/{args.model}",
                                    paid_role="teacher")   # metered on the ledger's first role (paid_calls.py)
        except ValueError as e:
            return _fail(str(e))
    outcomes = copy_examples(pending, examples, out)
    if endpoint is not None:
        print(f"drafting {len(to_draft)} summaries with {args.model} at {args.base_url} into {out}", flush=True)
        drafter = SummaryDrafter(endpoint, out, model=args.model, attempts=args.attempts, examples=examples,
                                 progress=lambda line: print(line, flush=True))
        previous = paid_calls.install(ledger)
        try:
            outcomes += asyncio.run(drafter.run(to_draft))
        finally:
            paid_calls.install(previous)
    for o in outcomes:
        rows[o.task_id.split("/", 1)[0]][{"drafted": "drafted", "error": "errors", "copied": "copied"}[o.status]] += 1
    for t in left:
        rows[t.task_id.split("/", 1)[0]]["left"] += 1
    print(_table(rows))
    if endpoint is not None:
        usage = endpoint.usage
        print(f"requests {usage.http_calls} (retries {usage.transport_retries}), tokens: prompt "
              f"{usage.prompt_tokens}, completion {usage.completion_tokens}")
        from actionopd_jax.train.spend_report import ledger_table

        table = ledger_table(ledger, {"teacher": "summaries drafter"})
        if table:
            print(f"what the drafter cost this run:\n{table}")
    errors = sum(o.status == "error" for o in outcomes)
    if errors:
        print(f"{errors} task(s) got error lines (their replies stayed garbled or empty); run again with "
              "--retry-errors, or write those summaries by hand")
    print(f"next: read every line of {out} with \"reviewed\": false, correct it where it is wrong or leaks the "
          "solution, set \"reviewed\": true, then train with teacher.privileged_summaries pointing at it "
          "(unreviewed drafts are refused)")
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "summaries":
        return summaries(args)
    return 2
