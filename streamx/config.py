"""One run configuration: defaults < a configs/*.yaml file < CLI flags. Saved into every store.

Every setting is declared once, here, with its type and help: the CLI's options are generated from
these fields (streamx.cli), and a choice typed as a Literal is validated and listed by the CLI too.
The defaults are the embedded default run; configs/default.yaml spells them out (a test keeps the
two equal), so `--config configs/default.yaml` and no --config at all run the same."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

LAYER_PRESETS = ("eagle3", "dflash")
Truncation = Literal["truncate", "skip"]
Kernel = Literal["auto", "torch", "triton"]
Compressor = Literal["none", "zstd", "shuffle-lz4", "shuffle-zstd", "bitshuffle-lz4", "bitshuffle-zstd"]
StorageName = Literal["bf16", "fp8"]
PackingSetting = Literal["on", "off"]


def setting(default: Any, help: str) -> Any:
    """A RunConfig field and its help, declared once: the CLI's options are generated from these."""
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    # what to run
    model: str = setting("smollm2-135m-instruct", "Hub id, local HF directory, or 'smollm2-135m-instruct' (the "
                         "embedded default, shipped by a pip package).")
    data: str = setting("chatterbot:english", "A .jsonl/.json/.parquet/.arrow file, a save_to_disk directory, a "
                        "datasets hub name, or 'chatterbot:english' (the embedded default).")
    split: str = setting("train", "Dataset split (datasets names and directories).")
    max_samples: int | None = setting(None, "Use only the first N rows of the source.")
    layers: str = setting("eagle3", "Layer ids, e.g. '2,15,27,30', or a preset: eagle3 = [2, L//2, L-3, L], dflash = "
                          "5 spread ids + L. Id 0 = embeddings, id k = output of layer k-1, id L = the last layer's "
                          "output before the final norm.")
    out: str = setting("streamx-out/store.zarr", "Store path (a local .zarr folder or s3://...). An existing "
                       "compatible store is resumed.")
    overwrite: bool = setting(False, "Delete an existing store at --out and start over.")
    random_weights: bool = setting(False, "Build the model from its config (a hub id, a folder with config.json, or "
                                   "a config .json file) with random weights, on the device, reading no weights: dry "
                                   "runs and benchmarks. Stores say so; convert refuses them.")
    tokenizer: str | None = setting(None, "Tokenizer hub id or folder, when not the model's own (needed with "
                                    "--random-weights from a config file).")
    # model execution
    dtype: str = setting("auto", "Compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, "
                         "float16.")
    device: str = setting("auto", "auto (CUDA when present; this process's GPU under torchrun), cpu, cuda, cuda:N.")
    device_map: str | None = setting(None, "Split a model larger than one GPU over the visible GPUs, e.g. auto or "
                                     "balanced (accelerate).")
    attn_implementation: str | None = setting(None, "transformers attention implementation (sdpa, eager, "
                                              "flash_attention_2, ...); transformers' default when unset.")
    kernel: Kernel = setting("auto", "The gather of each layer's real tokens: auto (Triton on CUDA, torch "
                             "elsewhere), torch, triton.")
    # tokenization
    max_length: int = setting(2048, "Maximum tokens per sample.")
    truncation: Truncation = setting("truncate", "Longer samples: truncate (cut to --max-length) or skip (reject "
                                     "as too_long).")
    skip_duplicates: bool = setting(False, "Leave out rows whose content (messages, text or input_ids) repeats an "
                                    "earlier row's exactly, as rejects (duplicate_content): repeats cost compute and "
                                    "disk and weight training. Counted either way.")
    # batching
    token_budget: int = setting(4096, "Max tokens per forward pass: real tokens when packed, batch x longest when "
                                "padded.")
    packing: PackingSetting = setting("on", "on: the samples of a forward pass side by side in one sequence, no "
                                      "padding, where a check at start proves this model keeps them apart (else "
                                      "padded batches, with the reason logged); off: right-padded batches.")
    max_batch_size: int = setting(256, "Max samples per forward pass.")
    sort_window: int = setting(1024, "Consecutive source rows sorted by length together before batching (more: "
                               "less padding, more host memory).")
    queue_batches: int = setting(4, "Batches each bounded hand-off queue between stages holds.")
    # storage
    chunk_tokens: int = setting(0, "Tokens per Zarr chunk, the unit a reader fetches (0: about 4 MiB of states).")
    shard_tokens: int = setting(0, "Tokens per shard file, a multiple of --chunk-tokens (0: about 256 MiB).")
    compressor: Compressor = setting("none", "Lossless hidden-state compressor, through zarr's codecs: bf16 "
                                     "activations save 17-19% at best, at 7-14x the writer's CPU and zarr's slower "
                                     "write path (bench/RESULTS.md, \"Lossless codecs\").")
    storage: StorageName = setting("bf16", "Hidden-state storage: bf16 (exact) or fp8 (float8_e4m3fn with one "
                                   "float32 scale per token, speculators' fp8 format: half the bytes, quantised on "
                                   "the model's device).")
    # safety
    space_check: bool = setting(True, "Refuse to start when the output filesystem has less free space than the "
                                "estimated store, and stop cleanly when it nearly fills up.")
    max_reject_fraction: float = setting(0.5, "Stop when more than this fraction of rows is rejected (checked after "
                                         "100 rows).")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        hints = get_type_hints(RunConfig)
        for f in fields(self):  # the Literal settings, for configs from YAML and Python (the CLI checks them too)
            choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else None
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        for name in ("max_length", "token_budget", "max_batch_size", "sort_window", "queue_batches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("chunk_tokens", "shard_tokens"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError(f"max_samples must be >= 0; got {self.max_samples}")
        if not 0.0 < self.max_reject_fraction <= 1.0:
            raise ValueError(f"max_reject_fraction must be in (0, 1]; got {self.max_reject_fraction}")
        if self.token_budget < self.max_length:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be >= max_length ({self.max_length}) "
                "so that the longest sample fits in one batch"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


def load_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    """The defaults, then the YAML file when one is given, then overrides.

    Overrides whose value is None are ignored, so CLI flags left unset keep the file's value."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config fields")
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if isinstance(values.get("layers"), list):
        values["layers"] = ",".join(str(i) for i in values["layers"])
    return RunConfig(**values)


def resolve_layer_ids(layers: str, num_layers: int) -> list[int]:
    """Layer ids in the speculators convention (docs/layers.md): id 0 = embeddings output,
    id k = output of layer k-1, id L = output of the last layer before the final norm."""
    L = num_layers
    if layers == "eagle3":
        ids = [2, L // 2, L - 3, L]
    elif layers == "dflash":
        # z-lab DFlash spaces 5 layers over 1..L-3 in "output of layer i" numbering; ours is i+1.
        ids = [round(1 + (L - 4) * j / 4) + 1 for j in range(5)] + [L]
    else:
        try:
            ids = [int(part) for part in str(layers).replace(" ", "").split(",") if part]
        except ValueError:
            raise ValueError(
                f"--layers must be a preset ({', '.join(LAYER_PRESETS)}) or comma-separated integers; got {layers!r}"
            ) from None
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate layer ids {dup}; valid ids are 0..{L} for this {L}-layer model")
    return check_layer_ids(sorted(set(ids)), L)  # a preset's ids meet on small models (eagle3 on L=4: 2, 2)


def check_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """The one check of a layer id list, wherever ids arrive (settings, capture, a store being
    converted): not empty, ascending without duplicates (slot j holds ids[j]), each in 0..L."""
    L = num_layers
    if not ids:
        raise ValueError("no layer ids: --layers is empty")
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise ValueError(
            f"layer ids {bad} out of range: valid ids are 0..{L} for this {L}-layer model "
            f"(0 = embeddings, k = output of layer k-1, {L} = last layer before the final norm)"
        )
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"layer ids must be ascending without duplicates; got {list(ids)}")
    return list(ids)
