"""A `Backend` that answers chat completions with a local model, through the continuous-
batching engine (`actionopd serve`'s default) or the static Sampler.

Per request: render messages + tools with the chat template, check the context budget (a
400 when it does not fit), queue the prompt with its own settings and key. The engine runs it
in a slot as soon as one is free, beside whatever else is running, and its tokens stream out
after every segment (serve/engine_backend.py); the static sampler samples concurrent requests
in ONE device call (MicroBatcher). Each reply is decoded, cut at the first `stop` string, and
split into content / tool_calls / reasoning_content.

Rendering and tokenizing run off the event loop (a megabyte conversation takes seconds), so
one large request never stalls the server's other clients. `tool_choice` forcing a call
(a named function, or "required": the offered tool the model finds most likely) is honoured by
writing the start of that call after the prompt; the model writes its arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from typing import Any

import jax
import numpy as np

from actionopd_jax.chat.template import render_text
from actionopd_jax.sampling import Generation, Sampler
from actionopd_jax.sampling.batching import Continue, MicroBatcher
from actionopd_jax.serve.engine_backend import open_stream
from actionopd_jax.serve.requests import ChatChoice, ChatRequest, RequestError, release_body_slot, serial_calls
from actionopd_jax.serve.reply_format import forced_call, forced_call_prefix, message_fields
from actionopd_jax.serve.scoring import top_logprob_entries
from actionopd_jax.serve.segments import SegmentedJob
from actionopd_jax.serve.token_floor import TokenFloor


def request_key(seed: int | None) -> jax.Array:
    """The request's PRNG key: from its `seed` (any 64-bit int), else fresh OS entropy."""
    if seed is None:
        seed = secrets.randbits(64)
    seed &= (1 << 64) - 1
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32)


def _stop_cut(tokenizer, ids: np.ndarray, text: str, stops: list[str]) -> tuple[str, int] | None:
    """(text before the earliest stop string, tokens needed to produce it), or None."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    at, stop = min(hits)
    lo, hi = 1, len(ids)  # smallest prefix whose decoding already contains the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(ids[:mid].tolist(), skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return text[:at], lo


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """Server-side sampling settings for harnesses that send none (ToolSandbox's OpenAI agent
    sends only model, messages and tools): each applies when the request's body omits its
    field. `max_tokens_cap` bounds every reply, asked for or not (paper table 8's response
    limit holds whatever a harness sends); a reply cut there ends with finish_reason "length"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens_cap: int | None = None

    def apply(self, req: ChatRequest) -> ChatRequest:
        changes: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None and req.raw.get(name) is None:
                changes[name] = value
        if self.max_tokens_cap is not None:
            changes["max_tokens"] = min(req.max_tokens or self.max_tokens_cap, self.max_tokens_cap)
        return dataclasses.replace(req, **changes) if changes else req


