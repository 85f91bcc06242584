"""Shared prefixes (--sharing): what rows share is found exactly (a token trie counted by brute force), computed
once, and every row's states still equal that row computed alone by an unbatched HF forward; a model whose
layers cannot continue a prefix's state is found by the probe and keeps the prefix rows only."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
import zarr
from helpers import assert_same_samples, emulate_flash_varlen, fail_at_batch, reference_states, reference_varlen
from tiny_models import tiny_model
from transformers.cache_utils import DynamicCache
from zoo_models import FAMILIES, zoo_config, zoo_model

from streamx.config import RunConfig
from streamx.data.batching import Batch, iter_batches
from streamx.data.sharing import pieces, share
from streamx.data.tokenize import Sample
from streamx.measure.look import row_lines
from streamx.model import attention, packing, segments
from streamx.model.capture import LayerCapture, find_decoder
from streamx.model.carry import Kept, carrying, kept_bytes_per_token
from streamx.model.gather import gather_into_torch
from streamx.model.packing import configure
from streamx.model.segments import PackedForward, forward_inputs
from streamx.model.support import support_of
from streamx.pipeline.estimate import estimate
from streamx.pipeline.plan import decide_sharing, make_plan
from streamx.pipeline.runner import run
from streamx.proof.check import check_continuation
from streamx.store import SharedKinds, open_store, shards
from streamx.store.shards import ChunkCache, ProcessCache
from streamx.train import verify as verify_module
from streamx.train.verify import check_index, verify

BF16_ULP = 2.0**-7


def as_samples(rows: list[list[int]], masks: list[list[int]] | None = None) -> list[Sample]:
    return [Sample(i, torch.tensor(r), torch.tensor(masks[i] if masks else [1] * len(r)))
            for i, r in enumerate(rows)]


def random_rows(rng: random.Random) -> list[list[int]]:
    """Rows drawn from a few stems: duplicates, prefixes and shared leading runs of every length."""
    stems = [[rng.randint(0, 3) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    rows = []
    for _ in range(rng.randint(1, 15)):
        stem = rng.choice(stems)
        rows.append(stem[: rng.randint(1, len(stem))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 4))])
    return rows


def chain_tokens(leaf) -> list[int]:
    return [t for seg in leaf.chain() for t in seg.source.input_ids[seg.depth : seg.end].tolist()]


def test_sharing_computes_a_token_trie_exactly_and_serves_every_row_once():
    rng = random.Random(0)
    for _ in range(300):
        rows = random_rows(rng)
        samples = as_samples(rows)
        trie = {tuple(r[:k]) for r in rows for k in range(1, len(r) + 1)}  # every distinct prefix: a trie node
        for min_shared in (None, 1, 3):
            segments = [s for root in share(samples, min_shared) for s in root.walk()]
            served = [row for s in segments if s.leaf is not None for row in (s.leaf, *s.covered)]
            assert sorted(r.row_id for r in served) == list(range(len(rows)))
            for s in (s for s in segments if s.leaf is not None):
                assert chain_tokens(s) == s.leaf.input_ids.tolist()
                for row in s.covered:  # a duplicate or a prefix of its leaf
                    assert s.leaf.input_ids[: len(row.input_ids)].tolist() == row.input_ids.tolist()
            computed = sum(s.length for s in segments)
            if min_shared == 1:
                assert computed == len(trie), rows
            # no leading run shorter than the minimum is split off
            assert all(s.parent is None or s.parent.end >= (min_shared or 10**9) for s in segments)
            for budget in (16, 24, 1000):
                cut = pieces(share(samples, min_shared), budget)
                assert sorted(r.row_id for p in cut for r, _ in p.rows) == list(range(len(rows)))
                # each segment computed once at any budget: a tree cut into pieces continues what earlier
                # pieces computed, in order, and each piece keeps what later ones continue until the last lets go
                assert sum(p.num_tokens for p in cut) == computed
                kept: set[int] = set()
                for p in cut:
                    assert p.num_tokens <= budget
                    order = {id(s): k for k, s in enumerate(p.segments)}
                    assert {id(s) for s in p.continues} <= kept and not kept & set(order)
                    for _, leaf in p.rows:  # brings its ancestors, or continues them
                        assert all(id(c) in order or any(c is s for s in p.continues) for c in leaf.chain())
                    assert all(s.parent is None or id(s.parent) in kept or order[id(s.parent)] < order[id(s)]
                               for s in p.segments)
                    kept |= {id(s) for s in p.exports}
                    kept -= {id(s) for s in p.releases}
                    assert p.cut == (len([q for q in cut if q.rows[0][1].chain()[0] is p.rows[0][1].chain()[0]]) > 1)
                assert not kept


def test_sharing_does_not_depend_on_the_rows_order():
    rows = random_rows(random.Random(3))
    samples = as_samples(rows)

    def layout(samples):
        return [(s.depth, s.end, s.source.row_id if s.leaf is None else s.leaf.row_id,
                 sorted(c.row_id for c in s.covered)) for root in share(samples, 2) for s in root.walk()]

    shuffled = samples[:]
    random.Random(1).shuffle(shuffled)
    assert layout(shuffled) == layout(samples)


def rows_of_every_kind(vocab: int) -> list[Sample]:
    """A shared 20-token prefix continued three ways, one continuation fanned out as prefix rows, duplicated and
    branching again after 15 more tokens (a tree three deep), an unrelated row, and a row sharing only 5 tokens
    (below the minimum) with the others."""
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    system, long_rest = draw(20), draw(30)
    rows = [system + draw(9), system + long_rest, system + draw(14), system + long_rest[:11],
            system + long_rest, system, draw(17), system[:5] + draw(12), system + long_rest[:15] + draw(8)]
    masks = [[0] * 20 + [1] * (len(r) - 20) if len(r) > 20 else [1] * len(r) for r in rows]
    masks[4] = [0] * 35 + [1] * 15  # the duplicate trains on less of the shared row than the row it repeats
    return as_samples(rows, masks)


def continues_prefixes(model) -> bool:
    """Set the model up for packed batches (streamx.model.packing.configure); True when rows continue a shared
    prefix's state, in the same forward and in a later one, as the model's own forward of each row alone has it."""
    packing_ = configure(model, "on", 256)
    return packing_.on and check_continuation(model, packing_.probes) is None


def capture_rows(model, batches, layer_ids, between=lambda k: None) -> dict[int, torch.Tensor]:
    """Each row's states: its ranges of its batch's states, after what an earlier batch computed (a cut tree);
    `between(k)` runs before batch k."""
    H = model.config.get_text_config().hidden_size
    out, kept = {}, {}
    with LayerCapture(model, layer_ids, gather_into_torch) as capture:
        for k, batch in enumerate(batches):
            between(k)
            states = torch.full((batch.num_tokens, len(layer_ids), H), float("nan"), dtype=torch.bfloat16,
                                device=next(model.parameters()).device)
            capture.forward(batch, states)
            bounds = batch.cu_seq_lens.tolist() if batch.packed else []
            for s, segment in batch.carry.exports.items() if batch.carry else ():
                kept[segment] = states[bounds[s] : bounds[s + 1]]
            for k, (sample, ranges) in enumerate(zip(batch.samples, batch.row_ranges, strict=True)):
                before = [kept[segment][:n] for segment, n in batch.carry.rows[k]] if batch.carry else []
                out[sample.row_id] = torch.cat([*before, *(states[a : a + n] for a, n in ranges)]).cpu()
    return out


def use_path(path: str | None, monkeypatch) -> None:
    """Packed trees on the CPU join each segment's attention parts by their log-sum-exps (tree); on CUDA in half
    precision they run as flash attention over variable-length sequences (varlen: here through reference_varlen,
    so the calls' layout is checked on any device); elsewhere each segment gathers its ancestors' keys."""
    if path in ("per_segment", "varlen"):
        monkeypatch.setattr(attention, "_ATTENTION_WITH_LSE", None)
    if path == "varlen":
        emulate_flash_varlen(monkeypatch)


PATHS = [(True, "tree"), (True, "per_segment"), (True, "varlen"), (False, None)]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # on a GPU machine (bench/gpu_check.sh) both


@pytest.mark.parametrize(("packed", "path"), PATHS, ids=["packed", "packed-per-segment", "packed-varlen", "padded"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_row_of_a_shared_batch_equals_the_row_alone(family, packed, path, device, monkeypatch):
    use_path(path, monkeypatch)
    model, untouched = tiny_model(family).to(device), tiny_model(family).to(device)
    packing_ = configure(model, "on" if packed else "off", 256)
    assert packing_.on == packed
    continues = packed and check_continuation(model, packing_.probes) is None
    assert continues == packed  # the hybrid's conv and recurrent states are handed over too (SampleWise)
    samples = rows_of_every_kind(model.config.vocab_size)
    batches = list(iter_batches(samples, 64, 256, 0, packed=packed, sharing=True,
                                min_shared_tokens=16 if continues else None))
    computed = sum(b.num_tokens for b in batches)
    rows = sum(len(s.input_ids) for s in samples)
    # duplicates and prefix rows are never computed; the 20-token prefix once a batch where it is handed over
    assert computed < rows - (len(samples[4].input_ids) + 11 + 20)
    if continues:  # a tree three deep: a segment continues one that continues another
        assert any(p >= 0 and b.segment_parents[p] >= 0 for b in batches for p in b.segment_parents or [])
    # the tree is larger than the budget: its later batches continue what the first one kept
    assert any(b.carry is not None and b.carry.parents for b in batches) == continues
    ids = [0, 1, 2, 3, 4]
    got = capture_rows(model, batches, ids)
    assert sorted(got) == list(range(len(samples)))
    for sample in samples:
        want_all = [h.cpu() for h in reference_states(untouched, sample.input_ids)]
        for slot, layer_id in enumerate(ids):
            want = want_all[layer_id].to(torch.bfloat16).float()
            torch.testing.assert_close(got[sample.row_id][:, slot].float(), want, rtol=BF16_ULP,
                                       atol=1e-5 * want.abs().max().item(),
                                       msg=f"{family}: row {sample.row_id} id {layer_id}")


def test_hybrid_rows_from_different_states_run_as_one_padded_group(monkeypatch):
    """The hybrid's linear-attention layers run the segments no other continues as padded groups of alike lengths:
    one group here holds rows continuing two different prefixes and a row starting clean, each row of the group
    from its own start states; every row equals the row alone."""
    model, untouched = tiny_model("qwen3_5"), tiny_model("qwen3_5")
    assert continues_prefixes(model)
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    first, second = draw(20), draw(20)
    samples = as_samples([first + draw(10), first + draw(10), second + draw(10), second + draw(9), draw(10)])
    groups, group_start = [], packing._group_start
    monkeypatch.setattr(packing, "_group_start", lambda starts, layer: groups.append(starts) or group_start(starts,
                                                                                                             layer))
    batches = list(iter_batches(samples, 256, 256, 0, packed=True, sharing=True, min_shared_tokens=16))
    assert len(batches) == 1 and batches[0].segment_parents is not None
    got = capture_rows(model, batches, [0, 1, 2, 3, 4])
    mixed = [starts for starts in groups if len(starts) == 5]
    assert mixed and all(None in starts and len({id(c) for c in starts}) == 3 for starts in mixed)
    for sample in samples:
        want_all = reference_states(untouched, sample.input_ids)
        for slot in range(5):
            want = want_all[slot].to(torch.bfloat16).float()
            torch.testing.assert_close(got[sample.row_id][:, slot].float(), want, rtol=BF16_ULP,
                                       atol=1e-5 * want.abs().max().item(), msg=f"row {sample.row_id} id {slot}")


flash_varlen_only = pytest.mark.skipif(not torch.cuda.is_available() or attention._VARLEN is None,
                                       reason="needs a CUDA device and torch's varlen_attn (torch >= 2.10)")


@flash_varlen_only
@pytest.mark.parametrize("causal", [True, False])
def test_torch_flash_varlen_is_the_attention_the_varlen_path_assumes(causal):
    """torch's varlen_attn, as packing calls it, against reference_varlen: queries and keys of different lengths
    per sequence (cu_q != cu_k), grouped-query heads, each query's log-sum-exp [heads, Tq]."""
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 5, 12, 40], dtype=torch.int32), torch.tensor([0, 9, 16, 60], dtype=torch.int32)
    q, k, v = (torch.randn(n, heads, 64, generator=g).cuda().bfloat16() for n, heads in ((40, 4), (60, 2), (60, 2)))
    args = (cu_q.cuda(), cu_k.cuda(), 28, 44, causal, 0.125)
    out, lse = attention._varlen_attention(q, k, v, *args)
    want, want_lse = reference_varlen(q, k, v, *args)
    assert lse.shape == want_lse.shape == (4, 40)
    torch.testing.assert_close(out.float(), want.float(), rtol=BF16_ULP, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-2)


