"""What a right way of computing rows may differ from the model's own forward by: the model's own noise, measured.

A token is compared as relative_error measures it: its distance from the model's own forward of the row alone,
relative to its own size. A right way rounds otherwise than the model's forward alone (other shapes, other kernels);
in float32 that moves a token by ~1e-6, under every floor. In bf16 it does not stay small: a rounding flipped in an
early layer grows through the later ones, so the model's own forward of a row alone and of the same row among copies
of itself differ by 0.02 on a typical token and 0.05-0.1 on the worst (SmolLM2-135M's 30 layers; a deeper model
more): past the fixed bf16 tolerance of 0.05 streamx had, which found right rows wrong. So in reduced precision the
model's own noise is measured at start-up (`Noise.of`: a row alone against the row among NOISE_COPIES copies of
itself in one forward, nothing but the rounding of other shapes), and a way is judged against NOISE_MARGIN times
it (`Tolerance`): no token further than that times the noise's worst token, and no row whose median token is
further than that times the noise's typical token (a wrong way moves most tokens of a row past where it goes wrong,
rounding moves a few far). A wrong way moves states by 0.1 to O(1) in a model whose noise is far below that; a model
louder than what it would take to see a wrong way says so (`Tolerance.explained`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data.batching import Batch, make_batch
from ..data.tokenize import Sample
from ..model.capture import LayerCapture

NOISE_MARGIN = 4.0  # a right way against the noise: SmolLM2 in bf16 batched its rows within 2x of its own noise
NOISE_COPIES = (4, 8)  # a row among this many copies of itself in one forward (fewer where the budget is smaller)
NOISE_TOKENS = 512  # the rows the noise is measured on, at most this long
RANKING_FIELDS = ("num_experts_per_tok", "n_routed_experts", "num_local_experts", "num_experts", "moe_topk",
                  "index_topk", "index_topk_blocks")  # config fields of a model that picks experts or keys by rank
WRONG_WAY = 0.1  # the least a wrong way of computing rows has moved a token by (a leak, a rope off by two: 0.1-O(1))
TIE_SHARE = 0.01  # of a model that picks by rank, this share of tokens may be near a tie (another pick, far off)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[tokens, layers]: each token's distance from `want` relative to its own size (so that a first token's massive
    activation hides nothing)."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)


def largest(error: torch.Tensor) -> tuple[float, int, int]:
    """The largest entry of a [tokens, layers] error, its token and its layer (index)."""
    value, at = error.flatten().max(0)
    token, layer = divmod(int(at), error.shape[1])
    return float(value), token, layer


def picks_by_ranking(model: nn.Module) -> bool:
    """Whether the model picks experts or keys by rank (a MoE router, a sparse attention's top-k), which rounding
    may flip near a tie."""
    text = model.config.get_text_config()
    return any(isinstance(getattr(text, name, None), int) and getattr(text, name) > 0 for name in RANKING_FIELDS)


def reduced_precision(dtype: torch.dtype) -> bool:
    """Whether a forward in `dtype` rounds enough to be measured (bf16, fp16); float32 rounds far below any floor."""
    return dtype not in (torch.float32, torch.float64)


@dataclass(frozen=True)
class Noise:
    """How far the model's own forwards of one row differ among themselves in its dtype (per token, relative_error):
    zero where it was not measured (float32)."""

    typical: float = 0.0  # the median token's difference
    worst: float = 0.0  # the largest token's (of a model that picks by rank, but for TIE_SHARE of them: ties)
    dtype: str = ""  # the reduced precision it was measured in; "": not measured (float32)

    @classmethod
    @torch.inference_mode()
    def of(cls, model: nn.Module, capture: LayerCapture, rows: list[Sample], token_budget: int | None) -> Noise:
        """Measured on `rows` (cut to NOISE_TOKENS): each alone against each among copies of itself in one forward,
        as many copies as NOISE_COPIES and `token_budget` allow (at least two). Call it while the model runs its own
        attention and layers; `capture` hooks the layers compared."""
        parameter = next(model.parameters())
        per_token = []
        for row in rows:
            n = min(len(row.input_ids), NOISE_TOKENS)
            row = Sample(row.row_id, row.input_ids[:n], row.loss_mask[:n])
            alone = own_states(capture, make_batch([row], 0), model)
            fits = max(2, (token_budget or n * max(NOISE_COPIES)) // n)
            for copies in sorted({min(c, fits) for c in NOISE_COPIES}):
                together = own_states(capture, make_batch([row] * copies, 0), model).view(copies, n, *alone.shape[1:])
                per_token += [relative_error(states, alone).max(dim=1).values for states in together]
        errors = torch.cat(per_token)
        errors = errors[errors.isfinite()]  # (a forward that overflows has nothing to compare)
        dtype = str(parameter.dtype).removeprefix("torch.")
        if not errors.numel():
            return cls(dtype=dtype)
        worst = errors.quantile(1 - TIE_SHARE) if picks_by_ranking(model) else errors.max()
        return cls(float(errors.median()), float(worst), dtype)


def own_states(capture: LayerCapture, batch: Batch, model: nn.Module) -> torch.Tensor:
    """[computed tokens, compared layers, hidden] of one forward of `batch`, in the model's dtype."""
    parameter = next(model.parameters())
    states = torch.empty(batch.num_tokens, len(capture.layer_ids), capture.residual.width,
                         dtype=parameter.dtype, device=parameter.device)
    capture.forward(batch, states)
    return states


@dataclass(frozen=True)
class Tolerance:
    """What a right way of computing rows may differ from the model's own forward by: a token by `token`, a row's
    median token by `typical` (the dtype's floor, or NOISE_MARGIN times the model's own noise where larger)."""

    token: float
    typical: float
    noise: Noise = Noise()

    @classmethod
    def of(cls, floor: float, noise: Noise) -> Tolerance:
        return cls(max(floor, NOISE_MARGIN * noise.worst), max(floor, NOISE_MARGIN * noise.typical), noise)

    def judge(self, error: torch.Tensor) -> tuple[int, float]:
        """Of a row's [tokens, layers] error: its tokens over `token`, and its median token's difference."""
        per_token = error.max(dim=1).values
        return int((~(per_token <= self.token)).sum()), float(per_token.median())

    def past(self, over: int, median: float, allowed: int = 0) -> bool:
        """Whether a row judged so (`judge`) is more than rounding: more than `allowed` tokens over `token` (ties:
        Audit), or its median token over `typical`."""
        return over > allowed or not median <= self.typical

    def to_json(self) -> dict:
        return {"token": self.token, "typical": self.typical, "noise_typical": self.noise.typical,
                "noise_worst": self.noise.worst, "dtype": self.noise.dtype}

    def __str__(self) -> str:
        return f"{self.token:.2g} on a token" + (f", {self.typical:.2g} on a row's median token" if self.noise.dtype
                                                 else "")

    def explained(self) -> str:
        """For the run's header: the tolerance and where it comes from."""
        if not self.noise.dtype:
            return str(self)
        return (f"{self} ({NOISE_MARGIN:g}x this model's own {self.noise.dtype} noise, measured at start-up: "
                f"{self.noise.worst:.2g} on its worst token, {self.noise.typical:.2g} on a typical one, between its "
                "forwards of a row alone and among copies of itself)"
                + ("; a wrong way that moves states by less than that hides in its noise" if self.token > WRONG_WAY
                   else ""))
