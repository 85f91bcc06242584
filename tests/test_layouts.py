"""Families whose decoders sit where no list of names looked (transformer.h, transformer.blocks, gpt_neox.layers,
OPT's model.decoder.layers, biogpt.layers, the SSMs' backbone.layers or .blocks, RWKV's rwkv.blocks), and
checkpoints that a causal-LM class loads only in part: streamx finds the decoder from what the model declares and
holds (model.capture.find_decoder) and loads a checkpoint's text decoder whole or not at all (model.load.causal_lm).
Each family is run by `streamx run` with its default settings and every stored row compared with the model's own
unbatched forward: transformers' output_hidden_states, aligned as the family's own forward fills it (the layout
table says where, test-side)."""

from typing import NamedTuple

import pytest
import torch
from helpers import cli, run_args, small_config
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from streamx.pipeline.runner import run
from streamx.store import open_store

H = 64  # hidden size of every tiny model here


class Layout(NamedTuple):
    model_type: str
    config: dict
    layers: str  # where the family keeps its decoder layers (known here, not asked of streamx)
    first_is_embeddings: bool = True  # output_hidden_states[0] is the first layer's input (else its output)


LAYOUTS = {
    "gpt2": Layout("gpt2", dict(n_embd=H, n_layer=4, n_head=4, n_positions=1024), "transformer.h"),
    "gpt_neox": Layout("gpt_neox", dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=4,
                                        intermediate_size=128), "gpt_neox.layers"),
    "opt": Layout("opt", dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, ffn_dim=128,
                              word_embed_proj_dim=H), "model.decoder.layers"),
    "mamba": Layout("mamba", dict(hidden_size=H, num_hidden_layers=4, state_size=8), "backbone.layers",
                    first_is_embeddings=False),
    "mamba2": Layout("mamba2", dict(hidden_size=H, num_hidden_layers=4, num_heads=8, head_dim=16, state_size=8,
                                    n_groups=1, chunk_size=16), "backbone.layers"),
    "rwkv": Layout("rwkv", dict(hidden_size=H, num_hidden_layers=4, attention_hidden_size=H, intermediate_size=128,
                                context_length=1024), "rwkv.blocks", first_is_embeddings=False),
    "gptj": Layout("gptj", dict(n_embd=H, n_layer=4, n_head=4, rotary_dim=8, n_positions=1024), "transformer.h"),
    "codegen": Layout("codegen", dict(n_embd=H, n_layer=4, n_head=4, rotary_dim=8, n_positions=1024, n_ctx=1024),
                      "transformer.h"),
    "gpt_bigcode": Layout("gpt_bigcode", dict(n_embd=H, n_layer=4, n_head=4, n_positions=1024), "transformer.h"),
    "gpt_neo": Layout("gpt_neo", dict(hidden_size=H, num_layers=4, num_heads=4, window_size=16,
                                      attention_types=[[["global", "local"], 2]], max_position_embeddings=1024),
                      "transformer.h"),
    "biogpt": Layout("biogpt", dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128),
                     "biogpt.layers"),
    "ctrl": Layout("ctrl", dict(n_embd=H, n_layer=4, n_head=4, dff=128), "transformer.h"),
    # ALiBi and parallel blocks: padded, the check measured
    "bloom": Layout("bloom", dict(hidden_size=H, n_layer=4, n_head=4), "transformer.h"),
    "falcon": Layout("falcon", dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=4), "transformer.h"),
    "mpt": Layout("mpt", dict(d_model=H, n_layers=4, n_heads=4, max_seq_len=1024), "transformer.blocks"),
    "xlstm": Layout("xlstm", dict(hidden_size=H, num_hidden_layers=4, num_heads=4), "backbone.blocks"),
    "falcon_mamba": Layout("falcon_mamba", dict(hidden_size=H, num_hidden_layers=4, state_size=8), "backbone.layers",
                           first_is_embeddings=False),
    # DBRX: clip_qkv set as its checkpoints set it (transformers 5.25 fails on the default None) and the rope_theta
    # its attention reads
    "dbrx": Layout("dbrx", dict(d_model=H, n_heads=4, n_layers=4, max_seq_len=1024,
                                attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
                   "transformer.blocks"),
    # RWKV halves the state after every rescale_every-th block, outside the block (in inference): the model's tuple
    # and its next block hold the halved state, the block's own output the whole one (id 3 read at block 3's input)
    "rwkv_rescaled": Layout("rwkv", dict(hidden_size=H, num_hidden_layers=4, attention_hidden_size=H,
                                         intermediate_size=128, context_length=1024, rescale_every=3), "rwkv.blocks",
                            first_is_embeddings=False),
}