@flash_varlen_only
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5"])
def test_the_flash_varlen_path_on_cuda_gives_every_row_alone(family):
    """In bf16 on CUDA packed attention runs on torch's flash kernel (cu_q != cu_k where segments continue others
    or kept chains): every row of shared, cut batches against the row alone in HF, both in bf16, within the
    probe's bf16 tolerance (a segment that missed its ancestors' keys is off by O(1))."""
    model, untouched = (tiny_model(family).cuda().bfloat16() for _ in range(2))
    assert continues_prefixes(model)
    samples = rows_of_every_kind(model.config.vocab_size)
    batches = list(iter_batches(samples, 64, 256, 0, packed=True, sharing=True, min_shared_tokens=16))
    assert any(b.carry is not None and b.carry.parents for b in batches)
    ids = [0, 2, 4]
    got = capture_rows(model, batches, ids)
    for sample in samples:
        want_all = reference_states(untouched, sample.input_ids)
        for slot, layer_id in enumerate(ids):
            want = want_all[layer_id].float().cpu()
            error = (got[sample.row_id][:, slot].float() - want).abs().max() / want.abs().max()
            assert error <= 5e-2, f"{family}: row {sample.row_id} id {layer_id}: relative difference {error:.3g}"


@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if support_of(zoo_config(f)).continued])
def test_what_a_cut_tree_keeps_is_what_the_run_says_it_keeps(family):
    """The bytes a batch keeps for the later batches of its tree, per kept token, are what the run's log line
    states from the model's config (every attention layer's keys and values, MLA's of their own sizes; none for the
    layers that mix tokens through a state, nor for MLP and MoE blocks), on every family of the zoo."""
    model = zoo_model(family)
    assert configure(model, "on", 256).on
    vocab = model.config.get_text_config().vocab_size
    batches = list(iter_batches(rows_of_every_kind(vocab), 64, 256, 0, packed=True, sharing=True,
                                min_shared_tokens=16))
    first = next(b for b in batches if b.carry is not None and b.carry.exports)
    kept = Kept()
    with torch.inference_mode(), carrying(first.carry, kept):
        find_decoder(model).module(**forward_inputs(first, torch.device("cpu"), kept), use_cache=False)
    tokens = sum(s.length for s in first.carry.exports.values())
    assert tokens > 0 and kept.nbytes == tokens * kept_bytes_per_token(model)