class ModelBackend:
    """Serve `sampler`'s model under `model_name`.

    max_context: prompt + completion limit (default: the model's max_position_embeddings);
    default_max_tokens: completion budget when a request gives no max_tokens;
    batch_window_s: how long the first queued request waits for others to join its batch;
    segment_tokens: new tokens per device call (serve/segments.py): a client that disconnects
    holds the device for at most one segment, and new requests join between segments; None
    (default): each generation in one call, the fewest compiled shapes (batch evaluation).

    `sampler` may be a continuous-batching `Engine` (the same samples): requests then run in
    its slots as they arrive, their tokens stream as its segments end (`stream`), and the
    engine's own segment length applies (segment_tokens and the batch window are unused);
    max_context is then at most the engine's max_len.
    """

    def __init__(self, sampler: Sampler, tokenizer: Any, *, model_name: str = "actionopd",
                 max_context: int | None = None, default_max_tokens: int = 1024,
                 batch_window_s: float = 0.005, max_batch_requests: int = 64, enable_thinking: bool = False,
                 segment_tokens: int | None = None, defaults: RequestDefaults | None = None):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context or sampler.cfg.max_position_embeddings)
        self.token_floor = TokenFloor(tokenizer)   # tokens a rendered prompt has at least (_render)
        self.source: dict = {}      # what was loaded (serve/cli.py): /v1/models shows it
        if not 1 <= self.max_context <= sampler.cfg.max_position_embeddings:
            raise ValueError(f"max_context {self.max_context} must be between 1 and the model's context "
                             f"(max_position_embeddings {sampler.cfg.max_position_embeddings}); "
                             "lower --max-context or leave it unset")
        if segment_tokens is not None and segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1 (or None), got {segment_tokens}")
        self.segment_tokens = segment_tokens
        self.default_max_tokens = default_max_tokens
        self.enable_thinking = enable_thinking
        self.defaults = defaults or RequestDefaults()
        self.end_ids = set(int(i) for i in sampler.eos_ids)
        self.batcher = MicroBatcher(self._sample_batch, window_s=batch_window_s, max_items=max_batch_requests)
        # a continuous-batching engine generates through its own stepping thread (requests join
        # and leave between its segments, tokens stream as they come); a Sampler through the batcher
        from actionopd_jax.engine import Engine
        from actionopd_jax.serve.engine_runner import EngineRunner

        self.runner = EngineRunner(sampler) if isinstance(sampler, Engine) else None
        if self.runner is not None and self.max_context > sampler.config.max_len:
            if max_context is not None:
                raise ValueError(f"max_context {self.max_context} exceeds the engine's max_len of "
                                 f"{sampler.config.max_len} tokens per slot; raise the engine's max_len or "
                                 "lower --max-context")
            self.max_context = sampler.config.max_len
        # /v1/completions echo scoring (token-level OPD teacher logprobs), serve/scoring.py
        from actionopd_jax.serve.scoring import BackendScorer

        self.score_tokens = BackendScorer(sampler, self.max_context, sampler.cfg.vocab_size)

    @property
    def device_calls(self) -> int:
        return len(self.batcher.batch_sizes)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop generating: every request still running is withdrawn and the engine's thread
        joined (serve calls this once its HTTP side has stopped). False when the thread was
        still busy after `timeout_s`."""
        stopped = self.runner.close(timeout_s) if self.runner is not None else True
        self.batcher.close()
        return stopped

    # --- request -> job ------------------------------------------------------------------
    def _render(self, req: ChatRequest) -> np.ndarray:
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in req.messages]
        kwargs = req.raw.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking", self.enable_thinking) if isinstance(kwargs, dict) else self.enable_thinking
        try:
            text = render_text(self.tokenizer, messages, req.tools, enable_thinking=bool(thinking))
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise RequestError(400, f"cannot render the conversation with the chat template: {e}") from e
        # refused before tokenizing, from the rendered text's size: every field the model reads
        # (content, tool-call arguments, tool schemas, ...) is in it, nothing it does not read is
        floor = self.token_floor(text)
        room = self.max_context - floor
        if room <= 0 or (req.max_tokens is not None and req.max_tokens > room):
            asked = f" + max_tokens {req.max_tokens}" if req.max_tokens is not None else ""
            raise RequestError(400, f"context too long: the prompt has at least {floor:,} tokens{asked} (its "
                                    f"{len(text):,} characters of messages, tool calls and tool schemas, at most "
                                    f"{self.token_floor.max_token_bytes} bytes a token), the model's context is "
                                    f"{self.max_context:,} tokens; shorten the conversation or the tools, or lower "
                                    "max_tokens", code="context_length_exceeded")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)

    def _budget(self, req: ChatRequest, prompt_len: int) -> int:
        room = self.max_context - prompt_len
        if room <= 0 or (req.max_tokens is not None and req.max_tokens > room):
            asked = f" + max_tokens {req.max_tokens}" if req.max_tokens is not None else ""
            raise RequestError(400, f"context too long: the prompt has {prompt_len} tokens{asked}, the model's "
                                    f"context is {self.max_context} tokens; shorten the conversation or lower max_tokens",
                               code="context_length_exceeded")
        return min(room, req.max_tokens if req.max_tokens is not None else self.default_max_tokens)

    async def _prepare(self, req: ChatRequest) -> tuple[np.ndarray, str | None, int, float, float]:
        """(prompt ids, forced tool name or None, token budget, temperature, top_p) of a request."""
        prompt_ids = await asyncio.to_thread(self._render, req)
        release_body_slot()   # tokenized: the next large body may be read (OpenAIServer.max_large_bodies)
        forced = None
        if req.tool_choice == "required":
            forced = req.forced_tool or await self._likeliest_tool(req, prompt_ids)
            prompt_ids = np.concatenate([prompt_ids, self._encode(forced_call_prefix(forced))])
        max_new = self._budget(req, prompt_ids.size)
        # top_p 0 means "only the most likely token": greedy
        temperature, top_p = (req.temperature, req.top_p) if req.top_p > 0 else (0.0, 1.0)
        return prompt_ids, forced, max_new, temperature, top_p

    @property
    def streams_live(self) -> bool:
        """True when `stream` sends tokens as they are generated (the engine); else the server
        streams the finished reply from `complete`."""
        return self.runner is not None

    async def stream(self, req: ChatRequest):
        """(prompt tokens, an async iterator of ("delta", choice, field, text) events and a last
        ("choices", [ChatChoice])); a request the engine cannot take raises here (an HTTP
        error, before any of the stream is sent). Engine only (`streams_live`)."""
        req = self.defaults.apply(req)
        prompt_ids, forced, max_new, temperature, top_p = await self._prepare(req)
        events = await open_stream(self, req, prompt_ids, forced, max_new, temperature, top_p, request_key(req.seed))
        return int(prompt_ids.size), events

    def warm_up(self) -> float:
        """One short request before the server reports ready, so its programs (prefill, decode)
        are compiled then and not on a client's first request (issue 34: a 3.6 s stall on the
        tiny model, tens of seconds for 4B on a GPU). Returns its seconds."""
        import time

        t0 = time.perf_counter()
        req = ChatRequest(model=self.model_name, messages=[{"role": "user", "content": "warm-up"}], max_tokens=2,
                          temperature=0.0)
        asyncio.run(self.complete(req))
        return time.perf_counter() - t0

    async def complete(self, req: ChatRequest) -> tuple[list[ChatChoice], int]:
        if self.runner is not None:
            prompt_tokens, events = await self.stream(req)
            async with contextlib.aclosing(events):
                async for event in events:
                    if event[0] == "choices":
                        return event[1], prompt_tokens
            raise RuntimeError("the engine's event stream ended without the choices")
        req = self.defaults.apply(req)
        prompt_ids, forced, max_new, temperature, top_p = await self._prepare(req)
        job = SegmentedJob(prompt_ids=prompt_ids, n=req.n, max_new=max_new, temperature=temperature, top_p=top_p,
                           top_k=req.top_k, key=request_key(req.seed), segment=self.segment_tokens or max_new)
        generations: list[Generation] = await self.batcher.submit(job)
        return await self.choices(req, prompt_ids, generations, forced, temperature), int(prompt_ids.size)

    async def choices(self, req: ChatRequest, prompt_ids: np.ndarray, generations: list[Generation],
                      forced: str | None, temperature: float) -> list[ChatChoice]:
        """The finished generations as choices (with top_logprobs when asked: a scoring pass)."""
        choices = [self._choice(req, g, forced) for g in generations]
        if req.logprobs and req.top_logprobs:
            await self._fill_top_logprobs(req, prompt_ids, choices, temperature or 1.0)
        return [c for c, _ in choices]

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)

    async def _likeliest_tool(self, req: ChatRequest, prompt_ids: np.ndarray) -> str:
        """tool_choice "required": the offered tool whose call opening the model scores highest
        after the prompt (one scoring pass; the only one when a single tool is offered)."""
        names = [t["function"]["name"] for t in req.tools or []]
        if len(names) == 1:
            return names[0]
        openings = [self._encode(forced_call_prefix(n)) for n in names]
        self._budget(req, prompt_ids.size + max(o.size for o in openings))
        scored = await self.score_tokens.response_logprobs([prompt_ids] * len(names), openings)
        return names[int(np.argmax([float(lp.sum()) for lp in scored]))]

    async def _fill_top_logprobs(self, req: ChatRequest, prompt_ids: np.ndarray, choices, temperature: float):
        """Alternatives at each generated token from one scoring pass over prompt + reply, at the
        temperature the logprobs are reported at (the decode loop keeps only the chosen token's)."""
        kept = [(c, ids) for c, ids in choices if ids.size]
        scored = await self.score_tokens.top_alternatives(
            [np.concatenate([prompt_ids, ids]) for _, ids in kept], req.top_logprobs, temperature)
        for (choice, ids), (top_ids, top_lps) in zip(kept, scored):
            at = prompt_ids.size - 1  # position predicting the first generated token
            for t, entry in enumerate(choice.logprobs):
                entry["top_logprobs"] = top_logprob_entries(self.tokenizer, top_ids[at + t], top_lps[at + t])

    # --- the device call ---------------------------------------------------------------------
    def _sample_batch(self, jobs: list[SegmentedJob]) -> list:
        """One device call for the next segment of every job: its generations when done, else
        Continue(job) (the batcher runs it again, unless its client has gone)."""
        per_job = [j.calls() for j in jobs]
        calls = [(j, c) for j, cs in zip(jobs, per_job) for c in cs]
        result = self.sampler.sample(
            [c[0] for _, c in calls], n=[c[1] for _, c in calls], max_new_tokens=[c[2] for _, c in calls],
            temperature=[j.temperature for j, _ in calls], top_p=[j.top_p for j, _ in calls],
            top_k=[j.top_k for j, _ in calls], key=[c[3] for _, c in calls])
        out, at = [], 0
        for job, cs in zip(jobs, per_job):
            done = job.absorb(result.generations[at:at + len(cs)])
            at += len(cs)
            out.append(job.result() if done else Continue(job))
        return out

    # --- generation -> choice ------------------------------------------------------------------
    def _choice(self, req: ChatRequest, gen: Generation, forced: str | None = None) -> tuple[ChatChoice, np.ndarray]:
        """The choice, and the generated ids its text and logprobs cover."""
        ids, logprobs = gen.token_ids, gen.logprobs
        if gen.finish_reason == "stop" and ids.size and int(ids[-1]) in self.end_ids:
            ids, logprobs = ids[:-1], logprobs[:-1]  # the end token is not part of the text
        finish, produced = gen.finish_reason, int(gen.token_ids.size)
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        cut = _stop_cut(self.tokenizer, ids, text, req.stop or [])
        if cut is not None:
            text, kept = cut
            ids, logprobs, finish, produced = ids[:kept], logprobs[:kept], "stop", kept
        if forced is not None:  # the reply is the forced call: its arguments are what the model wrote
            content, tool_calls, reasoning = None, [forced_call(forced, text)], None
        else:
            offered = {t["function"]["name"] for t in req.tools or []}
            content, tool_calls, reasoning = message_fields(
                text, parse_tools=req.tool_choice != "none" and bool(offered), offered=offered)
            tool_calls = serial_calls(req, tool_calls)
        token_logprobs = None
        if req.logprobs:
            token_logprobs = []
            for tid, lp in zip(ids.tolist(), logprobs.tolist()):
                piece = self.tokenizer.decode([tid], skip_special_tokens=False)
                token_logprobs.append({"token": piece, "logprob": float(lp),
                                       "bytes": list(piece.encode("utf-8", "replace")), "top_logprobs": []})
        return ChatChoice(content=content, tool_calls=tool_calls, reasoning_content=reasoning,
                          finish_reason=finish, logprobs=token_logprobs, completion_tokens=produced), ids
