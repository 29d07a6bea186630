"""The engine loop of `hal.server.app`: one thread owns the `SpeculativeDecoder` (adds,
aborts, steps); HTTP handlers talk to it only through queues (`EngineLoop.submit_all`,
`abort`, `close`), and each request's events come back on its asyncio queue (`Handle`)."""

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from hal.errors import HalError
from hal.server.openai_schema import Parsed


@dataclass(frozen=True)
class Tokens:
    """New tokens of a request (and their logprobs, when it asked for them)."""

    ids: list[int]
    logprobs: list | None = None


@dataclass(frozen=True)
class Finished:
    """The request ended: ``reason`` is ``stop``, ``length`` or ``abort``."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The request failed: ``invalid`` when its own parameters stopped it (a 400 naming the
    first of them), else the engine did (a 500)."""

    message: str
    invalid: bool = False


@dataclass(frozen=True)
class Shutdown:
    """Cut by SIGTERM at ``--shutdown-timeout``."""


Event = Tokens | Finished | Failed | Shutdown


@dataclass
class Handle:
    """One HTTP request as the engine loop sees it; events go back through ``q``: `Tokens`,
    then one of `Finished`, `Failed` or `Shutdown`."""

    parsed: Parsed
    q: asyncio.Queue
    aio: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    rid: int | None = None
    first: float | None = None
    generated: int = 0
    last: int | None = None
    cancelled: bool = False
    done: bool = False

    held: list[int] = field(default_factory=list)   # tokens not yet pushed (`whole`)
    held_logprobs: list | None = None

    @property
    def whole(self) -> bool:
        """Its answer goes out in one body and no stop string needs its text as it grows: its
        tokens are held and pushed once at its end, so the event loop (and its thread) is not
        woken every step while the engine decodes."""
        return not self.parsed.stream and not self.parsed.stop

    def push(self, event: Event) -> None:
        try:
            self.aio.call_soon_threadsafe(self.q.put_nowait, event)
        except RuntimeError:   # the event loop is gone (shutdown)
            pass

    def tokens(self, ids: list[int], logprobs: list | None) -> None:
        """A step's new tokens: pushed now, or held while `whole`."""
        if not self.whole:
            self.push(Tokens(ids, logprobs))
            return
        self.held += ids
        if logprobs is not None:
            self.held_logprobs = (self.held_logprobs or []) + list(logprobs)

    def flush(self) -> None:
        """Push the held tokens (before the request's last event)."""
        if self.held:
            self.push(Tokens(self.held, self.held_logprobs))
            self.held, self.held_logprobs = [], None


class Busy(Exception):
    pass


class Closing(Exception):
    pass


