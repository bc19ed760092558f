"""What `actionopd eval` pays for: every request to a paid model it makes (the evaluated
endpoint, the tau2 / EnvScaler user simulator, the AWM SQL verifiers' judge) on the same
ledger as training's (paid_calls.py), so the same table (train/spend_report.py) ends the run.

The evaluated endpoint is the ledger's "teacher" role, the AWM judge its "matcher" role, the
user simulator its "user" role. `--price ROLE=IN,CACHED,OUT` prices a role (USD per million
input, cached input and output tokens; no price is built in: providers change them); without
one a role's requests and tokens are counted all the same. `--budget-usd` is a hard cap on the
priced roles through the ledger's reservations: a request whose worst case would pass it is not
sent, the requests in flight finish, and the run stops with exit 3; finished episodes stay in
episodes.jsonl and the rest run when the same command is run again (with a higher cap). The
totals are kept in the output directory's paid_calls.json, so a resumed evaluation counts on.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from actionopd_jax.paid_calls import Ledger, parse_price

PRICED = {"agent": "teacher", "user": "user", "judge": "matcher"}   # --price's names: the ledger's roles
LABELS = {"teacher": "agent (evaluated endpoint)", "matcher": "judge (AWM SQL verifier)", "user": "user simulator"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("spend of the paid models (the evaluated endpoint, the user simulator, the AWM judge)")
    g.add_argument("--price", action="append", default=[], metavar="ROLE=IN,CACHED,OUT",
                   help="USD per million input, cached input and output tokens of ROLE (agent, user or judge), "
                        "e.g. agent=0.28,0.028,0.42; repeatable. Unpriced roles count requests and tokens only")
    g.add_argument("--budget-usd", type=float, default=0.0,
                   help="hard cap on what the priced roles may cost (resumes included): a request that could pass "
                        "it is not sent and the run stops with exit 3, finished episodes kept (0: none)")


def ledger_of(args: argparse.Namespace, agent_max_tokens: int | None = None) -> Ledger:
    """The evaluation's ledger from --price and --budget-usd (ValueError naming what is wrong);
    `agent_max_tokens` bounds the evaluated endpoint's replies in the check before the first request."""
    prices: dict[str, tuple[float, ...]] = {}
    for item in getattr(args, "price", None) or []:
        name, sep, value = str(item).partition("=")
        if not sep or name.strip() not in PRICED:
            raise ValueError(f"--price {item!r}: expected ROLE=IN,CACHED,OUT with ROLE one of "
                             f"{', '.join(PRICED)} (e.g. --price agent=0.28,0.028,0.42)")
        try:
            prices[PRICED[name.strip()]] = parse_price(value)
        except ValueError as e:
            raise ValueError(f"--price {item!r}: {str(e).split(': ', 1)[-1]}") from None
    cap = float(getattr(args, "budget_usd", 0.0) or 0.0)
    if cap < 0 or (cap and not prices):
        raise ValueError(f"--budget-usd {cap:g} needs a price to count spend against it: --price agent=..., "
                         "user=... or judge=... (and must be >= 0)")
    ledger = Ledger({"usd": cap}, prices, {"teacher": agent_max_tokens})
    ledger.role_names.update({"teacher": "evaluated endpoint (agent)", "matcher": "AWM judge"})
    ledger.usd_cap_name = "--budget-usd"
    ledger.stop_note = ("Finished episodes are kept in episodes.jsonl (scored); the others were not, and run when the "
                        "same command is run again with a higher --budget-usd (the spend so far counts on: "
                        "paid_calls.json)")
    return ledger


def check_lines(args: argparse.Namespace) -> list[str]:
    """`eval --check`'s lines for the prices and the cap."""
    ledger = ledger_of(args)
    priced = [f"{name} ${p[0]:g}/${p[1]:g}/${p[2]:g}" for name, role in PRICED.items()
              if (p := ledger.prices.get(role))]
    cap = f"--budget-usd ${ledger.caps['usd']:,.4f} (a hard cap: exit 3 at the first request that could pass it)" \
        if ledger.capped else "no --budget-usd cap"
    prices = (", ".join(priced) + " per million input/cached/output tokens" if priced
              else "no --price: requests and tokens counted, no money")
    return [f"spend      {prices}; {cap}"]


def write_spend(ledger: Ledger, out: Path) -> str:
    """spend.md in the output directory (the roles that made a request); returns its table."""
    from actionopd_jax.train.spend_report import ledger_table

    table = ledger_table(ledger, LABELS)
    if table:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spend.md").write_text(
            f"# What the paid models cost: {out.name}\n\nTotals of this evaluation (resumes included; "
            f"paid_calls.json). Prompt tokens the vendor read from its prompt cache are priced at the cached rate "
            f"(shown in brackets); money only where --price set one.\n\n{table}\n")
    return table


def summary(ledger: Ledger) -> dict[str, Any]:
    from actionopd_jax.train.spend_report import ledger_summary

    return ledger_summary(ledger, LABELS)
