"""What a window's rows share, found before anything is computed: each distinct token computed and stored once.

The model is causal, so a token's states depend only on the tokens before it: rows that start alike have the
same states over what they share. Three kinds of sharing, all found by sorting a window's rows by their token
ids (a row sorts right before the rows that extend it, and neighbours' longest common prefixes are exactly a
token trie's branch points):

- a duplicate, or a row that is a prefix of another row (fanned-out turns, agent steps): not computed at all;
  its states are the first tokens of the row it is a prefix of (it is "covered" by that leaf);
- leaves (the other rows) that start with a common run of at least `min_shared_tokens` tokens (a system
  prompt, a tool schema, a shared history): the run is one segment, computed once, and each leaf continues
  from its state (streamx.model.packing gives attention the keys of a segment's ancestors);
- everything else is a segment of its own, as without sharing.

A window's rows become trees of segments. A tree too large for one forward pass is cut between its leaves into
`Piece`s, one forward each, in order: a piece computes the segments its rows need that no earlier piece computed,
and continues the others from the states their piece kept (streamx.model.carry); each segment is stored once,
by the piece that computes it, and the rows of later pieces read it there. The cut depends on the window's rows
alone, so every world size and every resume computes the same pieces (a resume runs a window's pieces again
from its first). Memory: one window's token ids; the states kept are at most one chain of segments (leaves go
depth first, so a segment is let go once the leaves under it are done), at most `token_budget` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..base.units import gb
from .tokenize import Sample


@dataclass(eq=False)
class Segment:
    """Tokens [depth, end) of the rows under it, computed once; it continues `parent` (None: a root)."""

    end: int
    source: Sample  # a row that holds its tokens (a leaf under it)
    parent: Segment | None = None
    children: list[Segment] = field(default_factory=list)
    leaf: Sample | None = None  # the row it ends (a leaf's own segment)
    covered: list[Sample] = field(default_factory=list)  # rows that are prefixes of its leaf (duplicates too)

    @property
    def depth(self) -> int:
        """Tokens its rows hold before it: the position of its first token."""
        return self.parent.end if self.parent is not None else 0

    @property
    def length(self) -> int:
        return self.end - self.depth

    def chain(self) -> list[Segment]:
        """Its ancestors from the root down, then itself."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def walk(self) -> Iterable[Segment]:
        """It and its descendants, parents first (children in sorted order). A stack, not recursion: a tree is
        as deep as its rows' distinct branch points (an agent trace fanned out per step: thousands)."""
        stack = [self]
        while stack:
            segment = stack.pop()
            yield segment
            stack.extend(reversed(segment.children))


@dataclass
class Piece:
    """What one forward pass computes of a tree: segments (parents first) and the rows they serve, each with
    the leaf segment whose chain holds its tokens. A piece of a tree cut into several also continues segments
    that an earlier piece computed (`continues`), and keeps the states of those a later one continues."""

    segments: list[Segment]
    rows: list[tuple[Sample, Segment]]
    continues: list[Segment] = field(default_factory=list)  # earlier pieces' segments its rows start with
    exports: list[Segment] = field(default_factory=list)  # its segments that later pieces continue
    releases: list[Segment] = field(default_factory=list)  # earlier pieces' segments no later piece continues

    @property
    def cut(self) -> bool:
        """One of several pieces of a tree: it runs after the pieces before it, alone in its batch."""
        return bool(self.continues or self.exports)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two rows' ids share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def share(samples: list[Sample], min_shared_tokens: int | None) -> list[Segment]:
    """The roots of the segment trees of `samples` (one window's), in sorted order. `min_shared_tokens`: the
    shortest common leading run that becomes a segment of its own; None: none does (each leaf is a root, and
    only covered rows are shared: no state is handed over). Memory: 4 bytes per token of the window for the
    sort keys (big-endian ids: their byte order is the ids' order, and a row's key starts every key that
    extends it)."""
    ids = [s.input_ids.numpy() for s in samples]
    keys = [row.astype(">u4").tobytes() for row in ids]
    order = sorted(range(len(samples)), key=lambda i: (keys[i], samples[i].row_id))
    leaves: list[tuple[int, list[Sample]]] = []  # (sample, the rows it covers)
    waiting: list[Sample] = []  # rows that the next row in sorted order starts with
    for k, i in enumerate(order):
        after = order[k + 1] if k + 1 < len(order) else None
        if after is not None and keys[after].startswith(keys[i]):
            waiting.append(samples[i])  # then the leaf that ends this run of rows starts with it too
        else:
            leaves.append((i, waiting))
            waiting = []
    root = Segment(0, samples[0]) if samples else None  # a virtual root of depth 0, never computed
    stack = [root]  # the open path from the root
    for k, (i, covered) in enumerate(leaves):
        shared = common_prefix(ids[leaves[k - 1][0]], ids[i]) if k else 0
        if min_shared_tokens is None or shared < min_shared_tokens:
            shared = 0
        while stack[-1].end > shared:
            last = stack.pop()
            if stack[-1].end < shared:  # the branch point lies inside `last`: a segment of its own ends there
                stack.append(Segment(shared, last.source))
            _adopt(stack[-1], last)
        leaf = Segment(len(ids[i]), samples[i], leaf=samples[i], covered=covered)
        stack.append(leaf)
    while len(stack) > 1:
        last = stack.pop()
        _adopt(stack[-1], last)
    return root.children if root is not None else []


def _adopt(parent: Segment, child: Segment) -> None:
    child.parent = parent if parent.end > 0 else None
    parent.children.append(child)


