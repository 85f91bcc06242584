"""`streamx convert --format nemo-dspark|nemo-eagle3`: a store as NeMo AutoModel's offline caches (the layout of
nemo-automodel 0.7.0's `precompute_dspark` / `precompute_eagle3`), which its recipes train from through
`recipe_args.cached_target_path` without loading the target.

Both: manifest.json (`format_version`, then the manifest, keys sorted) and shard-NNNNNN.safetensors of
`shard_size` samples each (the last fewer), every sample padded to seq_length (the store's --max-length) with the
tokenizer's pad id (else its eos), its mask 0 and its states 0 there.
- DSpark (format 1): `input_ids`, `loss_mask` int64 [n, S] as the rows have them; `target_hidden_states` [n, S, k*H]:
  NeMo's layer ids, -1 the embeddings (streamx id 0), k < L-1 the output of block k (streamx id k+1), L-1 the last
  block's output after the final norm; `target_last_hidden_states` [n, S, H], that post-norm state; manifest
  `complete` set last; target_weights.safetensors (`embed_tokens.weight`, `lm_head.weight`).
- EAGLE-3 (format 2): `input_ids` and `loss_mask` shifted left by one (0 last), `attention_mask`, `aux_hidden_states`
  [n, S, 3H] (block outputs; L-1 before the norm: streamx id L); of the next token, through the target's final norm
  and lm_head: `target_probs` [n, S, Vd] (softmax over the draft vocabulary's logits) or its top k
  (`target_probs_values`, renormalised, and `target_probs_indices` int32), and `position_mask` [n, S, 1] (the
  target's greedy next token is in the draft vocabulary, and supervised); manifest `selected_token_ids` (draft id
  -> target id: special tokens, then by count over supervised tokens, then the rest); target_embeddings.safetensors.
States are bf16 (the store's); the folder is written beside --out and renamed into place once whole (folder.staging).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save
from tqdm import tqdm
from transformers import AutoConfig

from ..base import durable
from ..base.locks import Lock, lock_file
from ..base.units import gb
from ..model.load import load_tokenizer
from ..store import Store
from .convert import ConvertError, token_problem
from .export import open_for_export, prepare_folder, publish
from .final_norm import FinalNorm, embeddings_and_head
from .folder import EXPORT, staging

SHARD_ROWS = 256  # NeMo's default --shard-size
FORMATS = ("nemo-dspark", "nemo-eagle3")


@dataclass
class NemoSummary:
    out: str
    fmt: str
    rows: int
    tokens: int
    skipped: dict[str, int]
    seconds: float
    layer_ids: list[int]
    seq_length: int
    command: str

    def lines(self, store: str) -> list[str]:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return [f"{self.rows:,} rows ({self.tokens:,} tokens) as NeMo AutoModel's {self.fmt.removeprefix('nemo-')} "
                f"cache in {self.out} ({self.seconds:.0f} s); skipped {skipped}",
                f"train: {self.command}",
                f"before a long training run, check the store against the model: streamx verify {store}"]


def dspark_ids(L: int) -> list[int]:
    """NeMo's DSpark default (`build_target_layer_ids(L, 5)`): five ids spread from block 1 to the last, each once."""
    n = min(max(5, 1), L - 1)
    if n <= 1:
        return [L - 1]
    step = (L - 2) / (n - 1)
    return sorted({int(round(1 + i * step)) for i in range(n)})


