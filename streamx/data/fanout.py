"""Fanned-out rows that sharing cannot fold: a row whose messages begin with all of an earlier row's, but whose tokens
do not begin with that row's tokens.

Fanned out, a conversation becomes one row per assistant turn, each with the whole history before it. Under ChatML
row k is then a token prefix of row k + 1 and --sharing stores each token once. Thinking templates (Qwen3, Qwen3.5)
render an empty `<think>` block before the last assistant turn only, so row k's last turn is not rendered as row
k + 1 renders it: no row is a prefix of the next, and with every turn trained (--train-turns all) each row trains
every earlier turn again, in a rendering the model never generated it in. `FanOut` counts such rows as the sample
builder tokenizes them and keeps the first one as an example, for `streamx plan` to say so.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from .sharing import common_prefix

SNIPPET_TOKENS = 16  # decoded from where two rows differ ...
SNIPPET_CHARS = 40  # ... and cut to this many characters


@dataclass(frozen=True)
class Divergence:
    """Where a row's tokens leave those of the earlier row whose messages it extends."""

    row: int
    earlier: int  # the earlier row
    position: int  # the first token where they differ
    snippet: str  # the row's tokens from there
    earlier_snippet: str


class FanOut:
    """Chat rows fed one by one (`add`, from any thread): how many extend an earlier row's messages (begin with all
    of them, and have more), how many of those are also that row's token prefix, and the first that is not. Memory:
    the token ids of the most recent rows, `max_tokens` of them at most (4 bytes each; least recently used out),
    keyed by a digest of their messages."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, max_tokens: int = 1 << 20):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.rows = 0  # fed
        self.extending = 0  # extend an earlier row's messages
        self.token_prefixes = 0  # of those, whose tokens begin with that row's tokens too
        self.example: Divergence | None = None  # the first of the others
        self._recent: OrderedDict[bytes, tuple[int, np.ndarray]] = OrderedDict()
        self._kept_tokens = 0
        self._lock = threading.Lock()

    def add(self, row_id: int, keys: Sequence[bytes], input_ids: Sequence[int]) -> None:
        """A chat row: `keys[i]` a digest of its messages[:i] for i = 0 .. len(messages) (RenderedPrompts.keys),
        and its token ids."""
        ids = np.asarray(input_ids, dtype=np.int32)
        with self._lock:
            self.rows += 1
            # the earlier row with the most of its messages: the turn before this one, when fanned out
            earlier = next((k for k in reversed(keys[1:-1]) if k in self._recent), None)
            if earlier is not None:
                self._recent.move_to_end(earlier)
                self._compare(row_id, ids, *self._recent[earlier])
            self._keep(keys[-1], row_id, ids)

    def _compare(self, row_id: int, ids: np.ndarray, earlier_row: int, earlier_ids: np.ndarray) -> None:
        self.extending += 1
        position = common_prefix(earlier_ids, ids)
        if position == len(earlier_ids):
            self.token_prefixes += 1
        elif self.example is None:
            self.example = Divergence(row_id, earlier_row, position, self._snippet(ids, position),
                                      self._snippet(earlier_ids, position))

    def _keep(self, key: bytes, row_id: int, ids: np.ndarray) -> None:
        kept = self._recent.pop(key, None)
        self._kept_tokens -= 0 if kept is None else len(kept[1])
        self._recent[key] = (row_id, ids)
        self._kept_tokens += len(ids)
        while self._kept_tokens > self.max_tokens and len(self._recent) > 1:
            self._kept_tokens -= len(self._recent.popitem(last=False)[1][1])

    def _snippet(self, ids: np.ndarray, position: int) -> str:
        part = ids[position: position + SNIPPET_TOKENS].tolist()
        if self.tokenizer is None:
            return str(part[:8])
        return self.tokenizer.decode(part)[:SNIPPET_CHARS]

    def note(self, train_turns: str = "all") -> str | None:
        """One line on the rows that extend an earlier row's messages but not its tokens, with the first example and
        what to do (given the run's --train-turns); None where there are none."""
        with self._lock:
            diverging, rows, e = self.extending - self.token_prefixes, self.rows, self.example
        if e is None:
            return None
        cost = ("each row trains every earlier turn again, in a rendering the model never generated it in; "
                "--train-turns last trains each turn once, as it was generated" if train_turns == "all" else
                "each turn is trained once (--train-turns last)")
        return (f"{diverging:,} of {rows:,} rows extend an earlier row's messages but not its tokens (the chat "
                "template renders an earlier turn differently from a last turn, e.g. "
                f"row {e.row} vs row {e.earlier} at token {e.position:,}: {e.snippet!r} vs {e.earlier_snippet!r}): "
                f"sharing cannot store a row inside the next, only their common leading run; {cost} "
                "(docs/fanout.md)")
