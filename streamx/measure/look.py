"""A look inside a store, and pictures: what `streamx inspect --sample ROW` and `--plot FILE` show, and the
picture `streamx bench --plot FILE` draws of its stages.

The first thing a drafter trainer checks is the loss mask: `sample_lines` decodes a sample with its trained
spans marked and gives each slot's RMS, min and max. `layer_norms` reads a spread of samples for the
per-layer picture. Pictures need matplotlib (`pip install 'streamx-hs[plot]'`); a FILE ending in .html is one
self-contained page (the figure inline as SVG), anything else an image in the format its suffix names.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import Store

MARK_OPEN, MARK_CLOSE = "«", "»"  # around the tokens the loss mask trains on
NORM_SAMPLES = 64  # samples read for the per-layer picture, spread over the store
SHARE_SAMPLES = 4096  # samples whose loss masks are read for the trained-share picture


def sample_lines(store: Store, row_id: int, tokenizer: Any | None) -> list[str]:
    """A sample as text with its trained spans marked (token ids where no tokenizer is at hand), then each
    slot's RMS, min and max over its tokens."""
    sample = store.sample(row_id)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    trained = sum(mask)
    lines = [f"row {row_id}: {len(ids):,} tokens, {trained:,} trained ({trained / max(1, len(ids)):.0%}); trained "
             f"spans are marked {MARK_OPEN}...{MARK_CLOSE}"]
    text, start = [], 0
    for k in range(1, len(ids) + 1):  # runs of equal mask values
        if k == len(ids) or mask[k] != mask[start]:
            piece = tokenizer.decode(ids[start:k]) if tokenizer is not None else " ".join(map(str, ids[start:k]))
            text.append(f"{MARK_OPEN}{piece}{MARK_CLOSE}" if mask[start] else piece)
            start = k
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


def layer_norms(store: Store, samples: int = NORM_SAMPLES) -> dict[int, np.ndarray]:
    """Per layer id, every token's L2 norm over `samples` samples spread evenly over the store."""
    positions = np.unique(np.linspace(0, len(store) - 1, min(samples, len(store))).astype(int)) if len(store) else []
    norms: dict[int, list[torch.Tensor]] = {i: [] for i in store.layer_ids}
    for position in positions:
        states = store.at(int(position)).hidden_states.float()
        for slot, layer_id in enumerate(store.layer_ids):
            norms[layer_id].append(states[:, slot].norm(dim=-1))
    return {i: torch.cat(v).numpy() if v else np.zeros(0) for i, v in norms.items()}


def plot_store(store: Store, path: str) -> None:
    """The store in three panels: sample lengths, the trained share per sample, and per-layer token norms."""
    plt = _pyplot()
    lengths = store.index.lengths
    spread = np.unique(np.linspace(0, len(store) - 1, min(SHARE_SAMPLES, len(store))).astype(int))
    trained = np.array([float(store.tokens_at(int(p))[1].float().mean()) for p in spread])
    norms = layer_norms(store)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.hist(lengths, bins=min(50, max(1, len(lengths))))
    a.set(title=f"sample lengths ({len(lengths):,} samples)", xlabel="tokens", ylabel="samples")
    b.hist(trained, bins=20, range=(0, 1))
    b.set(title=f"trained share ({len(spread):,} samples; all tokens: {_share(store):.1%})",
          xlabel="trained tokens / tokens",
          ylabel="samples")
    ids = list(norms)
    c.boxplot([norms[i] for i in ids], tick_labels=[str(i) for i in ids], showfliers=False)
    c.set(title=f"token norms per layer id ({min(NORM_SAMPLES, len(store))} samples)", xlabel="layer id",
          ylabel="L2 norm")
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
