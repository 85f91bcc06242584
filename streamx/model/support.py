"""What streamx does with each model family by default, in one table: packed or padded batches, shared prefixes
continued or prefix rows only, and why.

Every row is what the test zoo (tests/test_zoo.py) ran: a tiny random-weight model of the family, built from its
transformers config, run with the default settings on rows longer than its windows and chunks, every row compared
with the model's own forward of it alone. At run time the start-up check (streamx.proof.check) decides, on the
loaded model, and the log names the family's row (or says that the family is not in the table, and the check alone
decides). docs/support.md is this table (`markdown`; tests/test_zoo.py checks that it is up to date).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    """A family's row: what its checkpoints' config names it, and what a run does with it by default."""

    family: str  # as users name it
    model_type: str  # transformers' model_type of the checkpoint's config
    packed: bool  # packed batches (else padded)
    continued: bool  # rows continue a shared prefix's state (else only prefix rows and duplicates are shared)
    how: str  # what its layers ask and how streamx does it, or why it falls back
    alone: bool = False  # one row per forward (no batching gives its rows their own forward's states)
    prefix_rows: bool = True  # a row that is a prefix of another is served from it (else its states depend on its
    # length: every row computed in full)

    @property
    def path(self) -> str:
        shared = "prefix rows shared" if self.prefix_rows else "nothing shared"
        if self.alone:
            return f"one row per forward, {shared}"
        if not self.packed:
            return f"padded, {shared}"
        return "packed and shared" if self.continued else "packed, prefix rows shared"


PLAIN = "causal attention"
WINDOWS = "sliding windows per layer (a window on the CPU and in shared prefixes' keys, flash's window_size on CUDA)"
GDN = ("gated delta-net layers kept apart per row (run row by row where transformers' kernels would mix rows), a "
       "shared prefix's conv and recurrent state handed over")
MAMBA = "Mamba2 layers run row by row, a shared prefix's conv and SSM state handed over"
DSA = ("sparse attention: an indexer picks the top-k keys per query from a padding mask that packed rows lack: "
       "padded batches, probed past index_topk")
HYPER = ("hyper-connections: several residual streams, stored whole at every id (streams x hidden values per token, "
         "as the model's own output_hidden_states holds them; id L before their contraction)")

SUPPORT: tuple[Support, ...] = (
    Support("Llama 3", "llama", True, True,
            f"{PLAIN}; a checkpoint with dynamic NTK rope (rope_type dynamic: the base rescaled to the forward's "
            "longest row past max_position_embeddings, "
            "and kept for later forwards): rows up to that length never share a forward or a prefix with longer ones, "
            "which run each in a forward of its own from the original scale"),
    Support("Llama 4 (text)", "llama4_text", True, True,
            "chunked attention (each query within its chunk of positions, counted from the row's start); the no-rope "
            "layers' attention temperature from each token's own position, not its place in the batch"),
    Support("Llama 4 (multimodal checkpoint)", "llama4", True, True, "as Llama 4 (text): loaded as Llama4ForCausalLM"),
    Support("Qwen3", "qwen3", True, True, PLAIN),
    Support("Qwen3-MoE", "qwen3_moe", True, True, PLAIN),
    Support("Qwen3.5 / 3.6 (text)", "qwen3_5_text", True, True, GDN),
    Support("Qwen3.5 / 3.6 (multimodal checkpoint)", "qwen3_5", True, True,
            f"{GDN}; decoder under model.language_model"),
    Support("Qwen3.5 / 3.6 MoE (text)", "qwen3_5_moe_text", True, True, GDN),
    Support("Qwen3.5 / 3.6 MoE (multimodal checkpoint)", "qwen3_5_moe", True, True,
            f"{GDN}; decoder under model.language_model"),
    Support("Qwen3-Next", "qwen3_next", True, True, GDN),
    Support("gpt-oss", "gpt_oss", True, True, f"{WINDOWS}; attention sinks (a logit per head in every softmax)"),
    Support("Gemma 3 (text)", "gemma3_text", True, True, WINDOWS),
    Support("Gemma 3 (multimodal checkpoint)", "gemma3", True, True, f"{WINDOWS}; decoder under model.language_model"),
    Support("Gemma 2", "gemma2", True, True,
            f"{WINDOWS}; logit soft-capping (computed as eager attention does, a block of queries at a time)"),
    Support("Mistral", "mistral", True, True, WINDOWS),
    Support("Mixtral", "mixtral", True, True, PLAIN),
    Support("DeepSeek-V3 / R1, Kimi K2", "deepseek_v3", True, True,
            "MLA: value heads narrower than query and key heads (padded for the fused kernels)"),
    Support("Kimi K2.5 (multimodal checkpoint)", "kimi_k25", True, True,
            "as DeepSeek-V3 (MLA); no causal LM class in transformers: loaded as image-text-to-text, its text decoder "
            "run"),
    Support("GLM-4.5 / 4.6", "glm4_moe", True, True, PLAIN),
    Support("MiniMax-M2", "minimax_m2", True, True, PLAIN),
    Support("MiniMax-Text-01", "minimax", False, False,
            "its lightning-attention layers mix packed rows, and streamx does not run them row by row"),
    Support("Phi-3 / Phi-3.5 / Phi-4-mini", "phi3", True, True,
            f"{WINDOWS}; longrope (long factors for a whole forward once a position passes "
            "original_max_position_embeddings): rows up to that length never share a forward or a prefix with longer "
            "ones, which are batched among themselves"),
    Support("Olmo 3", "olmo3", True, True, WINDOWS),
    Support("Nemotron-H", "nemotron_h", True, True, MAMBA),
    Support("Granite 4.0-H", "granitemoehybrid", True, True, MAMBA),
    Support("LFM2", "lfm2", True, True, "short-convolution layers run row by row, a shared prefix's conv state handed "
            "over"),
    Support("DeepSeek-V3.2", "deepseek_v32", False, False,
            f"{DSA}; MLA"),
    Support("GLM-5", "glm_moe_dsa", False, False, DSA),
    Support("MiniMax-M3 (text decoder)", "minimax_m3_vl_text", False, False,
            "block-sparse attention (an indexer picks blocks of keys per query from the row's own positions, which "
            "packed rows restart): padded batches, where the packed attention refuses the blocks it would not pick"),
    Support("DeepSeek-V4", "deepseek_v4", False, False,
            f"{HYPER} (a learned head contracts them); compressed attention pools the row's blocks, so packed and "
            "padded rows differ from their own forward and a prefix's states depend on the row's length: every row in "
            "a forward of its own, in full", alone=True, prefix_rows=False),
    Support("Qwen4-exp (text)", "qwen4_exp_text", False, False,
            f"{HYPER} (a gated mixer contracts them; no final norm); gated delta-net and indexed sparse attention, "
            "which packed rows' segments do not reach: padded batches"),
    Support("GLM-5-next (multimodal checkpoint)", "glm5_next", False, False,
            f"{HYPER} (their mean is normed); linear and indexed attention reading a 2-D padding mask: padded batches; "
            "no causal LM class in transformers: loaded as image-text-to-text, its text decoder run"),
    Support("Gemma 3n (text)", "gemma3n_text", True, True,
            f"AltUp: {HYPER.removeprefix('hyper-connections: ')} ([streams, B, S, D] between layers; projections and a "
            f"mean contract them); {WINDOWS}"),
    Support("Gemma 4 (text)", "gemma4_text", True, True,
            f"settings per layer (the full-attention layers' head size and key-value heads: read per layer, where the "
            f"global config refuses them); per-layer inputs; {WINDOWS}; keys and values shared by the last layers"),
    Support("LongCat-Flash", "longcat_flash", True, True,
            "MLA, two attention sublayers per decoder layer (its config's num_hidden_layers counts the sublayers: L "
            "is the model's decoder layers)"),
)


# --tp: the families whose TP 2 run tests/test_tensor_parallel.py compares with one process (dense, MoE, the gated
# delta-net hybrid); every family of the table has a tensor-parallel plan in transformers (tests/test_zoo.py)
TP_TESTED = ("llama", "qwen3_moe", "qwen3_5_text")


# what a TP 2 run of the family showed transformers' plan does, where it is not what --tp is for
TP_MEASURED = {"gpt_oss": "TP 2 runs, but transformers' plan splits only its embeddings and head: its attention (and "
                          "experts, without --ep) whole on every process (measured; the run's `tp` line says so)"}

# quantized checkpoints of the family made in the format of its releases, run on the CPU (dequantized), every stored
# state compared with transformers' own forward of the checkpoint (tests/test_quantized.py)
QUANTIZED_TESTED = {
    "qwen3_moe": "FP8 blocks (Qwen3 FP8): the states of its stored values (tested)",
    "gpt_oss": "MXFP4 experts: the states of its stored values (tested)",
    "deepseek_v3": "FP8 blocks: refused where dequantized (kv_a_proj_with_mqa's partial block, which transformers "
                   "misplaces); kept as FP8 on a GPU: not tested here",
}


def tensor_parallel(support: Support) -> str:
    """Its --tp column."""
    if support.model_type in TP_MEASURED:
        return TP_MEASURED[support.model_type]
    return "TP 2 = one process (tested)" if support.model_type in TP_TESTED else "transformers' plan; not tested here"


def quantized(support: Support) -> str:
    """Its quantized column."""
    return QUANTIZED_TESTED.get(support.model_type, "as transformers loads it; not tested here")


def support_of(config) -> Support | None:
    """The row of a model's config: its model_type (a multimodal checkpoint's), else its text config's."""
    for model_type in (config.model_type, config.get_text_config().model_type):
        found = next((s for s in SUPPORT if s.model_type == model_type), None)
        if found is not None:
            return found
    return None


