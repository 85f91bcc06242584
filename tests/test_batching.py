import os
import sys
import threading

import pytest
import torch

from streamx.data.batching import iter_batches, make_batch, make_packed_batch
from streamx.data.tokenize import Reject, Sample


def samples_of(lengths: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(i, torch.randint(3, 1000, (n,), generator=g), torch.ones(n, dtype=torch.int64))
            for i, n in enumerate(lengths)]


def test_padded_batch_is_right_padded_and_indexes_each_real_token():
    samples = samples_of([5, 2, 7])
    batch = make_batch(samples, pad_token_id=0)
    assert batch.input_ids.shape == (3, 7) and batch.input_ids.dtype == torch.int64
    real = []
    for b, s in enumerate(samples):
        T = len(s.input_ids)
        assert torch.equal(batch.input_ids[b, :T], s.input_ids) and not batch.input_ids[b, T:].any()
        assert batch.attention_mask[b].tolist() == [1] * T + [0] * (7 - T)
        real += [b * 7 + t for t in range(T)]
    assert batch.token_index.tolist() == real
    assert batch.segment_index.tolist() == [0] * 5 + [1] * 2 + [2] * 7
    assert torch.equal(batch.input_ids.flatten()[batch.token_index], torch.cat([s.input_ids for s in samples]))


def test_packed_batch_restarts_positions_and_marks_boundaries():
    samples = samples_of([5, 2, 7])
    batch = make_packed_batch(samples)
    assert torch.equal(batch.input_ids[0], torch.cat([s.input_ids for s in samples]))
    assert batch.position_ids.tolist() == [list(range(5)) + list(range(2)) + list(range(7))]
    assert batch.cu_seq_lens.tolist() == [0, 5, 7, 14] and batch.cu_seq_lens.dtype == torch.int32
    assert batch.token_index.tolist() == list(range(14)) and batch.padded_tokens == 14
    assert batch.segment_index.tolist() == [0] * 5 + [1] * 2 + [2] * 7
    assert batch.input_ids.dtype == batch.position_ids.dtype == batch.token_index.dtype == torch.int64


def _threads_started_by(work) -> int:
    """OS threads that appear while `work` runs in a fresh thread and are still there when it is done (an
    OpenMP team lives as long as its thread); threads of earlier work that end meanwhile do not count."""
    started = {}

    def body() -> None:
        before = set(os.listdir("/proc/self/task"))
        work()
        started["n"] = len(set(os.listdir("/proc/self/task")) - before)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return started["n"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts Linux threads")
@pytest.mark.parametrize("packed", [True, False])
def test_batching_starts_no_openmp_team_in_the_producer_thread(packed, torch_threads):
    """The producer thread builds batches beside the model's forward; a multi-threaded torch op there would
    give it an OpenMP team of its own for the whole run (and slow a CPU forward pass: bench/RESULTS.md).
    Large batches (64k tokens), where torch's ops would go parallel."""
    torch_threads(2)  # one intra-op thread starts no team anywhere
    assert _threads_started_by(lambda: torch.repeat_interleave(torch.arange(16), torch.full((16,), 4096))) > 0
    items = samples_of([4096] * 16) + [Reject(16, "empty_conversation", "no turns")]
    batches = _threads_started_by(lambda: list(iter_batches(items, 65536, 64, 0, packed=packed)))
    assert batches == 0


def trie_nodes(rows: list[list[int]]) -> int:
    """Distinct non-empty prefixes of `rows` (a token trie's nodes): what sharing computes, each once."""
    root: dict = {}
    count = 0
    for row in rows:
        node = root
        for token in row:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def test_a_window_of_rows_leaving_one_path_at_every_depth_is_batched_and_served_exactly():
    """An agent trace fanned out a row per step (each step's own turn rendered only while it is the last): row
    k leaves the trace after 16 + k tokens, so the window's segment tree is 2,000 levels deep (past Python's
    recursion limit) and too large for one batch. Every row's tokens are read back from the batches alone: this
    batch's computed tokens, after those of the segments earlier batches computed and kept."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    trace = torch.randint(10, 1000, (16 + n,), generator=g).tolist()
    rows = [trace[: 16 + k] + [1, 2, 3] for k in range(n)]
    samples = [Sample(k, torch.tensor(r), torch.ones(len(r), dtype=torch.int64)) for k, r in enumerate(rows)]
    batches = list(iter_batches(samples, token_budget=2048 + 32, max_batch_size=256, pad_token_id=0, packed=True,
                                sharing=True, min_shared_tokens=16))
    assert any(b.carry is not None for b in batches)  # the tree was cut: rows continue earlier batches' segments
    kept: dict[int, list[int]] = {}  # id of a segment an earlier batch kept -> its computed token ids
    served: dict[int, list[int]] = {}
    for batch in batches:
        ids, cu = batch.computed_ids().tolist(), batch.cu_seq_lens.tolist()
        for k, (sample, ranges) in enumerate(zip(batch.samples, batch.row_ranges, strict=True)):
            earlier = batch.carry.rows[k] if batch.carry is not None else []
            tokens = [t for segment, m in earlier for t in kept[id(segment)][:m]]
            tokens += [t for start, m in ranges for t in ids[start : start + m]]
            assert sample.row_id not in served
            served[sample.row_id] = tokens
        if batch.carry is not None:
            kept.update((id(s), ids[cu[k] : cu[k + 1]]) for k, s in batch.carry.exports.items())
    assert served == dict(enumerate(rows))
    assert sum(b.num_tokens for b in batches) == trie_nodes(rows) == 15 + n + 3 * n


@pytest.mark.parametrize(("packed", "alone_past"), [(True, False), (False, False), (True, True)])
def test_rows_on_two_sides_of_a_length_split_never_share_a_forward_or_a_prefix(packed, alone_past):
    """A length-dependent rope (streamx.model.lengths): rows of at most `split` tokens are batched, and share
    prefixes, only among themselves; past it among themselves too (prefix rows only, no leading runs), or each alone."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 1000, (90,), generator=g)
    # a short row that is a prefix of a long one, a long row that is a prefix of a longer one, rows that share a
    # leading run on each side, and unrelated rows of both sides
    ids = [base[:20], base[:90], base[:70], torch.cat([base[:30], base[60:80]]), *(
        torch.randint(3, 1000, (n,), generator=g) for n in (12, 25, 33, 41, 55, 64, 80))]
    samples = [Sample(i, t, torch.ones(len(t), dtype=torch.int64)) for i, t in enumerate(ids)]
    split = 32
    batches = list(iter_batches(samples, 256, 8, 0, packed=packed, sharing=True, min_shared_tokens=8, split_at=split,
                                alone_past_split=alone_past))
    served = sorted(s.row_id for b in batches for s in b.samples)
    assert served == list(range(len(samples)))  # every row once
    for b in batches:
        sides = {len(s.input_ids) > split for s in b.samples}
        assert len(sides) == 1, [len(s.input_ids) for s in b.samples]
        if sides == {True}:
            assert b.segment_parents is None  # no leading run shared past the split
            if alone_past:
                assert len(b.samples) == 1 and len(b.segment_lengths) == 1
    # the short prefix of the long row is computed on its own side; the long prefix row is served from 90 (or alone)
    short = next(b for b in batches if 0 in [s.row_id for s in b.samples])
    assert all(len(s.input_ids) <= split for s in short.samples)
    longest = next(b for b in batches if 1 in [s.row_id for s in b.samples])
    assert (2 in [s.row_id for s in longest.samples]) != alone_past
