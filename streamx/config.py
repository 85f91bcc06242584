"""One run configuration: defaults < a configs/*.yaml file < CLI flags. Saved into every store.

Every setting is declared once, here, with its type and help: the CLI's options are generated from
these fields (streamx.cli), and a choice typed as a Literal is validated and listed by the CLI too.
The defaults are the embedded default run; configs/default.yaml spells them out (a test keeps the
two equal), so `--config configs/default.yaml` and no --config at all run the same. `streamx regenerate`
has its own settings, RegenerateConfig, declared the same way (configs/regenerate.yaml)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

LAYER_PRESETS = ("eagle3", "dflash")
Truncation = Literal["truncate", "skip"]
Kernel = Literal["auto", "torch", "triton"]
Compressor = Literal["none", "zstd", "shuffle-lz4", "shuffle-zstd", "bitshuffle-lz4", "bitshuffle-zstd"]
StorageName = Literal["bf16", "fp8"]
PackingSetting = Literal["on", "off"]
SharingSetting = Literal["on", "rows", "off"]
Thinking = Literal["auto", "on", "off"]
Reasoning = Literal["keep", "drop"]
TruncatedTurns = Literal["keep", "drop-turn", "drop-row"]
TrainTurns = Literal["all", "last"]


def check_choices(settings: Any) -> None:
    """The Literal-typed settings hold one of their choices, for configs from YAML and Python (the CLI checks
    them too)."""
    hints = get_type_hints(type(settings))
    for f in fields(settings):
        choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else None
        if choices and getattr(settings, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(settings, f.name)!r}")


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
    allow_partial: bool = setting(False, "Read an output of streamx regenerate that is not complete (its run "
                                  "stopped, or is still writing it): by default such a file is refused.")
    layers: str = setting("eagle3", "Layer ids, e.g. '2,15,27,30', or a preset: eagle3 = [2, L//2, L-3, L], dflash = "
                          "5 spread ids + L. Id 0 = embeddings, id k = output of layer k-1, id L = the last layer's "
                          "output before the final norm.")
    any_layers: bool = setting(False, "Extract layer ids that speculators cannot train from (without id L, the "
                               "verifier's last state, or with no id below it), for other uses of the states: by "
                               "default such a --layers is refused before anything runs.")
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
    dequantize: bool = setting(False, "Load a quantized checkpoint (FP8, MXFP4) dequantized to --dtype on a GPU too "
                               "(2-4x its weights' memory; the states then are those of its dequantized weights). On "
                               "the CPU it always is; on a GPU transformers keeps it as stored where it has kernels.")
    device_map: str | None = setting(None, "Split a model larger than one GPU over the visible GPUs, e.g. auto or "
                                     "balanced (accelerate).")
    tp: int = setting(1, "Tensor parallel: the model's linear layers sharded over N processes of a torchrun job "
                       "(transformers' tp_plan), for a target larger than one GPU at the speed of all of them; the "
                       "job's processes form WORLD_SIZE / N data-parallel groups, each taking its share of the rows "
                       "and writing its own part (docs/scaling.md).")
    ep: bool = setting(False, "With --tp N, expert parallel: a MoE target's experts spread whole over the group's "
                        "processes (transformers' expert-parallel plan: num_experts / N each) rather than every "
                        "expert split N ways; the other layers stay tensor parallel.")
    rank: int | None = setting(None, "This process's share of the rows where no torchrun starts the processes (a "
                               "Slurm job array, any scheduler): rank N of --world-size M, each process writing its "
                               "own part, the result bit for bit torchrun's. Unset: torchrun's RANK, else Slurm's "
                               "SLURM_ARRAY_TASK_ID (from SLURM_ARRAY_TASK_MIN, by its step), else 0.")
    world_size: int | None = setting(None, "How many processes share the rows, with --rank. Unset: torchrun's "
                                     "WORLD_SIZE, else SLURM_ARRAY_TASK_COUNT, else 1.")
    attn_implementation: str | None = setting(None, "transformers attention implementation (sdpa, eager, "
                                              "flash_attention_2, ...); transformers' default when unset.")
    kernel: Kernel = setting("auto", "The gather of each layer's real tokens: auto (Triton on CUDA, torch "
                             "elsewhere), torch, triton.")
    # tokenization
    max_length: int = setting(2048, "Maximum tokens per sample.")
    truncation: Truncation = setting("truncate", "Longer samples: truncate (cut to --max-length) or skip (reject "
                                     "as too_long).")
    train_turns: TrainTurns = setting("all", "The assistant turns a chat row's loss mask trains: all, or last (only "
                                      "its last assistant message with content). Use last on fanned-out rows, one "
                                      "row per assistant turn with the whole history before it, especially on "
                                      "thinking templates (Qwen3, Qwen3.5) that render an earlier turn unlike the "
                                      "last: each turn is then trained once, as it was generated (docs/fanout.md). "
                                      "Text rows and pre-tokenized input_ids rows (with their own loss_mask) are "
                                      "unchanged.")
    skip_duplicates: bool = setting(False, "Leave out rows whose content (messages, text or input_ids) repeats an "
                                    "earlier row's exactly, as rejects (duplicate_content): repeats cost compute and "
                                    "disk and weight training. Counted either way.")
    # batching
    token_budget: int = setting(4096, "Max tokens per forward pass: real tokens when packed, batch x longest when "
                                "padded.")
    packing: PackingSetting = setting("on", "on: the samples of a forward pass side by side in one sequence, no "
                                      "padding, where a check at start proves this model keeps them apart (else "
                                      "padded batches, with the reason logged); off: right-padded batches.")
    sharing: SharingSetting = setting("on", "on: each token that rows share computed and stored once: a row that "
                                      "is a prefix of another row (duplicates too) is not computed, and, packed, a "
                                      "common leading run of --min-shared-tokens (system prompts, a shared history) "
                                      "is computed once and the rows continue from its state, where a check at start "
                                      "proves this model gives them their states alone (else only the prefix rows, "
                                      "with the reason logged). Found within each --sort-window, but for a row "
                                      "whose content repeats an earlier row's anywhere in the data: it is not "
                                      "computed and reads that row. Readers see whole rows either way. off: every "
                                      "row computed in full (the reference; stores written before streamx 0.5 resume "
                                      "with it). rows: only rows that repeat or are prefixes of others.")
    min_shared_tokens: int = setting(16, "The shortest common leading run of tokens that --sharing computes once.")
    max_batch_size: int = setting(256, "Max samples per forward pass (with --packing off, 1: each row in a forward "
                                  "of its own, the model's own forward).")
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
    audit_every: int = setting(512, "The in-run audit: rows of each way the run computes them (packed, continued "
                               "from a shared prefix, padded, ...), each at least twice as long as that way's longest "
                               "audited so far, the first past each length limit the model declares, and the row ids "
                               "that are multiples of N are computed again alone through the model's own forward and "
                               "compared token by token. A way found wrong is dropped for the rest of the run, the "
                               "batch computed again, and the rows committed that way computed again before the run "
                               "ends. 0: no audit.")
    audit_share: float = setting(0.01, "The in-run audit's forwards stay within this share of the run's forward time "
                                 "(plus a small start allowance); rows past it wait, and the run's summary, the store "
                                 "and verify say which ways and lengths went unaudited. 0: audit every row picked, "
                                 "whatever it costs.")
    space_check: bool = setting(True, "Refuse to start when the output filesystem has less free space than the "
                                "estimated store (off: start anyway; the run still stops cleanly, everything "
                                "committed, when the filesystem nearly fills up).")
    max_reject_fraction: float = setting(0.5, "Stop when more than this fraction of rows is rejected (checked after "
                                         "100 rows).")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_choices(self)
        for name in ("max_length", "token_budget", "max_batch_size", "sort_window", "queue_batches",
                     "min_shared_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("chunk_tokens", "shard_tokens", "audit_every"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if not 0.0 <= self.audit_share < 1.0:
            raise ValueError(f"audit_share must be in [0, 1); got {self.audit_share}")
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError(f"max_samples must be >= 0; got {self.max_samples}")
        if not 0.0 < self.max_reject_fraction <= 1.0:
            raise ValueError(f"max_reject_fraction must be in (0, 1]; got {self.max_reject_fraction}")
        if self.token_budget < self.max_length:
            raise ValueError(f"--token-budget ({self.token_budget}) must be >= --max-length ({self.max_length}), so "
                             f"that the longest sample fits in one forward pass: add --token-budget {self.max_length}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class RegenerateConfig:
    """The settings of `streamx regenerate` (streamx.regen): the target model answers the prompts of a
    chat dataset, turn by turn, and the rows it writes are what `streamx run --data` reads."""

    # what to run
    data: str = setting("chatterbot:english", "Conversations to regenerate: any source `streamx run` reads with "
                        "messages or conversations rows.")
    split: str = setting("train", "Dataset split (datasets names and directories).")
    max_samples: int | None = setting(None, "Use only the first N rows of the source.")
    out: str = setting("streamx-out/regenerated.jsonl", "Output .jsonl file, one row per conversation. An existing "
                       "file of the same settings is resumed: rows already in it are not generated again.")
    overwrite: bool = setting(False, "Delete an existing output of streamx regenerate (and its side files) and "
                              "start over; a file streamx did not write is never deleted.")
    skip_duplicates: bool = setting(False, "Leave out rows whose prompt (every message but the assistant turns to "
                                    "generate, and the tools) repeats an earlier row's: a greedy target answers them "
                                    "alike. Reported, and listed in OUT.errors.jsonl as duplicate_prompt.")
    retry_errors: bool = setting(False, "Try again the rows an earlier run could not regenerate for a reason of "
                                 "their own (their data, a prompt too long): by default a rerun passes them over. "
                                 "Rows that failed for a server error or a timeout are always tried again.")
    model: str | None = setting(None, "The target model. With --endpoint: the name the server knows it by (unset: "
                                "the one model the server lists). Without: a hub id, local HF directory or "
                                "'smollm2-135m-instruct' (unset: the embedded default), run in this process.")
    # engines
    endpoint: list[str] | None = setting(None, "An OpenAI-compatible server (vllm serve, SGLang, transformers "
                                         "serve), e.g. http://localhost:8000/v1; repeat it to share the load over "
                                         "several. Unset: the model runs in this process through transformers.")
    api_key_env: str = setting("OPENAI_API_KEY", "The environment variable holding the endpoints' API key (vLLM's "
                               "--api-key, hosted services), sent as a Bearer token when set; the key itself is "
                               "never written to the output, its records, a log line or an error.")
    concurrency: int = setting(8, "Conversations in flight: requests at once over all endpoints, or the batch size "
                               "of the in-process engine.")
    timeout: float = setting(600.0, "Seconds to wait for one response before retrying it.")
    retries: int = setting(5, "Retries of a request that failed with 408/429/5xx or a connection error, with "
                           "exponential backoff over the endpoints; then the run stops, naming the server.")
    return_token_ids: bool = setting(False, "Ask the server for the token ids it used and generated (vLLM's "
                                     "return_token_ids): rows then carry input_ids + loss_mask exactly as generated. "
                                     "The in-process engine always writes them.")
    device: str = setting("auto", "In-process engine: auto (CUDA when present), cpu, cuda, cuda:N.")
    dtype: str = setting("auto", "In-process engine: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, "
                         "float16.")
    # sampling
    max_tokens: int = setting(1024, "Most tokens generated per assistant turn; a turn that reaches it is truncated "
                              "(finish reason length).")
    temperature: float | None = setting(None, "Sampling temperature; 0 = greedy. Unset: the model's own "
                                        "generation config (what it is deployed with).")
    top_p: float | None = setting(None, "Nucleus sampling; unset: the model's own generation config.")
    seed: int = setting(0, "Seed of sampling; each turn's seed is derived from it, the row id and the turn, so a "
                       "resumed or reordered run asks servers that honour it (vLLM) for the same samples. The "
                       "in-process engine seeds each batch from its first turn's.")
    thinking: Thinking = setting("auto", "Reasoning models: on or off (the chat template's enable_thinking), or "
                                 "auto (the template's default).")
    reasoning: Reasoning = setting("keep", "The reasoning text a reply comes with: keep it in the history sent for "
                                   "later turns and in the output (where the template renders it, it is trained "
                                   "on), or drop it.")
    truncated: TruncatedTurns = setting("keep", "A turn that hit --max-tokens: keep it, drop-turn (the row ends "
                                        "before it), or drop-row (to the side file).")

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("concurrency", "max_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.retries < 0 or self.timeout <= 0:
            raise ValueError(f"retries must be >= 0 and timeout > 0; got {self.retries}, {self.timeout}")
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError(f"max_samples must be >= 0; got {self.max_samples}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if isinstance(self.endpoint, str):  # one endpoint from YAML or Python
            self.endpoint = [self.endpoint]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Settings = TypeVar("Settings", RunConfig, RegenerateConfig)


def load_config(path: str | Path | None = None, cls: type[Settings] = RunConfig, **overrides: Any) -> Settings:
    """The defaults of `cls` (RunConfig or RegenerateConfig), then the YAML file when one is given, then
    overrides.

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
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if cls is RunConfig and isinstance(values.get("layers"), list):
        values["layers"] = ",".join(str(i) for i in values["layers"])
    return cls(**values)


