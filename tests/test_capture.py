"""Batched, padded capture equals an independent unbatched reference, per sample, for every id.

Reference: HF `output_hidden_states` of an unbatched forward for ids < L; for id L, the same
forward with the final norm replaced by identity (HF's hidden_states[L] is post-norm)."""

import pytest
import torch
from helpers import reference_states
from tiny_models import tiny_model
from torch import nn

from streamx.data.batching import make_batch
from streamx.data.tokenize import Sample
from streamx.model.capture import LayerCapture, LayerDiscoveryError, find_decoder, segment_is_finite
from streamx.model.gather import gather_into_torch

BF16_ULP = 2.0**-7  # relative spacing of bf16


def random_samples(vocab: int, lengths: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(row_id=i, input_ids=torch.randint(3, vocab, (n,), generator=g),
                   loss_mask=torch.ones(n, dtype=torch.long)) for i, n in enumerate(lengths)]


def capture(model, samples, layer_ids):
    batch = make_batch(samples, pad_token_id=0)
    H = model.config.get_text_config().hidden_size
    packed = torch.full((batch.num_tokens, len(layer_ids), H), float("nan"), dtype=torch.bfloat16)  # poisoned
    with LayerCapture(model, layer_ids, gather_into_torch) as cap:
        cap.forward(batch, packed)
    return batch, packed


def assert_matches_reference(model, samples, layer_ids):
    batch, packed = capture(model, samples, layer_ids)
    assert batch.padded_tokens > batch.num_tokens  # the test exercises padding
    offset = 0
    for sample in samples:
        T = len(sample.input_ids)
        ref = reference_states(model, sample.input_ids)
        for slot, layer_id in enumerate(layer_ids):
            got = packed[offset : offset + T, slot].float()
            want = ref[layer_id].to(torch.bfloat16).float()
            # batched vs unbatched fp32 differ in the last bits: one bf16 rounding step, and a tiny
            # absolute slack relative to the layer's scale for values near zero
            torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=1e-5 * want.abs().max().item(),
                                       msg=f"row {sample.row_id} id {layer_id}")
        offset += T
    return packed


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5"])
def test_every_layer_id_matches_unbatched_reference(family):
    model = tiny_model(family, num_layers=4)
    samples = random_samples(model.config.vocab_size, [7, 19, 3, 12])
    assert_matches_reference(model, samples, [0, 1, 2, 3, 4])


def test_last_id_is_pre_norm():
    model = tiny_model("llama", num_layers=4)
    samples = random_samples(model.config.vocab_size, [9, 5])
    _, packed = capture(model, samples, [4])
    with torch.inference_mode():
        post_norm = model(input_ids=samples[0].input_ids[None], output_hidden_states=True).hidden_states[4][0]
    assert not torch.allclose(packed[:9, 0].float(), post_norm, atol=1e-2)


def test_smollm2_real_weights_selected_ids(smollm2):
    model, tokenizer = smollm2
    texts = ["What is the capital of France?", "Hello world, this is SmolLM. It is small and quick to run on CPUs.",
             "Hi"]
    samples = [Sample(i, torch.tensor(tokenizer(t).input_ids), torch.ones(1)) for i, t in enumerate(texts)]
    assert_matches_reference(model, samples, [0, 2, 15, 27, 30])


def test_forward_stops_after_deepest_layer():
    model = tiny_model("llama", num_layers=4)
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    norm_calls = []
    model.model.norm.register_forward_hook(lambda *a: norm_calls.append(1))
    capture(model, random_samples(model.config.vocab_size, [4, 6]), [1, 2])
    assert ran == [0, 1] and norm_calls == []


def test_layer_id_errors_name_the_range():
    model = tiny_model("llama", num_layers=4)
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.4"):
        LayerCapture(model, [2, 5], gather_into_torch)
    with pytest.raises(ValueError, match="without duplicates"):
        LayerCapture(model, [2, 2], gather_into_torch)
    with pytest.raises(LayerDiscoveryError, match="cannot find the decoder layers"):
        LayerCapture(nn.Linear(2, 2), [0], gather_into_torch)


def test_non_finite_segments_are_flagged():
    packed = torch.randn(10, 2, 8).to(torch.bfloat16)
    packed[6, 1, 3] = float("inf")
    segment_index = torch.tensor([0] * 4 + [1] * 3 + [2] * 3)
    assert segment_is_finite(packed, segment_index, 3).tolist() == [True, False, True]


# where families keep their decoder (Llama; multimodal wrappers, newer and older; a bare decoder; somewhere no
# family does): find_decoder asks the model, not these names
NESTINGS = ("model.layers", "model.language_model.layers", "language_model.model.layers", "layers",
            "outer.anywhere.layers")


@pytest.mark.parametrize("path", NESTINGS)
def test_every_decoder_path_is_found_and_run_by_capture_bench_and_verify(path):
    """Wherever a model keeps its decoder, find_decoder finds it: a tiny Llama's decoder put there is found with its
    norm, the capture hooks gather through it, bench's plain forward runs it, and verify's reference (every id, id L
    before the norm) equals the one of the unwrapped model."""
    from streamx.measure.bench import forward_only
    from streamx.train.verify import reference_states as verify_reference

    model = tiny_model("llama", num_layers=4)
    decoder, top = model.model, model.model
    if path != "layers":  # nest the decoder at the path's modules (e.g. model.language_model)
        top = holder = nn.Module()
        names = path.split(".")[:-1]
        for name in names[:-1]:
            setattr(holder, name, nn.Module())
            holder = getattr(holder, name)
        setattr(holder, names[-1], decoder)
        top.config = model.config
    found = find_decoder(top)
    assert found.module is decoder and found.layers is decoder.layers and found.norm is decoder.norm
    samples = random_samples(model.config.vocab_size, [5, 8])
    _, states = capture(top, samples, [1, 4])
    _, plain = capture(model, samples, [1, 4])
    assert torch.equal(states, plain)
    forward_only(top, [make_batch(samples, pad_token_id=0)], torch.device("cpu"))
    ids = samples[1].input_ids
    wrapped, unwrapped = verify_reference(top, ids), verify_reference(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(wrapped[0], unwrapped[0], strict=True))
    want = wrapped[0][4].to(torch.bfloat16).float()  # id 4: the last layer's output before the norm
    torch.testing.assert_close(states[5:, 1].float(), want, rtol=BF16_ULP, atol=1e-5 * want.abs().max().item())


def test_the_final_norm_is_found_under_the_names_families_give_it():
    """Jamba calls it `final_layernorm`, not `norm`: verify hooks it and convert applies it (it was None)."""
    from transformers import AutoModelForCausalLM, JambaConfig

    from streamx.model.capture import find_decoder

    config = JambaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, num_experts=2, num_experts_per_tok=1,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         mamba_d_state=4, mamba_expand=2)
    model = AutoModelForCausalLM.from_config(config)
    assert find_decoder(model).norm is model.model.final_layernorm