def eagle3_ids(L: int) -> list[int]:
    """NeMo's EAGLE-3 default: blocks 1, L//2 - 1 and L - 4."""
    return [1, L // 2 - 1, L - 4]


def export_nemo(store_path: str, out: str, fmt: str, layer_ids: list[int] | None = None, model: str | None = None,
                draft_vocab_size: int | None = None, topk: int | None = None, overwrite: bool = False,
                progress: bool = True, log: Callable[[str], None] = print, allow_partial: bool = False,
                allow_random_weights: bool = False) -> NemoSummary:
    """Write the store at `store_path` into `out` as NeMo's `fmt` cache, with `layer_ids` in NeMo's numbering
    (default: NeMo's own for the model); `model`: the target's checkpoint folder where the one the store records is
    not on this machine. Re-running resumes."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    with Lock(lock_file(out), f"the convert folder {out}"):
        return _export(store_path, Path(out), fmt, layer_ids, model, draft_vocab_size, topk, overwrite, progress, log,
                       allow_partial, allow_random_weights)


@dataclass
class Cache:
    """What a cache's samples are made from: the store's rows and the target's norm, head and pad id."""

    store: Store
    fmt: str
    ids: list[int]  # NeMo's layer ids
    rows: list[int]  # the store's rows it holds, in order
    skipped: dict[str, int]
    seq_length: int
    pad: int
    norm: FinalNorm
    head: torch.Tensor  # float32 [V, H]
    tokenizer: Any
    selected: torch.Tensor | None  # EAGLE-3: draft id -> target id
    topk: int

    @classmethod
    def of(cls, store: Store, fmt: str, layer_ids: list[int] | None, target: str, draft_vocab_size: int | None,
           topk: int | None) -> Cache:
        eagle = fmt == "nemo-eagle3"
        ids = _layer_ids(store, eagle, layer_ids)
        norm = FinalNorm.from_checkpoint(target, store.metadata.model.get("weights_fingerprint"))
        head = embeddings_and_head(target)[1].float()
        tokenizer = load_tokenizer(target)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rows, skipped = _rows(store)
        selected = _draft_vocab(store, rows, tokenizer, head.shape[0], draft_vocab_size) if eagle else None
        topk = topk if topk and selected is not None and topk < selected.numel() else 0
        return cls(store, fmt, ids, rows, skipped, store.metadata.max_length, pad, norm, head, tokenizer, selected,
                   topk)

    @property
    def eagle(self) -> bool:
        return self.fmt == "nemo-eagle3"

    def shards(self) -> range:
        return range(-(-len(self.rows) // SHARD_ROWS))

    def shard(self, index: int) -> dict[str, torch.Tensor]:
        """Shard `index` as it is written: its samples' tensors, stacked."""
        L, held = self.store.metadata.num_layers, self.store.layer_ids
        slots, last = [held.index(0 if k == -1 else min(k + 1, L)) for k in self.ids], held.index(L)
        samples = [_sample(self.store, row, self.seq_length, self.pad, slots, last, self.ids, L, self.norm, self.head,
                           self.selected, self.topk, self.eagle)
                   for row in self.rows[index * SHARD_ROWS : (index + 1) * SHARD_ROWS]]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def _export(store_path: str, out: Path, fmt: str, layer_ids: list[int] | None, model: str | None,
            draft_vocab_size: int | None, topk: int | None, overwrite: bool, progress: bool,
            log: Callable[[str], None], allow_partial: bool, allow_random_weights: bool) -> NemoSummary:
    started = time.perf_counter()
    store = open_for_export(store_path, out, allow_partial, allow_random_weights, log)
    meta, target = store.metadata, model or store.metadata.model["path"]
    cache = Cache.of(store, fmt, layer_ids, target, draft_vocab_size, topk)
    ids, rows, S, selected = cache.ids, cache.rows, cache.seq_length, cache.selected
    identity = {"trainer": fmt, "store_created": meta.created, "layer_ids": ids, "rows": len(rows),
                "draft_vocab_size": draft_vocab_size, "topk": cache.topk, "shard_rows": SHARD_ROWS}
    manifest = _manifest(fmt, meta, ids, len(rows), S, cache.head.shape[0], cache.tokenizer, selected, cache.topk,
                         target)
    command = _command(fmt, out, ids, S)
    done = prepare_folder(out, identity, overwrite)
    if done is not None:
        log(f"{out} already holds this conversion; nothing to do")
        return NemoSummary(str(out), fmt, done["rows"], done["tokens"], done["skipped"], 0.0, ids, S, command)
    stage = staging(out)
    width = (S * (len(ids) + 1) * meta.hidden_size * 2 + S * 16) if not cache.eagle else \
        (S * 3 * meta.hidden_size * 2 + S * 25 + S * (cache.topk * 6 if cache.topk else 2 * selected.numel()))
    log(f"writing {len(rows):,} rows as NeMo's {fmt.removeprefix('nemo-')} cache into {stage}, renamed to {out} once "
        f"whole: about {gb(len(rows) * width)} (every row padded to {S:,} tokens"
        + ("" if not cache.eagle or cache.topk else f"; target_probs over {selected.numel():,} ids: "
                                                    "--target-probs-topk K keeps K of them") + ")")
    embed = embeddings_and_head(target)[0]
    if not cache.eagle:
        _write_manifest(stage, {**manifest, "complete": False}, 1)
        _write_tensors(stage / "target_weights.safetensors", {"embed_tokens.weight": embed.to(torch.bfloat16),
                                                               "lm_head.weight": cache.head.to(torch.bfloat16)})
    else:
        _write_tensors(stage / "target_embeddings.safetensors", {"weight": embed.float()})
    with tqdm(total=len(rows), unit="row", desc=f"convert {fmt}", disable=not progress) as bar:
        for shard in cache.shards():
            path = stage / f"shard-{shard:06d}.safetensors"
            if not path.exists():  # (written whole by an interrupted convert)
                _write_tensors(path, cache.shard(shard))
            bar.update(len(rows[shard * SHARD_ROWS : (shard + 1) * SHARD_ROWS]))
    tokens = int(sum(store.index.lengths[store.position(row)] for row in rows))
    _write_manifest(stage, {**manifest, **({"complete": True} if not cache.eagle else {})}, 2 if cache.eagle else 1)
    record = {"identity": identity, "complete": True, "rows": len(rows), "tokens": tokens, "skipped": cache.skipped,
              "store": store.path, "model": meta.model, "final_norm_from": target, "command": command}
    durable.write_file(stage / EXPORT, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))
    publish(stage, out)
    return NemoSummary(str(out), fmt, len(rows), tokens, cache.skipped, time.perf_counter() - started, ids, S, command)


def _layer_ids(store: Store, eagle: bool, given: list[int] | None) -> list[int]:
    """NeMo's ids (given, or its default), checked as its recipes check them and against what the store holds."""
    L, held = store.metadata.num_layers, store.layer_ids
    ids = list(given) if given is not None else (eagle3_ids(L) if eagle else dspark_ids(L))
    if eagle and (len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= k < L for k in ids)):
        raise ConvertError(f"NeMo's EAGLE-3 reads exactly 3 distinct blocks 0..{L - 1} (the output of block k; "
                           f"its default 1, L//2-1, L-4 does not fit a model of {L} layers); got {ids}: pass "
                           "--trainer-layers A,B,C")
    if not eagle and (ids != sorted(set(ids)) or not all(-1 <= k < L for k in ids)):
        raise ConvertError(f"NeMo's DSpark reads increasing ids from -1 (the embeddings) to {L - 1} (the last block's "
                           f"output after the final norm), each once; got {ids}")
    needed = sorted({0 if k == -1 else min(k + 1, L) for k in ids} | {L})
    missing = [k for k in needed if k not in held]
    if missing:
        want = ",".join(map(str, sorted(set(held) | set(needed))))
        raise ConvertError(f"{store.path} holds streamx ids {held}; NeMo's layers {ids} (and the last state) are "
                           f"streamx ids {needed}, of which it lacks {missing}: extract them with `streamx run "
                           f"--layers {want}` (a new --out), or pass --trainer-layers with ids it holds")
    return ids


def _rows(store: Store) -> tuple[list[int], dict[str, int]]:
    """The rows to write, in row order, and the rows left out by why (tokens a trainer cannot use)."""
    rows, skipped = [], {}
    for row in np.unique(store.row_ids()).tolist():
        problem = token_problem(*store.tokens_at(store.position(row)))
        if problem:
            skipped[problem] = skipped.get(problem, 0) + 1
        else:
            rows.append(row)
    return rows, skipped


def _draft_vocab(store: Store, rows: list[int], tokenizer: Any, V: int, size: int | None) -> torch.Tensor:
    """Draft id -> target id, as NeMo builds it: the special tokens, then the supervised tokens by count (ties to the
    lower id), then the rest by id; all V where no size is given."""
    if size is None:
        return torch.arange(V)
    if not 0 < size <= V:
        raise ConvertError(f"--draft-vocab-size must be 1..{V} (the target's vocabulary); got {size}")
    counts = np.zeros(V, dtype=np.int64)
    for row in rows:
        ids, mask = store.tokens_at(store.position(row))
        counts += np.bincount(ids[mask == 1].numpy(), minlength=V)[:V]
    special = [t for t in dict.fromkeys((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                         tokenizer.unk_token_id)) if t is not None and 0 <= t < V]
    by_count = [int(t) for t in np.lexsort((np.arange(V), -counts)) if counts[t] > 0 and t not in special]
    rest = sorted(set(range(V)) - set(special) - set(by_count))
    return torch.tensor((special + by_count + rest)[:size])


@torch.no_grad()
def _sample(store: Store, row: int, S: int, pad: int, slots: list[int], last: int, ids: list[int], L: int,
            norm: FinalNorm, head: torch.Tensor, selected: torch.Tensor | None, topk: int,
            eagle: bool) -> dict[str, torch.Tensor]:
    """One row's tensors, padded to S."""
    s = store.sample(row)
    T, H = len(s.input_ids), s.hidden_states.shape[-1]
    if not bool(torch.isfinite(s.hidden_states.float()).all()):
        raise ConvertError(f"row {row} of {store.path} holds non-finite states; `streamx verify {store.path}`")
    post32 = norm(s.hidden_states[:, last])  # [T, H]: the last state after the final norm, in float32
    post = post32.to(torch.bfloat16)

    def padded(x: torch.Tensor, value: float = 0) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, S - T), value=value)

    ids_, mask = padded(s.input_ids, pad), padded(s.loss_mask)
    if not eagle:
        states = [post if k == L - 1 else s.hidden_states[:, slot] for k, slot in zip(ids, slots, strict=True)]
        return {"input_ids": ids_, "loss_mask": mask, "target_hidden_states": padded(torch.cat(states, dim=-1)),
                "target_last_hidden_states": padded(post)}
    aux = padded(s.hidden_states[:, slots].reshape(T, 3 * H))
    logits = torch.zeros(S, head.shape[0])
    logits[: T - 1] = post32[1:] @ head.T  # of the next token: the last real one's is a pad's, masked
    shifted = torch.cat([mask[1:], mask.new_zeros(1)])
    in_draft = torch.zeros(head.shape[0], dtype=torch.bool)
    in_draft[selected] = True
    probs = torch.softmax(logits[:, selected], dim=-1)
    out = {"input_ids": torch.cat([ids_[1:], ids_.new_zeros(1)]), "loss_mask": shifted,
           "attention_mask": padded(torch.ones(T, dtype=torch.int64)), "aux_hidden_states": aux,
           "position_mask": (in_draft[logits.argmax(-1)] & shifted.bool())[:, None]}
    if topk:
        values, indices = probs.topk(topk, dim=-1)
        out |= {"target_probs_values": (values / values.sum(-1, keepdim=True)).to(torch.bfloat16),
                "target_probs_indices": indices.to(torch.int32)}
    else:
        out["target_probs"] = probs.to(torch.bfloat16)
    return out


