"""A look inside a store, and pictures: what `streamx inspect --sample ROW` and `--plot FILE` show, and the
picture `streamx bench --plot FILE` draws of its stages.

The first thing a drafter trainer checks is the loss mask: `sample_lines` decodes a sample with its trained
spans marked and gives each slot's RMS, min and max. `layer_spread` reads a spread of samples for the
per-layer picture: the token norms, and the largest |value| (massive activations), which a box alone hides.
Pictures need matplotlib (`pip install 'streamx-hs[plot]'`); a FILE ending in .html is one
self-contained page (the figure inline as SVG), anything else an image in the format its suffix names.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..base.location import local_path
from ..store import Store
from ..train.folder import EXPORT, FROM_STORE, META, WORK

MARK_OPEN, MARK_CLOSE = "«", "»"  # around the tokens the loss mask trains on
NORM_SAMPLES = 64  # samples read for the per-layer picture, spread over the store
SHARE_SAMPLES = 4096  # samples whose loss masks are read for the trained-share picture


def row_lines(store: Store, row_id: int) -> list[str]:
    """What `--sample ROW` shows: the row's sample (`sample_lines`, decoded with the store's tokenizer), or why the
    run rejected it."""
    try:
        store.position(row_id)
    except KeyError:
        return [rejected_line(store, row_id)]
    return sample_lines(store, row_id, store_tokenizer(store))


def rejected_line(store: Store, row_id: int) -> str:
    """Why the run rejected source row `row_id`: its reason, and its detail where the store kept it (one row's per
    reason and part: the commit's example), else the row it repeats or the kept example of that reason."""
    reason = dict(store.rejected()).get(row_id)
    if reason is None:
        waits = store.repeated.unread_same_as[store.repeated.unread == row_id]
        if waits.size:  # committed as a repeat of a row that no part has committed yet
            raise LookupError(f"source row {row_id} is committed as a repeat of row {int(waits[0])}, which no part of "
                              f"{store.path} has committed yet (another rank's, still running, or stopped): it reads "
                              "as its sample once that row lands; re-run the rank that holds it")
        raise LookupError(f"source row {row_id} is not in {store.path}: no sample and no reject")
    own = f"row {row_id}: "
    examples = [e for c in store.commits.values() if (e := c.reject_examples.get(reason))]
    repeats = dict(zip(store.repeated.unread.tolist(), store.repeated.unread_same_as.tolist(), strict=True))
    why = next((e.removeprefix(own) for e in examples if e.startswith(own)), None)
    if why is None and row_id in repeats:
        why = f"it repeats row {repeats[row_id]}, rejected for that reason"
    elif why is None:
        why = "the store keeps the detail of one row per reason" + (f", e.g. {examples[0]}" if examples else "")
    return f"row {row_id} was rejected by the run, so it has no sample: {reason} ({why})"


def converted_folder_line(path: str) -> str | None:
    """What a folder `streamx convert` wrote is, in one line, or None where `path` is no such folder: `inspect`
    reads stores, and points at the folder's own."""
    local = local_path(path)
    if local is None or not local.is_dir():
        return None
    if (local / META).is_file():
        record = _json(local / META)
        store, rows = record.get("source", {}).get("store"), record.get("counts", {}).get("rows")
        if not isinstance(store, str) or not isinstance(rows, int):
            return f"{path} is a speculators training folder whose {META} cannot be read"
        states = "states read from the store" if record.get("hidden_states_dtype") == FROM_STORE else \
            f"{rows:,} hs files"
        return (f"{path} is a speculators training folder converted from {store} ({rows:,} rows, {states}); inspect "
                f"the store: streamx inspect {store}")
    if (local / WORK / "plan.json").is_file():
        return f"{path} is a speculators training folder `streamx convert` has not finished; run it again to finish"
    if (local / EXPORT).is_file():  # another trainer's (train.export, train.nemo): written whole, then renamed here
        record = _json(local / EXPORT)
        trainer, store = record.get("identity", {}).get("trainer", "?"), record.get("store", "?")
        return (f"{path} is a `streamx convert --format {trainer}` folder converted from {store} "
                f"({record.get('rows', 0):,} rows); inspect the store: streamx inspect {store}")
    return None


def _json(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def sample_lines(store: Store, row_id: int, tokenizer: Any | None) -> list[str]:
    """A sample as text with its trained spans marked (token ids where no tokenizer is at hand), then each
    slot's RMS, min and max over its tokens."""
    sample = store.sample(row_id)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    trained = sum(mask)
    cut = store.cut_of(row_id)
    lines = [f"row {row_id}: {len(ids):,} tokens, {trained:,} trained ({trained / max(1, len(ids)):.0%})"
             + (f", CUT at --max-length: its last {cut:,} tokens are not stored" if cut else "")
             + f"; trained spans are marked {MARK_OPEN}...{MARK_CLOSE}"]
    text, start = [], 0
    for k in range(1, len(ids) + 1):  # runs of equal mask values
        if k == len(ids) or mask[k] != mask[start]:
            piece = tokenizer.decode(ids[start:k]) if tokenizer is not None else " ".join(map(str, ids[start:k]))
            text.append(f"{MARK_OPEN}{piece}{MARK_CLOSE}" if mask[start] else piece)
            start = k
    if cut:
        text.append(f" [CUT: {cut:,} more tokens of this row past --max-length {store.metadata.max_length:,} are not "
                    "stored]")
    lines += ["", "".join(text), "", f"{'id':>6}{'rms':>11}{'min':>11}{'max':>11}"]
    states = sample.hidden_states.float()
    for slot, layer_id in enumerate(store.layer_ids):
        x = states[:, slot]
        lines.append(f"{layer_id:>6}{float(x.pow(2).mean().sqrt()):>11.4g}{float(x.min()):>11.4g}"
                     f"{float(x.max()):>11.4g}")
    return lines


def store_tokenizer(store: Store) -> Any | None:
    """The tokenizer the store was made with, where it can still be loaded (None: the ids are shown instead)."""
    from ..model.load import load_tokenizer

    for name in (store.metadata.tokenizer.get("name_or_path"), store.metadata.model.get("path")):
        try:
            return load_tokenizer(name) if name else None
        except Exception:  # noqa: BLE001 - moved or offline: try the next, else show ids
            continue
    return None


@dataclass(frozen=True)
class LayerSpread:
    """One layer id's states over the samples read: what the per-layer panel draws."""

    norms: np.ndarray  # every token's L2 norm
    peak: float  # the largest |value| (a massive activation stands out here)
    peak_at: tuple[int, int, int]  # where it is: (source row, token, dimension)


def layer_spread(store: Store, samples: int = NORM_SAMPLES) -> dict[int, LayerSpread]:
    """Per layer id, every token's L2 norm and the largest |value| over `samples` samples spread evenly over the
    store."""
    positions = np.unique(np.linspace(0, len(store) - 1, min(samples, len(store))).astype(int)) if len(store) else []
    norms: dict[int, list[torch.Tensor]] = {i: [] for i in store.layer_ids}
    peaks: dict[int, tuple[float, tuple[int, int, int]]] = {i: (0.0, (-1, -1, -1)) for i in store.layer_ids}
    for position in positions:
        sample = store.at(int(position))
        states = sample.hidden_states.float()
        for slot, layer_id in enumerate(store.layer_ids):
            x = states[:, slot]
            norms[layer_id].append(x.norm(dim=-1))
            magnitudes = x.abs().flatten()
            at = int(magnitudes.argmax())
            if float(magnitudes[at]) > peaks[layer_id][0]:
                peaks[layer_id] = float(magnitudes[at]), (sample.row_id, *divmod(at, x.shape[1]))
    return {i: LayerSpread(torch.cat(v).numpy() if v else np.zeros(0), *peaks[i]) for i, v in norms.items()}


def plot_store(store: Store, path: str) -> None:
    """The store in three panels: sample lengths, the trained share per sample, and per-layer token norms with
    the tokens past the whiskers drawn and each layer's largest |value| marked, the largest of all named: massive
    activations, which a box alone would hide."""
    plt = _pyplot()
    lengths = store.index.lengths
    spread = np.unique(np.linspace(0, len(store) - 1, min(SHARE_SAMPLES, len(store))).astype(int))
    trained = np.array([float(store.tokens_at(int(p))[1].float().mean()) for p in spread])
    layers = layer_spread(store)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.hist(lengths, bins=min(50, max(1, len(lengths))))
    a.set(title=f"sample lengths ({len(lengths):,} samples)", xlabel="tokens", ylabel="samples")
    b.hist(trained, bins=20, range=(0, 1))
    b.set(title=f"trained share ({len(spread):,} samples; all tokens: {_share(store):.1%})",
          xlabel="trained tokens / tokens",
          ylabel="samples")
    ids = list(layers)
    c.boxplot([layers[i].norms for i in ids], tick_labels=[str(i) for i in ids],
              flierprops={"marker": ".", "markersize": 3, "alpha": 0.5})
    if ids:  # each layer's largest |value| marked, the largest of all named in the legend
        top = max(ids, key=lambda i: layers[i].peak)
        row, token, dim = layers[top].peak_at
        c.scatter(range(1, len(ids) + 1), [layers[i].peak for i in ids], marker="x", color="tab:red", zorder=3,
                  label=f"largest |value|: {layers[top].peak:,.5g} at id {top} (row {row}, token {token}, dim {dim})")
        c.legend(fontsize=8)
    c.set(title=f"token norms per layer id ({min(NORM_SAMPLES, len(store))} samples)", xlabel="layer id",
          ylabel="L2 norm; largest |value|")
    fig.suptitle(f"{store.path}: {store.metadata.model.get('model', '?')}")
    save_figure(fig, path, title=f"streamx inspect {store.path}")


def plot_bench(report: dict[str, Any], path: str) -> None:
    """Tokens/s of each mode and the streamx stages' busy time, as `streamx bench` measured them."""
    plt = _pyplot()
    modes = [m for m in ("forward_only", "forward_padded", "streamx", "streamx_unshared", "naive") if m in report]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.bar(modes, [report[m]["tokens_per_s"] for m in modes])
    a.set(title="tokens/s per mode", ylabel="tokens/s")
    stages = report["streamx"]["stage_seconds"]
    b.barh(list(stages), list(stages.values()))
    b.set(title="streamx stage busy time", xlabel="seconds per round")
    fig.suptitle(f"streamx bench: {report['model']['model']} on {report['model']['device']}")
    save_figure(fig, path, title="streamx bench")


def save_figure(fig: Any, path: str, title: str) -> None:
    """An image in the format of the suffix, or for .html one page with the figure inline."""
    fig.tight_layout()
    if Path(path).suffix.lower() in (".html", ".htm"):
        svg = io.BytesIO()
        fig.savefig(svg, format="svg")
        page = (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<img alt='{html.escape(title)}' src='data:image/svg+xml;base64,"
                f"{base64.b64encode(svg.getvalue()).decode()}'>")
        Path(path).write_text(page)
    else:
        fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def _share(store: Store) -> float:
    return sum(c.trainable_tokens for c in store.commits.values()) / max(1, store.row_tokens)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install 'streamx-hs[plot]' (or matplotlib)") from None
    return plt