def pieces(roots: list[Segment], token_budget: int) -> list[Piece]:
    """Each tree as one piece, or, when it holds more than `token_budget` tokens, cut between its leaves into
    pieces that fit (`_cut`)."""
    out = []
    for root in roots:
        segments = list(root.walk())
        if sum(s.length for s in segments) <= token_budget:
            out.append(Piece(segments, [row for s in segments for row in _rows(s)]))
        else:
            out += _cut(segments, token_budget)
    return out


def _cut(segments: list[Segment], token_budget: int) -> list[Piece]:
    """A tree's leaves in order, as many to a piece as fit: a piece computes what its leaves' chains hold beyond
    what earlier pieces computed, and continues the rest."""
    out: list[Piece] = []
    done: set[int] = set()  # ids of the segments earlier pieces computed
    chosen: dict[int, Segment] = {}  # id -> segment, in the order first needed (parents first)
    rows: list[tuple[Sample, Segment]] = []
    for leaf in (s for s in segments if s.leaf is not None):
        need = [s for s in leaf.chain() if id(s) not in chosen and id(s) not in done]
        if rows and sum(s.length for s in chosen.values()) + sum(s.length for s in need) > token_budget:
            out.append(Piece(list(chosen.values()), rows))
            done.update(chosen)
            chosen, rows = {}, []
        chosen.update((id(s), s) for s in need)
        rows += _rows(leaf)
    out.append(Piece(list(chosen.values()), rows))
    last_use: dict[int, int] = {}  # id of a continued segment -> the last piece that continues it
    for k, piece in enumerate(out):
        own = {id(s) for s in piece.segments}
        seen: set[int] = set()
        for _, leaf in piece.rows:
            for s in leaf.chain():
                if id(s) not in own and id(s) not in seen:
                    seen.add(id(s))
                    piece.continues.append(s)
                    last_use[id(s)] = k
    for k, piece in enumerate(out):
        piece.exports = [s for s in piece.segments if id(s) in last_use]
        piece.releases = [s for s in piece.continues if last_use[id(s)] == k]
    return out


def _rows(segment: Segment) -> list[tuple[Sample, Segment]]:
    if segment.leaf is None:
        return []
    return [(segment.leaf, segment), *((row, segment) for row in segment.covered)]


def covered_rows(roots: list[Segment]) -> Iterable[tuple[Sample, bool]]:
    """The rows not computed at all, each with whether it duplicates a row before it (else it is a strict prefix
    of its leaf): a leaf's covered rows are its prefixes, so two of the same length are equal."""
    for root in roots:
        for segment in root.walk():
            seen = {segment.end}  # the leaf's own length
            for row in segment.covered:
                yield row, len(row.input_ids) in seen
                seen.add(len(row.input_ids))


def row_ranges(length: int, leaf: Segment, starts: dict[int, int]) -> tuple[list[tuple[Segment, int]],
                                                                            list[tuple[int, int]]]:
    """Where a row of `length` tokens that starts like `leaf` lies: the segments of the leaf's chain that an
    earlier piece computed, each with how many of its tokens the row reads, then (start, length) in the batch's
    computed tokens per segment of the chain that the batch computes (`starts`: each one's first token, by id)."""
    earlier, ranges = [], []
    for segment in leaf.chain():
        if segment.depth >= length:
            break
        n = min(segment.end, length) - segment.depth
        if id(segment) in starts:
            ranges.append((starts[id(segment)], n))
        else:
            earlier.append((segment, n))
    return earlier, ranges


@dataclass(frozen=True)
class Sharing:
    """What a run shares: nothing (off), rows that are prefixes of others (duplicates too), and, where the model
    can continue a segment from another's state (a probe at start: streamx.model.packing), common leading runs."""

    on: bool
    min_shared_tokens: int | None = None  # the shortest leading run computed once; None: no leading runs shared
    reason: str | None = None  # why no leading runs are shared although sharing is on
    kept_bytes: int | None = None  # at most what a tree cut into batches keeps between them (streamx.model.carry)
    handing_over: int = 0  # linear-attention layers run once per segment in batches with trees, to hand states over

    @property
    def setting(self) -> str:
        """What a resume must match: which rows are computed together decides how their states round."""
        if not self.on:
            return "off"
        return "on" if self.min_shared_tokens is not None else "rows"

    def __str__(self) -> str:  # as the store's metadata records it
        return self.setting if self.reason is None else f"{self.setting}: {self.reason}"

    def note(self) -> str:
        """The run's log line."""
        if not self.on:
            return "off: every row computed in full" + (f" ({self.reason})" if self.reason else "")
        if self.min_shared_tokens is None:
            return ("prefix rows only: a row that repeats an earlier row, or is a prefix of another, is not "
                    f"computed; {self.reason}")
        return (f"on: rows that repeat an earlier row, or are prefixes of others, are not computed, and leading "
                f"runs of {self.min_shared_tokens}+ tokens that rows share are computed once, also across batches "
                "(checked against this model's own forward: a row continued from a shared prefix, in its batch or "
                "a later one, has the states it has alone)"
                + (f"; a prefix continued in later batches keeps at most {gb(self.kept_bytes)} of keys and values "
                   "meanwhile" if self.kept_bytes else "")
                + (f"; in batches with shared runs its {self.handing_over} linear-attention layers run once per "
                   "segment, each continuing its parent's state (their own kernels start every sample from a clean one)"
                   if self.handing_over else ""))
