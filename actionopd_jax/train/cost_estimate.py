"""What a run's remote models will cost, estimated before it starts (`train --check`).

Requests, input and output tokens, and spend where a price is set (`teacher.price`,
`matcher.price`, `env.user_price`: USD per million [input, cached input, output] tokens), for
the teacher, the LLM judge and the user simulator, as three scenarios. The recipe gives the
counts; what it cannot give is assumed, and the assumptions are printed with the figures.

What each recipe asks of its remote models (issue 46 item 6: every recipe was priced as
ActionOPD's, with K requests a state and a user at every task start):
- ActionOPD: per decision of a task start's trajectory, K teacher samples. A provider that
  takes `n` (teacher.provider vllm / sglang / actionopd / openai; Vertex's candidate_count)
  gets them as one request with one copy of the prompt; the others as K requests, K copies;
  the judge sees the state's N x K (candidate, teacher sample) pairs.
- KD (paper B.4, kd.trials fresh teacher episodes per task start): one teacher request per
  decision of each episode, one sample; no judge. kd.trajectories (recorded): nothing remote.
- OPD (teacher.kind=openai): one echo-scoring request per state of each of the N student
  trajectories, whose input is the prompt plus the student's reply; no output, no judge.
- The user simulator plays only the task starts that have one: every tau2 task; of the
  AWM / EnvScaler mixture, the EnvScaler starts whose scenario is conversational
  (envs/envscaler/mode.py), counted from the admitted scenarios where the pools are on this
  host, else every one assumed conversational (said so); BFCL, MCP and AWM tasks have none.

The assumptions:
- decisions per trajectory (or episode): 1 / half of collect.max_decisions / all of them;
- the prompt: the shortest measured first prompt / the mean first prompt plus half the
  replies of a typical trajectory (collect.max_response_tokens / 2 each) /
  collect.max_prompt_tokens; without a measurement (e.g. the pools are not on this host),
  collect.max_prompt_tokens for all three, and a line says that the sizes are assumed;
- replies: 10% / 50% / 100% of the role's max_tokens (OPD: of the student's reply budget);
- the judge: none / half / all of a state's N x K pairs reach it (the rules settle the rest),
  each a prompt of 512 / a quarter of / all of its window;
- the user simulator: none / half / every decision of a task start that has one sends it a
  turn, with a prompt of 512 / half the teacher's typical / collect.max_prompt_tokens tokens,
  and replies of up to env.user_max_tokens (1,024 where that is 0, no cap sent);
- no cached input (the dearest case: a provider's prompt cache only lowers it).

Spend is input x price[0] + output x price[2] per million tokens.
"""

from __future__ import annotations

import dataclasses

from actionopd_jax.config import Config
from actionopd_jax.providers import PROVIDERS

SCENARIOS = ("low", "typical", "high")
REPLY_SHARE = (0.1, 0.5, 1.0)
JUDGED_SHARE = (0.0, 0.5, 1.0)
USER_TURN_SHARE = (0.0, 0.5, 1.0)
SMALL_PROMPT = 512
USER_REPLY_UNCAPPED = 1024   # env.user_max_tokens 0 sends no cap: assume this many for the high case


@dataclasses.dataclass(frozen=True)
class RoleCost:
    """One remote role's figures, each (low, typical, high), and how they were counted."""

    role: str
    requests: tuple[int, int, int]
    input_tokens: tuple[int, int, int]
    output_tokens: tuple[int, int, int]
    spend: tuple[float, float, float] | None      # None: no price set
    notes: tuple[str, ...] = ()                   # what the counts assume for this role


def _three(f) -> tuple:
    return tuple(f(i) for i in range(3))


def _spend(price: tuple[float, ...], inp: tuple, out: tuple) -> tuple[float, float, float] | None:
    if not price:
        return None
    return _three(lambda i: (inp[i] * float(price[0]) + out[i] * float(price[2])) / 1e6)


def takes_n(cfg: Config) -> bool:
    """Whether the teacher gets a state's K samples in one request (the client asks for them so:
    teacher/base.batched_or_single_replies with the endpoint's supports_n, Vertex's
    candidate_count)."""
    t = cfg.teacher
    if t.kind == "vertex":
        return True
    traits = PROVIDERS.get(t.provider or "openai")
    return bool(traits and traits.supports_n)


