"""A convert folder's streamx_meta.json: where it came from, what its states are, and the `speculators train`
commands that fit it."""

from __future__ import annotations

import shlex
from collections import Counter
from typing import Any

from .. import __version__
from ..base.location import local_path
from ..config import resolve_layer_ids
from ..store import BF16, Storage, Store
from .folder import FROM_STORE

BACKEND = "streamx"  # the hidden-states backend streamx.speculators_backend registers
HS_FILES = {  # what the meta says an hs file holds
    "bf16": "hs_{i}.safetensors: hidden_states bfloat16 [T, K, H], slot j = layer_ids[j], the last slot is id L "
            "before the final norm; token_ids int64 [T] == input_ids of dataset row i",
    "fp8": "hs_{i}.safetensors: hidden_states float8_e4m3fn [T, K, H] and hidden_states_scales float32 [T, 1, 1] "
           "(value = bf16(fp8) * bf16(scale), speculators' fp8 backend), slot j = layer_ids[j], the last slot is id L "
           "before the final norm; token_ids int64 [T] == input_ids of dataset row i",
    FROM_STORE: "no hs files: speculators' `streamx` backend (python -m streamx.speculators_backend) reads dataset "
                "row i's states from the store sample of source row store_rows.npy[i]: hidden_states bf16 [T, K'+1, "
                "H], the slots of --target-layer-ids then id L before the final norm; token_ids int64 [T]",
}
ALGORITHMS = ("eagle3", "dflash")  # both read this data as is (EAGLE-3 shifts at load time, DFlash does not)
SKIP_EXAMPLES = 20  # skipped rows listed by id in the meta (all are counted)


NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def draft_layer_ids(aux: list[int], num_layers: int, files: bool) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Which drafts a store of auxiliary ids `aux` suits, each with the --target-layer-ids to train it with, and
    for each other draft what to extract instead. A draft is suited when the store holds its preset's ids
    (`streamx run --layers eagle3|dflash`): from the store itself it reads those alone, from hs files (which
    hold every stored id) all of them. Ids that hold neither preset are the user's own choice: both drafts."""
    presets = {algo: resolve_layer_ids(algo, num_layers)[:-1] for algo in ALGORITHMS}
    held = [algo for algo, ids in presets.items() if set(ids) <= set(aux)]
    if not held:
        return {algo: aux for algo in ALGORITHMS}, {}
    union = ",".join(map(str, sorted({num_layers, *(i for ids in presets.values() for i in ids)})))
    suited = {algo: aux if files else presets[algo] for algo in held}
    others = {algo: f"the store lacks the ids of {NAMES[algo]} drafts, {presets[algo]}: extract them with `streamx run "
                    f"--layers {algo}` into another store, or once the union of both presets (--layers {union}) and "
                    "convert it with --hidden-states store, which gives each draft its own ids"
              for algo in ALGORITHMS if algo not in held}
    return suited, others


def train_commands(out: str, verifier: str, target_layer_ids: dict[str, list[int]], files: Storage | None = BF16,
                   mask_token_id: int | None = None) -> dict[str, list[str]]:
    """`speculators train` argv for each algorithm of `target_layer_ids` (its ids): --on-missing raise (the
    default, generate, calls a vLLM server); fp8 files need the fp8 hidden-states backend, which dequantises them
    to bf16 as it loads; with no files (`files` None), speculators' own train CLI with the streamx backend
    registered reads the store; `mask_token_id` where speculators cannot resolve it itself (streamx.train.mask_token:
    it resolves one for either draft)."""
    launcher = ["speculators", "train"] if files is not None else ["python", "-m", "streamx.speculators_backend"]
    backend = ["--hidden-states-backend", BACKEND] if files is None else \
        ["--hidden-states-backend", files.name] if files.scaled else []  # speculators' fp8 backend is named fp8
    mask = [] if mask_token_id is None else ["--mask-token-id", str(mask_token_id)]
    return {algo: [*launcher, "--data-path", out, "--verifier-name-or-path", verifier, "--on-missing", "raise",
                   "--target-layer-ids", *map(str, ids), *backend, *mask, "--speculator-type", algo]
            for algo, ids in target_layer_ids.items()}


def folder_meta(store: Store, identity: dict[str, Any], aux: list[int], totals: dict[str, int],
                skipped: list[tuple[int, str]], commands: dict[str, list[str]], unsuited: dict[str, str]
                ) -> dict[str, Any]:
    m, summary = store.metadata, store.summary()
    return {
        "format": "speculators",
        "streamx_version": __version__,
        "model": m.model,
        "tokenizer": m.tokenizer,
        "layer_ids": store.layer_ids,
        "target_layer_ids": aux,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "layer_convention": m.layer_convention,
        "layer_convention_text": m.layer_convention_text,
        "last_id_is_pre_norm": m.last_id_is_pre_norm,
        "hidden_states": HS_FILES[identity["hidden_states"]],
        "hidden_states_dtype": identity["hidden_states"],
        "source": {"store": store_location(store.path), "created": m.created, "samples": summary["samples"],
                   "tokens": summary["tokens"], "rejected_by_run": summary["rejected"], "parts": summary["parts"]},
        "shuffle": {"seed": identity["seed"], "method": "numpy.random.default_rng(seed).permutation of the sorted "
                    "unique row ids", "order_sha256": identity["order_sha256"]},
        "counts": {**totals, "skipped": len(skipped)},
        "skipped": dict(sorted(Counter(why for _, why in skipped).items())),
        "skipped_examples": [{"row_id": r, "reason": why} for r, why in skipped[:SKIP_EXAMPLES]],
        "speculators_train": {algo: shlex.join(argv) for algo, argv in commands.items()},
        "speculators_train_argv": commands,
        "drafts_not_served": unsuited,  # algorithm -> why this store's ids do not suit it, and what to extract
        "identity": identity,
    }


def store_location(path: str) -> str:
    """Where a converted folder's store is: an absolute local path, or the object store URL as given."""
    local = local_path(path)
    return path if local is None else str(local.resolve())


def backend_layer_ids(target_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """The ids the `streamx` backend returns, slot by slot (its contract, streamx.train.backend): the
    --target-layer-ids, ascending as vLLM captures them and speculators' file backend returns them, then id L
    (the last layer's output before the final norm); speculators' own default `2, L//2, L-3` when none are
    given. Raises ValueError for ids it would have to reorder, an empty list, repeats or L among them."""
    L = num_layers
    ids = [2, L // 2, L - 3] if target_layer_ids is None else list(target_layer_ids)
    if not ids:
        raise ValueError("--target-layer-ids is empty: name the auxiliary layers the draft reads, e.g. "
                         f"{' '.join(map(str, [2, L // 2, L - 3]))}")
    if L in ids:
        raise ValueError(f"--target-layer-ids holds {L}, the last layer, which the backend always returns last: "
                         "name only the auxiliary layers below it")
    if ids != sorted(set(ids)):
        ascending = " ".join(map(str, sorted(set(ids))))
        raise ValueError(f"--target-layer-ids {' '.join(map(str, ids))} must be ascending and distinct, as vLLM "
                         f"captures them and speculators' file backend returns them: {ascending}")
    return [*ids, L]
