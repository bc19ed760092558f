"""One chat request's generation, run as segments of at most `segment` new tokens per device
call, so that between calls the server can drop a request whose client has gone and let new
requests join (sampling/batching.py `Continue`).

After the first segment each unfinished sample continues as its own prompt (the request's
prompt + what that sample generated so far, re-prefilled), n=1, with key
fold_in(fold_in(request key, sample), segment index): a fixed seed still gives fixed samples.
A generation that fits one segment is exactly the unsegmented one; a longer one differs only
through the re-prefill's float rounding (greedy text can then differ in rare near-ties).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from actionopd_jax.sampling import Generation


@dataclasses.dataclass
class SegmentedJob:
    prompt_ids: np.ndarray
    n: int
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    key: jax.Array
    segment: int
    rounds: int = 0
    tokens: list = dataclasses.field(default_factory=list)      # per sample: list of arrays
    logprobs: list = dataclasses.field(default_factory=list)
    finish: list = dataclasses.field(default_factory=list)      # per sample: None while running

    def calls(self) -> list[tuple[np.ndarray, int, int, jax.Array]]:
        """(prompt, n, max_new_tokens, key) of each sampler prompt this job needs next."""
        if self.rounds == 0:
            return [(self.prompt_ids, self.n, min(self.max_new, self.segment), self.key)]
        out = []
        for j in self._running():
            made = sum(t.size for t in self.tokens[j])
            prompt = np.concatenate([self.prompt_ids, *self.tokens[j]]).astype(self.prompt_ids.dtype)
            key = jax.random.fold_in(jax.random.fold_in(self.key, j), self.rounds)
            out.append((prompt, 1, min(self.max_new - made, self.segment), key))
        return out

    def _running(self) -> list[int]:
        return [j for j, f in enumerate(self.finish) if f is None]

    def absorb(self, generations: list[list[Generation]]) -> bool:
        """Take the sampler's generations for `calls()`, in order; True when the job is done."""
        if self.rounds == 0:
            (gens,) = generations
            self.tokens = [[g.token_ids] for g in gens]
            self.logprobs = [[g.logprobs] for g in gens]
            self.finish = [None] * len(gens)
            updates = list(enumerate(gens))
        else:
            updates = [(j, gens[0]) for j, gens in zip(self._running(), generations)]
            for j, g in updates:
                self.tokens[j].append(g.token_ids)
                self.logprobs[j].append(g.logprobs)
        for j, g in updates:
            made = sum(t.size for t in self.tokens[j])
            if g.finish_reason == "stop" or made >= self.max_new:
                self.finish[j] = g.finish_reason
        self.rounds += 1
        return not self._running()

    def result(self) -> list[Generation]:
        return [Generation(token_ids=np.concatenate(t), logprobs=np.concatenate(lp), finish_reason=f)
                for t, lp, f in zip(self.tokens, self.logprobs, self.finish)]
