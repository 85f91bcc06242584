"""`streamx regenerate`: the target model writes the assistant turns its drafter will learn from.

    source rows --conversation()--> Requests --engine--> Replies --> one output row per conversation

Each row keeps its system, user and tool messages; every assistant turn is generated again, in order,
conditioned on the model's own earlier replies (a conversation that ends on a user turn gets one more). An
assistant turn that called tools keeps its calls (parallel ones too) and the tool results that answer them:
there is no tool executor here to answer new calls. Rows are written whole, one line each, as they finish,
and a resume skips the source rows already in the file (by row id, never by line count), so a `kill -9` at
any moment and the same command again give every row exactly once. Rows that fail go to a side file with
their reason: a reason of the row's own keeps it done, a transient one (a server error, a timeout) has the
next run try it again.

The parts: the turn plan and the conversation (regen.conversation), the engines (regen.engines), the one
scheduler (regen.scheduler), the files (regen.files); here the run that ties them and its summary.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..base import durable
from ..base.locks import Lock, lock_file
from ..base.progress import Progress
from ..base.threads import SignalStop
from ..config import RegenerateConfig
from ..data.provenance import fingerprint
from ..data.source import Row, open_source
from ..model.load import EMBEDDED_MODEL, library_bars
from .conversation import PromptRepeats, Regenerated
from .engines import Endpoints, LocalEngine, RowError, Sampling
from .files import (
    DUPLICATE,
    TRANSIENT_REASONS,
    ErrorFile,
    RowFile,
    check_settings,
    finish_settings,
    replace_output,
    side_files,
)
from .scheduler import BatchSteps, Steps, ThreadSteps, schedule


@dataclass
class RegenerateSummary:
    out: str
    model: str
    engine: str  # the endpoints, or "in-process (device)"
    rows: int = 0  # written by this run
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    dropped_turns: int = 0
    tool_turns_kept: int = 0
    tool_calls_generated: int = 0
    rows_with_token_ids: int = 0
    turns_not_verbatim: int = 0
    errors: Counter = field(default_factory=Counter)  # reason -> rows, this run's
    duplicates: int = 0  # rows left out by --skip-duplicates, this run's
    resumed_rows: int = 0
    recorded_errors: Counter = field(default_factory=Counter)  # reason -> rows an earlier run could not regenerate
    recorded_duplicates: int = 0  # rows an earlier run left out by --skip-duplicates
    seconds: float = 0.0
    stopped_by: str | None = None
    complete: bool = True  # no row left for a resume to write (none left by a signal, none failed on the server)
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def done(self) -> int:  # rows this run has finished, written or not (the progress bar's count)
        return self.rows + sum(self.errors.values()) + self.duplicates

    def add(self, outcome: Regenerated | RowError) -> None:
        if isinstance(outcome, RowError) and outcome.reason == DUPLICATE:
            self.duplicates += 1
        elif isinstance(outcome, RowError):
            self.errors[outcome.reason] += 1
        else:
            self._add_row(outcome)

    def _add_row(self, outcome: Regenerated) -> None:
        turns = outcome.row["turns"]
        self.rows += 1
        self.turns += len(turns)
        self.prompt_tokens += sum(t["prompt_tokens"] for t in turns)
        self.completion_tokens += sum(t["completion_tokens"] for t in turns)
        self.finish_reasons.update(t["finish_reason"] for t in turns)
        self.dropped_turns += outcome.dropped_turns
        self.tool_turns_kept += outcome.tool_turns_kept
        self.tool_calls_generated += outcome.tool_calls_generated
        if "input_ids" in outcome.row:
            self.rows_with_token_ids += 1
            self.turns_not_verbatim += sum(1 for t in turns if not t["tokens_verbatim"])

    def status(self, total_rows: int | None, elapsed: float) -> str:
        parts = [f"{self.rows / elapsed:.2f} rows/s", f"{self.completion_tokens / elapsed:,.0f} gen tok/s"]
        if self.finish_reasons["length"]:
            parts.append(f"truncated {self.finish_reasons['length']}")
        if self.errors:
            parts.append(f"errors {sum(self.errors.values())}")
        if total_rows and self.done:
            parts.append(f"ETA {tqdm.format_interval(max(0, total_rows - self.done) * elapsed / self.done)}")
        return ", ".join(parts)

    def lines(self, command: str = "the same command") -> list[str]:
        """What `streamx regenerate` prints when it ends; `command`: the one that resumes it."""
        errors_file, _ = side_files(Path(self.out))
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.finish_reasons.items())) or "none"
        truncated = self.finish_reasons["length"]
        errors = _counts(self.errors)
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return [
            f"wrote {self.rows:,} rows ({self.turns:,} assistant turns) to {self.out} in {self.seconds:.0f} s with "
            f"{self.model} ({self.engine})" + (f"; the file holds {self.rows + self.resumed_rows:,} rows "
                                              f"({self.resumed_rows:,} from earlier runs)"
                                              if self.resumed_rows else ""),
            f"tokens: {self.prompt_tokens:,} prompt, {self.completion_tokens:,} generated ({rate:,.0f}/s); finish "
            f"reasons: {reasons}",
            *([f"truncated at --max-tokens: {truncated:,} turns kept"
               + (f", {self.dropped_turns:,} more dropped (--truncated drop-turn)" if self.dropped_turns else "")]
              if truncated or self.dropped_turns else []),
            *([f"tool calls: {self.tool_turns_kept:,} source turns with tool calls kept as they were, "
               f"{self.tool_calls_generated:,} generated turns call tools"]
              if self.tool_turns_kept or self.tool_calls_generated else []),
            *([f"token ids: {self.rows_with_token_ids:,} rows carry input_ids + loss_mask as generated; "
               f"{self.turns_not_verbatim:,} earlier turns the template renders otherwise (left out of the loss "
               "mask, tokens_verbatim false)"] if self.rows_with_token_ids else []),
            *([f"errors: {sum(self.errors.values()):,} rows ({errors}), in {errors_file}; "
               + self._retried_when()] if self.errors else []),
            *([f"skipped {self.duplicates + self.recorded_duplicates:,} rows whose prompt repeats an earlier row's "
               f"(--skip-duplicates; listed in {errors_file} as {DUPLICATE})"]
              if self.duplicates + self.recorded_duplicates else []),
            *([f"skipped {sum(self.recorded_errors.values()):,} rows an earlier run could not regenerate for a reason "
               f"of their own ({_counts(self.recorded_errors)}; in {errors_file}): --retry-errors tries them again"]
              if self.recorded_errors else []),
            *([f"stopped by {self.stopped_by}: every row finished is written"] if self.stopped_by else []),
            *(["the output is unfinished (streamx run refuses it without --allow-partial)",
               f"next: {command}   (goes on)   |   to use the rows written so far: {self._run('--allow-partial')}"]
              if not self.complete else [f"next: {self._run()}"]),
        ]

    def _run(self, *flags: str) -> str:
        """The `streamx run` over the output, into a store named after it: typed as printed, it never runs into
        the default --out (another run's store, the quick start's)."""
        store = str(Path(self.out).with_suffix(".zarr"))
        return shlex.join(["streamx", "run", "--data", self.out, *flags, "--model", self.model, "--out", store])

    def _retried_when(self) -> str:
        transient = sum(n for reason, n in self.errors.items() if reason in TRANSIENT_REASONS)
        if transient == sum(self.errors.values()):
            return "the same command tries them again"
        if not transient:
            return "a reason of their own: the same command passes them over (--retry-errors tries them again)"
        return (f"the same command tries the {transient:,} with a server error or a timeout again, and passes the "
                "others over (--retry-errors tries them again)")

    def written(self) -> str:
        """What was written, in a line: for a run that fails part way."""
        return (f"written before it stopped: {self.rows:,} rows to {self.out}, {sum(self.errors.values()):,} to "
                f"its side file; the same command goes on from there")


def _counts(counts: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def regenerate(cfg: RegenerateConfig, progress: bool = True, log: Callable[[str], None] = print,
               wind_up_on_signals: bool = True) -> RegenerateSummary:
    """Regenerate every assistant turn of `cfg.data` with the target model into `cfg.out` (resuming it)."""
    library_bars(progress)
    source = open_source(cfg.data, cfg.split, cfg.max_samples)
    out = Path(cfg.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a .jsonl file")
    if Path(cfg.data).exists() and out.resolve() == Path(cfg.data).resolve():
        raise ValueError(f"--out {out} is the --data file itself; name another file for the output")
    errors_path, settings_path = side_files(out)
    durable.make_dirs(out.parent)
    with Lock(lock_file(out), "regenerate output"):
        if cfg.overwrite:
            replace_output(out)
        signalled = threading.Event()
        engine, where = open_engine(cfg)
        data = str(Path(cfg.data).resolve()) if Path(cfg.data).exists() else cfg.data  # however a path is spelled
        settings = cfg.to_dict() | {"model": engine.model, "data": data, "data_fingerprint": fingerprint(cfg.data),
                                    "vocabulary": engine.vocabulary}
        check_settings(settings_path, settings, out)
        rows = RowFile(out, log)
        if rows.done:
            log(f"resuming {out}: {len(rows.done):,} rows already there")
        errors = ErrorFile(errors_path, cfg.retry_errors)  # the transient errors of the last run are tried again
        recorded = Counter(errors.reasons)
        summary = RegenerateSummary(str(out), engine.model, where, resumed_rows=len(rows.done),
                                    recorded_duplicates=recorded.pop(DUPLICATE, 0), recorded_errors=recorded)
        repeats = PromptRepeats() if cfg.skip_duplicates else None

        def todo() -> Iterator[Row]:
            for row in source:
                first = repeats.earlier(row) if repeats is not None else None  # every row: the first stays first
                if row.row_id in rows.done or row.row_id in errors.done:
                    continue
                if first is not None:
                    take(row.row_id, RowError(DUPLICATE, f"the same prompt as row {first} (--skip-duplicates)"))
                else:
                    yield row

        total = None if source.num_rows is None else max(0, source.num_rows - len(rows.done) - len(errors.done))

        def take(row_id: int, outcome: Regenerated | RowError) -> None:
            if isinstance(outcome, RowError):
                errors.append(row_id, outcome)
            else:
                rows.append(outcome.row)
            summary.add(outcome)

        try:
            with Progress(_Done(summary), total, "streamx regenerate", disable=not progress), \
                    SignalStop(signalled, log, enabled=wind_up_on_signals) as signals:
                left = schedule(todo(), engine_steps(engine, cfg.concurrency), cfg, take, signalled)
        except BaseException:
            log(summary.written())
            raise
        finally:
            rows.close()
            errors.close()
        summary.seconds = time.perf_counter() - summary.started
        summary.stopped_by = signals.signal.name if signals.signal and left else None
        summary.complete = not left and not any(reason in TRANSIENT_REASONS for reason in summary.errors)
        finish_settings(settings_path, summary.complete)
    return summary


def open_engine(cfg: RegenerateConfig) -> tuple[Endpoints | LocalEngine, str]:
    """The endpoints, or the model in this process, and where it runs (for the summary)."""
    sampling = Sampling(cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.thinking)
    if cfg.endpoint:
        engine = Endpoints(cfg.endpoint, sampling, cfg.timeout, cfg.retries, cfg.return_token_ids, cfg.model,
                           api_key=os.environ.get(cfg.api_key_env), api_key_env=cfg.api_key_env)
        return engine, ", ".join(engine.urls)
    local = LocalEngine(cfg.model or EMBEDDED_MODEL, sampling, cfg.device, cfg.dtype)
    return local, f"in-process, {local.info.device}"


def engine_steps(engine: Endpoints | LocalEngine, concurrency: int) -> Steps:
    """The engine's step, the one part of the scheduling that differs: servers answer each request on its own
    thread, the model in this process a batch at a time."""
    if isinstance(engine, Endpoints):
        return ThreadSteps(engine.complete, engine.cancel, concurrency)
    return BatchSteps(engine.generate)


@dataclass
class _Done:
    """The summary as Progress counts it: rows finished, written or to the side file."""

    summary: RegenerateSummary

    @property
    def rows(self) -> int:
        return self.summary.done

    def status(self, total_rows: int | None, elapsed: float) -> str:
        return self.summary.status(total_rows, elapsed)
