"""Rows -> token ids + an assistant loss mask, through the tokenizer's own chat template.

Most chat templates (ChatML/SmolLM2, Qwen3, Llama-3, Gemma) have no `{% generation %}`
markers, so the mask is found in the rendered text instead: each assistant message's
content is located in order, and its tokens are marked together with the end-of-turn
token that closes it (`<|im_end|>`, `<|eot_id|>`, ...), because the drafter must learn to
end turns. Template boilerplate around the content is never marked, including Qwen3's
empty `<think>\\n\\n</think>\\n\\n` block: at inference it comes from the prompt
(`enable_thinking=False`), not from the model. With train_turns "last" only a row's last assistant message with
content is marked: fanned-out rows, one per turn, then train each turn once (streamx.data.fanout).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import jinja2
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .messages import BadRow, conversation_of, normalize
from .source import Row

if TYPE_CHECKING:
    from .fanout import FanOut

REJECT_REASONS = (
    "malformed_json",  # a jsonl line that does not parse
    "unrecognised_row",  # not an object, or no messages/conversations/text/input_ids field
    "empty_conversation",
    "unknown_role",
    "non_string_content",
    "empty_text",
    "invalid_input_ids",  # pre-tokenized ids out of range, or a loss_mask that does not fit
    "template_error",  # the chat template raised on this conversation
    "template_mismatch",  # an assistant message's text is not in the rendered template
    "no_assistant_tokens",  # nothing to train on, e.g. every assistant token truncated away
    "too_long",  # over max_length with truncation="skip"
    "non_finite",  # NaN/inf hidden states (set by the capture stage)
    "duplicate_content",  # --skip-duplicates: the same content as an earlier row (last: stored codes index this)
)

THINK_OPEN = "<think>"  # what reasoning models open their reasoning with (Qwen3, DeepSeek-R1)


CONTENT_FIELDS = ("input_ids", "messages", "conversations", "text")  # what SampleBuilder builds from, in its order


def content_key(record: dict | None) -> int | None:
    """A 64-bit hash of what a row's sample is built from (the first of CONTENT_FIELDS it has, with its
    loss_mask for input_ids), so rows that differ only elsewhere (an id, a source tag) count as the same;
    None for a row that is not an object. 64 bits: a chance collision among a million rows is ~3e-8."""
    if not isinstance(record, dict):
        return None
    field = next((f for f in CONTENT_FIELDS if record.get(f) is not None), None)
    if field is None:
        return None
    content = [record.get(field), record.get("loss_mask")] if field == "input_ids" else record.get(field)
    text = json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


DIGEST_BYTES = 16


def tokens_digest(input_ids: torch.Tensor | np.ndarray, loss_mask: torch.Tensor | np.ndarray) -> bytes:
    """A 128-bit digest of a sample's token ids and loss mask: what proves that a repeated row (the same content
    key) is the row it reads. The key hashes the raw row, 64 bits, and can be made to collide; the digest hashes
    what is stored, so a repeat is read from its first row only when their digests are equal."""
    ids = np.asarray(input_ids, dtype="<i8")
    mask = np.asarray(loss_mask, dtype=np.uint8)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"streamx-tokens")
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.tobytes())
    h.update(mask.tobytes())
    return h.digest()


class Repeats:
    """Which rows repeat an earlier row's content (content_key), and the first row that had it, row after row in
    source order. Every rank and every resume passes every row, read or (a resume's done windows) with its key
    from the store, so all of them agree on which is first. Memory: a 64-bit key and a row id per distinct row
    (a Python dict, ~100 bytes an entry: ~100 MB at a million rows), and the token digest of each first row
    this process tokenized (`digests`)."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.digests: dict[int, bytes] = {}  # first rows tokenized here: their tokens_digest

    def of(self, rows: Iterable[Row]) -> dict[int, tuple[int, int | None]]:
        """Row id -> (its content key, the earlier row that had it, here or before, or None) of the rows here
        that have a key."""
        found = {}
        for row in rows:
            key = content_key(row.record)
            if key is not None:
                first = self.first.setdefault(key, row.row_id)
                found[row.row_id] = (key, None if first == row.row_id else first)
        return found

    def add(self, rows: Iterable[int], keys: Iterable[int]) -> None:
        """The keys of rows passed without being read (a resume's done windows, from the store), in source order."""
        for row, key in zip(rows, keys, strict=True):
            if key:
                self.first.setdefault(int(key), int(row))


class NoChatTemplateError(ValueError):
    """A chat row met a tokenizer without a chat template: fatal for the run, not per row."""


@dataclass
class Sample:
    row_id: int
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 0/1 [T], not shifted: 1 on assistant tokens
    duplicate: bool = False  # its content repeats an earlier row's
    content_key: int = 0  # content_key of its row (0: not computed)
    cut: int = 0  # its tokens past max_length, not kept (truncation "truncate")

    @functools.cached_property
    def digest(self) -> bytes:
        """tokens_digest of its ids and mask (taken once: the run compares it, the writer stores it)."""
        return tokens_digest(self.input_ids, self.loss_mask)


@dataclass(frozen=True)
class Duplicate:
    """A row whose content repeats an earlier row's, anywhere in the data: with --sharing it is not computed and
    reads that row (`same_as`) in the store."""

    row_id: int
    same_as: int  # the first row with its content
    length: int  # its tokens (the same as that row's)
    trainable: int  # of them, where its loss mask is 1
    content_key: int
    digest: bytes  # tokens_digest of its own tokens: the store reads that row only where the two are equal
    cut: int = 0  # its tokens past max_length, not kept (as that row's)


@dataclass(frozen=True)
class Reject:
    row_id: int
    reason: str  # one of REJECT_REASONS
    detail: str
    content_key: int = 0  # content_key of its row (0: none or not computed)

    def __post_init__(self):
        if self.reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {self.reason!r}")


class SampleBuilder:
    """Turns a Row into a Sample or a Reject. Safe to call from threads (its one mutable part, the rendered prompts
    it keeps, is locked). `train_turns`: the assistant turns of a chat row its mask trains, all or the last one with
    content (RunConfig.train_turns). `fanout`, when set: fed every chat row it tokenizes (streamx.data.fanout)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int,
                 truncation: Literal["truncate", "skip"] = "truncate", train_turns: Literal["all", "last"] = "all"):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if truncation not in ("truncate", "skip"):
            raise ValueError(f"truncation must be 'truncate' or 'skip', got {truncation!r}")
        if train_turns not in ("all", "last"):
            raise ValueError(f"train_turns must be 'all' or 'last', got {train_turns!r}")
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.train_turns = train_turns
        self.fanout: FanOut | None = None
        self.vocab_size = len(tokenizer)
        # end-of-turn markers (<|im_end|>, <|eot_id|>, <end_of_turn>) are added tokens; finetunes
        # often add theirs without the special flag, so any added token counts
        self._end_ids = frozenset(tokenizer.added_tokens_decoder)
        self.fingerprint = tokenizer_fingerprint(tokenizer, max_length, truncation, train_turns)
        self._prompts = RenderedPrompts()

    def __call__(self, row: Row) -> Sample | Reject:
        try:
            if row.error is not None:
                raise BadRow(*row.error)
            ids, mask = self._encode(row.row_id, row.record)
            cut = max(0, len(ids) - self.max_length)
            if cut and self.truncation == "skip":
                raise BadRow("too_long", f"{len(ids)} tokens > max_length {self.max_length}")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            if not any(mask):
                raise BadRow("no_assistant_tokens", f"loss mask is all zero over {len(ids)} tokens")
        except BadRow as r:
            return Reject(row.row_id, r.reason, r.detail)
        return Sample(row.row_id, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64),
                      cut=cut)

    def _encode(self, row_id: int, record: dict | None) -> tuple[list[int], list[int]]:
        if not isinstance(record, dict):
            raise BadRow("unrecognised_row", f"expected an object, got {type(record).__name__}")
        # Arrow-backed datasets fill absent columns with None, so test values, not keys
        if record.get("input_ids") is not None:
            return self._pretokenized(record["input_ids"], record.get("loss_mask"))
        if conversation_of(record) is not None:
            return self._chat(row_id, normalize(conversation_of(record)))
        if record.get("text") is not None:
            return self._text(record["text"])
        raise BadRow("unrecognised_row", f"no messages/conversations/text/input_ids field in {sorted(record)}")

    def _pretokenized(self, ids, mask) -> tuple[list[int], list[int]]:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise BadRow("invalid_input_ids", "input_ids must be a non-empty list of ints")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRow("invalid_input_ids", f"ids must be in [0, {self.vocab_size}), got [{min(ids)}, {max(ids)}]")
        if mask is None:
            return ids, [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise BadRow("invalid_input_ids", f"loss_mask must be {len(ids)} values of 0/1")
        return ids, [int(m) for m in mask]

    def _text(self, text) -> tuple[list[int], list[int]]:
        if not isinstance(text, str):
            raise BadRow("non_string_content", f"text is {type(text).__name__}")
        if not text.strip():
            raise BadRow("empty_text", "text is empty or whitespace")
        ids = self.tokenizer(text)["input_ids"]  # special tokens as the tokenizer adds them to plain text
        return ids, [1] * len(ids)

    def _chat(self, row_id: int, messages: list[dict]) -> tuple[list[int], list[int]]:
        if self.tokenizer.chat_template is None:
            raise NoChatTemplateError("the tokenizer has no chat template, so chat rows cannot be tokenized; "
                                      "set tokenizer.chat_template or use text / input_ids rows")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].strip()]
        if not turns:
            raise BadRow("no_assistant_tokens", "no assistant message with content")
        trained = turns[-1:] if self.train_turns == "last" else turns
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        except jinja2.TemplateError as e:
            raise BadRow("template_error", str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        ends = [e for _, e in offsets]
        mask = [0] * len(ids)
        cursor = 0
        prefixes = self._prompts.keys(messages)
        if self.fanout is not None:
            self.fanout.add(row_id, prefixes, ids)
        for i in turns:
            content = messages[i]["content"].strip()  # templates may strip it
            turn_start = max(cursor, self._turn_start(messages, i, text, prefixes[i]))
            start = text.find(content, turn_start)
            if start < 0:
                raise BadRow("template_mismatch", f"assistant message {i} not found in the rendered chat template")
            cursor = start + len(content)
            if i not in trained:  # (found all the same: the next turn is looked for after it)
                continue
            # reasoning the model wrote before its answer (and the <think> tag that opens it) is trained on
            # where the template renders it
            reasoning = (messages[i].get("reasoning_content") or "").strip()
            thought = text.find(reasoning, turn_start, start) if reasoning else -1
            if thought >= 0:
                opener = text.rfind(THINK_OPEN, turn_start, thought)
                start = opener if opener >= 0 and not text[opener + len(THINK_OPEN):thought].strip() else thought
            k = bisect.bisect_right(ends, start)  # first token ending after the content starts
            while k < len(ids) and offsets[k][0] < cursor:
                mask[k] = 1
                k += 1
            # the end-of-turn token, if only whitespace separates it from the content
            j = k
            while j < len(ids) and ids[j] not in self._end_ids and not text[offsets[j][0]:offsets[j][1]].strip():
                j += 1
            if j < len(ids) and ids[j] in self._end_ids:
                mask[k: j + 1] = [1] * (j + 1 - k)
        return ids, mask

    def _turn_start(self, messages: list[dict], i: int, text: str, key: bytes) -> int:
        """Where assistant message i can start: after the rendered prompt that precedes it, so
        its content is not matched inside an earlier message (user "Hi", assistant "Hi"). `key`: its
        messages' (RenderedPrompts.keys)."""
        if i == 0:
            return 0

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            except jinja2.TemplateError:
                return ""  # (never found below: the running cursor)

        length, digest = self._prompts.get(key, render)
        found = length and _digest(text[:length]) == digest  # text.startswith(prompt)
        return length if found else 0  # else fall back to the running cursor


class RenderedPrompts:
    """The chat template's prompts before each assistant turn, kept for the rows that ask for them again: a
    conversation fanned out one row per turn (speculators' regenerate, agent steps) renders the same prompts in
    every row, turn after turn, and rendering them dominated tokenizing such rows. Keyed by a digest of the
    messages before the turn; each kept as its length and digest (32 bytes, however long the prompt);
    bounded, least recently used out."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._prompts: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def keys(messages: list[dict]) -> list[bytes]:
        """Key i: a digest of messages[:i], for i = 0 .. len(messages) (each a running digest of the last and
        message i - 1)."""
        keys, digest = [b""], b""
        for message in messages:
            digest = _digest(digest.hex() + json.dumps(message, sort_keys=True, default=str))
            keys.append(digest)
        return keys

    def get(self, key: bytes, render: Callable[[], str]) -> tuple[int, bytes]:
        """The length and digest of the prompt under `key`, rendered (outside the lock) when not kept."""
        with self._lock:
            kept = self._prompts.get(key)
            if kept is not None:
                self._prompts.move_to_end(key)
                return kept
        prompt = render()
        kept = (len(prompt), _digest(prompt))
        with self._lock:
            self._prompts[key] = kept
            if len(self._prompts) > self.capacity:
                self._prompts.popitem(last=False)
        return kept


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _vocabulary(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """What decides which token an id is: the tokenizer's own state and its added tokens, as text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    added = {i: [t.content, t.special] for i, t in tokenizer.added_tokens_decoder.items()}
    return state, json.dumps(added, sort_keys=True)


def vocabulary_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides which token each id is: rows of token ids made with one tokenizer are the same
    tokens under another only when this is equal."""
    return hashlib.sha256("\0".join(_vocabulary(tokenizer)).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, max_length: int, truncation: str,
                          train_turns: str = "all") -> str:
    """sha256 of everything that decides the token ids and the mask, so a resume can refuse a change. train_turns
    enters only where it is not "all", so that the stores made before it existed keep their fingerprints."""
    h = hashlib.sha256()
    turns = () if train_turns == "all" else (f"train_turns={train_turns}",)
    for part in (*_vocabulary(tokenizer), json.dumps(tokenizer.chat_template, sort_keys=True),
                 json.dumps(tokenizer.special_tokens_map, sort_keys=True), str(max_length), truncation, *turns):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
