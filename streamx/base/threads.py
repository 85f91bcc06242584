"""Threads that stop together: a worker whose error reaches the main thread, queue hand-offs that
give up when the run stops, and the signals that ask a run to wind up.

Every stage waits on a bounded queue (or the pinned-buffer ring) with a short timeout and looks at
the run's `stop` event in between, so that no thread blocks forever once another has failed. A
thread that finds the run stopped raises `Stopped`: it did nothing wrong, and the error to report
is the one that set `stop`.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.1  # how often a waiting thread looks at the stop event


class Stopped(Exception):
    """Raised in a thread that was waiting when the run stopped."""


class Worker(threading.Thread):
    """A daemon thread that keeps its exception for the main thread and then sets `stop`; a thread
    that ends with `Stopped` ends cleanly."""

    def __init__(self, name: str, target: Callable[[], None], stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self._target_fn, self.stop, self.error = target, stop, None

    def run(self) -> None:
        try:
            self._target_fn()
        except Stopped:
            pass
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error = err
            self.stop.set()


def put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Put, waiting for room; raises Stopped if the run stops first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_SECONDS)
            return
        except queue.Full:
            continue
    raise Stopped


def get(q: queue.Queue, stop: threading.Event, *also: threading.Event) -> Any:
    """Get, waiting for an item; raises Stopped if the run stops (or one of `also` is set) while the queue is
    empty."""
    while True:
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if stop.is_set() or any(e.is_set() for e in also):
                raise Stopped from None


def first_error(workers: list[Worker]) -> BaseException:
    """The error that stopped a run, for the main thread to raise once every worker has ended."""
    errors = [w.error for w in workers if w.error is not None]
    return errors[0] if errors else RuntimeError("a pipeline thread stopped without an error")


class SignalStop:
    """SIGINT (Ctrl-C) and SIGTERM (Slurm, preemption, `kill`) ask a run to wind up: `requested` is set, the
    stages stop taking new batches and the writer commits what it holds. A second signal stops at once
    (KeyboardInterrupt; what was committed stays). Python delivers signals to the main thread, so the
    handlers are installed only there, and the previous ones are put back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, requested: threading.Event, log: Callable[[str], None], enabled: bool = True):
        self.requested, self.log, self.enabled = requested, log, enabled
        self.signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            if handler is not None:  # None: a handler installed from C, which Python cannot put back
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum)
        self.requested.set()
        self.log(f"{self.signal.name}: finishing the batch in hand and committing what is written "
                 "(send it again to stop at once)")
