"""Threads that stop together: the first real error is the one the main thread raises."""

import queue
import threading
import time

import pytest
import torch

from streamx.base.threads import Stopped, Worker, first_error, get, put


def test_a_failed_worker_stops_the_waiting_ones_and_its_error_is_raised():
    stop = threading.Event()
    empty, full = queue.Queue(maxsize=1), queue.Queue(maxsize=1)
    full.put("taken")

    def fail():
        time.sleep(0.05)
        raise OSError(28, "No space left on device")

    waiting = [Worker("getter", lambda: get(empty, stop), stop), Worker("putter", lambda: put(full, 1, stop), stop)]
    failing = Worker("writer", fail, stop)
    for w in (*waiting, failing):
        w.start()
    for w in (*waiting, failing):
        w.join(timeout=120)  # far above any load: they stop at once
        assert not w.is_alive()
    assert all(w.error is None for w in waiting)  # they stopped (Stopped): not errors of their own
    assert isinstance(failing.error, OSError) and stop.is_set()
    assert first_error([*waiting, failing]) is failing.error
    with pytest.raises(Stopped):
        get(empty, stop)
    with pytest.raises(Stopped):
        put(full, 2, stop)


def test_items_come_through_until_the_run_stops():
    stop, q = threading.Event(), queue.Queue(maxsize=2)
    put(q, "a", stop)
    assert get(q, stop) == "a"
    put(q, "b", stop)
    stop.set()
    assert get(q, stop) == "b"  # what is queued is still handed over; only an empty queue stops a getter
    assert "without an error" in str(first_error([]))


def test_a_failed_write_gives_its_host_buffer_back():
    """On CUDA the model stage waits for a free pinned buffer: one kept by a failed write would be lost."""
    import torch

    from streamx.data.batching import make_packed_batch
    from streamx.data.tokenize import Sample
    from streamx.model.transfer import HostBatch
    from streamx.pipeline.metrics import StageTimes
    from streamx.pipeline.writer import CapturedBatch, RejectRate, WriterStage
    from streamx.store import BF16

    class FullDisk:
        storage = BF16

        def append_batch(self, *args):
            raise OSError(28, "No space left on device")

    released = []
    sample = Sample(0, torch.arange(1, 4), torch.ones(3, dtype=torch.int64))
    host = HostBatch(torch.randn(3, 2, 4).to(torch.bfloat16), torch.ones(1, dtype=torch.bool),
                     release=lambda: released.append(True))
    stage = WriterStage(FullDisk(), set(), RejectRate(0.5), StageTimes())
    with pytest.raises(OSError, match="No space"):
        stage.write(CapturedBatch(make_packed_batch([sample]), host))
    assert released == [True]


def test_a_second_signal_stops_at_once_with_its_own_exit_code():
    """The first SIGTERM winds the run up; one right after it is the same request passed on (torchrun passes its
    own on to workers that got it too) and changes nothing; a second one later stops it at once, and the command
    exits 143 (128 + 15), not 130 as an interrupt would, with one line saying what stays."""
    import os
    import signal
    import time

    import typer

    from streamx.base.threads import Interrupted, SignalStop
    from streamx.cli import _fail

    signalled, said = threading.Event(), []
    with SignalStop(signalled, said.append):
        os.kill(os.getpid(), signal.SIGTERM)
        assert signalled.is_set() and "SIGTERM: finishing" in said[0]
        os.kill(os.getpid(), signal.SIGINT)  # passed on: no Interrupted, nothing said
        assert len(said) == 1
        time.sleep(SignalStop.PASSED_ON_SECONDS)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the second signal did not stop at once")
        except Interrupted as err:
            second = err
    assert second.signal == signal.SIGTERM and "what was committed or written stays" in str(second)
    try:
        _fail(second)
    except typer.Exit as exit_:
        assert exit_.exit_code == 143


def _team_size_in(thread_of) -> int:
    """How many threads a parallel torch op would use in a thread made by `thread_of` (OpenMP's setting is per
    thread; more than one starts a team of that thread's own)."""
    seen = {}
    thread = thread_of(lambda: seen.update(n=torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen["n"]


def test_a_worker_runs_torch_on_one_thread(torch_threads):
    """A side thread's parallel torch op gives it an OpenMP team beside the main thread's, which keeps the
    main thread's forward waking threads at every small op (bench/RESULTS.md): a Worker's torch runs on its
    own thread, and the main thread and the threads started later keep theirs (torch.set_num_threads also sets
    what later threads begin with). A plain thread uses them all (the control)."""
    torch_threads(2)  # one intra-op thread starts no team anywhere
    threads = torch.get_num_threads()
    plain = lambda work: threading.Thread(target=work)  # noqa: E731
    assert _team_size_in(plain) == threads
    assert _team_size_in(lambda work: Worker("w", work, threading.Event())) == 1
    assert torch.get_num_threads() == threads
    assert _team_size_in(plain) == threads