def test_two_models_in_one_process_keep_their_forwards_apart():
    """Each forward carries its own segments and each run its own kept states (nothing global): one model's cut trees
    run entirely between two batches of another's cut tree (a verify beside a run, a notebook), and every row of both
    has the states its model gives it alone."""
    first, second = tiny_model("llama"), tiny_model("qwen3_5", seed=1)
    assert continues_prefixes(first) and continues_prefixes(second)
    rows = rows_of_every_kind(first.config.vocab_size)
    batches = list(iter_batches(rows, 64, 256, 0, packed=True, sharing=True, min_shared_tokens=16))
    continuing = [k for k, b in enumerate(batches) if b.carry is not None and b.carry.parents]
    assert continuing  # the first model's tree is cut: its later batches read what its earlier ones kept
    got_second = {}
    got_first = capture_rows(first, batches, [2, 4], between=lambda k: k == continuing[0] and got_second.update(
        capture_rows(second, batches, [2, 4])))
    assert sorted(got_second) == sorted(got_first) == list(range(len(rows)))
    for model, got in ((tiny_model("llama"), got_first), (tiny_model("qwen3_5", seed=1), got_second)):
        for sample in rows:
            want_all = reference_states(model, sample.input_ids)
            for slot, layer_id in enumerate([2, 4]):
                want = want_all[layer_id].to(torch.bfloat16).float()
                torch.testing.assert_close(got[sample.row_id][:, slot].float(), want, rtol=BF16_ULP,
                                           atol=1e-5 * want.abs().max().item())


def test_a_prefix_without_its_keys_or_its_recurrent_state_is_caught_by_the_check(monkeypatch):
    model = tiny_model("llama")
    assert continues_prefixes(model)
    probes = configure(model, "on", 256).probes
    no_descendants = lambda bounds, parents: bounds[1:]  # noqa: E731  # the tree path: no query sees an ancestor
    monkeypatch.setattr(segments, "_subtree_ends", no_descendants)
    assert "do not continue from the prefix's state" in check_continuation(model, probes)
    use_path("varlen", monkeypatch)  # the varlen path's joins, from the same descendants
    assert "do not continue from the prefix's state" in check_continuation(model, probes)
    monkeypatch.undo()
    monkeypatch.setattr(attention, "_ATTENTION_WITH_LSE", None)  # the per-segment path: only its own keys
    own_keys_only = lambda self, segment: [(self.bounds[segment], self.bounds[segment + 1])]  # noqa: E731
    monkeypatch.setattr(PackedForward, "key_ranges", own_keys_only)
    assert "do not continue from the prefix's state" in check_continuation(model, probes)
    monkeypatch.undo()
    hybrid = tiny_model("qwen3_5")
    assert continues_prefixes(hybrid)
    hybrid_probes = configure(hybrid, "on", 256).probes
    fresh = lambda cache: DynamicCache(config=hybrid.config.get_text_config())  # noqa: E731
    monkeypatch.setattr(packing, "handed_over", fresh)  # each continuation from a clean recurrent state
    assert "do not continue from the prefix's state" in check_continuation(hybrid, hybrid_probes)