class EngineLoop:
    """Owns the engine: adds, aborts and steps in one thread. ``submit_all``, ``abort`` and
    ``close`` are safe from any thread; events reach each request's asyncio queue."""

    def __init__(self, dec, metrics=None, max_in_flight: int = 256, on_idle=None):
        self.dec, self.metrics, self.max_in_flight = dec, metrics, max_in_flight
        self.on_idle = on_idle   # called in this thread while nothing runs (a worker's rejoin)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[int, Handle] = {}
        self.in_flight, self._lock = 0, threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.error: str | None = None   # why the engine failed (`failed`)
        self.deadline: float | None = None   # set by `close`: in-flight requests are cut then
        self.thread = threading.Thread(target=self._run, name="hal-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self, timeout: float) -> None:
        """Stop accepting (`submit_all` raises `Closing`); what is in flight may run ``timeout``
        more seconds, then each request still running ends with `Shutdown`."""
        with self._lock:
            if self.deadline is None:
                self.deadline = time.monotonic() + timeout
        self.inbox.put(("wake", None, None))

    @property
    def closing(self) -> bool:
        return self.deadline is not None

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout)

    def submit_all(self, handles: list[Handle]) -> None:
        """Queue every handle (the choices of one request), or none (`Busy`, `Closing`)."""
        with self._lock:
            if self.deadline is not None:
                raise Closing
            if self.in_flight + len(handles) > self.max_in_flight:
                raise Busy
            self.in_flight += len(handles)
        for h in handles:
            self.inbox.put(("add", h, None))

    def abort(self, h: Handle, reason: str = "abort") -> None:
        """End ``h`` now, its blocks freed; ``reason`` is what it is counted as (``stop``: its
        text hit a stop string)."""
        self.inbox.put(("abort", h, reason))

    def wait_drained(self, timeout: float) -> bool:
        """Block until no request is in flight (each has had its last event), at most
        ``timeout`` seconds; whether it drained."""
        with self._drained:
            return self._drained.wait_for(lambda: self.in_flight == 0, timeout)

    def _done(self, h: Handle, event: Event) -> None:
        if not h.done:
            h.done = True
            h.flush()
            h.push(event)
            with self._lock:
                self.in_flight -= 1
                self._drained.notify_all()

    def _end(self, h: Handle, event: Event, reason: str) -> None:
        """The one place a request that ran ends: recorded (its ``finished_reason``), then its last event."""
        if self.metrics:
            self.metrics.finished(h.arrival, h.first, time.perf_counter(), len(h.parsed.prompt_ids), h.generated,
                                  reason)
        self._done(h, event)

    def _cut(self, event: Event, reason: str = "abort") -> None:
        for rid, h in list(self.live.items()):
            self.dec.abort(rid)   # frees its blocks, target and draft
            self._end(h, event, reason)
        self.live.clear()

    def _run(self) -> None:
        # every change of the engine's state happens in this thread, in inference mode (as in
        # `SpeculativeDecoder.step`): tensors a step made are updated in place by adds and aborts too
        with torch.inference_mode():
            try:
                while not self._stop.is_set():
                    self._drain(block=not self.dec.has_unfinished())
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        self._cut(Shutdown())
                    if self.dec.has_unfinished():
                        self._dispatch(self.dec.step())
                    elif self.on_idle is not None:
                        self.on_idle()
            except Exception as e:   # not one request's: the engine is broken; fail everything, say so, stop
                self.error = f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
                self._broken(Failed(f"the engine failed: {self.error}"))
                return
            self._cut(Shutdown())   # stopping: end what is left

    def _broken(self, event: Event) -> None:
        """End every request in flight (running, or still in the inbox) with ``event`` and refuse
        new ones; `failed` is then true (the server exits non-zero; /health says error meanwhile)."""
        with self._lock:
            self.deadline = self.deadline if self.deadline is not None else time.monotonic()
        for h in list(self.live.values()):
            self._end(h, event, "error")
        self.live.clear()
        while True:
            try:
                kind, h, _ = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._done(h, event)

    @property
    def failed(self) -> bool:
        """The engine failed in a way no one request explains: this loop has stopped for good."""
        return self.error is not None and not self.thread.is_alive()

    def _drain(self, block: bool) -> None:
        items = []
        try:
            items.append(self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        for kind, handle, reason in items:
            if kind == "add":
                self._add(handle)
            elif kind == "abort":
                handle.cancelled = True
                if handle.rid is not None and self.live.pop(handle.rid, None) is not None:
                    self.dec.abort(handle.rid)   # frees its blocks now, target and draft
                    self._end(handle, Finished(reason), reason)
        if items and self.metrics:
            self.metrics.gauges(self.dec)

    def _add(self, handle: Handle) -> None:
        """Queue one request in the engine; if that fails, it alone is answered (a 400 for its own
        input, a 500 naming it otherwise). `SpeculativeDecoder.add` changes nothing when it raises."""
        if handle.cancelled:
            self._done(handle, Finished("abort"))
            return
        try:
            handle.rid = self.dec.add(handle.parsed.params.request(handle.parsed.prompt_ids))
        except HalError as e:
            self._done(handle, Failed(str(e), invalid=True))
            return
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._done(handle, Failed(f"the engine could not queue this request: {type(e).__name__}: {e}"))
            return
        self.live[handle.rid] = handle

    def _dispatch(self, out) -> None:
        now = time.perf_counter()
        for rid, toks in out.tokens.items():
            if (handle := self.live.get(rid)) is None:
                continue
            if handle.first is None:
                handle.first = now
                if self.metrics:
                    self.metrics.first_token(handle.arrival, now)
            handle.generated += len(toks)
            handle.last = toks[-1]
            handle.tokens(toks, out.logprobs.get(rid))
        if self.metrics:
            self.metrics.step(self.dec, out)
        for rid in out.finished:
            if (handle := self.live.pop(rid, None)) is None:
                continue
            reason = "error" if rid in out.errors else "stop" if handle.last in handle.parsed.params.stop_ids \
                else "length"
            self._end(handle, Failed(out.errors[rid], invalid=True) if rid in out.errors else Finished(reason), reason)
