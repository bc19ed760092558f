"""Chat-template misses of the prefix cache, per trajectory (`session`).

A trajectory's next prompt should be its previous prompt + the committed reply + the tool
result, token for token; then the prefix index serves all of it. A template that rewrites the
history (Qwen3's drops the reasoning of earlier turns once a new user turn starts) breaks that:
the cache then serves only the longest common prefix. This counts such prompts and the
previous tokens lost, so a run can see what its template costs.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Sessions:
    def __init__(self):
        self.prompt: dict[Any, np.ndarray] = {}          # session -> its previous prompt
        self.samples: dict[Any, list[np.ndarray]] = {}   # session -> that prompt + each sample

    def admitted(self, req, stats) -> None:
        """Count a miss when req's prompt does not extend its session's previous prompt plus
        one of that prompt's samples (EngineStats.template_misses / template_miss_tokens)."""
        if req.session is None:
            return
        prev = self.prompt.get(req.session)
        if prev is not None:
            best = 0
            for seq in self.samples.get(req.session) or [prev]:
                m = min(len(seq), req.prompt.size)
                diff = np.nonzero(seq[:m] != req.prompt[:m])[0]
                best = max(best, int(diff[0]) if diff.size else m)
            if best < prev.size:
                stats.template_misses += 1
                stats.template_miss_tokens += prev.size - best
        self.prompt[req.session] = req.prompt
        self.samples[req.session] = []

    def sample_done(self, req, j: int) -> None:
        if req.session is not None and req.session in self.samples:
            self.samples[req.session].append(np.concatenate([req.prompt, np.asarray(req.tokens[j], np.int32)]))

    def clear(self) -> None:
        self.prompt.clear()
        self.samples.clear()


__all__ = ["Sessions"]
