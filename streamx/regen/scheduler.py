"""One scheduler for `streamx regenerate`: up to --concurrency conversations in flight, each one's next turn
asked for as soon as its last reply is in, outcomes taken in source order.

What differs between engines is only their step (`Steps`): an engine that answers one request at a time
(Endpoints over HTTP) runs on --concurrency threads and hands back each reply as it comes (`ThreadSteps`); an
engine that answers a batch (the model in this process) generates every request sent since its last step at
once (`BatchSteps`).

Rows are taken in source order, so a slow conversation holds back the finished ones behind it: at most
WINDOW_PER_SLOT x concurrency rows are in flight or waiting, which bounds memory. SIGINT / SIGTERM
(`signalled`) start no new row and end requests waiting to retry (their rows are left for the next run); the
conversations in flight run to their end. On a failure, every finished row is still taken: nothing is done
twice.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from ..base.threads import POLL_SECONDS, Stopped, Worker, first_error, get, put
from ..config import RegenerateConfig
from ..data.source import Row
from .conversation import Conversation, Regenerated, conversation
from .engines import Reply, Request, RowError

WINDOW_PER_SLOT = 16  # rows in flight or waiting for a slower earlier one, per --concurrency: bounds memory

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
             signalled: threading.Event) -> None:
    """Regenerate the rows of `todo` on `steps`; `take` gets each row's outcome, in source order."""
    rows = iter(todo)
    active: dict[int, Conversation] = {}
    finished: dict[int, Outcome | None] = {}  # None: left for the next run
    order: deque[int] = deque()  # rows started and not yet taken, in source order
    window, exhausted, cancelled = WINDOW_PER_SLOT * cfg.concurrency, False, False

    def advance(row_id: int, conv: Conversation, answer: Reply | RowError | None) -> None:
        """Send the conversation's next request, or record how it ended."""
        try:
            if isinstance(answer, RowError):
                raise answer
            request = next(conv) if answer is None else conv.send(answer)
        except StopIteration as done:
            finished[row_id] = done.value
        except RowError as err:
            finished[row_id] = err
        else:
            active[row_id] = conv
            steps.send(row_id, request)

    def take_in_order() -> None:
        while order and order[0] in finished:
            row_id = order.popleft()
            if (outcome := finished.pop(row_id)) is not None:
                take(row_id, outcome)

    try:
        while True:
            while len(active) < cfg.concurrency and len(order) < window and not (exhausted or signalled.is_set()):
                row = next(rows, None)
                if row is None:
                    exhausted = True
                    break
                order.append(row.row_id)
                advance(row.row_id, conversation(row, cfg), None)
            take_in_order()
            if not active and (exhausted or signalled.is_set()):  # every row taken, or winding up with none in flight
                return
            if signalled.is_set() and not cancelled:
                steps.cancel()
                cancelled = True
            for row_id, answer in steps.replies():
                conv = active.pop(row_id)
                if answer is None:
                    finished[row_id] = None
                else:
                    advance(row_id, conv, answer)
    finally:
        steps.close()
        for row_id in order:  # after a failure: the rows finished before it are kept, nothing is done twice
            if finished.get(row_id) is not None:
                take(row_id, finished.pop(row_id))