def user_share(cfg: Config) -> tuple[float, str]:
    """The share of task starts played with the user simulator, and how it was found."""
    e = cfg.env
    if e.name == "tau2":
        return 1.0, "every tau2 task start"
    from actionopd_jax.envs.mixture import POOLS, mixture_entries, missing_pool_files, scale_counts

    if e.name not in POOLS:
        return 0.0, f"env.name={e.name} tasks have none"
    entries = mixture_entries(e)
    per_step = max(1, cfg.collect.task_starts_per_step)
    counts = dict(zip([p for p, _ in entries], scale_counts([c for _, c in entries], per_step)))
    drawn = counts.get("envscaler", 0)
    if not drawn:
        return 0.0, "the run draws no EnvScaler scenario (AWM tasks have none)"
    starts = f"{drawn} of {per_step} task starts a step are EnvScaler"
    from actionopd_jax.envs.envscaler.mode import parse_rule

    rule = parse_rule(e.envscaler_conversational)
    if rule.kind == "none":
        return 0.0, f"{starts}, played one-turn (env.envscaler_conversational=none)"
    missing = missing_pool_files(e)
    if missing:
        return drawn / per_step, (f"{starts}, every one assumed conversational (the pools are not on this host: "
                                  f"{', '.join(missing)})")
    from actionopd_jax.envs.mixture import mixture_pool_tasks

    tasks = mixture_pool_tasks(e).get("envscaler") or []
    conv = sum(1 for t in tasks if (t.payload or {}).get("conversational"))
    share = drawn / per_step * (conv / len(tasks) if tasks else 0.0)
    return share, f"{starts}, {conv} of their {len(tasks)} admitted scenarios conversational"


