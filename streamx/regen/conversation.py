"""One conversation regenerated: its turn plan, the generator that asks for each assistant turn in order on
the model's own earlier replies, and the output row (with input_ids + loss_mask exactly as generated, where
the engine gives token ids).

    plan_turns(record) -> messages, None where a turn is to be generated
    conversation(row, cfg): yield Request, receive Reply, ..., return Regenerated (or raise RowError)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Generator
from dataclasses import dataclass

from ..config import RegenerateConfig
from ..data.messages import BadRow, conversation_of, normalize
from ..data.source import Row
from ..data.tokenize import CONTENT_FIELDS
from .engines import Reply, Request, RowError

# a source row's fields that the output row replaces (the others, such as an id or tools, are kept)
REPLACED_FIELDS = (*CONTENT_FIELDS, "loss_mask", "source_row", "turns")

Conversation = Generator[Request, Reply, "Regenerated"]


@dataclass
class Regenerated:
    row: dict  # the output row
    dropped_turns: int = 0  # truncated turns cut off under --truncated drop-turn
    tool_turns_kept: int = 0  # assistant turns with tool calls, kept from the source
    tool_calls_generated: int = 0  # generated turns that call tools


def plan_turns(record: dict | None) -> tuple[list[dict | None], list | None]:
    """A row -> its messages (streamx.data.messages' one form) with None where an assistant turn is to be
    generated, and its tool definitions. An assistant turn that called tools is kept as it is, with the tool
    results that answer it."""
    if not isinstance(record, dict):
        raise RowError("unrecognised_row", f"expected an object, got {type(record).__name__}")
    turns = conversation_of(record)
    if turns is None:
        has = "input_ids" if record.get("input_ids") is not None else "text" if record.get("text") is not None else None
        raise RowError("not_a_conversation", f"this {has} row has no turns to regenerate" if has else
                       f"no messages/conversations field in {sorted(record)}")
    try:
        messages = normalize(turns, answers=False)
    except BadRow as err:
        raise RowError(err.reason, err.detail) from None
    items: list[dict | None] = [None if m["content"] is None else m for m in messages]
    if items[-1] is not None and items[-1]["role"] != "assistant":
        items.append(None)  # a conversation that ends on a user (or tool) turn: answer it
    if None not in items:
        raise RowError("empty_conversation", "no assistant turn to generate")
    first = items.index(None)
    if not any(m["role"] != "system" for m in items[:first]):
        raise RowError("no_prompt", "nothing but a system prompt before the first assistant turn")
    tools = record.get("tools")
    return items, tools if isinstance(tools, list) and tools else None


class PromptRepeats:
    """Which rows ask what an earlier row asked (--skip-duplicates): every message but the assistant turns to be
    generated, and the tools. Rows are passed in source order, done or not, so a resume agrees on which came
    first. Memory: a 64-bit key and the first row id per distinct prompt."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}

    def earlier(self, row: Row) -> int | None:
        """The row id of the first row with this row's prompt, when that is another row; None otherwise (and for
        a row that is not a conversation, which fails on its own)."""
        try:
            items, tools = plan_turns(row.record)
        except RowError:
            return None
        text = json.dumps([items, tools], sort_keys=True, ensure_ascii=False)
        key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        first = self.first.setdefault(key, row.row_id)
        return first if first != row.row_id else None


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
    # the source row first: a resume reads it off each line's start without parsing the row (regen.files)
    row_out = {"source_row": row.row_id} | kept_fields | {"messages": history, "turns": turns}
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