def note(config, packed: bool, continued: bool, alone: bool = False, prefix_rows: bool = True,
         run_as: str | None = None) -> str:
    """The run's log line: the checkpoint's (`config`) row of the table, and whether the start-up check on this model
    agrees; `run_as`: the class streamx runs where the checkpoint's own is another (a multimodal checkpoint's text
    decoder)."""
    support = support_of(config)
    run = f", its text decoder run as {run_as}" if run_as else ""
    if support is None:
        return (f"{config.model_type}{run}: not in streamx's support table (docs/support.md); the start-up check on "
                "this model decided the path above")
    said = f"{support.family} ({support.model_type}{run}): {support.path} in the support table (docs/support.md)"
    if (packed, continued, alone, prefix_rows) == (support.packed, support.continued, support.alone,
                                                   support.prefix_rows):
        return f"{said}, as the start-up check found on this model"
    return f"{said}, but the start-up check on this model found otherwise (above): the run takes the path it proved"


def markdown() -> str:
    """The table as docs/support.md holds it."""
    lines = ["| family | model_type | default path | --tp | quantized checkpoints | what its layers ask, and how |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {s.family} | `{s.model_type}` | {s.path} | {tensor_parallel(s)} | {quantized(s)} | {s.how} |"
              for s in SUPPORT]
    return "\n".join(lines) + "\n"
