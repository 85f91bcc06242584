"""One run configuration: defaults < configs/*.yaml < CLI flags. Saved into every store."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

LAYER_PRESETS = ("eagle3", "dflash")
TRUNCATION_POLICIES = ("truncate", "skip")
KERNELS = ("auto", "torch", "triton")
COMPRESSORS = ("none", "zstd")


@dataclass
class RunConfig:
    # what to run
    model: str = "smollm2-135m-instruct"
    data: str = "chatterbot:english"
    split: str = "train"
    max_samples: int | None = None
    layers: str = "eagle3"  # a preset (eagle3, dflash) or comma-separated layer ids, e.g. "2,15,27,30"
    out: str = "streamx-out/store.zarr"
    overwrite: bool = False
    random_weights: bool = False  # build the model from its config with random weights: dry runs and benchmarks
    tokenizer: str | None = None  # tokenizer hub id or directory, when not the model's own
    # model execution
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available (this process's GPU under torchrun)
    device_map: str | None = None  # e.g. "auto": split a model larger than one GPU (accelerate)
    attn_implementation: str | None = None  # transformers' default when unset
    kernel: str = "auto"  # pack path: auto (triton on CUDA), torch, triton
    # tokenization
    max_length: int = 4096
    truncation: str = "truncate"  # truncate: cut to max_length; skip: reject longer rows
    # batching
    token_budget: int = 4096  # max padded tokens (batch x longest) per forward
    max_batch_size: int = 256
    sort_window: int = 1024  # consecutive source rows sorted by length together; larger = less padding, more memory
    queue_batches: int = 4  # bounded hand-off queues between stages
    # storage
    chunk_tokens: int = 0  # 0: about 4 MiB of hidden states per chunk
    shard_tokens: int = 0  # 0: about 256 MiB per shard file (many chunks each)
    compressor: str = "none"  # bf16 activations barely compress; zstd costs writer CPU
    # safety
    max_reject_fraction: float = 0.5  # stop when more rows than this are rejected (after 100 rows)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def choose(name: str, value: Any, choices: tuple) -> None:
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")

        choose("truncation", self.truncation, TRUNCATION_POLICIES)
        choose("kernel", self.kernel, KERNELS)
        choose("compressor", self.compressor, COMPRESSORS)
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
    """Defaults, then the YAML file (configs/default.yaml when none is given), then overrides.

    Overrides whose value is None are ignored, so CLI flags left unset keep the file's value."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    values: dict[str, Any] = {}
    if path.exists():
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config fields")
    elif path != DEFAULT_CONFIG:
        raise FileNotFoundError(f"config file not found: {path}")
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
        if not ids:
            raise ValueError("--layers is empty")
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate layer ids {dup}; valid ids are 0..{L} for this {L}-layer model")
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise ValueError(
            f"layer ids {bad} out of range: valid ids are 0..{L} for this {L}-layer model "
            f"(0 = embeddings, k = output of layer k-1, {L} = last layer before the final norm)"
        )
    return sorted(set(ids))
