"""Scoring given tokens with a model: log p(t_i | t_<i) at every position, on device, and the
vLLM-compatible HTTP request that asks a server for it.

The request (what vLLM's `/v1/completions` answers, so one client works against both):

    POST /v1/completions {"model": M, "prompt": [token ids], "max_tokens": 0, "echo": true, "logprobs": 1}
    -> choices[0].logprobs.token_logprobs = [null, lp_1, ..., lp_{T-1}]   (one entry per prompt token)
       choices[0].logprobs.tokens / top_logprobs / text_offset as in the OpenAI completions format

Log-probabilities are under the model's full softmax at temperature 1 (the teacher's own
distribution, as vLLM reports prompt logprobs); the first token has no context, hence null.
Token-level OPD (paper B.4) uses this to get teacher log-probabilities of student-sampled
tokens from a served teacher. Only echo scoring (max_tokens 0) is served here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from actionopd_jax.sampling.buckets import bucket_length
from actionopd_jax.serve.requests import RequestError, release_body_slot, requested_model
from actionopd_jax.jax_compat import set_mesh

POSITION_CHUNK = 128  # positions per LM-head chunk: [rows, chunk, vocab] logits at a time


def _bucket(n: int, multiple: int) -> int:
    return bucket_length(n, multiple)


class TokenScorer:
    """log p(t_i | t_<i) for batches of token sequences under `model` (an nnx Qwen3).

    Sequences are right-padded to shape buckets (few compiled programs); the LM head runs on
    chunks of positions so [T, vocab] logits never exist at once. `mesh`: trace under it
    when the parameters are sharded."""

    def __init__(self, model: Any, *, mesh: Any = None, temperature: float = 1.0, position_chunk: int = POSITION_CHUNK):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.graphdef, self.state = nnx.split(model)
        self.mesh = mesh
        self.temperature = float(temperature)
        self.chunk = int(position_chunk)
        self._fn = jax.jit(self._score_impl, static_argnames=("k",))

    def _score_impl(self, state, tokens, mask, temperature, *, k: int):
        model = nnx.merge(self.graphdef, state)
        b, t = tokens.shape
        positions = jnp.clip(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
        hidden, _ = model(tokens, positions, attention_mask=mask)
        n = t // self.chunk
        h = hidden[:, :-1]
        h = jnp.concatenate([h, jnp.zeros_like(hidden[:, :1])], axis=1)  # position t-1 predicts nothing
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
        hc = h.reshape(b, n, self.chunk, -1).swapaxes(0, 1)
        tc = targets.reshape(b, n, self.chunk).swapaxes(0, 1)

        def one(xs):
            hh, tt = xs
            logits = model.logits(hh).astype(jnp.float32) / temperature
            lse = jax.nn.logsumexp(logits, axis=-1)
            lp = jnp.take_along_axis(logits, tt[..., None], axis=-1)[..., 0] - lse
            top_lp, top_id = jax.lax.top_k(logits, k)  # k=1: the argmax (lowest id on ties, as argmax)
            return lp, top_id.astype(jnp.int32), top_lp - lse[..., None]

        lp, top_id, top_lp = jax.lax.map(one, (hc, tc))
        unchunk = lambda x: x.swapaxes(0, 1).reshape(b, t, *x.shape[3:])[:, :-1]  # noqa: E731
        return unchunk(lp), unchunk(top_id), unchunk(top_lp)

    def _run(self, seqs: list[np.ndarray], k: int, temperature: float):
        if any(s.size < 2 for s in seqs):
            raise ValueError("a scored sequence needs at least 2 tokens (the first has no context)")
        t = _bucket(max(s.size for s in seqs), self.chunk)
        t = -(-t // self.chunk) * self.chunk
        b = 1 << (len(seqs) - 1).bit_length()
        tokens = np.zeros((b, t), np.int32)
        mask = np.zeros((b, t), bool)
        for i, s in enumerate(seqs):
            tokens[i, : s.size], mask[i, : s.size] = s, True
        temperature = np.float32(temperature)
        if self.mesh is not None:
            with set_mesh(self.mesh):
                out = self._fn(self.state, tokens, mask, temperature, k=k)
        else:
            out = self._fn(self.state, tokens, mask, temperature, k=k)
        return (np.asarray(jax.device_get(x)) for x in out)

    def score(self, sequences: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per sequence of length T: (logp[T-1] of tokens 1..T-1, argmax ids[T-1], their logp[T-1])."""
        seqs = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
        if not seqs:
            return []
        lp, top_id, top_lp = self._run(seqs, 1, self.temperature)
        return [(lp[i, : s.size - 1], top_id[i, : s.size - 1, 0], top_lp[i, : s.size - 1, 0])
                for i, s in enumerate(seqs)]

    def top_alternatives(self, sequences: Sequence[np.ndarray], k: int, temperature: float
                         ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per sequence of length T: the k most likely next tokens at every position, (ids
        [T-1, k], logp [T-1, k]) best first, under softmax(logits / temperature)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        seqs = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
        if not seqs:
            return []
        _, top_id, top_lp = self._run(seqs, int(k), temperature)
        return [(top_id[i, : s.size - 1], top_lp[i, : s.size - 1]) for i, s in enumerate(seqs)]

    def response_logprobs(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> list[np.ndarray]:
        """log p(response tokens | prompt, earlier response tokens), one array per pair."""
        seqs = [np.concatenate([np.asarray(p, np.int32), np.asarray(r, np.int32)]) for p, r in zip(prompts, responses)]
        scored = self.score(seqs)
        return [lp[len(p) - 1:].astype(np.float32) for (lp, _, _), p in zip(scored, prompts)]


# --- the HTTP side -----------------------------------------------------------------------------

@dataclass
class ScoreRequest:
    model: str
    prompt: list[int]
    logprobs: int
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, body: Any) -> "ScoreRequest":
        model = requested_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one token list
        if not (isinstance(prompt, list) and len(prompt) >= 1
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            raise RequestError(400, "'prompt' must be one list of token ids (non-negative integers): this server "
                                    "only scores given tokens; use /v1/chat/completions to generate text")
        if not body.get("echo"):
            raise RequestError(400, "only prompt scoring is served here: set 'echo': true and 'max_tokens': 0")
        max_tokens = body.get("max_tokens", 16)
        if max_tokens != 0:
            raise RequestError(400, f"'max_tokens' must be 0 (score the prompt, generate nothing), got {max_tokens!r}")
        logprobs = body.get("logprobs")
        if logprobs is None or isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 1:
            raise RequestError(400, f"'logprobs' must be 0 or 1 (top alternatives per position), got {logprobs!r}")
        if body.get("n", 1) != 1 or body.get("stream"):
            raise RequestError(400, "scoring takes n=1 and no streaming")
        return cls(model=model, prompt=list(prompt), logprobs=logprobs, raw=body)


def _piece(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def completion_body(req: ScoreRequest, logp: np.ndarray, top_id: np.ndarray, top_lp: np.ndarray,
                    tokenizer: Any = None) -> dict[str, Any]:
    """The OpenAI completions response for an echo-only scoring request."""
    tokens = [_piece(tokenizer, t) for t in req.prompt]
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    token_logprobs: list[float | None] = [None] + [float(x) for x in logp]
    top: list[dict[str, float] | None] = [None]
    for i in range(1, len(req.prompt)):
        entry = {tokens[i]: float(logp[i - 1])}
        if req.logprobs >= 1:
            entry.setdefault(_piece(tokenizer, int(top_id[i - 1])), float(top_lp[i - 1]))
        top.append(entry)
    n = len(req.prompt)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "text": "".join(tokens), "finish_reason": "length",
                     "logprobs": {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                                  "text_offset": offsets}}],
        "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n},
    }


