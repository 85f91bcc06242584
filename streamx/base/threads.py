"""Threads that stop together: a worker whose error reaches the main thread, queue hand-offs that
give up when the run fails, and the signals that ask a run to wind up.

A run's threads share two events, each named for who sets it, and a third for what came of the second:

    failed     set by the first thread that fails (Worker), or by the main thread on its way out:
               every stage gives up at once (a waiting thread raises `Stopped`)
    signalled  set by SIGINT / SIGTERM (SignalStop): the run winds up, taking no new work and finishing
               and committing what it holds
    rows_left  set by a stage that, winding up, left rows for the resume (not when the data ran out first)

Every stage waits on a bounded queue (or the pinned-buffer ring) with a short timeout and looks at
`failed` in between, so that no thread blocks forever once another has failed. A thread that finds
the run failed raises `Stopped`: it did nothing wrong, and the error to report is the one that set
`failed`.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

POLL_SECONDS = 0.1  # how often a waiting thread looks at the failed event


class Stopped(Exception):
    """Raised in a thread that was waiting when the run stopped."""


class Worker(threading.Thread):
    """A daemon thread that keeps its exception for the main thread and then sets `failed`; a thread
    that ends with `Stopped` ends cleanly. Its torch operations run on one thread: a side thread that
    starts a parallel region of its own gets a pool of OpenMP threads beside the main thread's, and
    once the pools outnumber the cores, OpenMP stops keeping any pool's threads awake between regions,
    so every small CPU operation of the main thread's forward pass waits for a thread to wake (on 2
    cores, 9 -> 37 us an elementwise op; bench/RESULTS.md)."""

    def __init__(self, name: str, target: Callable[[], None], failed: threading.Event):
        super().__init__(name=name, daemon=True)
        self._target_fn, self.failed, self.error = target, failed, None
        self._on_one_thread = threading.Event()

    def start(self) -> None:
        threads = torch.get_num_threads()  # the starting thread's
        super().start()
        self._on_one_thread.wait()
        # torch.set_num_threads also sets what threads started later begin with: give them the starter's back
        torch.set_num_threads(threads)

    def run(self) -> None:
        try:
            torch.set_num_threads(1)
            self._on_one_thread.set()
            self._target_fn()
        except Stopped:
            pass
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error = err
            self.failed.set()
        finally:
            self._on_one_thread.set()


def put(q: queue.Queue, item: Any, failed: threading.Event) -> None:
    """Put, waiting for room; raises Stopped if the run fails first."""
    while not failed.is_set():
        try:
            q.put(item, timeout=POLL_SECONDS)
            return
        except queue.Full:
            continue
    raise Stopped


def get(q: queue.Queue, failed: threading.Event, *also: threading.Event) -> Any:
    """Get, waiting for an item; raises Stopped if the run fails (or one of `also` is set) while the queue is
    empty."""
    while True:
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if failed.is_set() or any(e.is_set() for e in also):
                raise Stopped from None


def first_error(workers: list[Worker]) -> BaseException:
    """The error that stopped a run, for the main thread to raise once every worker has ended."""
    errors = [w.error for w in workers if w.error is not None]
    return errors[0] if errors else RuntimeError("a pipeline thread stopped without an error")


class Interrupted(KeyboardInterrupt):
    """A second signal: stop at once (what was committed stays). `signal` says which, for the exit code."""

    def __init__(self, signum: signal.Signals):
        super().__init__(f"stopped at once by a second {signum.name}: what was committed or written stays; run the "
                         "same command again to resume")
        self.signal = signum


class SignalStop:
    """SIGINT (Ctrl-C) and SIGTERM (Slurm, preemption, `kill`) ask a run to wind up: `signalled` is set, the
    stages stop taking new work and finish and commit what they hold; `signal` says which came. A second
    signal stops at once (Interrupted, a KeyboardInterrupt; what was committed stays), but one within
    PASSED_ON_SECONDS of the first is that same request passed on: torchrun passes every signal it gets to its
    workers, which Ctrl-C (the terminal's whole process group) and Slurm (every process of a step) signal too.
    Python delivers signals to the main thread, so the handlers are installed only there, and the previous ones
    are put back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    PASSED_ON_SECONDS = 1.0

    def __init__(self, signalled: threading.Event, log: Callable[[str], None], enabled: bool = True):
        self.signalled, self.log, self.enabled = signalled, log, enabled
        self.signal: signal.Signals | None = None
        self._first_at = -math.inf
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
        if self.signalled.is_set():
            if time.monotonic() - self._first_at < self.PASSED_ON_SECONDS:
                return
            raise Interrupted(signal.Signals(signum))
        self.signal, self._first_at = signal.Signals(signum), time.monotonic()
        self.signalled.set()
        self.log(f"{self.signal.name}: finishing the batch in hand and committing what is written "
                 "(send it again to stop at once)")
