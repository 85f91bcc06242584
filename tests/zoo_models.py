"""Tiny random-weight models of many LLM families, for the zoo test that compares the packed (shared) forward with
each model's own unbatched HF forward. Built from transformers' config classes: nothing is downloaded.

Every family: 4 layers (each of its layer kinds at least once), hidden 64, 4 query heads of 16 and 2 KV heads, MLP
128, 4 experts with 2 per token where MoE, SmolLM2's 49152-token vocabulary, untied embeddings. Sliding windows,
attention chunks and SSM / lightning-attention chunks are 16 tokens, so rows of 40-200 tokens cross them. Weights are
drawn with std 0.1 rather than 0.02, so that attention is peaked enough for scaling, softcapping, sinks and windows to
move the hidden states well above float noise, and Mamba2 / Gated DeltaNet decays are set to remember for tens of
tokens (_long_memory). The default attention implementation is sdpa, except for gpt_oss and gemma2, whose classes
do not support it: transformers falls back to eager for them.
"""

import copy
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedConfig, PreTrainedModel

WINDOW = 16  # sliding window, attention chunk, Llama 4's temperature floor, lightning-attention block, SSM chunk
COMMON: dict[str, Any] = dict(
    num_hidden_layers=4, vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, initializer_range=0.1)  # (the pad token's embedding is zero: one chats never hold)
MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# MLA has no KV-head grouping, and its config's head_dim is the width of the rope part (qk_rope_head_dim)
MLA_COMMON = {k: v for k, v in COMMON.items() if k != "head_dim"} | dict(num_key_value_heads=4)
# Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next)
GDN: dict[str, Any] = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_conv_kernel_dim=4)
HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
ALTERNATING = ["sliding_attention", "full_attention"] * 2
LIMIT = 64  # where a length-dependent rope changes: rows of 40-200 tokens lie on both sides
# DeepSeek-V3.2 / GLM-5 sparse attention: an indexer picking 16 keys per query; 16 indexer heads, since with fewer the
# ReLU scores of a tiny random model tie at 0 and top-k breaks the ties by the tensor's size (not by the row)
DSA: dict[str, Any] = dict(
    MLA_COMMON, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16)
VISION_PATCHES: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14)
VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              num_position_embeddings=64)


class Family(NamedTuple):
    config_class: str  # looked up on transformers when used: a class this transformers lacks fails only its family
    kwargs: dict[str, Any]
    notes: str  # model_type / model class: layer kinds; what the tiny config exercises
    auto_class: type = AutoModelForCausalLM