def resolve_layer_ids(layers: str, num_layers: int) -> list[int]:
    """Layer ids in the speculators convention (docs/layers.md): id 0 = embeddings output,
    id k = output of layer k-1, id L = output of the last layer before the final norm."""
    L = num_layers
    if layers in LAYER_PRESETS:  # (on a small model a preset's ids meet, and clip to 0..L)
        ids = [min(max(i, 0), L) for i in preset_ids(layers, L)]
    else:
        try:
            ids = [int(part) for part in str(layers).replace(" ", "").split(",") if part]
        except ValueError:
            raise ValueError(f"--layers must be a preset ({', '.join(LAYER_PRESETS)}) or comma-separated integers; "
                             f"got {layers!r}{_suggest_preset(str(layers))}") from None
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate layer ids {dup}; valid ids are 0..{L} for this {L}-layer model")
    return check_layer_ids(sorted(set(ids)), L)  # a preset's ids meet on small models (eagle3 on L=4: 2, 2)


def preset_ids(preset: str, L: int) -> list[int]:
    """A --layers preset's ids for a decoder of L layers, as its trainers define them (may leave 0..L on a small
    model)."""
    if preset == "eagle3":
        return [2, L // 2, L - 3, L]
    # z-lab DFlash spaces 5 layers over 1..L-3 in "output of layer i" numbering; ours is i+1.
    return [round(1 + (L - 4) * j / 4) + 1 for j in range(5)] + [L]


def _suggest_preset(layers: str) -> str:
    """': did you mean --layers eagle3?' for a near miss of a preset (eagle, EAGLE3, dflsh), else ''."""
    close = difflib.get_close_matches(layers.lower(), LAYER_PRESETS, n=1)
    return f": did you mean --layers {close[0]}?" if close else ""


def untrainable_layers(ids: list[int], num_layers: int) -> str | None:
    """Why speculators cannot train a draft from stored layer ids `ids`, and the --layers to use instead (None:
    it can): it needs id L, the verifier's last state before the final norm, as the last slot, and at least one
    auxiliary id below it."""
    L = num_layers
    eagle3 = ",".join(map(str, resolve_layer_ids("eagle3", L)))
    if L not in ids:
        return (f"layer ids {ids} lack {L}, the last layer's output before the final norm, which speculators needs as "
                f"the last slot to recompute the verifier's logits; use --layers {','.join(map(str, [*ids, L]))} "
                f"(or --layers eagle3 = {eagle3})")
    if ids == [L]:
        return (f"layer id {L} alone gives EAGLE-3 and DFlash drafts no auxiliary layers below it; use --layers "
                f"{eagle3} (= --layers eagle3) or --layers dflash")
    return None


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