def like_native_varlen_kernels(model) -> list[int]:
    """Have the hybrid's linear-attention layers behave as flash-linear-attention's varlen kernels do: a packed
    forward keeps its samples apart (each segment from a clean state) and hands no state from one to another.
    Returns a list that grows by one for each packed call they take whole."""
    whole = []
    for module in packing.sequence_mixers(model):
        def forward(hidden_states, cache=None, attention_mask=None, own=module.forward, **kwargs):
            cu = kwargs.pop("cu_seq_lens_q", None)
            for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
                kwargs.pop(name, None)
            if cu is None:  # one sequence (as SampleWise calls them): the model's own, from the cache it is given
                return own(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
            whole.append(1)
            b = cu.tolist()
            return torch.cat([own(hidden_states[:, x:y], attention_mask=attention_mask, **kwargs)
                              for x, y in zip(b, b[1:], strict=False)], dim=1)
        module.forward = forward
    return whole


def test_linear_attention_kernels_that_start_every_sample_clean_hand_states_over_once_per_segment(monkeypatch):
    """A hybrid whose own kernels keep packed samples apart but cannot continue a segment from its parent's state
    (flash-linear-attention's varlen path): packing stays native, the continuation probe fails on its own, so
    those layers run once per segment in batches with shared runs only, and every row equals the row alone."""
    model, untouched = tiny_model("qwen3_5"), tiny_model("qwen3_5")
    whole = like_native_varlen_kernels(model)
    packing_ = configure(model, "on", 256)
    assert packing_.on and packing_.sample_wise_layers == 0  # native: the packing check passes as it is
    assert "do not continue from the prefix's state" in check_continuation(model, packing_.probes)
    sharing = decide_sharing(RunConfig(token_budget=64, max_length=64), packing_, model)
    assert sharing.min_shared_tokens is not None and sharing.handing_over == 3, sharing.note()
    assert "linear-attention layers run once per segment" in sharing.note()

    samples = rows_of_every_kind(model.config.vocab_size)
    batches = list(iter_batches(samples, 64, 256, 0, packed=True, sharing=True, min_shared_tokens=16))
    plain = [b for b in batches if b.segment_parents is None and b.carry is None]
    assert plain and len(plain) < len(batches)
    whole.clear()
    got = capture_rows(model, batches, [0, 2, 4])
    # the model's own kernels took the batches without shared runs whole (3 linear-attention layers each)
    assert len(whole) == 3 * len(plain)
    for sample in samples:
        want_all = reference_states(untouched, sample.input_ids)
        for slot, layer_id in enumerate([0, 2, 4]):
            want = want_all[layer_id].to(torch.bfloat16).float()
            torch.testing.assert_close(got[sample.row_id][:, slot].float(), want, rtol=BF16_ULP,
                                       atol=1e-5 * want.abs().max().item(), msg=f"row {sample.row_id} id {layer_id}")

    # where even once per segment the states do not carry over, the layers go back to their own kernels
    other = tiny_model("qwen3_5")
    like_native_varlen_kernels(other)
    monkeypatch.setattr(packing, "handed_over", lambda cache: DynamicCache(config=other.config.get_text_config()))
    sharing = decide_sharing(RunConfig(token_budget=64, max_length=64), configure(other, "on", 64), other)
    assert sharing.min_shared_tokens is None and packing.sample_wise_layers(other) == 0


def write_rows(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_off_and_on(tmp_path, **settings):
    """The rows of `settings` through `streamx run` with --sharing off and on (off.zarr, on.zarr): both stores."""
    stores = []
    for sharing in ("off", "on"):
        out = str(tmp_path / f"{sharing}.zarr")
        run(RunConfig(out=out, sharing=sharing, **settings), progress=False, log=lambda m: None)
        stores.append(open_store(out))
    return stores


def assert_rows_as_unshared(off, store, rows: list[dict]) -> None:
    """Every row of `store` as in `off` (the same rows, every one computed in full) and as the data has it: ids and
    mask exactly, states within bf16 rounding."""
    for row, data in enumerate(rows):
        a, b = off.sample(row), store.sample(row)
        assert a.input_ids.tolist() == b.input_ids.tolist() == data["input_ids"]
        assert a.loss_mask.tolist() == b.loss_mask.tolist() == data["loss_mask"]
        torch.testing.assert_close(b.hidden_states.float(), a.hidden_states.float(), rtol=BF16_ULP,
                                   atol=1e-5 * a.hidden_states.float().abs().max().item())


def rows_of_all_kinds() -> list[dict]:
    """Pretokenized rows behind one 24-token system prompt: 12 chats fanned out in 3 rows each (each row a
    prefix of the next), 5 duplicates, and a row of another row's ids with another mask."""
    rng = np.random.default_rng(0)
    system = rng.integers(10, 40000, 24).tolist()
    stems = [system + rng.integers(10, 40000, int(n)).tolist() for n in rng.integers(10, 60, 12)]
    rows = []
    for stem in stems:
        for turn in range(1, 4):  # fanned out: each row a prefix of the next
            ids = stem[: 24 + turn * (len(stem) - 24) // 3]
            rows.append({"input_ids": ids, "loss_mask": [0] * 24 + [1] * (len(ids) - 24)})
    rows += rows[:5]  # duplicates
    rows.append({"input_ids": stems[0], "loss_mask": [1] * len(stems[0])})  # the same ids, another mask
    return rows


def test_a_shared_store_reads_every_row_as_the_unshared_store(tmp_path, tiny_chat_model_dir):
    """Pretokenized rows of all three kinds through `streamx run`, sharing on and off: the same rows, ids and
    masks exactly, states within rounding, fewer tokens stored; rows whose masks differ keep their own."""
    rows = rows_of_all_kinds()
    data = write_rows(tmp_path / "rows.jsonl", rows)
    off, on = run_off_and_on(tmp_path, model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=16,
                             token_budget=256, max_length=256)
    assert on.metadata.sharing == "on" and on.metadata.compat.sharing == "on"
    assert len(on) == len(off) == len(rows) and on.row_tokens == off.row_tokens == off.num_tokens
    assert on.num_tokens < 0.6 * off.num_tokens
    assert (on.index.mask_offsets >= 0).any()  # the rows whose masks differ from a row sharing their tokens
    assert_rows_as_unshared(off, on, rows)

    # the share of each kind, read from the stored ranges, against the rows counted window by window (a row whose
    # ids and mask repeat an earlier row's, in any window, is a duplicate), and against what `streamx plan` finds
    # from the rows before anything is computed
    duplicates = prefixes = 0
    seen = set()
    for start in range(0, len(rows), 16):
        window = []
        for r in rows[start : start + 16]:
            content = (tuple(r["input_ids"]), tuple(r["loss_mask"]))
            if content in seen:
                duplicates += len(r["input_ids"])
            else:
                seen.add(content)
                window.append(content[0])
        distinct = set(window)
        duplicates += sum(len(r) for r in window) - sum(len(r) for r in distinct)
        prefixes += sum(len(r) for r in distinct if any(len(o) > len(r) and o[: len(r)] == r for o in distinct))
    kinds = on.shared_kinds()
    assert (kinds.duplicate_tokens, kinds.prefix_row_tokens) == (duplicates, prefixes) and prefixes > 0
    assert kinds.leading_run_tokens == on.row_tokens - on.num_tokens - duplicates - prefixes > 0
    assert off.shared_kinds() == SharedKinds()
    assert estimate(RunConfig(model=tiny_chat_model_dir, data=data, out=str(tmp_path / "plan.zarr"), layers="1,2,4",
                              sort_window=16, token_budget=256, max_length=256)).shared.kinds == kinds
    assert "duplicates" in " ".join(on.describe()) and "leading runs" in " ".join(on.describe())


def test_the_batches_never_depend_on_the_world_size(tmp_path, tiny_chat_model_dir):
    """What each rank computes, put back in window order, is what one process computes: the same forwards (rows,
    token ids, segments and the segments they continue, a cut tree's carries), the same repeats and rejects. So
    the states differ between world sizes only where the kernels do (docs/scaling.md: the CPU's thread count)."""
    rows = rows_of_all_kinds() + repeated_rows()
    data = write_rows(tmp_path / "rows.jsonl", rows)

    def stream(rank: int, world_size: int) -> list[tuple[int, tuple]]:
        config = RunConfig(model=tiny_chat_model_dir, data=data, out=str(tmp_path / "s.zarr"), layers="1,2,4",
                           sort_window=8, token_budget=96, max_length=96, rank=rank, world_size=world_size)
        out = []
        for item in make_plan(config, log=lambda m: None).batch_stream():
            if isinstance(item, Batch):
                carry = None if item.carry is None else (  # segments as (depth, end): objects differ per plan
                    {k: (s.depth, s.end) for k, s in item.carry.parents.items()},
                    {k: (s.depth, s.end) for k, s in item.carry.exports.items()},
                    [(s.depth, s.end) for s in item.carry.releases],
                    [[(s.depth, s.end, n) for s, n in row] for row in item.carry.rows])
                what = ("batch", [s.row_id for s in item.samples], item.computed_ids().tolist(),
                        item.cu_seq_lens.tolist(), item.segment_parents, item.row_ranges, repr(carry))
            else:
                what = (type(item).__name__, item.row_id, getattr(item, "same_as", None))
            first_row = item.samples[0].row_id if isinstance(item, Batch) else item.row_id
            out.append((first_row // 8, what))
        return out

    one = stream(0, 1)
    assert any(what[0] == "batch" and what[6] != "None" for _, what in one)  # a tree cut across batches
    assert any(what[0] == "Duplicate" for _, what in one)
    for world_size in (2, 3):
        ranks = [item for rank in range(world_size) for item in stream(rank, world_size)]
        assert [what for _, what in sorted(ranks, key=lambda item: item[0])] == [what for _, what in one]


def repeated_rows() -> list[dict]:
    """24 distinct pretokenized rows, then 12 repeats of earlier ones (ids and mask), each in a later sorting window
    of 4 rows than its first, and a row of an earlier row's ids with another mask (not a repeat)."""
    rng = np.random.default_rng(3)
    rows = [{"input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)}
            for ids in (rng.integers(10, 40000, int(n)).tolist() for n in rng.integers(8, 40, 24))]
    rows += [rows[i] for i in (0, 3, 3, 7, 11, 2, 20, 0, 5, 9, 23, 16)]
    rows.append({"input_ids": rows[1]["input_ids"], "loss_mask": [1] * len(rows[1]["input_ids"])})
    return rows


def test_a_row_repeated_anywhere_in_the_data_is_computed_once(tmp_path, tiny_chat_model_dir, monkeypatch):
    """Rows whose content repeats an earlier row's in another sorting window (and, at two ranks, another part) are
    not computed: they read the first row's sample, so they hold its states bit for bit, and every row reads as
    in the unshared store. The same at one rank and at two, and after a run that fails part way and a resume; a
    rank that runs before the rank holding the first rows leaves its repeats unread until that rank commits."""
    rows = repeated_rows()
    data = write_rows(tmp_path / "rows.jsonl", rows)
    settings = dict(model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=4, token_budget=256,
                    max_length=256)
    off, on = run_off_and_on(tmp_path, **settings)
    firsts = {}
    for row, r in enumerate(rows):
        firsts.setdefault((tuple(r["input_ids"]), tuple(r["loss_mask"])), row)
    first_of = [firsts[(tuple(r["input_ids"]), tuple(r["loss_mask"]))] for r in rows]
    repeats = [row for row, first in enumerate(first_of) if first != row]
    assert len(repeats) == 12 and all(first_of[row] // 4 < row // 4 for row in repeats)  # in earlier windows
    assert on.num_tokens == off.num_tokens - sum(len(rows[row]["input_ids"]) for row in repeats)
    assert on.row_tokens == off.row_tokens and len(on) == len(off) == len(rows)
    assert sorted(on.index.rows[on.same_as >= 0].tolist()) == repeats
    assert on.shared_kinds().duplicate_rows == len(repeats)
    assert_rows_as_unshared(off, on, rows)
    for row in repeats:  # the very states of the first row
        assert torch.equal(on.sample(row).hidden_states.view(torch.int16),
                           on.sample(first_of[row]).hidden_states.view(torch.int16))
    assert estimate(RunConfig(out=str(tmp_path / "plan.zarr"), **settings)).shared.leading_runs == on.num_tokens
    assert verify(str(tmp_path / "on.zarr"), use_model=False, log=lambda m: None).passed
    # convert --merge-prefix-rows trains on each repeated content once: the repeats fold into their first rows
    from streamx.train.convert import convert

    merged = tmp_path / "merged"
    convert(str(tmp_path / "on.zarr"), str(merged), progress=False, allow_random_weights=True, merge_prefix_rows=True,
            hidden_states="store", log=lambda m: None)
    kept = np.load(merged / "store_rows.npy").tolist()
    assert sorted(kept) == [row for row in range(len(rows)) if row not in repeats]

    # two independent ranks, rank 1 first: its repeats of rank 0's rows wait for them, then read them
    ranks = str(tmp_path / "ranks.zarr")
    first = run(RunConfig(out=ranks, rank=1, world_size=2, **settings), progress=False, log=lambda m: None)
    alone = open_store(ranks)
    waiting = alone.repeated.unread.tolist()
    assert waiting and all((first_of[row] // 4) % 2 == 0 for row in waiting)  # their first rows are rank 0's
    assert set(waiting) <= set(alone.done_row_ids()) and not set(waiting) & set(alone.row_ids().tolist())
    # one meaning of "samples": the rows readable now, and the committed ones that wait are counted beside them
    assert first.samples == len(alone) + len(waiting) == first.store_samples + first.store_waiting
    said = f"{len(waiting):,} more committed rows repeat rows not committed yet"
    assert any(said in line for line in alone.describe())
    assert any(said in line for line in dataclasses.replace(first, rank=0).lines())  # (as rank 0's summary says)
    with pytest.raises(LookupError, match=rf"source row {waiting[0]} is committed as a repeat of row "
                                          rf"{first_of[waiting[0]]}, which no part .* has committed yet"):
        row_lines(alone, waiting[0])  # inspect --sample says it waits (not "no sample and no reject")
    run(RunConfig(out=ranks, rank=0, world_size=2, **settings), progress=False, log=lambda m: None)
    assert len(open_store(ranks).parts) == 2 and not open_store(ranks).repeated.unread.size
    assert not any("not committed yet" in line for line in open_store(ranks).describe())
    assert_same_samples(tmp_path / "on.zarr", ranks)

    resumed = str(tmp_path / "resumed.zarr")
    fail_at_batch(monkeypatch, 5)
    with pytest.raises(OSError, match="injected"):
        run(RunConfig(out=resumed, chunk_tokens=16, shard_tokens=64, **settings), progress=False, log=lambda m: None)
    monkeypatch.undo()
    assert 0 < len(open_store(resumed)) < len(rows)
    run(RunConfig(out=resumed, chunk_tokens=16, shard_tokens=64, **settings), progress=False, log=lambda m: None)
    assert_same_samples(tmp_path / "on.zarr", resumed)


def test_a_run_stopped_part_way_never_commits_a_repeat_before_the_row_it_reads(tmp_path, tiny_chat_model_dir,
                                                                             monkeypatch):
    """One window of rows of a batch each, its last row a repeat of another: stopped after any batch, the store
    holds no repeat whose row is not there (every committed sample is readable), and the resume completes it."""
    rng = np.random.default_rng(5)
    rows = [{"input_ids": rng.integers(10, 40000, n).tolist(), "loss_mask": [1] * n} for n in (40, 44, 48, 52, 56, 60)]
    rows.append(dict(rows[0]))  # a repeat of the row computed in the window's last batch (the shortest: first fit)
    data = write_rows(tmp_path / "rows.jsonl", rows)
    settings = dict(model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=8, token_budget=64,
                    max_length=64, chunk_tokens=16, shard_tokens=64)
    for stop in range(2, 7):
        out = str(tmp_path / f"stopped{stop}.zarr")
        fail_at_batch(monkeypatch, stop)
        with pytest.raises(OSError, match="injected"):
            run(RunConfig(out=out, **settings), progress=False, log=lambda m: None)
        monkeypatch.undo()
        store = open_store(out)
        assert not store.repeated.unread.size and sum(c.samples for c in store.commits.values()) == len(store), stop
        run(RunConfig(out=out, **settings), progress=False, log=lambda m: None)
        assert open_store(out).completeness().complete and len(open_store(out)) == len(rows)


def test_a_store_from_before_repeats_were_read_resumes_computing_them(tmp_path, tiny_chat_model_dir, monkeypatch):
    """A store of format /3 (its parts without `sample_same_as`), interrupted before its repeated rows: the same
    command resumes it computing them in their windows, as the store was made, every row as in the unshared
    store."""
    rows = repeated_rows()
    data = write_rows(tmp_path / "rows.jsonl", rows)
    settings = dict(model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=4, token_budget=256,
                    max_length=256, chunk_tokens=16, shard_tokens=64)
    off, old = str(tmp_path / "off.zarr"), str(tmp_path / "old.zarr")
    run(RunConfig(out=off, sharing="off", **settings), progress=False, log=lambda m: None)
    fail_at_batch(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        run(RunConfig(out=old, **settings), progress=False, log=lambda m: None)
    monkeypatch.undo()
    root = zarr.open_group(old)
    root.attrs["streamx"] = {**root.attrs["streamx"], "format": "streamx-store/3"}
    del root["parts/part-00000/sample_same_as"]
    assert 0 < len(open_store(old)) < 24  # none of the repeats committed yet
    run(RunConfig(out=old, **settings), progress=False, log=lambda m: None)
    resumed, unshared = open_store(old), open_store(off)
    assert len(resumed) == len(rows) and (resumed.same_as < 0).all()
    assert resumed.num_tokens > unshared.num_tokens - sum(len(r["input_ids"]) for r in rows[24:36])  # computed
    assert_rows_as_unshared(unshared, resumed, rows)


def colliding_rows() -> list[dict]:
    """16 distinct pretokenized rows in windows of 4; rows 9 and 6 are as long as rows 1 and 0 (so that only their
    tokens tell them apart)."""
    rng = np.random.default_rng(7)
    lengths = [24, 30, 26, 28, 22, 32, 24, 20, 34, 30, 21, 25, 27, 29, 23, 31]
    return [{"input_ids": rng.integers(10, 40000, n).tolist(), "loss_mask": [0] * 4 + [1] * (n - 4)} for n in lengths]


def colliding_keys(rows: list[dict], pairs: dict[int, int]):
    """tokenize.content_key, but for each row of `pairs` the key of the row it is paired with: a content-key
    collision (by chance ~3e-8 at a million rows; crafted with ~2^32 hashes)."""
    from streamx.data import tokenize

    real = tokenize.content_key

    def key(record):
        for row, other in pairs.items():
            if record == rows[row]:
                return real(rows[other])
        return real(record)
    return key


def test_a_repeat_whose_tokens_are_not_its_first_rows_is_a_row_of_its_own(tmp_path, tiny_chat_model_dir,
                                                                          monkeypatch):
    """Rows whose content keys collide with an earlier row's, at the same length: never served the other row's ids,
    mask or states. In one process the run finds their tokens differ and computes them; at two ranks, a rank that
    runs before the one holding the first rows stores them as repeats, the store reads them as missing (not as
    the other row), verify names them, and the same command computes them."""
    from streamx.data import tokenize

    rows = colliding_rows()
    data = write_rows(tmp_path / "rows.jsonl", rows)
    settings = dict(model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=4, token_budget=256,
                    max_length=256)
    off = str(tmp_path / "off.zarr")
    run(RunConfig(out=off, sharing="off", **settings), progress=False, log=lambda m: None)  # no collision
    unshared = open_store(off)
    monkeypatch.setattr(tokenize, "content_key", colliding_keys(rows, {9: 1, 6: 0}))

    one = str(tmp_path / "one.zarr")
    run(RunConfig(out=one, **settings), progress=False, log=lambda m: None)
    store = open_store(one)
    assert (store.same_as < 0).all() and store.completeness().complete
    assert_rows_as_unshared(unshared, store, rows)

    # rank 1 (windows 1 and 3: row 6) first: row 0 is rank 0's and not yet stored, so row 6 is stored as its repeat
    ranks = str(tmp_path / "ranks.zarr")
    run(RunConfig(out=ranks, rank=1, world_size=2, **settings), progress=False, log=lambda m: None)
    assert open_store(ranks).repeated.unread.tolist() == [6]
    run(RunConfig(out=ranks, rank=0, world_size=2, **settings), progress=False, log=lambda m: None)
    store = open_store(ranks)
    assert store.repeated.differing.tolist() == [6] and 6 not in store.row_ids().tolist()
    with pytest.raises(KeyError):
        store.sample(6)
    assert store.completeness().missing_rows.tolist() == [6]
    rows_check = next(c for c in verify(ranks, use_model=False, log=lambda m: None).checks if c.name == "rows")
    assert not rows_check.passed and rows_check.problems == [
        "row 6 was stored as a repeat of row 0, whose tokens are not its own (their content keys collide): nothing "
        "reads it; re-run the same `streamx run` to compute it"]
    run(RunConfig(out=ranks, rank=1, world_size=2, **settings), progress=False, log=lambda m: None)
    store = open_store(ranks)
    assert store.completeness().complete and (store.same_as < 0).all()
    assert_rows_as_unshared(unshared, store, rows)
    assert verify(ranks, use_model=False, log=lambda m: None).passed


def test_verify_names_a_repeated_row_that_reads_no_row_or_another_length(tmp_path, tiny_chat_model_dir):
    rows = repeated_rows()
    out = tmp_path / "s.zarr"
    run(RunConfig(model=tiny_chat_model_dir, data=write_rows(tmp_path / "rows.jsonl", rows), out=str(out),
                  layers="1,2,4", sort_window=4, token_budget=256, max_length=256), progress=False, log=lambda m: None)
    part = zarr.open_group(str(out))["parts/part-00000"]
    same_as, lengths, row_ids = part["sample_same_as"][:], part["sample_length"][:], part["sample_row_id"][:]
    repeats = np.flatnonzero(same_as >= 0)
    lost, longer = repeats[:2]
    same_as[lost] = 10_000  # a row the data does not have
    part["sample_same_as"][:] = same_as
    rows_check = next(c for c in verify(str(out), use_model=False, log=lambda m: None).checks if c.name == "rows")
    assert not rows_check.passed and rows_check.problems == [
        f"row {row_ids[lost]} repeats row 10000, which is neither a sample nor a reject"]
    lengths[longer] += 1  # (the store then reads it as missing: the "neither" check waits for a complete store)
    part["sample_length"][:] = lengths
    rows_check = next(c for c in verify(str(out), use_model=False, log=lambda m: None).checks if c.name == "rows")
    assert not rows_check.passed and rows_check.problems == [
        f"row {row_ids[longer]} was stored as a repeat of row {same_as[longer]}, whose tokens are not its own (their "
        "content keys collide): nothing reads it; re-run the same `streamx run` to compute it"]


def row_problems(store, vocab_size: int) -> dict[str, set[str]]:
    """What verify's structural pass should name, found row by row from whole rows as `Store.sample` reads
    them (not verify's reads of each block's rows at once)."""
    found: dict[str, set[str]] = {"token_ids": set(), "loss_mask": set(), "states": set()}
    for row in store.row_ids().tolist():
        s = store.sample(row)
        ids, mask, states = s.input_ids, s.loss_mask, s.hidden_states.float()
        if ids.min() < 0 or ids.max() >= vocab_size:
            found["token_ids"].add(f"row {row}: token ids {int(ids.min())}..{int(ids.max())} outside "
                                   f"0..{vocab_size - 1}")
        if not ((mask == 0) | (mask == 1)).all():
            found["loss_mask"].add(f"row {row}: loss mask values other than 0 and 1")
        elif not mask.any():
            found["loss_mask"].add(f"row {row}: loss mask has no trainable token")
        for slot, layer_id in enumerate(store.layer_ids):
            values = states[:, slot]
            if not torch.isfinite(values).all():
                found["states"].add(f"row {row}: id {layer_id} holds NaN or Inf")
            elif values.max() == values.min():
                found["states"].add(f"row {row}: id {layer_id} is constant {float(values.max()):g}")
    return found


@pytest.mark.parametrize("read_bytes", [None, 3 * 64 * 4 * 40], ids=["whole-part-reads", "40-token-reads"])
def test_verify_names_exactly_the_shared_rows_that_read_damage(tmp_path, tiny_chat_model_dir, monkeypatch,
                                                               read_bytes):
    """A shared store damaged where rows share tokens (an id, a mask value, a NaN in a prefix that several rows
    read), in one row's own mask (all zero), over a whole row's slot (constant) and another's (the same values
    in every token, not constant): verify's structural pass,
    which checks each read's rows at once, names exactly the rows that a row-by-row reading finds wrong, with
    reads that hold whole trees and with reads so small that prefixes are read apart."""
    from streamx.store.format import bf16_to_bits

    rows = rows_of_all_kinds()
    out = str(tmp_path / "on.zarr")
    run(RunConfig(model=tiny_chat_model_dir, data=write_rows(tmp_path / "rows.jsonl", rows), out=out, layers="1,2,4",
                  sort_window=16, token_budget=256, max_length=256), progress=False, log=lambda m: None)
    store = open_store(out)
    assert verify(out, use_model=False, log=lambda m: None).passed
    part = zarr.open_group(f"{out}/parts/part-00000", mode="r+")
    readers = {}  # token -> positions of the rows that read it
    for position in range(len(store)):
        for a, b in store.ranges(position):
            for token in range(a, b):
                readers.setdefault(token, []).append(position)
    shared = [t for t, ps in sorted(readers.items()) if 2 <= len(ps) <= 4]  # a prefix a few rows read
    part["input_ids"][shared[0] : shared[0] + 1] = 49152 + 7
    part["loss_mask"][shared[1] : shared[1] + 1] = 2
    nan = bf16_to_bits(torch.full((1, 3, 64), float("nan"), dtype=torch.bfloat16))
    part["hidden_states"][shared[2] : shared[2] + 1] = nan
    own = int(np.flatnonzero(store.index.mask_offsets >= 0)[0])
    at = int(store.index.mask_offsets[own])
    part["row_loss_mask"][at : at + int(store.index.lengths[own])] = 0
    leaf = max(range(len(store)), key=lambda p: store.ranges(p)[-1][1] - store.ranges(p)[-1][0])
    a, b = store.ranges(leaf)[-1]
    constant = part["hidden_states"][a:b]
    constant[:, 1] = bf16_to_bits(torch.full((1, 64), 0.5, dtype=torch.bfloat16))
    part["hidden_states"][a:b] = constant
    other = next(p for p in range(len(store)) if p not in readers[shared[2]])
    for c, d in store.ranges(other):  # every token's greatest and least value the same, but not constant
        varied = part["hidden_states"][c:d]
        varied[:, 2] = bf16_to_bits(torch.linspace(-1, 1, 64, dtype=torch.bfloat16)[None].expand(d - c, 64))
        part["hidden_states"][c:d] = varied

    damaged = open_store(out)
    want = row_problems(damaged, 49152)
    assert all(want.values()) and len(want["states"]) >= 3  # every kind of damage is read by some row
    if read_bytes is not None:
        monkeypatch.setattr(verify_module, "READ_BYTES", read_bytes)
    report = verify(out, use_model=False, log=lambda m: None)
    checks = {c.name: c for c in report.checks}
    for name, problems in want.items():
        assert not checks[name].passed and checks[name].summary.startswith(f"{len(problems):,} of ")
        assert set(checks[name].problems) <= problems and len(checks[name].problems) == min(10, len(problems))


def test_verify_names_the_rows_whose_ranges_leave_their_part(tmp_path, tiny_chat_model_dir):
    """A shared store's index damaged: a shared range that runs past the committed tokens, and a row whose length
    disagrees with its tokens. verify's index check, which reads every row's ranges at once, names exactly the
    rows that a row-by-row look at their ranges finds out of place, and no other."""
    out = str(tmp_path / "on.zarr")
    run(RunConfig(model=tiny_chat_model_dir, data=write_rows(tmp_path / "rows.jsonl", rows_of_all_kinds()), out=out,
                  layers="1,2,4", sort_window=16, token_budget=256, max_length=256), progress=False, log=lambda m: None)
    store = open_store(out)
    part = zarr.open_group(f"{out}/parts/part-00000", mode="r+")
    tokens = store.commits["part-00000"].tokens
    tabled = int(np.flatnonzero(store.index.range_counts)[3])
    first = int(store.index.range_starts[tabled])
    part["range_length"][first : first + 1] = tokens + 5  # read by every row that lists this range
    part["sample_length"][len(store) - 1 :] = int(store.index.lengths[-1]) + 1

    damaged = open_store(out)
    want = {f"part-00000: sample {p} spans tokens {damaged.ranges(p)} of {tokens:,}, its length "
            f"{int(damaged.index.lengths[p])}" for p in range(len(damaged))
            if any(b <= a or a < 0 or b > tokens for a, b in damaged.ranges(p))
            or sum(b - a for a, b in damaged.ranges(p)) != int(damaged.index.lengths[p])}
    assert len(want) >= 2
    index = check_index(damaged)
    assert set(index.problems) == want and index.summary.startswith(f"{len(want)} of ")


@pytest.mark.parametrize("through", ["chunk files", "zarr"])
def test_own_loss_masks_are_read_a_chunk_at_a_time_whatever_the_ranges(tmp_path, monkeypatch, through):
    """Rows' own loss masks (row_loss_mask, zstd chunks) come through ChunkCache, which decompresses a local
    array's chunk files itself (else reads through zarr): any range, across chunks, over a chunk zarr left out
    (all zeros) and up to the array's end, equals zarr's own read of it; rows read in order load one chunk
    each, not one a row, and no more chunks stay than the process's budget allows."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2, 1000).astype(np.uint8)
    values[128:192] = 0  # a chunk of nothing but the fill value: zarr writes no file for it
    arr = zarr.create_array(str(tmp_path / "masks.zarr"), shape=(1000,), chunks=(64,), dtype="uint8",
                            compressors=zarr.codecs.ZstdCodec(level=1))
    arr[:] = values
    assert not (tmp_path / "masks.zarr" / "c" / "2").exists() and (tmp_path / "masks.zarr" / "c" / "3").exists()
    if through == "zarr":
        monkeypatch.setattr(shards, "zstd_chunk_dir", lambda arr: None)
    loads = []
    load = ChunkCache._load
    monkeypatch.setattr(ChunkCache, "_load", lambda self, k: loads.append(k) or load(self, k))
    pool = ProcessCache(lambda values: values.nbytes, 1 << 20, 3 * 64)
    cache = ChunkCache(arr, pool)
    assert (cache.dir is None) == (through == "zarr")
    lengths = rng.integers(1, 30, 60)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert 800 < starts[-1] + lengths[-1] <= 1000
    for a, n in zip(starts.tolist(), lengths.tolist(), strict=True):  # rows in store order
        assert cache.read(a, a + n).tolist() == values[a : a + n].tolist()
    assert loads == list(range(-(-int(starts[-1] + lengths[-1]) // 64)))
    for a, b in [(0, 0), (63, 65), (120, 200), (0, 1000), (990, 1000), *rng.integers(0, 1000, (30, 2)).tolist()]:
        a, b = min(a, b), max(a, b)
        assert cache.read(a, b).tolist() == values[a:b].tolist()
        assert len(pool.items) <= 3 and pool.held == sum(v.nbytes for v in pool.items.values())
    other = ChunkCache(arr, pool)  # another reader of the same array (another part, another Store): one budget
    assert other.read(5, 200).tolist() == values[5:200].tolist() and len(pool.items) <= 3


def test_a_prompt_over_more_tokens_than_a_batch_is_computed_and_stored_once(tmp_path, tiny_chat_model_dir,
                                                                           monkeypatch):
    """24 rows behind one 40-token system prompt, four times the token budget: the prompt is computed and stored
    once (the later batches continue from the keys and values the first one kept), every distinct token once,
    and every row reads as in the unshared store. A run that fails after its first batches and is resumed
    (the first batch's rows committed: it runs again for the batches that continue it, and stores again the
    prompt alone, not the rest of its batch) gives every row bit for bit as the uninterrupted run."""
    rng = np.random.default_rng(1)
    system = rng.integers(10, 40000, 40).tolist()
    rows = [system + rng.integers(10, 40000, int(n)).tolist() for n in rng.integers(20, 60, 24)]
    records = [{"input_ids": r, "loss_mask": [0] * 40 + [1] * (len(r) - 40)} for r in rows]
    data = write_rows(tmp_path / "rows.jsonl", records)
    settings = dict(model=tiny_chat_model_dir, data=data, layers="1,2,4", sort_window=32, token_budget=256,
                    max_length=256, chunk_tokens=16, shard_tokens=64)
    off, on = run_off_and_on(tmp_path, **settings)
    distinct = len({tuple(r[:k]) for r in rows for k in range(1, len(r) + 1)})  # a token trie's nodes
    assert sum(map(len, rows)) > 4 * 256 and on.num_tokens == distinct
    assert_rows_as_unshared(off, on, records)

    resumed = str(tmp_path / "resumed.zarr")
    fail_at_batch(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        run(RunConfig(out=resumed, **settings), progress=False, log=lambda m: None)
    monkeypatch.undo()
    assert 0 < len(open_store(resumed)) < len(rows)
    summary = run(RunConfig(out=resumed, **settings), progress=False, log=lambda m: None)
    assert summary.stored_again == 40 and open_store(resumed).num_tokens == distinct + 40
    assert any("stored again the 40 tokens" in line for line in summary.lines())
    assert_same_samples(str(tmp_path / "on.zarr"), resumed)


def test_merge_prefix_rows_folds_each_prefix_into_the_row_it_starts(tmp_path, tiny_chat_model_dir):
    """convert --merge-prefix-rows: a row whose ids start another row's (a fanned-out turn, a duplicate) is no
    training row of its own; the row it starts trains on the union of their masks, with its own states."""
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from streamx.train.convert import convert, order_sha256, training_order

    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 0, 1, 1, 1]},  # the full conversation
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},  # its first turn, another mask
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 0, 0, 1, 1]},  # a duplicate
            {"input_ids": [5, 6, 11, 12], "loss_mask": [0, 0, 1, 1]},  # shares 2 tokens only: stays a row
            {"input_ids": [20, 21, 22], "loss_mask": [1, 1, 1]}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = str(tmp_path / "s.zarr")
    run(RunConfig(model=tiny_chat_model_dir, data=data, out=out, layers="1,2,4", sharing="on", token_budget=256,
                  max_length=256), progress=False, log=lambda m: None)
    store = open_store(out)
    merged = tmp_path / "merged"
    summary = convert(out, str(merged), progress=False, allow_random_weights=True, merge_prefix_rows=True,
                      log=lambda m: None)
    assert summary.rows == 3
    data_rows = load_from_disk(str(merged))
    stored_rows = np.load(merged / "store_rows.npy").tolist()
    by_row = {row: torch.as_tensor(data_rows[i]["loss_mask"]).tolist() for i, row in enumerate(stored_rows)}
    leaf = 2 if 2 in by_row else 0  # of two equal rows, one folds into the other
    assert sorted(by_row) == sorted([leaf, 3, 4])
    assert by_row[leaf] == [0, 1, 1, 1, 1, 1]  # the union of rows 0, 1 and 2's masks
    assert by_row[3] == rows[3]["loss_mask"] and by_row[4] == rows[4]["loss_mask"]
    for i, row in enumerate(stored_rows):
        hs = load_file(merged / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(hs["hidden_states"].view(torch.int16), store.sample(row).hidden_states.view(torch.int16))
    plain = convert(out, str(tmp_path / "plain"), progress=False, allow_random_weights=True, log=lambda m: None)
    assert plain.rows == len(rows)
    # without hs files (speculators reads the store): the same training rows and masks; the folder names the
    # store's rows as the streamx backend checks them at start
    nocopy = tmp_path / "nocopy"
    convert(out, str(nocopy), progress=False, allow_random_weights=True, merge_prefix_rows=True, hidden_states="store",
            log=lambda m: None)
    assert np.load(nocopy / "store_rows.npy").tolist() == stored_rows
    assert [torch.as_tensor(r["loss_mask"]).tolist() for r in load_from_disk(str(nocopy))] == \
        [by_row[row] for row in stored_rows]
    identity = json.loads((nocopy / "streamx_meta.json").read_text())["identity"]
    assert identity["order_sha256"] == order_sha256(training_order(store.row_ids(), 0))


def test_verify_recomputes_shared_rows_and_names_a_damaged_shared_prefix(tmp_path, tiny_chat_model_dir, chat_jsonl):
    """A shared store passes verify with the model (shared rows among those recomputed alone); damage to a shared
    prefix's stored states is named in every row that reads it, and only in those."""
    out = str(tmp_path / "s.zarr")
    run(RunConfig(model=tiny_chat_model_dir, data=chat_jsonl, out=out, layers="1,2,4", sharing="on",
                  token_budget=512, max_length=256, max_samples=16), progress=False, log=lambda m: None)
    store = open_store(out)
    shared = [p for p in range(len(store)) if len(store.ranges(p)) > 1]
    assert shared and all(c.passed for c in verify(out, samples=8, log=lambda m: None).checks)
    a, b = store.ranges(shared[0])[0]  # the first row's shared prefix
    readers = {int(store.index.rows[p]) for p in range(len(store))
               if any(x < b and a < y for x, y in store.ranges(p))}
    assert len(readers) > 1
    states = zarr.open_array(f"{out}/parts/part-00000/hidden_states", mode="r+")
    damaged = states[a:b].view(np.int16).copy()
    damaged[:, 1] ^= 0x4000  # an exponent bit of every value of slot 1: the states move by orders of magnitude
    states[a:b] = damaged.view(np.uint16)
    report = verify(out, samples=len(store), log=lambda m: None)
    model = next(c for c in report.checks if c.name == "model")
    named = {int(p.split()[1].rstrip(":")) for p in model.problems}  # (the report lists 10 at most)
    assert not model.passed and named <= readers and len(named) == min(10, len(readers))
    assert model.summary.startswith(f"{len(readers)} of ")  # every reader's slot 1, and nothing else


def test_a_store_from_before_sharing_reads_and_resumes_with_the_same_command(tmp_path, tiny_chat_model_dir,
                                                                             chat_jsonl):
    """A format /2 part (no range arrays, no sharing in its records) reads as before, and the default command
    resumes it with --sharing off, to what an uninterrupted --sharing off run writes."""
    import zarr
    from helpers import small_config

    from streamx.store.format import SHARING_ARRAYS

    old, fresh = tmp_path / "old.zarr", tmp_path / "fresh.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, old, sharing="off", max_samples=20), progress=False,
        log=lambda m: None)
    root = zarr.open_group(str(old))
    record = dict(root.attrs["streamx"])
    del record["sharing"], record["compat"]["sharing"]
    root.attrs["streamx"] = {**record, "format": "streamx-store/2"}
    part = root["parts/part-00000"]
    for name in SHARING_ARRAYS:
        del part[name]
    commit = dict(part.attrs["commit"])
    for name in ("row_tokens", "ranges", "row_masks"):
        del commit[name]
    part.attrs["commit"] = commit
    before = open_store(str(old))
    assert len(before) == 20 and before.row_tokens == before.num_tokens
    notes = []
    run(small_config(tiny_chat_model_dir, chat_jsonl, old), progress=False, log=notes.append)  # sharing: default
    assert any("computes every row in full" in n for n in notes)
    run(small_config(tiny_chat_model_dir, chat_jsonl, old), progress=False, log=lambda m: None)  # and again
    run(small_config(tiny_chat_model_dir, chat_jsonl, fresh, sharing="off"), progress=False, log=lambda m: None)
    a, b = open_store(str(old)), open_store(str(fresh))
    assert a.row_ids().tolist() == b.row_ids().tolist() and a.metadata.compat.sharing == "off"
    for row in b.row_ids().tolist():
        assert torch.equal(a.sample(row).hidden_states.view(torch.int16), b.sample(row).hidden_states.view(torch.int16))
