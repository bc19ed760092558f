"""What a run's remote models will cost, estimated before it starts (`train --check`).

Requests, input and output tokens, and spend where a price is set (`teacher.price`,
`matcher.price`, `env.user_price`: USD per million [input, cached input, output] tokens), for
the teacher, the LLM judge and the user simulator, as three scenarios. The recipe gives the
counts; what it cannot give is assumed, and the assumptions are printed with the figures:

- decisions per task start: 1 / half of collect.max_decisions / all of them;
- the teacher's prompt: the shortest measured first prompt / the mean first prompt plus half
  the replies of a typical trajectory (collect.max_response_tokens / 2 each) /
  collect.max_prompt_tokens; without a measurement, collect.max_prompt_tokens, labelled so;
- replies: 10% / 50% / 100% of the role's max_tokens;
- the judge: none / half / all of a state's N x K (candidate, teacher sample) pairs reach it
  (the rules settle the rest), each a prompt of 512 / a quarter of / all of its window;
- the user simulator (tau2): none / half / every decision sends it a turn, with a prompt of
  512 / half the teacher's typical / collect.max_prompt_tokens tokens, and replies of up to
  env.user_max_tokens (1,024 where that is 0, no cap sent);
- no cached input (the dearest case: a provider's prompt cache only lowers it).

Spend is input x price[0] + output x price[2] per million tokens.
"""

from __future__ import annotations

import dataclasses

from actionopd_jax.config import Config

SCENARIOS = ("low", "typical", "high")
REPLY_SHARE = (0.1, 0.5, 1.0)
JUDGED_SHARE = (0.0, 0.5, 1.0)
USER_TURN_SHARE = (0.0, 0.5, 1.0)
SMALL_PROMPT = 512
USER_REPLY_UNCAPPED = 1024   # env.user_max_tokens 0 sends no cap: assume this many for the high case


@dataclasses.dataclass(frozen=True)
class RoleCost:
    """One remote role's figures, each (low, typical, high)."""

    role: str
    requests: tuple[int, int, int]
    input_tokens: tuple[int, int, int]
    output_tokens: tuple[int, int, int]
    spend: tuple[float, float, float] | None      # None: no price set


def _three(f) -> tuple:
    return tuple(f(i) for i in range(3))


def _spend(price: tuple[float, ...], inp: tuple, out: tuple) -> tuple[float, float, float] | None:
    if not price:
        return None
    return _three(lambda i: (inp[i] * float(price[0]) + out[i] * float(price[2])) / 1e6)


def estimate(cfg: Config, first_prompt: tuple[int, int, int] | None) -> list[RoleCost]:
    """Per-role figures for the whole run (module docstring). `first_prompt`: the training
    tasks' first prompts (shortest, mean, longest), or None when they were not measured."""
    c, t = cfg.collect, cfg.train
    starts = t.steps * c.task_starts_per_step
    decisions = (1, max(1, c.max_decisions // 2), c.max_decisions)
    states = _three(lambda i: starts * decisions[i])
    cap = c.max_prompt_tokens
    if first_prompt is None:
        prompt = (cap, cap, cap)
    else:
        lo, mean, _ = first_prompt
        typical = min(cap, mean + (decisions[1] - 1) // 2 * (c.max_response_tokens // 2))
        prompt = (min(cap, lo), typical, cap)
    roles = []
    if cfg.teacher.kind in ("openai", "vertex"):
        req = _three(lambda i: states[i] * c.teacher_samples)
        inp = _three(lambda i: req[i] * prompt[i])
        out = _three(lambda i: int(req[i] * cfg.teacher.max_tokens * REPLY_SHARE[i]))
        roles.append(RoleCost("teacher", req, inp, out, _spend(cfg.teacher.price, inp, out)))
    m = cfg.matcher
    if m.kind == "rules+llm" and (m.model or m.base_url):
        pairs = c.num_candidates * c.teacher_samples
        req = _three(lambda i: int(states[i] * pairs * JUDGED_SHARE[i]))
        window = max(SMALL_PROMPT, m.context_window - m.max_tokens)
        judge_prompt = (SMALL_PROMPT, window // 4, window)
        inp = _three(lambda i: req[i] * judge_prompt[i])
        out = _three(lambda i: int(req[i] * m.max_tokens * REPLY_SHARE[i]))
        roles.append(RoleCost("matcher", req, inp, out, _spend(m.price, inp, out)))
    e = cfg.env
    if e.user_model or e.user_base_url:
        req = _three(lambda i: int(states[i] * USER_TURN_SHARE[i]))
        user_prompt = (SMALL_PROMPT, max(SMALL_PROMPT, prompt[1] // 2), cap)
        inp = _three(lambda i: req[i] * user_prompt[i])
        reply = e.user_max_tokens or USER_REPLY_UNCAPPED
        out = _three(lambda i: int(req[i] * reply * REPLY_SHARE[i]))
        roles.append(RoleCost("user simulator", req, inp, out, _spend(e.user_price, inp, out)))
    return roles


def describe(cfg: Config, roles: list[RoleCost], prompt_source: str) -> list[str]:
    """The `--check` lines: one per role and its assumptions."""
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
    lines.append(f"  assumed: {cfg.train.steps} steps x {c.task_starts_per_step} task starts; 1 / "
                 f"{max(1, c.max_decisions // 2)} / {c.max_decisions} decisions each; K={c.teacher_samples} "
                 f"teacher samples and N x K = {c.num_candidates * c.teacher_samples} judged pairs per decision "
                 f"(0 / half / all reach the judge); replies 10% / 50% / 100% of max_tokens; first prompts "
                 f"{prompt_source}; no cached input (train/cost_estimate.py)")
    return lines


def _price_key(role: str) -> str:
    return {"teacher": "teacher.price", "matcher": "matcher.price", "user simulator": "env.user_price"}[role]


__all__ = ["RoleCost", "SCENARIOS", "describe", "estimate"]