_ZOO: dict[str, Family] = {
    "llama3": Family("LlamaConfig", dict(COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024)),
        "llama / LlamaForCausalLM: full attention; Llama 3.1 rope scaling"),
    "llama4": Family("Llama4TextConfig", dict(
        COMMON, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=2,
        interleave_moe_layer_step=2, attention_chunk_size=WINDOW, floor_scale=WINDOW),
        "llama4_text / Llama4ForCausalLM: 3 chunked-attention rope layers (L2 qk-norm) + 1 full-attention NoPE layer; "
        "16-token chunks; attention temperature tuning on the NoPE layer from token 16 on; MoE on odd layers"),
    "llama4_multimodal": Family("Llama4Config", dict(
        text_config=dict(COMMON, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
                         num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=WINDOW,
                         floor_scale=WINDOW),
        vision_config=dict(VISION_PATCHES, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64),
        tie_word_embeddings=False),
        "llama4 / Llama4ForConditionalGeneration (the released checkpoints' class, which streamx loads as "
        "Llama4ForCausalLM): as llama4, a 1-layer vision tower", AutoModelForImageTextToText),
    "qwen3": Family("Qwen3Config", COMMON, "qwen3 / Qwen3ForCausalLM: full attention; per-head q/k norm"),
    "qwen3_moe": Family("Qwen3MoeConfig", dict(COMMON, num_experts=4, **MOE),
                        "qwen3_moe / Qwen3MoeForCausalLM: full attention; MoE on every layer"),
    "qwen3_5": Family("Qwen3_5TextConfig", dict(COMMON, layer_types=HYBRID, **GDN),
                      "qwen3_5_text / Qwen3_5ForCausalLM: 3 Gated DeltaNet + 1 gated full attention; partial mrope"),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", dict(
        COMMON, layer_types=HYBRID, num_experts=4, shared_expert_intermediate_size=32, **MOE, **GDN),
        "qwen3_5_moe_text / Qwen3_5MoeForCausalLM: as qwen3_5, with MoE plus a shared expert"),
    "qwen3_5_multimodal": Family("Qwen3_5Config", dict(
        text_config=dict(COMMON, layer_types=HYBRID, **GDN), vision_config=VISION, tie_word_embeddings=False),
        "qwen3_5 / Qwen3_5ForConditionalGeneration (the released checkpoints' class): as qwen3_5, decoder under "
        "model.language_model, a 1-block vision tower", AutoModelForImageTextToText),
    "qwen3_5_moe_multimodal": Family("Qwen3_5MoeConfig", dict(text_config=dict(
        COMMON, layer_types=HYBRID, num_experts=4, shared_expert_intermediate_size=32, **MOE, **GDN),
        vision_config=VISION, tie_word_embeddings=False),
        "qwen3_5_moe / Qwen3_5MoeForConditionalGeneration: as qwen3_5_moe, decoder under model.language_model",
        AutoModelForImageTextToText),
    "qwen3_next": Family("Qwen3NextConfig", dict(
        COMMON, layer_types=HYBRID, num_experts=4, shared_expert_intermediate_size=32, **MOE, **GDN),
        "qwen3_next / Qwen3NextForCausalLM: 3 Gated DeltaNet + 1 gated full attention; MoE plus a shared expert"),
    "gpt_oss": Family("GptOssConfig", dict(
        COMMON, layer_types=ALTERNATING, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        "gpt_oss / GptOssForCausalLM: sliding (16) and full attention alternating, attention sinks, yarn rope, MoE; "
        "eager (no sdpa: sdpa has no sinks)"),
    "gemma3": Family("Gemma3TextConfig", dict(
        COMMON, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=WINDOW,
        query_pre_attn_scalar=32),
        "gemma3_text / Gemma3ForCausalLM: 3 sliding (16) + 1 full attention, a rope per layer kind, "
        "scaling 32**-0.5 (query_pre_attn_scalar, not head_dim), scaled embeddings"),
    "gemma3_multimodal": Family("Gemma3Config", dict(
        text_config=dict(COMMON, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=WINDOW,
                         query_pre_attn_scalar=32),
        vision_config=VISION_PATCHES, mm_tokens_per_image=4, tie_word_embeddings=False),
        "gemma3 / Gemma3ForConditionalGeneration (the 4B-27B checkpoints' class): as gemma3, decoder under "
        "model.language_model, a 1-layer vision tower", AutoModelForImageTextToText),
    "gemma2": Family("Gemma2Config", dict(
        COMMON, layer_types=ALTERNATING, sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=2.0),
        "gemma2 / Gemma2ForCausalLM: sliding (16) and full attention alternating, attention-logit softcap 2, "
        "query_pre_attn_scalar 32; eager (no sdpa: sdpa has no softcap)"),
    "mistral": Family("MistralConfig", dict(COMMON, sliding_window=WINDOW),
                      "mistral / MistralForCausalLM: sliding-window (16) attention on every layer"),
    "mixtral": Family("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
                      "mixtral / MixtralForCausalLM: full attention; MoE on every layer"),
    "deepseek_v3": Family("DeepseekV3Config", dict(
        MLA_COMMON, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, **MOE,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        "deepseek_v3 / DeepseekV3ForCausalLM (also Kimi K2): MLA, q/k head dim 24 and v head dim 16, interleaved "
        "rope, yarn mscale in the scaling; dense layer 0 then group-limited MoE with a shared expert"),
    "glm4_moe": Family("Glm4MoeConfig", dict(
        COMMON, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
        attention_bias=True, **MOE),
        "glm4_moe / Glm4MoeForCausalLM: full attention with qkv bias, q/k norm, half-width rope; dense layer 0 "
        "then MoE with a shared expert"),
    "minimax_m2": Family("MiniMaxM2Config", dict(COMMON, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
                         "minimax_m2 / MiniMaxM2ForCausalLM: full attention, q/k norm over all heads, half-width "
                         "rope; MoE on every layer"),
    "minimax": Family("MiniMaxConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2, block_size=WINDOW),
                      "minimax / MiniMaxForCausalLM (MiniMax-Text-01): full and lightning attention alternating, "
                      "16-token lightning blocks; MoE on every layer"),
    "phi3": Family("Phi3Config", dict(COMMON, sliding_window=WINDOW),
                   "phi3 / Phi3ForCausalLM: fused qkv, sliding-window (16) attention on every layer"),
    "olmo3": Family("Olmo3Config", dict(COMMON, sliding_window=WINDOW),
                    "olmo3 / Olmo3ForCausalLM: 3 sliding (16) + 1 full attention, q/k norm over all heads"),
    "nemotron_h": Family("NemotronHConfig", dict(
        COMMON, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=WINDOW, n_routed_experts=4,
        moe_shared_expert_intermediate_size=32, **MOE),
        "nemotron_h / NemotronHForCausalLM: one block each of Mamba2 (16-token chunks), MoE, NoPE full attention "
        "and MLP"),
    "granite4": Family("GraniteMoeHybridConfig", dict(
        COMMON, intermediate_size=32, layer_types=HYBRID, position_embedding_type="nope", mamba_n_heads=4,
        mamba_d_state=16, mamba_chunk_size=WINDOW, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=128, attention_multiplier=1 / 16, embedding_multiplier=12.0,
        residual_multiplier=0.22, logits_scaling=6.0),
        "granitemoehybrid / GraniteMoeHybridForCausalLM (Granite 4.0-H): 3 Mamba2 (16-token chunks) + 1 NoPE full "
        "attention, scaling 1/16 (attention_multiplier), embedding and residual multipliers; MoE plus shared MLP"),
    "lfm2": Family("Lfm2Config", dict(
        COMMON, layer_types=["conv", "conv", "full_attention", "conv"], block_auto_adjust_ff_dim=False),
        "lfm2 / Lfm2ForCausalLM: 3 gated short-conv (kernel 3) + 1 full attention with q/k norm"),
    # -- the newest families: length-dependent rope, sparse attention, multi-stream residuals, sublayer counts
    "phi3_longrope": Family("Phi3Config", dict(
        COMMON, original_max_position_embeddings=LIMIT, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[16.0] * 8,
            original_max_position_embeddings=LIMIT)),
        "phi3 / Phi3ForCausalLM with longrope (Phi-3.5-mini, Phi-4-mini): long factors for a whole forward once a "
        "position passes 64 (original_max_position_embeddings)"),
    "llama_dynamic": Family("LlamaConfig", dict(
        COMMON, max_position_embeddings=LIMIT, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                                                    factor=4.0)),
        "llama / LlamaForCausalLM with dynamic NTK rope: the base rescaled to the forward's longest row past 64 "
        "positions, kept for later forwards"),
    "deepseek_v32": Family("DeepseekV32Config", DSA,
                           "deepseek_v32 / DeepseekV32ForCausalLM (DeepSeek-V3.2): MLA with a lightning indexer "
                           "picking 16 keys per query (sparse past 16 tokens)"),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", DSA,
                          "glm_moe_dsa / GlmMoeDsaForCausalLM (GLM-5): as deepseek_v32, indexers on alternate layers"),
    "minimax_m3": Family("MiniMaxM3VLTextConfig", dict(
        COMMON, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3,
        mlp_layer_types=["dense"] + ["sparse"] * 3, index_n_heads=2, index_head_dim=16, index_block_size=8,
        index_topk_blocks=2, index_local_blocks=1,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5)),
        "minimax_m3_vl_text / MiniMaxM3VLForCausalLM (MiniMax-M3's text decoder): 3 block-sparse layers picking 2 "
        "blocks of 8 keys per query (sparse past 16 tokens) + 1 full attention; MoE"),
    "deepseek_v4": Family("DeepseekV4Config", dict(
        {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}, num_key_value_heads=1,
        partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
        n_shared_experts=1, **MOE, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                  "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=WINDOW,
        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20),
        "deepseek_v4 / DeepseekV4ForCausalLM: hyper-connections (4 residual streams, [B, S, 4, D] between layers, "
        "a learned head contracts them), sliding, compressed-sparse and heavily compressed attention; hash MoE"),
    "qwen4_exp": Family("Qwen4ExpTextConfig", dict(
        COMMON, layer_types=["linear_attention"] * 3 + ["indexed_attention"], **GDN, num_experts=4,
        shared_expert_intermediate_size=32, **MOE, hc_count=4, hc_lowrank=16, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1], mrope_interleaved=True)),
        "qwen4_exp_text / Qwen4ExpForCausalLM: hyper-connections (4 streams flattened, [B, S, 4 * D]; a gated mixer, "
        "no final norm), 3 Gated DeltaNet + 1 indexed sparse attention; MoE"),
    "glm5_next": Family("Glm5NextConfig", dict(
        text_config=dict({k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
                         num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=0, v_head_dim=16,
                         layer_types=["linear_attention", "indexed_attention"] * 2,
                         mlp_layer_types=["dense"] + ["sparse"] * 3, n_routed_experts=4, n_shared_experts=1, **MOE,
                         n_group=1, topk_group=1, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                         index_n_heads=16, index_head_dim=16, index_topk=256, index_kpool=4, hc_mult=4),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, image_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           projection_intermediate_size=64),
        image_token_id=49150, video_token_id=49151, image_start_token_id=49146, image_end_token_id=49147,
        video_start_token_id=49148, video_end_token_id=49149, tie_word_embeddings=False),
        "glm5_next / Glm5NextForConditionalGeneration (no causal LM class: loaded as image-text-to-text, its text "
        "decoder run): hyper-connections (4 streams, a mean contracts them), linear attention + indexed attention",
        AutoModelForImageTextToText),
    "gemma3n": Family("Gemma3nTextConfig", dict(
        COMMON, vocab_size_per_layer_input=49152, hidden_size_per_layer_input=16, laurel_rank=8,
        altup_num_inputs=4, altup_active_idx=0, altup_correct_scale=True,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW, num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0]),
        "gemma3n_text / Gemma3nForCausalLM: AltUp (4 streams, [4, B, S, D] between layers), per-layer inputs, "
        "sliding (16) and full attention, KV shared by the last 2 layers"),
    "gemma4": Family("Gemma4TextConfig", dict(
        COMMON, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        vocab_size_per_layer_input=49152, hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW, num_kv_shared_layers=2),
        "gemma4_text / Gemma4ForCausalLM: settings per layer (its full-attention layers' head size 32 and 1 key-value "
        "head, read per layer: transformers refuses them globally), per-layer inputs, sliding (16) and full "
        "attention, KV shared by the last 2 layers"),
    "kimi_k25": Family("Kimi_K25Config", dict(
        text_config=dict(MLA_COMMON, model_type="deepseek_v3", n_routed_experts=4, n_shared_experts=1, n_group=1,
                         topk_group=1, first_k_dense_replace=1, **MOE, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           pos_emb_height=8, pos_emb_width=8),
        projection_hidden_size=32, tie_word_embeddings=False),
        "kimi_k25 / Kimi_K25ForConditionalGeneration (no causal LM class: loaded as image-text-to-text, its "
        "DeepSeek-V3 text decoder run): MLA, group-limited MoE with a shared expert; a 1-layer vision tower",
        AutoModelForImageTextToText),
    "longcat_flash": Family("LongcatFlashConfig", dict(
        {k: v for k, v in COMMON.items() if k not in ("num_hidden_layers", "head_dim", "num_key_value_heads",
                                                       "intermediate_size")},
        num_layers=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, ffn_hidden_size=128, expert_ffn_hidden_size=32,
        n_routed_experts=4, moe_topk=2, zero_expert_num=2, routed_scaling_factor=6.0),
        "longcat_flash / LongcatFlashForCausalLM: 4 decoder layers of two MLA sublayers each (its config's "
        "num_hidden_layers counts the 8 sublayers); MoE with zero experts"),
}


