"""The engine's front: what callers in other threads use. Thread-safe submission (a request is
queued before a stop, or refused after it), the background loop (`start`, `stop`), cancellation
(`cancel_all`), and the inbox the engine's own thread empties at each iteration. The engine
(`engine.Engine`) subclasses it and supplies the iteration itself.
"""
from __future__ import annotations

import itertools
import queue
import threading
from typing import Callable, Optional

from medusa_jax.decoding.requests import EngineStopped, Request, RequestHandle


class EngineFront:
    """Submission, the background loop and cancellation, for a subclass that implements `step`
    (one iteration; returns whether work remains), `check` (a request with its id set, or the
    errors of its checks), `_queue` (a submitted handle joins the waiting requests),
    `_drop_cancelled` and `_fail_all` (end every request with an error message)."""

    def __init__(self):
        self.inbox: "queue.Queue[RequestHandle]" = queue.Queue()
        self._open: set = set()  # requests submitted, not finished (`cancel_all`); each set call is atomic
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()  # set by stop(), cleared by start(): submissions are refused while set
        self._submitting = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def _next_id(self) -> str:
        return str(next(self._ids))

    def submit(self, request: Request, on_event: Optional[Callable[[str, object], None]] = None) -> RequestHandle:
        """Queue a request (thread-safe); it starts at the engine's next iteration.

        on_event: called from the engine's thread with ``("tokens", [ids])`` each step and
        ``("done", Finished)`` at the end; without it the events go to the handle's queue.
        Raises: as `check`, and EngineStopped after `stop` (nothing is queued then).
        """
        handle = RequestHandle(self.check(request), on_event)
        with self._submitting:  # a submission is queued before a stop, or refused after it
            if self._stop.is_set():
                raise EngineStopped(f"request {handle.request.request_id}: the engine was stopped (Engine.stop); "
                                    "start() it again to submit")
            self._open.add(handle)
            self.inbox.put(handle)
        self._wake.set()
        return handle

    def run(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Iterate in this thread until idle (or until `until()` is true)."""
        while self.step():
            if until is not None and until():
                return

    def start(self) -> "EngineFront":
        """Run the loop in a background thread (the server); `stop` ends it."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="medusa-engine", daemon=True)
            self._thread.start()
        return self

    def cancel_all(self) -> None:
        """Cancel every request submitted so far, running, prefilling or waiting: each ends
        ("cancelled") at the loop's next iteration, or between two chunks of a prefill. Safe to call
        from any thread (the server, as its shutdown grace runs out)."""
        for h in set(self._open):  # a copy: the engine's thread removes finished ones
            if not h.cancelled.is_set():  # one a stop sequence ended keeps its reason
                h.cancel()
        self._wake.set()

    def stop(self, cancel: bool = True, timeout: Optional[float] = None) -> None:
        """End the background loop; with `cancel`, every request still running or waiting ends
        ("cancelled") first. Later submissions raise EngineStopped until `start`."""
        with self._submitting:  # first: a request submitted from now on is refused, any before it cancelled
            self._stop.set()
        if cancel:
            self.cancel_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if cancel:
            self._take_submissions()
            self._drop_cancelled()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception as e:  # a bug: end every request with the error, keep serving the next ones
                self._fail_all(f"{type(e).__name__}: {e}")
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _take_submissions(self) -> None:
        while True:
            try:
                h = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._queue(h)