def estimate(cfg: Config, first_prompt: tuple[int, int, int] | None) -> list[RoleCost]:
    """Per-role figures for the whole run (module docstring). `first_prompt`: the training
    tasks' first prompts (shortest, mean, longest), or None when they were not measured."""
    c, t, kind = cfg.collect, cfg.train, cfg.collect.kind
    if kind == "synthetic" or (kind == "kd" and cfg.kd.trajectories):
        return []   # no remote model is asked: a stand-in source, or KD on recorded episodes
    starts = t.steps * c.task_starts_per_step
    decisions = (1, max(1, c.max_decisions // 2), c.max_decisions)
    # trajectories a task start plays: ActionOPD follows one (the committed actions), KD's
    # teacher plays kd.trials episodes, OPD's student N trajectories
    per_start = {"kd": cfg.kd.trials, "opd": c.num_candidates}.get(kind, 1)
    states = _three(lambda i: starts * per_start * decisions[i])
    cap = c.max_prompt_tokens
    if first_prompt is None:
        prompt = (cap, cap, cap)
    else:
        lo, mean, _ = first_prompt
        typical = min(cap, mean + (decisions[1] - 1) // 2 * (c.max_response_tokens // 2))
        prompt = (min(cap, lo), typical, cap)
    roles = []
    tc = cfg.teacher
    if tc.kind in ("openai", "vertex") and kind == "actionopd":
        k, batched = c.teacher_samples, takes_n(cfg)
        req = _three(lambda i: states[i] * (1 if batched else k))
        inp = _three(lambda i: req[i] * prompt[i])   # one prompt copy a request
        out = _three(lambda i: int(states[i] * k * tc.max_tokens * REPLY_SHARE[i]))
        how = (f"K={k} samples a decision in one request, one prompt copy ({_provider(cfg)} takes n)" if batched else
               f"K={k} samples a decision as {k} requests, {k} prompt copies ({_provider(cfg)} takes no n)")
        roles.append(RoleCost("teacher", req, inp, out, _spend(tc.price, inp, out), (how,)))
    elif tc.kind in ("openai", "vertex") and kind == "kd":
        req = states
        inp = _three(lambda i: req[i] * prompt[i])
        out = _three(lambda i: int(req[i] * tc.max_tokens * REPLY_SHARE[i]))
        how = (f"KD (paper B.4): kd.trials={cfg.kd.trials} teacher episodes a task start, one request of one sample "
               "a decision")
        roles.append(RoleCost("teacher", req, inp, out, _spend(tc.price, inp, out), (how,)))
    elif tc.kind == "openai" and kind == "opd":
        req = states
        inp = _three(lambda i: req[i] * (prompt[i] + int(c.max_response_tokens * REPLY_SHARE[i])))
        out = (0, 0, 0)
        how = (f"OPD: one echo-scoring request a state of each of N={c.num_candidates} student trajectories "
               "(the prompt plus the student's reply in, nothing out)")
        roles.append(RoleCost("teacher", req, inp, out, _spend(tc.price, inp, out), (how,)))
    m = cfg.matcher
    if kind == "actionopd" and m.kind == "rules+llm" and (m.model or m.base_url):
        pairs = c.num_candidates * c.teacher_samples
        req = _three(lambda i: int(states[i] * pairs * JUDGED_SHARE[i]))
        window = max(SMALL_PROMPT, m.context_window - m.max_tokens)
        judge_prompt = (SMALL_PROMPT, window // 4, window)
        inp = _three(lambda i: req[i] * judge_prompt[i])
        out = _three(lambda i: int(req[i] * m.max_tokens * REPLY_SHARE[i]))
        roles.append(RoleCost("matcher", req, inp, out, _spend(m.price, inp, out),
                              (f"N x K = {pairs} pairs a decision, 0 / half / all reach the judge",)))
    e = cfg.env
    if e.user_model or e.user_base_url:
        share, where = user_share(cfg)
        req = _three(lambda i: int(states[i] * share * USER_TURN_SHARE[i]))
        user_prompt = (SMALL_PROMPT, max(SMALL_PROMPT, prompt[1] // 2), cap)
        inp = _three(lambda i: req[i] * user_prompt[i])
        reply = e.user_max_tokens or USER_REPLY_UNCAPPED
        out = _three(lambda i: int(req[i] * reply * REPLY_SHARE[i]))
        roles.append(RoleCost("user simulator", req, inp, out, _spend(e.user_price, inp, out),
                              (f"only task starts with a user: {where}",)))
    return roles


def _provider(cfg: Config) -> str:
    return "Vertex (candidate_count)" if cfg.teacher.kind == "vertex" else \
        f"teacher.provider={cfg.teacher.provider or 'openai'}"


def describe(cfg: Config, roles: list[RoleCost], prompt_source: str) -> list[str]:
    """The `--check` lines: one per role, what each assumes, and whether the prompt sizes were
    measured or assumed."""
    if not roles:
        return []
    c = cfg.collect

    def fig(v) -> str:
        return " / ".join(f"{x:,.0f}" if isinstance(x, int) else f"${x:,.2f}" for x in v)

    lines = ["cost of the remote models over the run (estimate: low / typical / high; assumptions below):"]
    for r in roles:
        money = fig(r.spend) if r.spend is not None else f"no price (set {_price_key(r.role)})"
        lines.append(f"  {r.role:<15} requests {fig(r.requests)}; input tokens {fig(r.input_tokens)}; "
                     f"output tokens {fig(r.output_tokens)}; spend {money}")
    if prompt_source.startswith("measured"):
        lines.append(f"  prompt sizes MEASURED: first prompts {prompt_source[len('measured'):].strip()}")
    else:
        lines.append(f"  prompt sizes ASSUMED, not measured{_why_unmeasured(cfg)}: every prompt is priced at "
                     f"collect.max_prompt_tokens={c.max_prompt_tokens:,}, the high case")
    per_start = {"kd": f" x {cfg.kd.trials} KD episodes", "opd": f" x N={c.num_candidates} student trajectories"}
    lines.append(f"  assumed: {cfg.train.steps} steps x {c.task_starts_per_step} task starts"
                 f"{per_start.get(c.kind, '')}; 1 / {max(1, c.max_decisions // 2)} / {c.max_decisions} decisions each; "
                 "replies 10% / 50% / 100% of max_tokens; no cached input (train/cost_estimate.py)")
    lines += [f"  {r.role}: {note}" for r in roles for note in r.notes]
    lines += _budget_lines(cfg, roles)
    return lines


def _budget_lines(cfg: Config, roles: list[RoleCost]) -> list[str]:
    """run.budget_usd against the estimate: how many steps it buys (low / typical / high
    spend), and a warning when it cannot buy the first request batch (the run then stops
    before step 0: train/budget.py)."""
    cap = cfg.run.budget_usd
    priced = [r.spend for r in roles if r.spend is not None]
    if not cap or not priced:
        return []
    from actionopd_jax.train.budget import ledger_from, next_batch

    steps = max(cfg.train.steps, 1)
    per_step = [sum(sp[i] for sp in priced) / steps for i in range(3)]
    bought = [min(steps, int(cap // p)) if p > 0 else steps for p in per_step]
    _, first, _ = next_batch(cfg, ledger_from(cfg))
    out = [f"  budget: run.budget_usd=${cap:,.4f} against ${sum(sp[1] for sp in priced):,.2f} typical for the run "
           f"(${per_step[1]:,.4f} a step): buys {bought[2]} / {bought[1]} / {bought[0]} of {steps} steps at the high / "
           f"typical / low spend; each request batch first reserves its worst case (paid_calls.py)"]
    if cap < first:
        out.append(f"  WARNING: run.budget_usd=${cap:,.4f} buys 0 steps: the teacher's smallest request batch reserves "
                   f"${first:,.4f}, so the run stops before step 0; raise run.budget_usd")
    return out


def _why_unmeasured(cfg: Config) -> str:
    """' (why)' where it can be said: the pools are not on this host."""
    from actionopd_jax.envs.mixture import POOLS, missing_pool_files

    if cfg.env.name in POOLS:
        missing = missing_pool_files(cfg.env)
        if missing:
            return f" (the pools are not on this host: {', '.join(missing)})"
    return ""


def _price_key(role: str) -> str:
    return {"teacher": "teacher.price", "matcher": "matcher.price", "user simulator": "env.user_price"}[role]


__all__ = ["RoleCost", "SCENARIOS", "describe", "estimate", "takes_n", "user_share"]
