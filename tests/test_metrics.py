"""What a run measures about itself."""

import queue

from streamx.base.progress import Progress
from streamx.pipeline.metrics import QueueFill, Throughput


class Clock:
    """A fake clock that the test moves."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_eta_is_the_tokens_left_to_compute_at_the_recent_rate_and_ends_at_zero(capsys):
    """With --sharing a row that repeats an earlier one computes nothing: the ETA counts the tokens left to compute
    (extrapolated from the rows tokenized, exact once all are) over the rate of the last RATE_WINDOW seconds,
    which holds between batches while the ETA counts down; it reaches zero when the last row is through, and the rows
    reach the total."""
    clock = Clock(100.0)
    counts = Throughput(clock=clock)
    with Progress(counts, total_rows=10, desc="t", disable=False, interval=3600, terminal=False, clock=clock) as bar:
        assert bar.status() == "starting: tokenizing the first window of rows, then the first forward pass"
        counts.tokenized(rows=2, tokens=1000)
        counts.tokenized(rows=1, tokens=0)  # a repeat
        assert bar.status() == "starting: the first forward pass"  # not "0 tok/s"
        clock.now = 160.0
        counts.forwarded(2, 1000, 1000)  # the first batch, a minute in: it paid the tokenizing and the warm-up
        counts.rows += 1  # the repeat is through
        counts.tokenized(rows=2, tokens=1000)
        clock.now = 165.0
        counts.forwarded(2, 1000, 1000)  # 1,000 tokens in 5 s: 200 tokens/s
        # 5 rows tokenized hold 2,000 tokens to compute: 10 rows, 4,000; 2,000 to go at 200 tokens/s
        assert counts.eta_seconds(10, elapsed=65.0) == 10.0
        bar.draw()
        clock.now = 170.0  # no batch since: the rate holds, the ETA counts down
        bar.draw()
        assert counts.eta_seconds(None, elapsed=70.0) is None  # a streamed source: no total
        counts.tokens_to_go = 3000  # as planned (--sharing off: the rows' tokens are computed)
        assert counts.eta_seconds(None, elapsed=70.0) == 1000 / 200 - 5
        for _ in range(3):
            counts.tokenized(rows=1, tokens=0)
        counts.tokenized(rows=2, tokens=1000)  # every row tokenized: 1,000 tokens left, exactly
        assert counts.tokens_left(10) == 1000
        clock.now = 200.0
        counts.forwarded(2, 1000, 1000)
        counts.rows += 3
        # the first batch ended over RATE_WINDOW seconds before the last: the rate is from 165 s on
        assert counts.tokens_per_s(elapsed=100.0) == 1000 / 35
        assert counts.eta_seconds(10, elapsed=100.0) == 0.0
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["t: 5/10 rows [01:05, 200 tok/s, pad eff 100.0%, ETA 00:10]",
                     "t: 5/10 rows [01:10, 200 tok/s, pad eff 100.0%, ETA 00:05]",
                     "t: 10/10 rows [01:40, 29 tok/s, pad eff 100.0%, ETA 00:00]"]


def test_an_eta_passed_with_tokens_left_says_overdue_and_for_how_long_no_batch_came_through():
    """A batch slower than the recent rate said: not a frozen "ETA 00:00" but the time since the last batch through."""
    clock = Clock(100.0)
    counts = Throughput(tokens_to_go=2000, clock=clock)
    counts.tokenized(rows=2, tokens=1000)
    for now in (110.0, 115.0):
        clock.now = now
        counts.forwarded(1, 500, 500)  # 500 tokens in 5 s: 100 tokens/s, 1,000 tokens left: 10 s
    clock.now = 124.0
    assert counts.status(4, elapsed=24.0) == "100 tok/s, pad eff 100.0%, ETA 00:01"
    clock.now = 131.0
    assert counts.status(4, elapsed=31.0) == "100 tok/s, pad eff 100.0%, ETA overdue (no batch through for 00:16)"


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

    counts = Throughput()
    with Progress(counts, total_rows=10, desc="test", disable=False, interval=0.02, terminal=True) as progress:
        counts.forwarded(3, 300, 400)  # no call into the bar
        deadline = time.time() + 120  # a bound far above any load, not a timing
        while "pad eff" not in str(progress.bar.postfix) and time.time() < deadline:
            time.sleep(0.01)
        assert progress.bar.n == 3 and "pad eff 75.0%" in progress.bar.postfix


def test_progress_in_a_log_is_plain_status_lines(capsys):
    """Where stderr is no terminal (Slurm, nohup, a CI log) the bar would be one ever-growing line of carriage
    returns: instead, a newline-ended status line every interval (30 s by default) and one at the end."""
    import time

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
