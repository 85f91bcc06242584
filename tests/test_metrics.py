"""What a run measures about itself."""

import queue

import streamx.pipeline.metrics as metrics
from streamx.pipeline.metrics import QueueFill, Throughput


def test_eta_comes_from_tokens_and_the_rate_since_the_first_batch(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    counts = Throughput()
    assert counts.status(200, elapsed=1.0) == "starting: tokenizing the first window of rows, then the first " \
        "forward pass"  # not "0 tok/s"
    counts.tokenized(100, 1000)
    assert counts.status(200, elapsed=2.0) == "starting: the first forward pass"
    assert counts.eta_seconds(200, elapsed=2.0) is None  # nothing measured yet
    counts.forwarded(10, 100, 100)  # the first batch, 30 s in: it paid for the tokenizing and the warm-up
    clock[0] = 105.0
    counts.forwarded(140, 400, 400)  # 400 tokens in the 5 s since: 80 tokens/s (not 500 in 35 s)
    assert counts.tokens_per_s(elapsed=35.0) == 80.0
    # 100 rows tokenized at 10 tokens each: 200 rows are ~2,000 tokens, 1,500 to go, although 150 of 200 rows
    # are done (short rows first, as a length-sorted window runs them)
    assert counts.eta_seconds(total_rows=200, elapsed=35.0) == 1500 / 80
    assert counts.eta_seconds(total_rows=None, elapsed=35.0) is None  # a streamed source: no total
    counts.tokens_to_go = 3000  # what the sizing pass counted over every row, when it ran
    assert counts.eta_seconds(total_rows=None, elapsed=35.0) == 2500 / 80


def test_queue_fill_is_the_mean_occupancy_its_consumer_sees():
    q: queue.Queue = queue.Queue(maxsize=4)
    fill = QueueFill(q)
    for _ in range(3):
        q.put(1)
    q.get()
    fill.record()  # 2 left + the one taken = 3 of 4
    q.get()
    fill.record()  # 1 left + 1 = 2 of 4
    assert fill.mean == (3 + 2) / 2 / 4


def test_progress_redraws_between_batches():
    """A long batch must not freeze the bar: it redraws on its own every `interval` seconds."""
    import time

    from streamx.base.progress import Progress

    counts = Throughput()
    with Progress(counts, total_rows=10, desc="test", disable=False, interval=0.02, terminal=True) as progress:
        counts.forwarded(3, 300, 400)  # no call into the bar
        deadline = time.time() + 5
        while "pad eff" not in str(progress.bar.postfix) and time.time() < deadline:
            time.sleep(0.01)
        assert progress.bar.n == 3 and "pad eff 75.0%" in progress.bar.postfix


def test_progress_in_a_log_is_plain_status_lines(capsys):
    """Where stderr is no terminal (Slurm, nohup, a CI log) the bar would be one ever-growing line of carriage
    returns: instead, a newline-ended status line every interval (30 s by default) and one at the end."""
    import time

    from streamx.base.progress import Progress

    counts = Throughput()
    assert Progress(counts, total_rows=10, desc="test", disable=False, terminal=False).interval == 30.0
    counts.forwarded(3, 300, 300)  # before the ticker starts: every line has a rate
    with Progress(counts, total_rows=10, desc="test", disable=False, interval=0.02, terminal=False):
        time.sleep(0.2)
        counts.rows = 10
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and err.endswith("\n") and len(lines) >= 3
    assert all(line.startswith("test: ") and " rows [" in line and "tok/s" in line for line in lines)
    assert lines[0].startswith("test: 3/10 rows [") and lines[-1].startswith("test: 10/10 rows [")
    with Progress(counts, total_rows=10, desc="test", disable=True, interval=0.02, terminal=False):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""  # --no-progress
