"""A reference teacher that disagrees with itself, seeded (issue 26 item 8).

A deterministic reference policy gives K identical samples at every state, so a candidate's
match count c is 0 or K and the frequency bonus lambda (eq. 6) never acts. With
`Disagreement(alternative=a, wrong=w, seed=s)` each of the n samples of one request is drawn
on its own:

- with probability w: a plausible WRONG action, when the state has one;
- else with probability a: one of the other correct-looking actions still due at the state,
  uniformly, when there is one;
- else the due reference action.

What those are, per policy (`options` in envs/reference.py):
- BFCL: the alternatives are the turn's other reference calls not yet made (the same calls in
  another order: equivalent for the official state checker when they are independent, as most
  are; not always). The wrong action is a premature closing message when a call is due, a
  repeat of the turn's last reference call when the closing message is due (the same claim of
  success when the turn has no reference call). In this mode progress through a turn is the
  reference calls already made (matched by name and arguments), so a reordering does not
  derail the teacher.
- tau2: no alternatives (the reference actions are ordered); the wrong action is a premature
  closing message while actions are due.

Each draw is a function of (seed, the request's own `seed` field, the conversation, the sample
index) only: the same request gets the same samples in any order or concurrency, and an
episode runner that sends seed=trial gets a different trajectory per trial.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from actionopd_jax.types import Action, ChatMessage


@dataclass(frozen=True)
class Disagreement:
    alternative: float = 0.0  # P(another correct-looking action still due), when there is one
    wrong: float = 0.0  # P(a plausible wrong action), when there is one
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("alternative", "wrong"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"reference disagreement {name}={p} must be a probability in [0, 1]")
        if self.alternative + self.wrong > 1.0:
            raise ValueError(f"reference disagreement alternative + wrong = {self.alternative + self.wrong} "
                             "must be <= 1 (the rest of the mass is the due reference action)")
        if self.seed < 0:
            raise ValueError(f"reference disagreement seed must be >= 0, got {self.seed}")

    @property
    def active(self) -> bool:
        return self.alternative > 0.0 or self.wrong > 0.0


def _conversation_words(messages: list[ChatMessage]) -> list[int]:
    blob = json.dumps(messages, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(blob).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def sample_rng(d: Disagreement, messages: list[ChatMessage], request_seed: int | None, sample: int):
    """The generator of sample `sample` of one request (module docstring: what it depends on)."""
    stream = 0 if request_seed is None else 1 + (int(request_seed) % (2**62))
    return np.random.default_rng([d.seed, stream, *_conversation_words(messages), sample])


def choose(d: Disagreement, due: Action, alternatives: list[Action], wrong: list[Action], rng: Any) -> Action:
    u = float(rng.random())
    if wrong and u < d.wrong:
        return wrong[int(rng.integers(len(wrong)))]
    if alternatives and u < d.wrong + d.alternative:
        return alternatives[int(rng.integers(len(alternatives)))]
    return due


def sample_actions(policy: Any, messages: list[ChatMessage], tools: list, n: int, d: Disagreement,
                   request_seed: int | None) -> list[Action]:
    """n samples of `policy` at the state `messages` (see the module docstring)."""
    from actionopd_jax.types import Observation

    due, alternatives, wrong = policy.options(Observation(messages=messages, tools=tools))
    return [choose(d, due, alternatives, wrong, sample_rng(d, messages, request_seed, j)) for j in range(n)]