def _manifest(fmt: str, meta: Any, ids: list[int], n: int, S: int, V: int, tokenizer: Any,
              selected: torch.Tensor | None, topk: int, target: str) -> dict[str, Any]:
    """The manifest NeMo's recipe compares with its own settings (the mask options: streamx's masks train the
    assistant's content, not the template's role header, which is NeMo's mask_generation_prompt)."""
    H = meta.hidden_size
    common = {"target_model": target, "seq_length": S, "dtype": "bf16", "num_samples": n, "shard_size": SHARD_ROWS,
              "shuffle_seed": 0, "mask_reasoning_content": False, "mask_generation_prompt": True}
    if fmt == "nemo-eagle3":
        return {**common, "target_vocab_size": V, "draft_vocab_size": int(selected.numel()),
                "target_probs_topk": topk, "aux_hidden_dim": 3 * H, "aux_layer_ids": ids,
                "selected_token_ids": selected.tolist(), "input_data": meta.compat.data, "split": meta.compat.split}
    return {**common, "target_model_type": AutoConfig.from_pretrained(target).model_type, "target_vocab_size": V,
            "hidden_size": H, "num_hidden_layers": meta.num_layers,
            "target_hidden_dim": H * len(ids), "target_last_hidden_dim": H, "target_layer_ids": ids,
            "train_data_path": meta.compat.data, "train_split": meta.compat.split,
            "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()}


def _command(fmt: str, out: Path, ids: list[int], S: int) -> str:
    recipe = "train_eagle3" if fmt == "nemo-eagle3" else "train_dspark"
    layers = "" if fmt == "nemo-eagle3" else f" --recipe_args.target_layer_ids [{','.join(map(str, ids))}]"
    return (f"python -m nemo_automodel.recipes.llm.{recipe} -c YOUR_RECIPE.yaml --recipe_args.cached_target_path "
            f"{out.resolve()} --recipe_args.seq_length {S}{layers} --recipe_args.mask_generation_prompt true "
            "(on CUDA: the cache is bf16)")


def _write_manifest(folder: Path, manifest: dict[str, Any], version: int) -> None:
    text = json.dumps({"format_version": version, **manifest}, indent=2, sort_keys=True)
    durable.write_file(folder / "manifest.json", lambda tmp: tmp.write_text(text))


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    data = save({k: v.contiguous() for k, v in tensors.items()})
    durable.write_file(path, lambda tmp: tmp.write_bytes(data))
