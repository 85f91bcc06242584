"""The start-up check: each way a run may compute its rows, proven on the loaded model against its own forward.

A run computes rows packed side by side, continued from a shared prefix (in the same forward, or from the states
an earlier forward kept), with linear-attention layers sample by sample, or in padded batches: none of that is the
model's own forward of a row alone. Before a run, each way it would take runs a few probe rows and is compared with
the model's own forward of each row alone (its own attention implementation and masks: what transformers does),
at its layer outputs, token by token, each token against its own scale (so that a first token's massive
activation hides nothing). The probe rows are longer than every sliding window and attention chunk the model's
config declares, so that one the packed path missed shows; they are at most --max-length long (no row of the run
is longer), half --token-budget (a probe's forward holds two rows: the check needs no more memory than the run's
forwards) and PROBE_MAX_TOKENS, and `Probes.scope` says what they covered. A way that differs is not taken: the
run falls back to the next correct one, and says why (streamx.model.packing, streamx.pipeline.plan).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ..data.batching import Batch, make_batch, make_packed_batch, packed_batch
from ..data.sharing import pieces, share
from ..data.tokenize import Sample
from ..model.capture import LayerCapture, find_decoder
from ..model.gather import gather_into_torch
from ..model.lengths import LengthSplit
from .tolerance import Noise, Tolerance, largest, own_states, reduced_precision, relative_error

PROBE_MAX_TOKENS = 16384  # the longest probe row: a window or chunk longer than this is not proven on the model
PLAIN_SPAN = 32  # the scale of the probe rows of a model without windows or chunks
COMPARED_LAYERS = 16  # layer outputs compared at most (evenly spread, the last one among them)
FAILURES = (NotImplementedError, TypeError, ValueError, RuntimeError, KeyError, AttributeError)


def declared_spans(config) -> dict[str, int]:
    """The lengths past which a model's (text) config declares that some of its layers attend otherwise: a sliding
    window, an attention chunk, the keys a sparse attention's indexer picks (DeepSeek-V3.2, GLM-5) or the blocks it
    picks (MiniMax-M3)."""
    types = set(getattr(config, "layer_types", None) or ())
    spans = {}
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and (not types or "sliding_attention" in types):
        spans["sliding window"] = window
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0 and (not types or "chunked_attention" in types):
        spans["attention chunk"] = chunk
    topk = getattr(config, "index_topk", None)
    if isinstance(topk, int) and topk > 0:
        spans["sparse attention's top-k keys"] = topk
    rates = getattr(config, "compress_rates", None)  # DeepSeek-V4: a window, then compressed blocks (top-k of some)
    if isinstance(rates, dict) and rates:
        picked = topk if isinstance(topk, int) and topk > 0 else 1
        spans["compressed attention's reach"] = (window if isinstance(window, int) else 0) + max(
            rate * (picked if "sparse" in kind else 1) for kind, rate in rates.items())
    block, blocks = getattr(config, "index_block_size", None), getattr(config, "index_topk_blocks", None)
    if isinstance(block, int) and isinstance(blocks, int) and block > 0 and blocks > 0:
        spans["sparse attention's top-k blocks"] = block * blocks
    return spans


@dataclass
class Probes:
    """The probe rows and the model's own forward of each alone, and which rows each way puts together: those a
    forward may hold side by side (packed, or padded), two rows that share a leading run (continued from it), and
    a row with its prefix (a prefix row served from the longer row's states). Where the model's forward depends on
    the batch's longest row (a LengthSplit), the rows a forward may hold are those of one side of its limit, as the
    run batches them."""

    rows: list[Sample]
    together: list[list[int]]  # rows a forward may hold, each list on one side of a LengthSplit
    continued: tuple[int, int]  # two rows that share their leading run
    prefixes: list[tuple[int, int]]  # a row and a row that is its prefix, on each side of a LengthSplit
    scope: str  # what the rows cover, for the log: their length against the windows, chunks and length limits
    layer_ids: list[int]  # the layer outputs compared (ids: k = the output of layer k-1)
    reference: dict[int, torch.Tensor]  # row id -> [tokens, len(layer_ids), hidden], the model's own forward
    noise: Noise  # the model's own rounding between forwards of a row (measured in reduced precision)

    @classmethod
    @torch.inference_mode()
    def of(cls, model: nn.Module, max_length: int, split: LengthSplit | None = None,
           token_budget: int | None = None) -> Probes:
        """Probe rows for `model` (random tokens, the same every time) and its own forward of each; call it while
        the model runs its own attention and layers. With a `split`, rows on both sides of its limit. The rows are
        at most `max_length` (no row of the run is longer) and half `token_budget` (a probe's forward holds two
        rows: it needs no more memory than the run's forwards)."""
        text = model.config.get_text_config()
        spans = declared_spans(text)
        cap = min(max_length, PROBE_MAX_TOKENS, token_budget // 2 if token_budget else max_length)
        n = max(min(max(spans.values(), default=PLAIN_SPAN) * 3 // 2 + 8, cap), 24)
        g = torch.Generator().manual_seed(0)
        draw = lambda k: torch.randint(0, text.vocab_size, (k,), generator=g)  # noqa: E731
        if split is not None:
            spans[split.why.split(" (")[0] + " limit"] = split.limit
        past = split is not None and split.limit < cap  # rows on both sides of the limit: the short ones below
        if past:
            n_long, n = max(min(split.limit * 3 // 2 + 8, cap), split.limit + 1), max(min(n, split.limit), 16)
        prefix = n // 3 + 5
        shared, second = draw(prefix), draw(n - 3)
        ids = [draw(n // 3 + 3), second, torch.cat([shared, draw(n - prefix)]),
               torch.cat([shared, draw(n - prefix - 5)]), second[: n - 11], draw(n)]
        # a short row beside a long one, and a row past every declared span beside a longer one (padded: past the
        # spans with padding after it; packed: after a row past them)
        together, prefixes = [[0, 1], [1, 5]], [(1, 4)]
        if past and not split.alone:  # longrope: the long side batched among itself, and its prefix rows
            longer = draw(n_long)
            ids += [longer, longer[: n_long - 7] if n_long - 7 > split.limit else draw(n_long)]
            together.append([6, 7])
            prefixes += [(6, 7)] if n_long - 7 > split.limit else []
        rows = [Sample(i, t, torch.ones(len(t), dtype=torch.long)) for i, t in enumerate(ids)]
        L = len(find_decoder(model).layers)
        layer_ids = sorted({round(1 + k * (L - 1) / (COMPARED_LAYERS - 1)) for k in range(COMPARED_LAYERS)}) \
            if L > COMPARED_LAYERS else list(range(1, L + 1))
        reference, noise = {}, Noise()
        with LayerCapture(model, layer_ids, gather_into_torch) as capture:
            for row in rows:
                reference[row.row_id] = own_states(capture, make_batch([row], 0), model)
            if reduced_precision(next(model.parameters()).dtype):
                noise = Noise.of(model, capture, [rows[1], rows[5]], token_budget)
        longest = max(len(t) for t in ids)
        return cls(rows, together, (2, 3), prefixes, _scope(longest, spans, max_length, cap), layer_ids,
                   reference, noise)

    @functools.cached_property
    def tolerance(self) -> Tolerance:
        """A way that keeps rows apart agrees with the model's own forward within its rounding (float32: 1e-3; in
        reduced precision the model's own noise, measured); a leak moves states by O(1)."""
        return Tolerance.of(5e-2 if self.noise.dtype else 1e-3, self.noise)

    def group(self, indexes: list[int] | tuple[int, ...]) -> list[Sample]:
        return [self.rows[i] for i in indexes]


def _scope(n: int, spans: dict[str, int], max_length: int, cap: int) -> str:
    said = f"on rows of up to {n:,} tokens"
    if not spans:
        return said
    shorter = [f"its {name} of {size:,}" for name, size in spans.items() if size < n]
    longer = [f"its {name} of {size:,}" for name, size in spans.items() if size >= n]
    if shorter:
        said += ", longer than " + " and ".join(shorter)
    if longer and max_length <= n:
        said += "; " + " and ".join(longer) + f" reaches past --max-length {max_length:,}, which no row exceeds"
    elif longer:
        said += ("; " + " and ".join(longer) + f" is longer than the check's rows (at most {cap:,} tokens: "
                 f"{PROBE_MAX_TOKENS:,}, or half --token-budget so that the check's forwards fit where the run's do): "
                 "rows that reach past it are proven by the in-run audit alone")
    return said


def _where(error: torch.Tensor, median: float, probes: Probes, done: int, length: int) -> str:
    value, token, layer = largest(error)
    return (f"layer output {probes.layer_ids[layer]}, token {done + token} of a {length}-token row: relative "
            f"difference {value:.2g}, its median token {median:.2g}; the tolerance {probes.tolerance}")


def served_states(batch: Batch, k: int, states: torch.Tensor) -> torch.Tensor:
    """Row k of `batch`: its tokens' states in `states` (those this forward computed: after the first
    `batch.carried_tokens(k)`, which an earlier forward did)."""
    index = torch.cat([torch.arange(a, a + n) for a, n in batch.row_ranges[k]]).to(states.device)
    return states.index_select(0, index)


def _differing(batch: Batch, states: torch.Tensor, probes: Probes) -> str | None:
    """Where a row of `batch` in `states` differs from the model's own forward of it alone past the probes'
    tolerance, or None. Rows' tokens an earlier forward computed were compared with that forward."""
    for k, row in enumerate(batch.samples):
        done = batch.carried_tokens(k)
        error = relative_error(served_states(batch, k, states), probes.reference[row.row_id][done:])
        over, median = probes.tolerance.judge(error)
        if probes.tolerance.past(over, median):
            return _where(error, median, probes, done, len(row.input_ids))
    return None


def _differs(model: nn.Module, batches: list[Batch], probes: Probes) -> str | None:
    """Run `batches` in order (a cut tree's later ones continue what the earlier kept); None when every row they
    serve has the states the model's own forward gives it alone, else where it differs most, or why they failed."""
    with LayerCapture(model, probes.layer_ids, gather_into_torch) as capture:
        for batch in batches:
            try:
                states = own_states(capture, batch, model)
            except FAILURES as err:
                return f"the forward failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            where = _differing(batch, states, probes)
            if where is not None:
                return where
    return None


@torch.inference_mode()
def check_packing(model: nn.Module, probes: Probes) -> str | None:
    """A row packed after another against the model's own forward of each alone: None when they agree, else why
    packed batches are not this model's forward."""
    wrong = _differs(model, [make_packed_batch(probes.group(rows)) for rows in probes.together], probes)
    if wrong is None:
        return None
    return (f"a row packed after another differs from the model's own forward of it alone ({wrong}): this model's "
            "layers or kernels do not keep packed rows apart, or its attention does what packed attention does not")


@torch.inference_mode()
def check_continuation(model: nn.Module, probes: Probes) -> str | None:
    """Two rows that share a leading run as a segment tree (the run once, each rest continuing from its state:
    streamx.data.sharing), in one forward and cut into two (the second continuing from what the first kept:
    streamx.model.carry), against the model's own forward of each row alone: None when they agree, else why. Call
    it on a model `streamx.model.packing.enable` set up."""
    rows = probes.group(probes.continued)
    together = [packed_batch(pieces(share(rows, 1), sum(len(r.input_ids) for r in rows)))]
    cut = [packed_batch([piece]) for piece in pieces(share(rows, 1), len(rows[0].input_ids))]
    if together[0].segment_parents is None or len(cut) != 2 or cut[1].carry is None:
        raise AssertionError("the probe's rows must share their leading run")
    for way, batches in (("in one forward", together), ("across two forwards", cut)):
        wrong = _differs(model, batches, probes)
        if wrong is not None:
            return (f"a row continued from a shared prefix's state {way} differs from the model's own forward of the "
                    f"row alone ({wrong}): this model's layers do not continue from the prefix's state")
    return None


@torch.inference_mode()
def check_padded(model: nn.Module, probes: Probes) -> str | None:
    """Rows of different lengths right-padded into one batch, through the model's own attention, against its
    forward of each alone: None when they agree, else where they differ."""
    return _differs(model, [make_batch(probes.group(rows), 0) for rows in probes.together], probes)


def check_prefix_rows(probes: Probes) -> str | None:
    """A row's prefix, forwarded alone, against the longer row's first tokens (what a prefix row is served from), on
    each side of a length split: None when they agree, else why (a model whose states depend on the row's length:
    DeepSeek-V4's compressed attention)."""
    for row, prefix in (probes.group(pair) for pair in probes.prefixes):
        n = len(prefix.input_ids)
        error = relative_error(probes.reference[row.row_id][:n], probes.reference[prefix.row_id])
        over, median = probes.tolerance.judge(error)
        if probes.tolerance.past(over, median):
            where = _where(error, median, probes, 0, n)
            break
    else:
        return None
    return (f"a row's prefix alone differs from the longer row's first tokens ({where}): this model's states depend on "
            "the row's length, so a row that is a prefix of another is computed on its own")
