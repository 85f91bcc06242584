"""One scheduler for `streamx regenerate`: up to --concurrency conversations in flight, each one's next turn
asked for as soon as its last reply is in, and each row taken the moment its conversation ends.

What differs between engines is only their step (`Steps`): an engine that answers one request at a time
(Endpoints over HTTP) runs on --concurrency threads and hands back each reply as it comes (`ThreadSteps`); an
engine that answers a batch (the model in this process) generates every request sent since its last step at
once (`BatchSteps`).

Rows are taken as they finish, not in source order: a slow conversation holds back nothing but its own slot
(a resume skips rows by id, whatever their order in the file), and memory is bounded by the conversations in
flight. SIGINT / SIGTERM (`signalled`) stop at turn boundaries: no new row starts, a request waiting to retry
ends, and a conversation whose turn comes back asks for no further turn: a conversation that ended with that
turn is taken, the others are left for the next run. Every finished row is taken at once, so a grace period
(Slurm's 30 s) needs only the turns in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ..base.threads import POLL_SECONDS, Stopped, Worker, first_error, get, put
from ..config import RegenerateConfig
from ..data.source import Row
from .conversation import Conversation, Regenerated, conversation
from .engines import Reply, Request, RowError

Answer = Reply | RowError | None  # None: the request was cancelled while winding up; its row is left for the next run
Outcome = Regenerated | RowError


class Steps(Protocol):
    """An engine's step: requests go in, replies come out (keyed by row id)."""

    def send(self, row_id: int, request: Request) -> None: ...

    def replies(self) -> list[tuple[int, Answer]]:
        """The replies that came in; waits up to a short poll for the first (an empty list: none yet)."""
        ...

    def cancel(self) -> None:
        """Winding up: requests waiting to retry end (their answer is None)."""
        ...

    def close(self) -> None: ...


class BatchSteps:
    """An engine that answers a batch (`generate`: one reply or RowError per request, in order): every request
    sent since the last step, generated as one batch."""

    def __init__(self, generate: Callable[[list[Request]], list[Reply | RowError]]):
        self.generate, self.pending = generate, []

    def send(self, row_id: int, request: Request) -> None:
        self.pending.append((row_id, request))

    def replies(self) -> list[tuple[int, Answer]]:
        step, self.pending = self.pending, []
        if not step:
            return []
        return list(zip([row_id for row_id, _ in step], self.generate([r for _, r in step]), strict=True))

    def cancel(self) -> None:
        pass  # a batch runs to its end

    def close(self) -> None:
        pass


class ThreadSteps:
    """An engine that answers one request at a time (`complete`), on `workers` threads; `cancel` ends its
    retries. A thread's failure (a server that stays down) is raised by `replies` once the replies that came
    before it are taken."""

    def __init__(self, complete: Callable[[Request], Reply], cancel: Callable[[], None], workers: int):
        self.complete, self._cancel = complete, cancel
        self.failed = threading.Event()
        self.jobs: queue.Queue = queue.Queue(maxsize=workers)
        self.answers: queue.Queue = queue.Queue()  # never more than the requests sent: one per conversation in flight
        self.threads = [Worker(f"streamx-regenerate-{i}", self._work, self.failed) for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while True:
            row_id, request = get(self.jobs, self.failed)
            try:
                answer: Answer = self.complete(request)
            except RowError as err:
                answer = err
            except Stopped:  # cancelled in its retries
                answer = None
            self.answers.put((row_id, answer))

    def send(self, row_id: int, request: Request) -> None:
        put(self.jobs, (row_id, request), self.failed)

    def replies(self) -> list[tuple[int, Answer]]:
        came = []
        try:
            came.append(self.answers.get(timeout=POLL_SECONDS))
            while True:
                came.append(self.answers.get_nowait())
        except queue.Empty:
            pass
        if not came and self.failed.is_set():
            raise first_error(self.threads)
        return came

    def cancel(self) -> None:
        self._cancel()

    def close(self) -> None:
        self._cancel()
        self.failed.set()  # idle threads end; one inside a request ends with the process (daemon)


def schedule(todo: Iterable[Row], steps: Steps, cfg: RegenerateConfig, take: Callable[[int, Outcome], None],
             signalled: threading.Event) -> bool:
    """Regenerate the rows of `todo` on `steps`; `take` gets each row's outcome as it finishes. Returns whether
    rows were left for the next run (a signal stopped conversations in flight, or rows not started)."""
    rows = iter(todo)
    active: dict[int, Conversation] = {}
    exhausted = cancelled = left = False

    def advance(row_id: int, conv: Conversation, answer: Reply | RowError | None) -> None:
        """Send the conversation's next request, or take how it ended."""
        nonlocal left
        try:
            if isinstance(answer, RowError):
                raise answer
            request = next(conv) if answer is None else conv.send(answer)
        except StopIteration as done:
            take(row_id, done.value)
        except RowError as err:
            take(row_id, err)
        else:
            if signalled.is_set():  # a turn boundary: the rest of this conversation is the next run's
                conv.close()
                left = True
                return
            active[row_id] = conv
            steps.send(row_id, request)

    try:
        while True:
            while len(active) < cfg.concurrency and not (exhausted or signalled.is_set()):
                row = next(rows, None)
                if row is None:
                    exhausted = True
                    break
                advance(row.row_id, conversation(row, cfg), None)
            if not active:  # every row taken, or winding up with none in flight
                return left or (not exhausted and next(rows, None) is not None)
            if signalled.is_set() and not cancelled:
                steps.cancel()
                cancelled = True
            for row_id, answer in steps.replies():
                conv = active.pop(row_id)
                if answer is None:  # cancelled in its retries
                    conv.close()
                    left = True
                else:
                    advance(row_id, conv, answer)
    finally:
        steps.close()
