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


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.get_num_threads() < 2,
                    reason="counts Linux threads; one intra-op thread starts no team")
@pytest.mark.parametrize("packed", [True, False])
def test_batching_starts_no_openmp_team_in_the_producer_thread(packed):
    """The producer thread builds batches beside the model's forward; a multi-threaded torch op there would
    give it an OpenMP team of its own for the whole run (and slow a CPU forward pass: bench/RESULTS.md).
    Large batches (64k tokens), where torch's ops would go parallel."""
    assert _threads_started_by(lambda: torch.repeat_interleave(torch.arange(16), torch.full((16,), 4096))) > 0
    items = samples_of([4096] * 16) + [Reject(16, "empty_conversation", "no turns")]
    batches = _threads_started_by(lambda: list(iter_batches(items, 65536, 64, 0, packed=packed)))
    assert batches == 0