async def handle_completion(body: Any, backends: dict[str, Any]) -> dict[str, Any]:
    """Answer a `/v1/completions` body with a backend that can score tokens
    (`async score_tokens(ids) -> (logp, top_id, top_logp)`); RequestError otherwise."""
    req = ScoreRequest.from_json(body)
    backend = backends.get(req.model)
    if backend is None:
        raise RequestError(404, f"model {req.model!r} not found; served: {sorted(backends)}", code="model_not_found")
    scorer = getattr(backend, "score_tokens", None)
    if scorer is None:
        raise RequestError(400, f"model {req.model!r} cannot score tokens (it is not a model on device)")
    if len(req.prompt) < 2:
        raise RequestError(400, "'prompt' needs at least 2 tokens to score (the first has no context)")
    ids = np.asarray(req.prompt, np.int32)
    release_body_slot()   # token ids need no tokenizing: a large body's slot is not held through scoring
    logp, top_id, top_lp = await scorer(ids)
    return completion_body(req, logp, top_id, top_lp, getattr(backend, "tokenizer", None))


class BackendScorer:
    """`score_tokens` for a ModelBackend: one TokenScorer per model object, run in a thread so
    the server's event loop keeps answering; requests are scored one at a time."""

    def __init__(self, sampler: Any, max_context: int, vocab_size: int):
        self.sampler = sampler
        self.max_context = max_context
        self.vocab_size = vocab_size
        self._scorer: TokenScorer | None = None
        self._model_id: int | None = None
        self._lock = asyncio.Lock()

    def _current(self) -> TokenScorer:
        model = self.sampler.model
        if self._scorer is None or self._model_id != id(model):
            self._scorer = TokenScorer(model, mesh=getattr(self.sampler, "mesh", None))
            self._model_id = id(model)
        return self._scorer

    async def __call__(self, ids: np.ndarray):
        if ids.size > self.max_context:
            raise RequestError(400, f"context too long: {ids.size} tokens, the model's context is {self.max_context}",
                               code="context_length_exceeded")
        if int(ids.max()) >= self.vocab_size:
            raise RequestError(400, f"token id {int(ids.max())} is outside the vocabulary ({self.vocab_size})")
        async with self._lock:
            scorer = self._current()
            ((lp, top_id, top_lp),) = await asyncio.to_thread(scorer.score, [ids])
        return lp, top_id, top_lp

    async def top_alternatives(self, sequences: Sequence[np.ndarray], k: int, temperature: float):
        """`TokenScorer.top_alternatives` on the served model, off the event loop."""
        async with self._lock:
            scorer = self._current()
            return await asyncio.to_thread(scorer.top_alternatives, sequences, k, temperature)


    async def response_logprobs(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]):
        """`TokenScorer.response_logprobs` on the served model, off the event loop."""
        async with self._lock:
            scorer = self._current()
            return await asyncio.to_thread(scorer.response_logprobs, prompts, responses)


def top_logprob_entries(tokenizer: Any, ids: np.ndarray, lps: np.ndarray) -> list[dict[str, Any]]:
    """OpenAI `top_logprobs` entries ({token, logprob, bytes}) of one position, best first."""
    out = []
    for tid, lp in zip(ids.tolist(), lps.tolist()):
        piece = _piece(tokenizer, tid)
        out.append({"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8", "replace"))})
    return out
