"""The ledger of paid calls: what every request to a paid model (the teacher, the matcher's
judge, the user simulator) cost, and `run.budget_*` as a hard cap over them.

Before a request (or a batch of requests for one state) is sent, its worst case is reserved:
prompt tokens bounded by the request's size (`prompt_token_bound`: the UTF-8 bytes of its
messages and tools as JSON, since no tokenizer in use turns a byte into more than one token,
plus `PROMPT_ALLOWANCE_TOKENS` for the chat template and the vendor's own system tokens) and
max_tokens for every reply, at the role's input and output price. When spent + reserved in
flight + this reservation would pass a cap, `BudgetReached` is raised instead and nothing is
sent; once a reply is in, its reported usage is what is spent and the reservation is given
back. Spend therefore never passes the cap. A request cancelled in flight (the run stopping
around it) may still be billed, so it is counted at its reserved worst case.

One ledger per process, installed for the length of a run (`install`) by the trainer, and by
the commands that pay outside training (`actionopd eval` with an endpoint, user or judge, `envs
screen`, `tau2 summaries`: their spend tables are train/spend_report.ledger_table); the
endpoints reach it through `current()` (a client with no ledger installed meters nothing).
Several processes split what is left of the cap at the start of each step evenly
(`begin_step`), so together they cannot pass it either. The totals travel in the checkpoint
(train/loop.py), so a resumed run counts on.

Layer 0: the endpoints (teacher, matching, envs' user simulator, eval) all import it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import threading
from typing import Any, Iterator

ROLES = ("teacher", "matcher", "user")   # one order with train/spend_report.ROLES
ROLE_NAMES = {"teacher": "teacher", "matcher": "judge (matcher)", "user": "user simulator"}
# a request's tokens beyond its JSON body: the chat template's markers and a vendor's own system
# text (a tool-use preamble is a few hundred tokens at most)
PROMPT_ALLOWANCE_TOKENS = 512
# a role without max_tokens (the endpoint's default): its replies are bounded here for the reservation
DEFAULT_OUTPUT_BOUND = 32768


class BudgetReached(BaseException):
    """A reservation would pass `run.budget_*`: nothing was sent. A BaseException, so the
    per-episode guards (`except Exception`: one broken trajectory must not sink a step) let
    it through to the trainer, which saves and stops (exit 3)."""

    def __init__(self, message: str, *, role: str, spent_usd: float, reserve_usd: float):
        super().__init__(message)
        self.role, self.spent_usd, self.reserve_usd = role, spent_usd, reserve_usd


def prompt_token_bound(messages: Any, tools: Any = None) -> int:
    """An upper bound of a request's prompt tokens: its messages and tools as ASCII JSON (every
    byte-level or byte-fallback tokenizer spends at least one byte per token; JSON escaping only
    adds bytes) plus PROMPT_ALLOWANCE_TOKENS."""
    body = json.dumps({"messages": messages, "tools": tools or []}, ensure_ascii=True, default=str)
    return len(body) + PROMPT_ALLOWANCE_TOKENS


@dataclasses.dataclass
class RoleTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    spend_usd: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class Hold:
    role: str
    usd: float
    tokens: int
    settled: bool = False


def _usd(price: tuple[float, ...], prompt: int, cached: int, completion: int) -> float:
    if not price:
        return 0.0
    cached = min(cached, prompt)
    return ((prompt - cached) * float(price[0]) + cached * float(price[1]) + completion * float(price[2])) / 1e6


class Ledger:
    """Per-process totals per role, the holds in flight and the caps (module docstring).
    `caps`: {"usd": float, "<role>_tokens": int} (0: no cap); `prices`: {role: (input, cached
    input, output) USD per million tokens}; `max_tokens`: {role: a reply's max_tokens}."""

    def __init__(self, caps: dict[str, float], prices: dict[str, tuple[float, ...]],
                 max_tokens: dict[str, int | None] | None = None):
        self.caps = {k: v for k, v in caps.items() if v}
        self.prices = {r: tuple(prices.get(r) or ()) for r in ROLES}
        self.max_tokens = dict(max_tokens or {})
        self.totals = {r: RoleTotals() for r in ROLES}
        self.largest = {"usd": 0.0, "tokens": 0, "role": ""}   # the largest hold so far: the next batch's forecast
        self._lock = threading.Lock()
        self._held_usd, self._held_tokens = 0.0, {r: 0 for r in ROLES}
        # this step's room: what is left of each cap for this process (begin_step)
        self._room: dict[str, float] = {}
        self._step_start_usd, self._step_start_tokens = 0.0, {r: 0 for r in ROLES}
        self._step_start_role_usd = {r: 0.0 for r in ROLES}
        self.step_label = 0
        self._closed = ""   # the first refusal of the step: every later reservation of the step is refused
        # how a refusal names the roles, the USD cap and what happens next: a command outside training
        # (`actionopd eval --budget-usd`) words them its own way
        self.role_names, self.usd_cap_name, self.stop_note = dict(ROLE_NAMES), "run.budget_usd", ""

    @property
    def capped(self) -> bool:
        return bool(self.caps)

    @property
    def spend_usd(self) -> float:
        return sum(t.spend_usd for t in self.totals.values())

    # ---- the cap ------------------------------------------------------------------------------
    def begin_step(self, step: int, global_usd: float, global_tokens: dict[str, float], processes: int = 1) -> None:
        """A new step: what is left of each cap (every process's spend so far) split evenly
        over the processes is this process's room until the next step."""
        with self._lock:
            self.step_label = step
            self._closed = ""
            self._step_start_usd = self.spend_usd
            self._step_start_tokens = {r: self.totals[r].tokens for r in ROLES}
            self._step_start_role_usd = {r: self.totals[r].spend_usd for r in ROLES}
            p = max(int(processes), 1)
            self._room = {}
            if "usd" in self.caps:
                self._room["usd"] = (self.caps["usd"] - global_usd) / p
            for r in ROLES:
                if f"{r}_tokens" in self.caps:
                    self._room[f"{r}_tokens"] = (self.caps[f"{r}_tokens"] - global_tokens.get(r, 0.0)) / p

    def worst_case(self, role: str, prompt_tokens: int, replies: int, requests: int = 1,
                   max_tokens: int | None = None) -> tuple[float, int]:
        """(USD, tokens) a batch can cost at most: `requests` prompts of at most `prompt_tokens`
        each (priced as uncached input) and `replies` replies of `max_tokens` each (default: the
        role's configured max_tokens)."""
        out = max_tokens or self.max_tokens.get(role) or DEFAULT_OUTPUT_BOUND
        prompt, completion = int(prompt_tokens) * max(int(requests), 1), int(out) * max(int(replies), 1)
        return _usd(self.prices.get(role, ()), prompt, 0, completion), prompt + completion

    def refusal(self, role: str, usd: float, tokens: int, *, spent_usd: float | None = None,
                spent_tokens: dict[str, float] | None = None, before_step: int | None = None) -> str | None:
        """Why a reservation of (usd, tokens) for `role` must not be made (None: it fits). With
        spent_*: against those (every process's) totals and the full caps (the step check);
        else against this process's room of the step, its spend and holds since."""
        where = (f"step {before_step} would start with it, so the run stops before that step"
                 if before_step is not None else f"so the run stops within step {self.step_label}")
        at = self.step_label if before_step is None else before_step
        if self.stop_note:
            where, how = "so the run stops", self.stop_note
        else:
            how = (f"Saved at step {at} (the state before that step); paid-for teacher samples are kept in the cache. "
                   "To go on, raise the cap and rerun the same command: the run resumes from here")
        held = ""
        if "usd" in self.caps:
            if spent_usd is None:
                used = self.spend_usd - self._step_start_usd + self._held_usd
                over = used + usd > self._room["usd"] + 1e-12
                spent_now, in_flight = self.spend_usd, self._held_usd
            else:
                over, spent_now, in_flight = spent_usd + usd > self.caps["usd"] + 1e-12, spent_usd, 0.0
            held = f" and ${in_flight:,.4f} more is held by requests in flight" if in_flight > 0 else ""
            if over and usd > 0:
                return (f"budget: the paid models (teacher, judge, user simulator) have cost ${spent_now:,.4f} of "
                        f"{self.usd_cap_name}=${self.caps['usd']:,.4f}{held}; the next {self.role_names[role]} request "
                        f"batch reserves up to ${usd:,.4f} (its prompt bound plus max_tokens per reply at "
                        f"the {role}'s price), which would pass the cap: {where}. {how} "
                        f"({self.usd_cap_name} >= ${spent_now + in_flight + usd:,.4f} buys that batch).")
        key = f"{role}_tokens"
        if key in self.caps:
            if spent_tokens is None:
                used = self.totals[role].tokens - self._step_start_tokens[role] + self._held_tokens[role]
                over, spent_now = used + tokens > self._room[key], self.totals[role].tokens
                in_flight = self._held_tokens[role]
            else:
                spent_now, in_flight = spent_tokens.get(role, 0.0), 0
                over = spent_now + tokens > self.caps[key]
            held = f" and {in_flight:,} more are held by requests in flight" if in_flight > 0 else ""
            if over:
                return (f"budget: the {self.role_names[role]} has used {spent_now:,.0f} of run.budget_{key}="
                        f"{int(self.caps[key]):,} tokens{held}; its next request batch reserves up to {tokens:,} "
                        f"tokens (prompt bound plus max_tokens per reply), which would pass the cap: {where}. {how} "
                        f"(run.budget_{key} >= {spent_now + in_flight + tokens:,.0f} buys that batch).")
        return None

    def reserve(self, role: str, prompt_tokens: int, replies: int = 1, requests: int = 1,
                max_tokens: int | None = None) -> Hold:
        """Hold the worst case of a batch (see worst_case), or raise BudgetReached."""
        usd, tokens = self.worst_case(role, prompt_tokens, replies, requests, max_tokens)
        with self._lock:
            why = (self._closed or self.refusal(role, usd, tokens)) if self._room else None
            if why:
                # the run stops at this step: no other request of it starts (those in flight finish)
                self._closed = why
                raise BudgetReached(why, role=role, spent_usd=self.spend_usd, reserve_usd=usd)
            self._held_usd += usd
            self._held_tokens[role] += tokens
            if usd > self.largest["usd"] or (usd == self.largest["usd"] and tokens > self.largest["tokens"]):
                self.largest = {"usd": usd, "tokens": tokens, "role": role}
        return Hold(role, usd, tokens)

    def release(self, hold: Hold, *, cancelled: bool = False) -> None:
        """Give a hold back once its usage is recorded; one cancelled in flight may have been
        billed, so its worst case is recorded as spent."""
        with self._lock:
            if hold.settled:
                return
            hold.settled = True
            self._held_usd -= hold.usd
            self._held_tokens[hold.role] -= hold.tokens
            if cancelled:
                t = self.totals[hold.role]
                t.spend_usd += hold.usd
                t.prompt_tokens += hold.tokens   # unknown split: counted as input (the cap reads the sum)

    def record(self, role: str, *, requests: int = 0, prompt_tokens: int = 0, cached_prompt_tokens: int = 0,
               completion_tokens: int = 0) -> None:
        """Usage a vendor reported (prompt tokens read from its cache priced at the cached rate)."""
        with self._lock:
            t = self.totals[role]
            t.requests += int(requests)
            t.prompt_tokens += int(prompt_tokens)
            t.cached_prompt_tokens += min(int(cached_prompt_tokens), int(prompt_tokens))
            t.completion_tokens += int(completion_tokens)
            t.spend_usd += _usd(self.prices.get(role, ()), int(prompt_tokens), int(cached_prompt_tokens),
                                int(completion_tokens))

    @contextlib.contextmanager
    def holding(self, role: str, prompt_tokens: int, replies: int = 1, requests: int = 1,
                max_tokens: int | None = None) -> Iterator[Hold]:
        """Reserve a batch for the block; the requests inside record their own usage and do not
        reserve again (`covered`)."""
        hold = self.reserve(role, prompt_tokens, replies, requests, max_tokens)
        token = _COVERED.set(role)
        cancelled = False
        try:
            yield hold
        except BaseException as err:
            cancelled = _is_cancel(err)
            raise
        finally:
            _COVERED.reset(token)
            self.release(hold, cancelled=cancelled)

    # ---- state --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"totals": {r: dataclasses.asdict(t) for r, t in self.totals.items()}, "largest": dict(self.largest)}

    def load(self, state: dict[str, Any]) -> None:
        for r, saved in (state.get("totals") or {}).items():
            if r in self.totals:
                self.totals[r] = RoleTotals(**{k: type(getattr(RoleTotals(), k))(v) for k, v in saved.items()
                                               if k in RoleTotals.__dataclass_fields__})
        if state.get("largest"):
            self.largest = {"usd": float(state["largest"].get("usd", 0.0)),
                            "tokens": int(state["largest"].get("tokens", 0)), "role": str(state["largest"].get("role", ""))}

    def metrics(self) -> dict[str, float]:
        """The totals as the spend meters name them (collect/<role>/..., train/spend_report.py)."""
        out: dict[str, float] = {}
        for r, t in self.totals.items():
            out.update({f"{r}/requests_total": float(t.requests), f"{r}/prompt_tokens_total": float(t.prompt_tokens),
                        f"{r}/completion_tokens_total": float(t.completion_tokens),
                        f"{r}/cached_prompt_tokens_total": float(t.cached_prompt_tokens),
                        f"{r}/cache_hits_total": 0.0})
            if self.prices.get(r):
                out[f"{r}/spend_usd_total"] = t.spend_usd
                out[f"{r}/spend_usd"] = t.spend_usd - self._step_start_role_usd[r]   # since the step began
        if any(self.prices.values()):
            out["spend_usd_total"] = self.spend_usd
        return out


def _is_cancel(err: BaseException) -> bool:
    import asyncio

    return isinstance(err, asyncio.CancelledError)


_COVERED: contextvars.ContextVar[str | None] = contextvars.ContextVar("paid_calls_covered", default=None)
_CURRENT: Ledger | None = None


def install(ledger: Ledger | None) -> Ledger | None:
    """Make `ledger` the process's ledger (None: none); returns the one it replaces."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, ledger
    return previous


def current() -> Ledger | None:
    return _CURRENT


@contextlib.contextmanager
def paid_request(role: str | None, messages: Any, tools: Any = None, replies: int = 1,
                 max_tokens: int | None = None) -> Iterator[Ledger | None]:
    """One request to a paid model: its worst case reserved on the installed ledger (unless a
    batch around it already holds it, or no ledger is installed) for the block. The block
    records the reply's usage on the yielded ledger (`ledger.record`)."""
    ledger = current()
    if ledger is None or role is None:
        yield None
        return
    if _COVERED.get() is not None:
        yield ledger
        return
    with ledger.holding(role, prompt_token_bound(messages, tools), replies, max_tokens=max_tokens):
        yield ledger


IN_FLIGHT_WAIT_S = 900.0   # beyond any request's retry bound (teacher.endpoint: 600 s by default)


async def finishing_in_flight(coro: Any) -> Any:
    """`coro`, except that when the cap refuses a request (BudgetReached) the episodes with a
    request in flight finish that request before the refusal is raised: it is paid for, and a
    request cancelled in flight is counted at its reserved worst case. Each of them stops at its
    next request (the ledger refuses every request after the first refusal); the episodes that
    finish are kept in the episode file (KD, the warm start, `actionopd eval --budget-usd`)."""
    import asyncio

    try:
        return await coro
    except BudgetReached:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=IN_FLIGHT_WAIT_S)
        raise


def parse_price(text: str) -> tuple[float, float, float]:
    """A command line's price: "IN,CACHED,OUT" USD per million tokens (input, cached input,
    output), as teacher.price; ValueError saying what is wrong otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        price = tuple(float(p) for p in parts)
    except ValueError:
        price = ()
    if len(price) != 3 or any(p < 0 or p != p for p in price):
        raise ValueError(f"price {text!r}: expected three USD prices per million tokens >= 0, "
                         "input,cached-input,output (e.g. 0.28,0.028,0.42)")
    return price  # type: ignore[return-value]


__all__ = ["BudgetReached", "Hold", "IN_FLIGHT_WAIT_S", "Ledger", "PROMPT_ALLOWANCE_TOKENS", "ROLES", "current",
           "finishing_in_flight", "install", "paid_request", "parse_price", "prompt_token_bound"]
