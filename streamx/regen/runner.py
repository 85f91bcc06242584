"""`streamx regenerate`: the target model writes the assistant turns its drafter will learn from.

    source rows --conversation()--> Requests --engine--> Replies --> one output row per conversation

Each row keeps its system, user and tool messages; every assistant turn is generated again, in order,
conditioned on the model's own earlier replies (a conversation that ends on a user turn gets one more). An
assistant turn that called tools keeps its calls (parallel ones too) and the tool results that answer them:
there is no tool executor here to answer new calls. Rows are written whole, one line each, in source order,
and a resume skips the source rows already in the file (by row id, never by line count), so a `kill -9` at
any moment and the same command again give every row exactly once. Rows that fail go to a side file with
their reason, and the next run tries them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..base import durable
from ..base.locks import Lock, lock_file
from ..base.progress import Progress
from ..base.threads import SignalStop, Stopped, Worker, first_error, get, put
from ..config import RegenerateConfig
from ..data.source import Row, open_source
from ..data.tokenize import CONTENT_FIELDS, ROLES, TEMPLATE_FIELDS
from ..model.load import EMBEDDED_MODEL
from .engines import Endpoints, LocalEngine, Reply, Request, RowError, Sampling

# what a resume must find unchanged: the settings that decide what is generated
COMPAT_SETTINGS = ("data", "split", "model", "max_tokens", "temperature", "top_p", "seed", "thinking", "reasoning",
                   "truncated", "return_token_ids")
SYNC_SECONDS = 1.0  # the output is fsynced this often: a power loss costs at most this much work, never a row twice
# a source row's fields that the output row replaces (the others, such as an id or tools, are kept)
REPLACED_FIELDS = (*CONTENT_FIELDS, "loss_mask", "source_row", "turns")
WINDOW_PER_SLOT = 16  # rows in flight or waiting for a slower earlier one, per --concurrency: bounds memory


def side_files(out: Path) -> tuple[Path, Path]:
    """(errors, settings) beside the output: the rows not written with their reasons, and the run's settings."""
    return out.with_name(out.name + ".errors.jsonl"), out.with_name(out.name + ".settings.json")


# ---- one conversation ----

Conversation = Generator[Request, Reply, "Regenerated"]


@dataclass
class Regenerated:
    row: dict  # the output row
    dropped_turns: int = 0  # truncated turns cut off under --truncated drop-turn
    tool_turns_kept: int = 0  # assistant turns with tool calls, kept from the source
    tool_calls_generated: int = 0  # generated turns that call tools


def plan_turns(record: dict | None) -> tuple[list[dict | None], list | None]:
    """A row -> its messages with None where an assistant turn is to be generated, and its tool definitions."""
    if not isinstance(record, dict):
        raise RowError("unrecognised_row", f"expected an object, got {type(record).__name__}")
    turns = record.get("messages") if record.get("messages") is not None else record.get("conversations")
    if turns is None:
        has = "input_ids" if record.get("input_ids") is not None else "text" if record.get("text") is not None else None
        raise RowError("not_a_conversation", f"a {has} row has no turns to regenerate" if has else
                       f"no messages/conversations field in {sorted(record)}")
    if not isinstance(turns, list):
        raise RowError("unrecognised_row", f"conversation is {type(turns).__name__}, not a list")
    items: list[dict | None] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("unrecognised_row", f"message {i} is {type(turn).__name__}, not an object")
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        role = ROLES.get(role.lower()) if isinstance(role, str) else None
        if role is None:
            raise RowError("unknown_role", f"message {i} has role {turn.get('role', turn.get('from'))!r}")
        if role == "assistant" and not turn.get("tool_calls"):
            items.append(None)
            continue
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if not isinstance(content, str) and not (role == "assistant" and content is None):
            raise RowError("non_string_content", f"message {i} ({role}) content is {type(content).__name__}")
        kept = {k: turn[k] for k in TEMPLATE_FIELDS if turn.get(k) is not None}  # not e.g. a per-message timestamp
        items.append({"role": role, "content": content, **kept})
    if items and items[-1] is not None and items[-1]["role"] != "assistant":
        items.append(None)  # a conversation that ends on a user (or tool) turn: answer it
    if not any(i is None for i in items):
        raise RowError("empty_conversation", "no assistant turn to generate" if items else "no messages")
    first = items.index(None)
    if not any(m["role"] != "system" for m in items[:first]):
        raise RowError("no_prompt", "nothing but a system prompt before the first assistant turn")
    tools = record.get("tools")
    return items, tools if isinstance(tools, list) and tools else None