def build(layout: Layout, path, tokenizer_dir: str) -> torch.nn.Module:
    """The family's tiny model (SmolLM2's vocabulary, weights drawn with std 0.1 so that a token's states depend on
    the tokens before it well above float noise), saved at `path` with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(layout.model_type, vocab_size=49152,
                                                                  **layout.config))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.1)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model.eval()


@torch.inference_mode()
def own_states(model, layout: Layout, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, L + 1, H]: ids 0..L of the row alone, from the model's own output_hidden_states where it holds them (its
    last entry has the final norm applied: id L is the last layer's output, taken by a hook where the tuple holds
    no such entry, and the first layer's input is the embeddings where the tuple starts after it)."""
    layers = model.get_submodule(layout.layers)
    last = []
    hook = layers[-1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple) else out))
    try:
        hidden = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False).hidden_states
    finally:
        hook.remove()
    assert len(hidden) == len(layers) + 1
    states = list(hidden[:-1]) + [last[0]] if layout.first_is_embeddings else \
        [model.get_input_embeddings()(input_ids[None]), *hidden[:-1]]
    return torch.stack(states, dim=2)[0]


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_a_family_keeping_its_layers_elsewhere_runs_right_by_default(family, smollm2_dir, chat_jsonl, tmp_path):
    layout = LAYOUTS[family]
    model = build(layout, tmp_path / family, smollm2_dir)
    lines: list[str] = []
    run(small_config(str(tmp_path / family), chat_jsonl, tmp_path / "s.zarr", layers="0,1,2,3,4", max_samples=24),
        progress=False, log=lines.append)
    store = open_store(str(tmp_path / "s.zarr"))
    assert len(store) == 24
    # the start-up proof: the ids are the model's own, and the final norm found gives its last hidden state
    ids = next(line for line in lines if line.startswith("  ids     "))
    assert ids.endswith("applied to id L gives its last hidden state (the final norm)"), ids
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        want, got = own_states(model, layout, sample.input_ids), sample.hidden_states.float()
        error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
        assert error < 5e-3, (family, row, float(error), "\n".join(lines))