def _config(config_class: str, kwargs: dict[str, Any]) -> PreTrainedConfig:
    # a copy: the config keeps the nested dicts (rope_parameters, ...), which a test may edit
    return getattr(transformers, config_class)(**copy.deepcopy(kwargs))


FAMILIES: dict[str, Callable[[], PreTrainedConfig]] = {
    name: partial(_config, family.config_class, family.kwargs) for name, family in _ZOO.items()
}
FAMILY_NOTES: dict[str, str] = {name: family.notes for name, family in _ZOO.items()}
# families this transformers cannot build, with the reason (every family builds with transformers 5.25)
UNBUILDABLE: dict[str, str] = {
    name: f"transformers {transformers.__version__} has no {family.config_class}"
    for name, family in _ZOO.items() if not hasattr(transformers, family.config_class)
}


def _long_memory(model: PreTrainedModel) -> None:
    """Per-token decays of 0.93-0.99 for the Mamba2 and Gated DeltaNet heads (exp(-A * softplus(dt_bias)) with A
    0.01-0.1 and dt_bias 0): as initialised they forget within a few tokens, which would hide a state carried wrongly
    across a chunk or from one row into the next."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.linspace(0.01, 0.1, module.A_log.numel()).log())
                module.dt_bias.zero_()


def _decisive_routers(model: PreTrainedModel) -> None:
    """MoE routers' weights (4 experts) 10x larger: as drawn, two experts' scores often lie within bf16 rounding of
    each other, and a row computed in another batch may then take another expert (the model's own rounding, not a
    fault of the path under test) and differ by O(1) on that token."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and parameter.shape[0] == 4:
                parameter.mul_(10)


def zoo_config(name: str) -> PreTrainedConfig:
    return FAMILIES[name]()


def zoo_model(name: str, seed: int = 0, vocab_size: int | None = None, dense: bool = False) -> PreTrainedModel:
    """The family's tiny model: float32, eval mode, weights drawn after torch.manual_seed(seed); `vocab_size` for
    another tokenizer than SmolLM2's; `dense`: dense MLPs where the family's config allows (Llama 4, DeepSeek-V3),
    since in bf16 a row computed in another batch may take another of the 4 experts (the model's own rounding)."""
    config = zoo_config(name)
    text = config.get_text_config()
    if vocab_size is not None:
        text.vocab_size = vocab_size
    if dense:
        for moe_from in ("interleave_moe_layer_step", "first_k_dense_replace"):
            if hasattr(text, moe_from):
                setattr(text, moe_from, text.num_hidden_layers + 1)
        if hasattr(text, "moe_layers"):  # (Llama 4 lists them from the step when built)
            text.moe_layers = []
    torch.manual_seed(seed)
    model = _ZOO[name].auto_class.from_config(config, dtype=torch.float32)
    _long_memory(model)
    _decisive_routers(model)
    return model.eval()
