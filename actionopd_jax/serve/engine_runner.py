"""One thread that owns a continuous-batching `Engine` and steps it while requests exist.

The server's handlers run on an asyncio loop; the engine is not thread-safe and a segment
takes a device call, so every engine call happens in this one thread. A handler `submit`s a
request and reads its `Ticket.queue`, which the thread feeds after every engine step with
each sample's new tokens: requests join and leave between segments, and a handler whose
client has gone `cancel`s its ticket, which frees the request's slots at the next step (the
running segment is the most it still costs). The thread ends when the engine is idle and a
new submission starts another, so an idle server holds no thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from typing import Any

import numpy as np


@dataclasses.dataclass
class SampleUpdate:
    """Sample `index`'s tokens (and their logprobs) from one engine step; `done`: the sample
    has ended, `stopped`: by an end token (else its token budget)."""

    index: int
    tokens: list[int]
    logprobs: list[float]
    done: bool
    stopped: bool


class Ticket:
    """A submitted request as its handler sees it. `queue` gets "accepted" once the engine
    took the request, an Exception when it refused it or a step failed, and after each engine
    step that advanced it a list of `SampleUpdate`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, args: dict[str, Any]):
        self.loop, self.args = loop, args
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request = None        # the engine's Request, once submitted
        self.cancelled = False
        self._sent: list[int] = []

    def _push(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:       # the server's loop has closed: nobody is listening
            self.cancelled = True
            return False


class EngineRunner:
    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._inbox: list[Ticket] = []
        self._live: list[Ticket] = []
        self._thread: threading.Thread | None = None
        self.steps = 0             # engine steps run (tests and logs)
        # (engine step, ids of the requests whose samples ran in its segment): who shared which
        self.history: collections.deque = collections.deque(maxlen=4096)
        # (request id, engine steps run when it was withdrawn before its end)
        self.withdrawn: collections.deque = collections.deque(maxlen=4096)

    def submit(self, prompt: np.ndarray, **args) -> Ticket:
        """Queue a request (`Engine.submit`'s arguments); call from the event loop."""
        ticket = Ticket(asyncio.get_running_loop(), dict(prompt=prompt, **args))
        with self._lock:
            self._inbox.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-steps", daemon=True)
                self._thread.start()
        return ticket

    def close(self, timeout_s: float = 60.0) -> bool:
        """Withdraw every request and wait for the stepping thread to end (the segment on the
        device finishes first). True once no thread runs. The thread is a daemon, so without
        this a process exiting mid-segment would end it inside the device runtime, which aborts
        the process (std::terminate: issue 34's "terminate called after throwing")."""
        with self._lock:
            for ticket in self._inbox + self._live:
                ticket.cancelled = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def cancel(self, ticket: Ticket) -> None:
        """Withdraw a request (its client left, or it needs no more tokens); any thread."""
        ticket.cancelled = True
        req = ticket.request
        if req is not None and not req.done:
            self.withdrawn.append((req.rid, self.steps))

    # --- the stepping thread ----------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                arrived, self._inbox = self._inbox, []
                if not arrived and not self._live and not engine.busy:
                    self._thread = None
                    return
            for ticket in arrived:
                self._admit(ticket)
            for ticket in self._live:
                if ticket.cancelled:
                    engine.cancel(ticket.request)
            self._live = [t for t in self._live if not t.cancelled]
            if not engine.busy:
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - every waiting handler gets the error
                engine.abort()
                for ticket in self._live:
                    ticket._push(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
                self._live = []
                continue
            self.steps += 1
            ran = {r.rid for r, _ in engine.running.values()} | {r.rid for r in finished}
            self.history.append((self.steps, tuple(sorted(ran))))
            self._report()

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            return
        try:
            ticket.request = self.engine.submit(**ticket.args)
        except ValueError as e:  # the engine's shapes cannot take it: the client's request is too big
            ticket._push(e)
            return
        ticket._sent = [0] * ticket.request.n
        if ticket._push("accepted"):
            self._live.append(ticket)
        else:
            self.engine.cancel(ticket.request)

    def _report(self) -> None:
        still = []
        for ticket in self._live:
            req = ticket.request
            if not req.tokens:         # not admitted yet (waiting for slots or pages)
                still.append(ticket)
                continue
            updates = []
            for j in range(req.n):
                made, sent = len(req.tokens[j]), ticket._sent[j]
                done = bool(req.finished[j])
                if sent < 0:               # its end was reported already
                    continue
                if made > sent or done:
                    updates.append(SampleUpdate(j, req.tokens[j][sent:], req.logprobs[j][sent:], done,
                                                bool(req.stopped[j])))
                    ticket._sent[j] = -1 if done else made
            if updates and not ticket._push(updates):
                self.engine.cancel(req)
            if not req.done:  # (a cancelled one stays: the loop withdraws it from the engine)
                still.append(ticket)
        self._live = still


__all__ = ["EngineRunner", "SampleUpdate", "Ticket"]
