"""The progress a long command shows: a live bar on a terminal, plain status lines in a log."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tqdm import tqdm


class Counts(Protocol):
    """What a Progress shows: rows done so far, and a status line of rates and an ETA."""

    rows: int

    def status(self, total_rows: int | None, elapsed: float) -> str: ...


class Progress:
    """Rows done and the counts' own status (`Counts.status`: rates, an ETA), redrawn every `interval` seconds
    even while a long batch runs: a live bar on a terminal; elsewhere (Slurm, nohup, CI logs) one plain,
    newline-ended status line every `interval` seconds (default 30), so a log file gets readable lines.
    `clock` gives the elapsed time (a test's fake one); the redraws keep real time."""

    def __init__(self, counts: Counts, total_rows: int | None, desc: str, disable: bool,
                 interval: float | None = None, terminal: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.counts, self.total_rows, self.desc, self.disable, self.clock = counts, total_rows, desc, disable, clock
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.interval = interval if interval is not None else 1.0 if self.terminal else 30.0
        self.started = clock()
        self.bar = tqdm(total=total_rows, unit="row", desc=desc, disable=disable or not self.terminal,
                        dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="streamx-progress", daemon=True)

    def __enter__(self) -> Progress:
        if not self.disable:
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if not self.disable:
            self.draw()
        self.bar.close()

    def status(self) -> str:
        return self.counts.status(self.total_rows, max(self.clock() - self.started, 1e-9))

    def draw(self) -> None:
        if self.terminal:
            self.bar.n = self.counts.rows
            self.bar.set_postfix_str(self.status())  # and redraws
            return
        total = f"/{self.total_rows:,}" if self.total_rows is not None else ""
        elapsed = tqdm.format_interval(self.clock() - self.started)
        print(f"{self.desc}: {self.counts.rows:,}{total} rows [{elapsed}, {self.status()}]", file=sys.stderr,
              flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self.draw()