def turn_seed(seed: int, row_id: int, turn: int) -> int:
    """Each turn's own seed, from the run's seed, the row and the turn: a resume or another order asks for the
    same sample."""
    digest = hashlib.blake2b(f"{seed}:{row_id}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def conversation(row: Row, cfg: RegenerateConfig) -> Conversation:
    """Asks for each assistant turn in order (yield Request, receive Reply) and returns the output row."""
    if row.error is not None:
        raise RowError(*row.error)
    items, tools = plan_turns(row.record)
    history: list[dict] = []
    turns: list[dict] = []
    trace: list[tuple[list[int] | None, list[int] | None]] = []
    dropped = calls = 0
    for item in items:
        if item is not None:
            history.append(item)
            continue
        reply = yield Request([dict(m) for m in history], turn_seed(cfg.seed, row.row_id, len(turns)), tools)
        if reply.finish_reason == "length" and cfg.truncated != "keep":
            if cfg.truncated == "drop-row":
                raise RowError("truncated", f"turn {len(turns)} reached --max-tokens {cfg.max_tokens}")
            dropped = 1
            break
        message = {"role": "assistant", "content": reply.content}
        if reply.reasoning and cfg.reasoning == "keep":
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
            calls += 1
        history.append(message)
        turns.append({"finish_reason": reply.finish_reason, "prompt_tokens": reply.prompt_tokens,
                      "completion_tokens": reply.completion_tokens})
        trace.append((reply.prompt_ids, reply.completion_ids))
    if not turns:
        raise RowError("truncated", f"the first turn reached --max-tokens {cfg.max_tokens} (--truncated drop-turn)")
    while history[-1]["role"] != "assistant":  # a row cut short ends on its last answer
        history.pop()
    kept_fields = {k: v for k, v in row.record.items() if k not in REPLACED_FIELDS}  # an id, tools, a source tag
    row_out = kept_fields | {"source_row": row.row_id, "messages": history, "turns": turns}
    if all(p is not None and c is not None for p, c in trace):
        row_out |= exact_tokens(trace, turns)
    kept = sum(1 for m in items if m is not None and m.get("tool_calls"))
    return Regenerated(row_out, dropped, kept, calls)


def exact_tokens(trace: list[tuple[list[int], list[int]]], turns: list[dict]) -> dict:
    """input_ids + loss_mask exactly as generated: the last request's prompt and its reply. An earlier reply is
    trained on where its tokens stand there verbatim (its own prompt, then it); where the chat template
    rendered it otherwise for the later turns (dropped reasoning, another tokenization of the text), it is
    left out of the loss mask and its turn says `tokens_verbatim: false`."""
    prompt, completion = trace[-1]
    input_ids = list(prompt) + list(completion)
    loss_mask = [0] * len(prompt) + [1] * len(completion)
    for (p, c), turn in zip(trace, turns, strict=True):
        end = len(p) + len(c)
        turn["tokens_verbatim"] = input_ids[:end] == list(p) + list(c)
        if turn["tokens_verbatim"]:
            loss_mask[len(p):end] = [1] * len(c)
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def drive(conv: Conversation, complete: Callable[[Request], Reply]) -> Regenerated | RowError:
    """Run one conversation to its end on an engine that answers one request at a time."""
    try:
        request = next(conv)
        while True:
            request = conv.send(complete(request))
    except StopIteration as done:
        return done.value
    except RowError as err:
        return err


# ---- the output file, written exactly once ----

class RowFile:
    """The output .jsonl: one whole row per line, appended with one write and fsynced every SYNC_SECONDS. A kill
    leaves whole lines and at most one partial last line, which the next open cuts off (its row is generated
    again)."""

    def __init__(self, path: Path):
        self.path = path
        self.done = self._recover() if path.exists() else set()
        durable.make_dirs(path.parent)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        durable.fsync_dir(path.parent)
        self._synced = time.monotonic()

    def _recover(self) -> set[int]:
        done, good = set(), 0
        with open(self.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break  # a write cut short by a kill: generated again
                try:
                    done.add(int(json.loads(line)["source_row"]))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{self.path} line {lineno} is not a regenerated row; it is not a file "
                                     "streamx regenerate wrote (--overwrite starts over)") from None
                good += len(line)
        if good < self.path.stat().st_size:
            os.truncate(self.path, good)
        return done

    def append(self, row: dict) -> None:
        # default=str: a source's other fields may hold what JSON has no type for (Arrow timestamps)
        data = memoryview((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode())
        while data:  # a regular file takes the whole line in one write, save on a full disk
            data = data[os.write(self._fd, data):]
        if time.monotonic() - self._synced >= SYNC_SECONDS:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._synced = time.monotonic()

    def close(self) -> None:
        self.sync()
        os.close(self._fd)


# ---- what a run did ----

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
    errors: Counter = field(default_factory=Counter)  # reason -> rows
    resumed_rows: int = 0
    seconds: float = 0.0
    stopped_by: str | None = None
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def done(self) -> int:  # rows this run has finished, written or not (the progress bar's count)
        return self.rows + sum(self.errors.values())

    def add(self, outcome: Regenerated | RowError) -> None:
        if isinstance(outcome, RowError):
            self.errors[outcome.reason] += 1
            return
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

    def lines(self) -> list[str]:
        errors_file, _ = side_files(Path(self.out))
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.finish_reasons.items())) or "none"
        truncated = self.finish_reasons["length"]
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items()))
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return [
            f"wrote {self.rows:,} rows ({self.turns:,} assistant turns) to {self.out} in {self.seconds:.0f} s with "
            f"{self.model} ({self.engine})" + (f"; {self.resumed_rows:,} rows were already there"
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
            *([f"errors: {sum(self.errors.values()):,} rows ({errors}), in {errors_file}; the same command "
               "tries them again"] if self.errors else []),
            *([f"stopped by {self.stopped_by}: every row written is whole; run the same command again to go on"]
              if self.stopped_by else []),
            f"next: streamx run --data {self.out} --model {self.model}",
        ]


# ---- the run ----

def regenerate(cfg: RegenerateConfig, progress: bool = True, log: Callable[[str], None] = print,
               wind_up_on_signals: bool = True) -> RegenerateSummary:
    """Regenerate every assistant turn of `cfg.data` with the target model into `cfg.out` (resuming it)."""
    source = open_source(cfg.data, cfg.split, cfg.max_samples)
    out = Path(cfg.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a .jsonl file")
    errors_path, settings_path = side_files(out)
    durable.make_dirs(out.parent)
    with Lock(lock_file(out), "regenerate output"):
        stop, wind_up = threading.Event(), threading.Event()
        engine, where = open_engine(cfg, wind_up)
        data = str(Path(cfg.data).resolve()) if Path(cfg.data).exists() else cfg.data  # however a path is spelled
        settings = cfg.to_dict() | {"model": engine.model, "data": data}
        if cfg.overwrite:
            for path in (out, errors_path, settings_path):
                path.unlink(missing_ok=True)
        _check_settings(settings_path, settings, out)
        rows = RowFile(out)
        if rows.done:
            log(f"resuming {out}: {len(rows.done):,} rows already there")
        errors = ErrorFile(errors_path)  # the last run's errors are in this run's work again
        summary = RegenerateSummary(str(out), engine.model, where, resumed_rows=len(rows.done))
        todo = (row for row in source if row.row_id not in rows.done)
        total = None if source.num_rows is None else max(0, source.num_rows - len(rows.done))

        def take(row_id: int, outcome: Regenerated | RowError) -> None:
            if isinstance(outcome, RowError):
                errors.append(row_id, outcome)
            else:
                rows.append(outcome.row)
            summary.add(outcome)

        try:
            with Progress(_Done(summary), total, "streamx regenerate", disable=not progress), \
                    SignalStop(wind_up, log, enabled=wind_up_on_signals) as signals:
                if isinstance(engine, Endpoints):
                    _threaded(todo, engine.complete, cfg, take, stop, wind_up)
                else:
                    _batched(todo, engine.generate, cfg, take, wind_up)
        finally:
            rows.close()
            errors.close()
        summary.seconds = time.perf_counter() - summary.started
        summary.stopped_by = signals.signal.name if signals.signal else None
    return summary


def open_engine(cfg: RegenerateConfig, give_up: threading.Event) -> tuple[Endpoints | LocalEngine, str]:
    """The endpoints, or the model in this process, and where it runs (for the summary). `give_up` ends a
    request's retries: a signal, or another thread's failure (_threaded sets it then)."""
    sampling = Sampling(cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.thinking)
    if cfg.endpoint:
        engine = Endpoints(cfg.endpoint, sampling, give_up, cfg.timeout, cfg.retries, cfg.return_token_ids, cfg.model)
        return engine, ", ".join(engine.urls)
    local = LocalEngine(cfg.model or EMBEDDED_MODEL, sampling, cfg.device, cfg.dtype)
    return local, f"in-process, {local.info.device}"


@dataclass
class _Done:
    """The summary as Progress counts it: rows finished, written or to the side file."""

    summary: RegenerateSummary

    @property
    def rows(self) -> int:
        return self.summary.done

    def status(self, total_rows: int | None, elapsed: float) -> str:
        return self.summary.status(total_rows, elapsed)


class ErrorFile:
    """The side file: one line per row not written, with its reason. Started afresh by each run, whose work
    includes the rows it held."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self._fh = open(path, "w", encoding="utf-8")

    def append(self, row_id: int, err: RowError) -> None:
        self._fh.write(json.dumps({"source_row": row_id, "reason": err.reason, "detail": err.detail},
                                  ensure_ascii=False) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if not self.count:  # no errors: no side file
            self.path.unlink()


def _check_settings(path: Path, settings: dict, out: Path) -> None:
    """The first run records its settings beside the output; a resume with settings that change what is
    generated is refused, naming them (the rows would mix two regenerations)."""
    wanted = {k: settings[k] for k in COMPAT_SETTINGS}
    has_rows = out.exists() and out.stat().st_size > 0
    if not path.exists() and has_rows:
        raise ValueError(f"{out} exists but has no {path.name}: it was not written by streamx regenerate "
                         "(--overwrite starts over)")
    if not has_rows:  # nothing generated yet: these settings are the run's
        durable.write_file(path, lambda tmp: tmp.write_text(json.dumps(settings, indent=2)))
        return
    saved = json.loads(path.read_text())
    changed = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in wanted.items() if saved.get(k) != v]
    if changed:
        raise ValueError(f"{out} was generated with other settings ({'; '.join(changed)}): use the same ones to "
                         "resume it, or --overwrite to start over")


def _threaded(todo: Iterable[Row], complete: Callable[[Request], Reply], cfg: RegenerateConfig,
              take: Callable[[int, Regenerated | RowError], None], stop: threading.Event,
              wind_up: threading.Event) -> None:
    """--concurrency threads, each driving one conversation at a time against the endpoints; rows are taken in
    source order, at most WINDOW_PER_SLOT x concurrency of them in flight or waiting."""
    jobs: queue.Queue = queue.Queue(maxsize=cfg.concurrency)
    finished: dict[int, Regenerated | RowError | None] = {}
    ready = threading.Condition()

    def work() -> None:
        while (job := get(jobs, stop)) is not None:
            row_id, conv = job
            try:
                outcome = None if wind_up.is_set() else drive(conv, complete)  # None: left for the next run
            except Stopped:  # winding up in the middle of its retries
                outcome = None
            with ready:
                finished[row_id] = outcome
                ready.notify_all()

    workers = [Worker(f"streamx-regenerate-{i}", work, stop) for i in range(cfg.concurrency)]
    for w in workers:
        w.start()
    order: deque[int] = deque()

    def take_ready(wait_for: int) -> None:
        """Take the finished rows at the head of the order; wait while more than `wait_for` are in flight."""
        with ready:
            while order:
                if order[0] in finished:
                    row_id = order.popleft()
                    if (outcome := finished.pop(row_id)) is not None:
                        take(row_id, outcome)
                elif len(order) > wait_for and not stop.is_set():
                    ready.wait(0.1)
                else:
                    return

    window = WINDOW_PER_SLOT * cfg.concurrency
    try:
        for row in todo:
            if wind_up.is_set() or stop.is_set():
                break
            put(jobs, (row.row_id, conversation(row, cfg)), stop)
            order.append(row.row_id)
            take_ready(window - 1)
        for _ in workers:
            put(jobs, None, stop)
        take_ready(0)
    except Stopped:
        pass
    finally:
        stop.set()  # a worker's failure, a signal or the end: no thread waits on, no request retries on
        wind_up.set()
        with ready:
            for row_id in order:  # the rows finished before a failure are kept: nothing is done twice
                if finished.get(row_id) is not None:
                    take(row_id, finished.pop(row_id))
    if any(w.error for w in workers):
        raise first_error(workers)


def _batched(todo: Iterable[Row], generate: Callable[[list[Request]], list[Reply | RowError]],
             cfg: RegenerateConfig, take: Callable[[int, Regenerated | RowError], None],
             wind_up: threading.Event) -> None:
    """Up to --concurrency conversations at once, the next turn of each generated as one batch; rows are taken
    in source order."""
    rows: Iterator[Row] = iter(todo)
    exhausted = False
    active: dict[int, tuple[Conversation, Request]] = {}
    finished: dict[int, Regenerated | RowError] = {}
    order: deque[int] = deque()

    def advance(row_id: int, conv: Conversation, reply: Reply | RowError | None) -> None:
        try:
            if isinstance(reply, RowError):
                raise reply
            active[row_id] = (conv, next(conv) if reply is None else conv.send(reply))
        except StopIteration as done:
            finished[row_id] = done.value
        except RowError as err:
            finished[row_id] = err

    while True:
        while len(active) < cfg.concurrency and not (exhausted or wind_up.is_set()):
            row = next(rows, None)
            if row is None:
                exhausted = True
                break
            order.append(row.row_id)
            advance(row.row_id, conversation(row, cfg), None)
        if active:
            step = list(active.items())
            active.clear()
            for (row_id, (conv, _)), reply in zip(step, generate([r for _, (_, r) in step]), strict=True):
                advance(row_id, conv, reply)
        while order and order[0] in finished:
            row_id = order.popleft()
            take(row_id, finished.pop(row_id))
        if not active and (exhausted or wind_up.is_set()):  # every row taken, or winding up with none in flight
            return