def test_a_checkpoint_missing_decoder_weights_stops_in_one_line_before_the_first_batch(smollm2_dir, chat_jsonl,
                                                                                       tmp_path):
    """A checkpoint whose second layer's tensors are named otherwise (as a multimodal checkpoint names its text
    model's): transformers would initialise that layer at random and say so only in its load report."""
    path = tmp_path / "half"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    save_file({("text_model." if key.startswith("model.layers.1.") else "") + key: value
               for key, value in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    result = cli(*run_args(str(path), chat_jsonl, tmp_path / "s.zarr", layers="0,1,2"))
    assert result.returncode == 1
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: LlamaForCausalLM: 9 of its text decoder's weights are not in the checkpoint "
                            "(model.layers.1.input_layernorm.weight, "), error
    assert "no class of transformers" in error and "loads this checkpoint's text decoder whole" in error
    assert "batches" not in result.stderr and not (tmp_path / "s.zarr" / "parts").exists()


def test_a_multimodal_checkpoint_is_run_by_the_class_that_loads_its_text_decoder_whole(smollm2_dir, chat_jsonl,
                                                                                       tmp_path):
    """Emu3's checkpoint names its text decoder text_model.model.*: Emu3ForCausalLM (the causal-LM class) would
    load none of it; its image-text-to-text class loads every tensor, and its text decoder (model.text_model, where
    no list looked) is run: every row equals that decoder's own forward."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration
    from transformers.models.emu3.configuration_emu3 import Emu3TextConfig, Emu3VQVAEConfig

    path = tmp_path / "emu3"
    vq = Emu3VQVAEConfig(codebook_size=32, embed_dim=32, latent_channels=32, base_channels=32,
                         channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], double_latent=False,
                         temporal_downsample_factor=1)
    text = Emu3TextConfig(vocab_size=49152, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)
    torch.manual_seed(0)
    model = Emu3ForConditionalGeneration(Emu3Config(vq_config=vq.to_dict(), text_config=text.to_dict(),
                                                    vocabulary_map={"<image>": 5})).eval()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    summary = run(small_config(str(path), chat_jsonl, tmp_path / "s.zarr", layers="0,1,2", max_samples=12),
                  progress=False, log=lambda m: None)
    store = open_store(str(tmp_path / "s.zarr"))
    assert summary.samples == 12 and store.metadata.model["architecture"] == "Emu3ForConditionalGeneration"
    decoder = model.model.text_model
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        with torch.inference_mode():
            hidden = decoder(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states
        want = torch.stack(hidden[:2], dim=2)[0]  # ids 0 and 1 (id 2 is before the norm: its tuple entry is after)
        got = sample.hidden_states[:, :2].float()
        assert float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()) < 5e-3, row


def test_lfm2s_final_norm_is_found_and_every_convert_that_needs_it_writes_it(smollm2_dir, chat_jsonl, tmp_path):
    """LFM2 calls its final norm embedding_norm (no list held that name: every convert that writes the post-norm
    state refused its stores): the trainers' post-norm last state equals LFM2's own last_hidden_state of each row."""
    from zoo_models import zoo_model

    from streamx.train.export import export, row_file
    from streamx.train.trainers import TRAINERS

    model = zoo_model("lfm2")
    model.save_pretrained(tmp_path / "lfm2")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path / "lfm2")
    quiet = dict(progress=False, log=lambda m: None)
    run(small_config(str(tmp_path / "lfm2"), chat_jsonl, tmp_path / "s.zarr", layers="1,2,4", max_samples=8), **quiet)
    for fmt in ("specforge-eagle3", "modelopt", "torchspec"):
        assert export(str(tmp_path / "s.zarr"), str(tmp_path / fmt), fmt, [0, 1], **quiet).rows == 8, fmt
    store = open_store(str(tmp_path / "s.zarr"))
    for row in store.row_ids().tolist():
        written = torch.load(row_file(tmp_path / "modelopt", TRAINERS["modelopt"], row), weights_only=True)
        with torch.inference_mode():
            want = model.model(written["input_ids"][None]).last_hidden_state[0]
        error = ((written["hidden_states"].float() - want).norm(dim=-1) / want.norm(dim=-1)).max()
        assert error < 5e-3, (row, float(error))


def test_verify_reads_a_family_whose_tuple_starts_after_the_embeddings(smollm2_dir, chat_jsonl, tmp_path):
    """Mamba's output_hidden_states start at its first layer's output: verify aligns its reference as the start-up
    proof found (proof.ids), and passes the store (it compared id k with the entry of id k+1)."""
    from streamx.train.verify import verify

    build(LAYOUTS["mamba"], tmp_path / "mamba", smollm2_dir)
    run(small_config(str(tmp_path / "mamba"), chat_jsonl, tmp_path / "s.zarr", layers="0,1,2,3,4", max_samples=8),
        progress=False, log=lambda m: None)
    assert verify(str(tmp_path / "s.zarr"), log=lambda m: None).passed


class CalledAs(torch.nn.ModuleList):
    """A decoder's layers, which its forward (iterating self.layers[:num_hidden_layers]) calls in `order`: a looped
    stack (a layer called twice) or one whose forward skips a layer."""

    def __init__(self, layers, order: list[int]):
        super().__init__(layers)
        self.order = order

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [super(CalledAs, self).__getitem__(i) for i in self.order]
        return super().__getitem__(index)


@pytest.mark.parametrize(("order", "said"), [
    ([0, 1, 2, 1, 2, 3], "the model's forward calls layers 1, 2 of its 4 more than once (a loop: 6 calls"),
    ([0, 1, 3], "the model's forward does not call layer 2 of its 4 on a text row"),
], ids=["looped", "skipped"])
def test_a_decoder_whose_ids_its_hooks_cannot_read_is_refused_in_one_line(order, said):
    """Hooks on layer modules see a looped layer's last call (the model's own tuple records each call) and nothing of
    a layer the forward skips (its slot would hold uninitialised memory): the start-up proof refuses the model in
    one line (the run's plan asks it before any batch; rwkv_rescaled above is the plan acting on its answer)."""
    from streamx.proof.ids import CaptureRefused, prove_ids

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    assert prove_ids(model).inputs == frozenset() and prove_ids(model).offset == 0  # as built: proven
    model.model.layers = CalledAs(list(model.model.layers), order)
    with torch.inference_mode():
        hidden = model(input_ids=torch.arange(3, 10)[None], output_hidden_states=True).hidden_states
    assert len(hidden) == len(order) + 1  # transformers records every call
    with pytest.raises(CaptureRefused) as refused:
        prove_ids(model)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_a_final_norm_that_does_not_give_the_last_hidden_state_is_said():
    """OPT with a projection after its final norm (word_embed_proj_dim below the hidden size): the norm found does
    not give the model's last hidden state, and the proof's line says so; OPT-350m's layout (norms inside the layers,
    none after them) has no final norm to find."""
    from transformers import OPTConfig, OPTForCausalLM

    from streamx.proof.ids import prove_ids

    for settings, said in ((dict(), "model.decoder.final_layer_norm applied to id L gives its last hidden state"),
                           (dict(word_embed_proj_dim=32), "model.decoder.final_layer_norm applied to id L differs "
                                                          "from its last hidden state by inf"),
                           (dict(word_embed_proj_dim=32, do_layer_norm_before=False), "no final norm found")):
        torch.manual_seed(0)
        model = OPTForCausalLM(OPTConfig(vocab_size=100, hidden_size=H, num_hidden_layers=2, ffn_dim=128,
                                         num_attention_heads=4, **settings)).eval()
        note = prove_ids(model).note()
        assert note.startswith("every id < L is the model's own output_hidden_states") and said in note, note


def refused_line(model_dir, tokenizer_dir: str, chat_jsonl: str, tmp_path) -> str:
    """`streamx run` on the model saved at `model_dir`, which must exit 1: its last line."""
    result = cli(*run_args(str(model_dir), chat_jsonl, tmp_path / "s.zarr", tokenizer=tokenizer_dir))
    assert result.returncode == 1, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_model_of_sub_models_is_refused_in_one_line(smollm2_dir, chat_jsonl, tmp_path):
    """BLT (a byte patcher, byte encoder, global transformer and byte decoder, each its own size) declares no layer
    count or hidden size of its own: the run says in one line that it has no per-token state to store (it crashed
    on config.num_hidden_layers)."""
    from transformers import BltConfig

    small = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    config = BltConfig(vocab_size=260, patcher_config=dict(small, num_hidden_layers=2, vocab_size=260),
                       encoder_config=dict(small, num_hidden_layers=1, vocab_size=260),
                       decoder_config=dict(small, num_hidden_layers=2, vocab_size=260),
                       global_config=dict(small, num_hidden_layers=2), patch_size=4, hidden_size_global=H,
                       dim_token_emb=H, encoder_hash_byte_group_vocab=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "blt")
    assert refused_line(tmp_path / "blt", smollm2_dir, chat_jsonl, tmp_path) == (
        "error: BltConfig declares no num_hidden_layers: streamx runs decoders whose layers pass one hidden state per "
        "token, and this model is made of sub-models of their own sizes (as BLT's patcher, byte encoder, global "
        "transformer and byte decoder); no per-token state to store")


def test_mllamas_text_decoder_skipping_its_cross_attention_layers_is_refused():
    """Mllama's text decoder skips its cross-attention layers on a row without an image: their hooks never fire (the
    run committed 0 rows, every one rejected as non-finite, and exited 0); the start-up proof refuses it in one line."""
    from transformers import MllamaForCausalLM, MllamaTextConfig

    from streamx.proof.ids import CaptureRefused, prove_ids

    model = MllamaForCausalLM(MllamaTextConfig(vocab_size=1000, hidden_size=H, intermediate_size=128,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               cross_attention_layers=[1], pad_token_id=0)).eval()
    with pytest.raises(CaptureRefused, match="^the model's forward does not call layer 1 of its 4 on a text row"):
        prove_ids(model)


def test_a_decoder_of_two_stacks_called_in_cycles_is_refused_in_one_line(smollm2_dir, chat_jsonl, tmp_path):
    """HRM runs a low-level and a high-level stack of layers in nested cycles, each kept inside a sub-module: its
    output_hidden_states records every call, so an id per layer means nothing there; the run says so in one line
    (it said only that no decoder layers were found)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("hrm_text", vocab_size=49152, hidden_size=H, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, head_dim=16, num_layers_per_stack=2,
                                  H_cycles=2, L_cycles=2, L_bp_cycles=[1])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.inference_mode():
        hidden = model(input_ids=torch.arange(3, 10)[None], output_hidden_states=True, use_cache=False).hidden_states
    assert len(hidden) > config.num_hidden_layers + 1  # more recorded calls than layers: not one state per layer
    model.save_pretrained(tmp_path / "hrm")
    assert refused_line(tmp_path / "hrm", smollm2_dir, chat_jsonl, tmp_path) == (
        "error: cannot number the decoder layers of HrmTextForCausalLM: the blocks it records as hidden states sit in "
        "2 module lists that no model class holds itself (model.L_module.layers, model.H_module.layers), a decoder of "
        "several stacks, not one list of layers")
