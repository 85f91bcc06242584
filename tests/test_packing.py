"""Packed (padding-free) batches: every sample's states equal an independent unbatched reference,
boundaries never leak (a short sample after a long, very different one is checked alone), and a model
that cannot keep packed samples apart falls back to padded batches and says so (the start-up check,
against the model's own forward)."""

import json

import pytest
import torch
from helpers import reference_states, small_config
from tiny_models import tiny_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from streamx.data.batching import first_fit, make_packed_batch
from streamx.data.tokenize import Sample
from streamx.model.capture import LayerCapture
from streamx.model.gather import gather_into_torch
from streamx.model.packing import PACKED_ATTENTION, configure, enable, sample_wise_layers, sequence_mixers
from streamx.pipeline.runner import run
from streamx.proof.check import Probes, check_packing
from streamx.store import open_store

BF16_ULP = 2.0**-7


def samples_after_a_long_one(vocab: int, seed: int = 0) -> list[Sample]:
    """A long sample of one repeated token (nothing like the rest), then short random ones."""
    g = torch.Generator().manual_seed(seed)
    long = torch.full((150,), 5)
    rows = [long] + [torch.randint(3, vocab, (n,), generator=g) for n in (7, 19, 1, 12, 40)]
    return [Sample(i, ids, torch.ones(len(ids), dtype=torch.long)) for i, ids in enumerate(rows)]


def packed_capture(model, samples, layer_ids) -> torch.Tensor:
    batch = make_packed_batch(samples)
    H = model.config.get_text_config().hidden_size
    packed = torch.full((batch.num_tokens, len(layer_ids), H), float("nan"), dtype=torch.bfloat16)  # poisoned
    with LayerCapture(model, layer_ids, gather_into_torch) as cap:
        cap.forward(batch, packed)
    return packed


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5"])
def test_packed_states_equal_each_sample_alone(family):
    model, untouched = tiny_model(family), tiny_model(family)  # same weights; the reference keeps plain sdpa
    assert enable(model, Probes.of(model, 256)) is None and model.config._attn_implementation == PACKED_ATTENTION
    # the hybrid's gated delta-net layers run sample by sample unless transformers found kernels that reset at
    # boundaries (flash-linear-attention and causal-conv1d, CUDA only)
    if family != "qwen3_5":
        assert sample_wise_layers(model) == 0
    elif not torch.cuda.is_available():
        assert sample_wise_layers(model) == 3
    samples = samples_after_a_long_one(model.config.vocab_size)
    ids = [0, 1, 2, 3, 4]
    packed = packed_capture(model, samples, ids)
    offset = 0
    for sample in samples:
        T = len(sample.input_ids)
        want_all = reference_states(untouched, sample.input_ids)
        for slot, layer_id in enumerate(ids):
            got, want = packed[offset : offset + T, slot].float(), want_all[layer_id].to(torch.bfloat16).float()
            torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=1e-5 * want.abs().max().item(),
                                       msg=f"{family}: sample {sample.row_id} id {layer_id}")
        offset += T


def test_hybrid_linear_attention_mixes_packed_samples_unless_run_sample_wise():
    """Without SampleWise, transformers' own gated delta-net path refuses packed rows on the CPU (or, with
    flash-linear-attention but no causal-conv1d, lets the conv window cross the boundary): the probe says so.
    With it, packing is on; padded batches afterwards (--packing off, or bench's padded forward) run the
    layers as they are, and off removes the wrapper."""
    model = tiny_model("qwen3_5")
    if not torch.cuda.is_available():  # (CUDA with both kernel packages keeps samples apart by itself)
        probes = Probes.of(model, 256)
        model.set_attn_implementation(PACKED_ATTENTION)
        assert "flash-linear-attention" in check_packing(model, probes)
        model.set_attn_implementation("sdpa")
    packing = configure(model, "on", 256)
    assert packing.on and packing.sample_wise_layers == 3 and sample_wise_layers(model) == 3
    untouched = tiny_model("qwen3_5")
    one = samples_after_a_long_one(model.config.vocab_size)[4:5]  # a packed batch of one sample (a long one alone)
    packed = packed_capture(model, one, [4])[:, 0].float()
    torch.testing.assert_close(packed, reference_states(untouched, one[0].input_ids)[4].to(torch.bfloat16).float())
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")  # padded batches: the same model, its attention as it was
        got = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        want = untouched.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    packing = configure(model, "off", 256)
    assert not packing.on and packing.reason is None and sample_wise_layers(model) == 0
    assert model.config._attn_implementation == "sdpa"


def test_sequence_mixers_that_return_no_tensor_leave_packing_off_and_say_why():
    """SampleWise cuts and joins the linear-attention layers' outputs as tensors; layers that return anything
    else (a tuple with their cache, say, which the model's own layer unpacks: a hook here) must not be joined as if
    they did: packing stays off and says why."""
    model = tiny_model("qwen3_5")
    for mixer in sequence_mixers(model):
        mixer.forward = lambda *args, _own=mixer.forward, **kwargs: (_own(*args, **kwargs), None)
        mixer.register_forward_hook(lambda module, args, out: out[0] if isinstance(out, tuple) else out)
    packing = configure(model, "on", 256)
    assert not packing.on and "sample-wise layers return tensors; got tuple" in packing.reason, packing
    assert sample_wise_layers(model) == 0 and model.config._attn_implementation == "sdpa"


def leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """Causal attention over the whole packed row: what a boundary leak looks like."""
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, scaling=kwargs.get("scaling"))


AttentionInterface.register("leaky_for_tests", leaky_attention)


def test_a_leak_is_caught_by_the_check_and_packing_stays_off(monkeypatch):
    model = tiny_model("llama")
    probes = Probes.of(model, 256)
    model.set_attn_implementation("leaky_for_tests")
    assert "differs from the model's own forward of it alone" in check_packing(model, probes)
    # and the reference comparison above would have failed too: the short sample after the long one differs
    samples = samples_after_a_long_one(model.config.vocab_size)
    packed = packed_capture(model, samples, [4])
    alone = reference_states(tiny_model("llama"), samples[1].input_ids)[4]
    assert (packed[150:157, 0].float() - alone).abs().max() > 0.1 * alone.abs().max()

    # eager attention (the default of families sdpa cannot run, such as Gemma 2's) is stood in for, as sdpa is
    model = tiny_model("llama", num_layers=2)
    model.set_attn_implementation("eager")
    assert configure(model, "on", 256).on and model.config._attn_implementation == PACKED_ATTENTION
    assert not configure(model, "off", 256).on and model.config._attn_implementation == "eager"
    # an implementation streamx knows nothing of keeps its own forward, in padded batches
    monkeypatch.setitem(AttentionInterface._global_mapping, "other_for_tests", sdpa_attention_forward)
    model.set_attn_implementation("other_for_tests")
    packing = configure(model, "on", 256)
    assert not packing.on and "other_for_tests has no packed path" in packing.reason
    assert model.config._attn_implementation == "other_for_tests"


def test_first_fit_fills_batches_within_budget():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 60, (200,), generator=g).tolist()
    samples = [Sample(i, torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long))
               for i, n in enumerate(lengths)]
    groups = first_fit(samples, lambda s: len(s.input_ids), lambda s: 1, token_budget=128, max_batch_size=6)
    assert sorted(s.row_id for g in groups for s in g) == list(range(200))  # every sample once
    assert all(sum(len(s.input_ids) for s in g) <= 128 and len(g) <= 6 for g in groups)
    assert len(groups) <= -(-sum(lengths) // 128) * 1.25  # bins nearly full: few batches
    batch = make_packed_batch(groups[0])
    n = [len(s.input_ids) for s in groups[0]]
    assert batch.input_ids.shape == (1, sum(n)) and batch.attention_mask is None and batch.padded_tokens == sum(n)
    assert batch.cu_seq_lens.tolist() == [0, *torch.cumsum(torch.tensor(n), 0).tolist()]
    assert batch.position_ids[0].tolist() == [t for k in n for t in range(k)]
    assert torch.equal(batch.token_index, torch.arange(sum(n)))
    assert batch.segment_index.tolist() == [b for b, k in enumerate(n) for _ in range(k)]


def test_run_packs_by_default_and_records_it(tiny_chat_model_dir, chat_jsonl, tmp_path):
    lines = []
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "p.zarr"), progress=False, log=lines.append)
    assert summary.padded_tokens == summary.real_tokens and summary.padding_efficiency == 1.0
    assert any(line.startswith("  packing on") for line in lines)
    meta = open_store(str(tmp_path / "p.zarr")).metadata
    assert meta.packing == "on" and meta.compat.packing == "on"

    off = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "o.zarr", packing="off"), progress=False,
              log=lines.append)
    assert off.padded_tokens > off.real_tokens and open_store(str(tmp_path / "o.zarr")).metadata.packing == "off"


def test_a_model_that_leaks_falls_back_to_padded_batches(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    # the packed path itself leaks, as gated delta-net layers do without kernels that reset at boundaries
    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_ATTENTION, leaky_attention)
    lines = []
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr"), progress=False, log=lines.append)
    note = next(line for line in lines if line.startswith("  packing off"))
    assert "differs from the model's own forward of it alone" in note and "padded batches" in note
    assert summary.padded_tokens > summary.real_tokens  # it really ran padded
    meta = json.loads((tmp_path / "s.zarr" / "zarr.json").read_text())["attributes"]["streamx"]
    assert meta["packing"].startswith("off: ") and "differs from the model's own forward" in meta["packing"]
    assert meta["compat"]["packing"] == "off"


def test_the_check_needs_no_more_memory_than_the_runs_forwards():
    """With --max-length equal to --token-budget, the start-up check's forwards (two rows packed, padded or
    continued) stay within the budget: its rows are at most half of it, and the log says what that leaves unprobed."""
    model = tiny_model("llama")
    model.config.sliding_window = 200  # a span the probes would otherwise reach past (1.5 x 200 + 8 tokens)
    model.config.layer_types = None
    probes = Probes.of(model, max_length=256, token_budget=256)
    assert max(len(row.input_ids) for row in probes.rows) <= 128
    forwards = [sum(len(probes.rows[i].input_ids) for i in rows) for rows in probes.together]
    forwards.append(sum(len(r.input_ids) for r in probes.group(probes.continued)))
    assert max(forwards) <= 256
    assert "half --token-budget" in probes.scope and "sliding window of 200" in probes.scope
    wide = Probes.of(model, max_length=256, token_budget=4096)
    assert max(len(row.input_ids) for row in wide.rows) > 200  # with room, past the window
