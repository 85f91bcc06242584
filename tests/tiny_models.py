"""Tiny random models of each architecture family the capture code supports (no weights needed)."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_config(family: str, num_layers: int = 4):
    if family == "llama":
        return LlamaConfig(num_hidden_layers=num_layers, **COMMON)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=num_layers, **COMMON)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_hidden_layers=num_layers, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, decoder_sparse_step=1, **COMMON)
    if family == "qwen3_5":  # hybrid: Gated DeltaNet linear attention mixed with full attention
        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (num_layers // 4)
        return Qwen3_5TextConfig(num_hidden_layers=num_layers, layer_types=types, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_conv_kernel_dim=4, **COMMON)
    raise ValueError(family)


def tiny_model(family: str, num_layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_layers), dtype=torch.float32)
    return model.eval()
