"""`streamx bench`: the full pipeline against the plain forward pass and the naive per-sample approach.

The modes run in one process on the same samples and device, in rounds whose order rotates so
that machine drift hits all of them equally:
  forward_only      the decoder over the run's batches, nothing captured or written
  forward_padded    the same samples in padded batches (when the run packs)
  streamx           the full pipeline (pipeline.run) into a temporary store
  streamx_unshared  the same with --sharing off: every row computed in full (when the run shares)
  streamx_unaudited the same with --audit-every 0: the in-run audit's cost is streamx / streamx_unaudited
  naive             what HF-based dumpers do: per sample, the CausalLM with output_hidden_states=True,
                    selected layers taken from the tuple, one safetensors file written synchronously
Rates count the rows' tokens (what every mode delivers), so that sharing shows as speed.
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ..config import RunConfig
from ..data.batching import Batch
from ..data.tokenize import Sample
from ..model.capture import find_decoder
from ..model.carry import Kept, carrying
from ..model.load import library_bars
from ..model.packing import padded_attention
from ..model.segments import forward_inputs
from ..pipeline.plan import RunPlan, make_plan
from ..pipeline.runner import run
from ..store import Audited, SharedKinds
from .ceilings import host_copy_gb_per_s, matmul_peak_tflops
from .writebench import write_ceiling

MODES = ("forward_only", "forward_padded", "streamx", "streamx_unshared", "streamx_unaudited", "naive")  # (above)


class PeakRSS:
    """Peak resident memory while a block runs (sampled; ru_maxrss only ever grows per process)."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the process-wide high-water mark
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_only(model, batches: list[Batch], device: torch.device, kept: Kept | None = None) -> dict[str, Any]:
    """The decoder alone over `batches`, in order (a cut tree's later batches continue what `kept` holds)."""
    decoder, kept = find_decoder(model).module, kept or Kept()
    with torch.inference_mode():
        for batch in batches:
            with carrying(batch.carry, kept):
                decoder(**forward_inputs(batch, device, kept), use_cache=False)
    _sync(device)
    return {"bytes_written": 0}


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


# torch counts the GPU's fused attention kernels but not the CPU's: the same formula for both
_CPU_ATTENTION_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
                        torch.ops.aten.scaled_dot_product_attention: _cpu_sdpa_flops}


def warm_up(model, batches: list[Batch], device: torch.device) -> dict[tuple, int]:
    """One forward over one batch of each distinct shape, before anything is timed: compilation and
    autotuning happen per shape (Triton, flash-linear-attention) and would otherwise land in the first
    timed round. The forwards run under torch's FLOP counter, so the result is the model FLOPs of
    each shape: matmuls and attention as executed, MoE experts as routed; custom Triton kernels such as
    flash-linear-attention's recurrence (about 1% of a gated delta-net layer's FLOPs) go uncounted. Where
    batches continue what earlier ones kept (streamx.model.carry), every batch runs, in order."""
    flops: dict[tuple, int] = {}
    in_order, kept = any(b.carry is not None for b in batches), Kept()
    for batch in batches:
        if batch.shape_key in flops:
            if in_order:
                forward_only(model, [batch], device, kept)
            continue
        with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS) as counter:
            forward_only(model, [batch], device, kept)
        flops[batch.shape_key] = counter.get_total_flops()
    return flops


def naive(model, samples: list[Sample], layer_ids: list[int], device: torch.device, out_dir: Path) -> dict[str, Any]:
    written = 0
    with torch.inference_mode():
        for sample in samples:
            out = model(input_ids=sample.input_ids[None].to(device), output_hidden_states=True)
            hidden = torch.stack([out.hidden_states[i][0] for i in layer_ids], dim=1).to(torch.bfloat16).cpu()
            path = out_dir / f"{sample.row_id}.safetensors"
            save_file({"hidden_states": hidden, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask},
                      str(path))
            written += path.stat().st_size
    return {"bytes_written": written}


def calibrate(config: RunConfig, batches: int = 8, log: Callable[[str], None] = print) -> float:
    """Tokens/s of the model's forward pass over the first `batches` batches of the data, after one
    uncounted batch (kernels load or compile): the rate `streamx run` approaches (bench/RESULTS.md)."""
    plan = make_plan(config.replace(space_check=False), log=log)
    taken = list(itertools.islice((b for b in plan.batch_stream() if isinstance(b, Batch)), batches + 1))
    if len(taken) < 2:
        raise ValueError("too few rows to calibrate on: pass --tokens-per-s")
    kept = Kept()  # the timed batches may continue what the first one kept
    forward_only(plan.model, taken[:1], plan.device, kept)
    timed = taken[1:]
    started = time.perf_counter()
    forward_only(plan.model, timed, plan.device, kept)
    return sum(b.num_tokens for b in timed) / (time.perf_counter() - started)


def machine() -> dict[str, Any]:
    info = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


@dataclass
class Workload:
    """What every mode runs, built once from the plan: the run's own batches (RunPlan.batch_stream), the same
    samples in padded batches (forward_padded, when the run packs), and their model FLOPs."""

    plan: RunPlan
    batches: list[Batch]
    padded_batches: list[Batch]
    flops_by_shape: dict[tuple, int] = field(default_factory=dict)  # filled by warm_up

    @classmethod
    def build(cls, plan: RunPlan, padded: bool) -> Workload:
        batches = [b for b in plan.batch_stream() if isinstance(b, Batch)]
        padded_batches = [b for b in plan.batch_stream(packed=False) if isinstance(b, Batch)] if padded else batches
        if not batches:
            raise ValueError("no usable samples in the data")
        return cls(plan, batches, padded_batches)

    @property
    def samples(self) -> list[Sample]:
        return sorted((s for b in self.batches for s in b.samples), key=lambda s: s.row_id)

    @property
    def tokens(self) -> int:
        """The rows' tokens: what every mode delivers."""
        return sum(b.row_tokens for b in self.batches)

    @property
    def computed_tokens(self) -> int:
        """What the run's batches compute (fewer than the rows' tokens where rows share)."""
        return sum(b.num_tokens for b in self.batches)

    @property
    def round_flops(self) -> int:
        return sum(self.flops_by_shape[b.shape_key] for b in self.batches)

    def warm_up(self, padded: bool) -> None:
        """Every batch shape once before timing (and the padded ones, under the padded attention)."""
        model, device = self.plan.model, self.plan.device
        self.flops_by_shape = warm_up(model, self.batches, device)
        if padded:
            with padded_attention(model):
                warm_up(model, self.padded_batches, device)


def run_mode(mode: str, work: Workload, scratch: Path, r: int) -> tuple[dict[str, Any], Any]:
    """One round of one mode: what it wrote, and the run's summary for the streamx mode."""
    plan = work.plan
    if mode == "forward_only":
        return forward_only(plan.model, work.batches, plan.device), None
    if mode == "forward_padded":  # the same samples in padded batches, as --packing off runs them
        with padded_attention(plan.model):
            return forward_only(plan.model, work.padded_batches, plan.device), None
    if mode in ("streamx", "streamx_unshared", "streamx_unaudited"):
        store = scratch / f"round{r}.zarr"
        planned = plan.unshared() if mode == "streamx_unshared" else plan.unaudited() \
            if mode == "streamx_unaudited" else plan
        summary = run(planned.with_output(str(store), overwrite=True), progress=False, log=lambda m: None,
                      wind_up_on_signals=False)
        written = _dir_bytes(store)
        shutil.rmtree(store)  # a round's store can be GBs: keep one at a time
        return {"bytes_written": written}, summary
    naive_dir = scratch / f"naive{r}"
    naive_dir.mkdir()
    out = naive(plan.model, work.samples, plan.layer_ids, plan.device, naive_dir)
    shutil.rmtree(naive_dir)
    return out, None


def bench(config: RunConfig, rounds: int = 2, progress: bool = True, log: Callable[[str], None] = print,
          modes: tuple[str, ...] = MODES, out_dir: str | None = None, ceiling_bytes: int = 1 << 30,
          warmup_rounds: int | None = None) -> dict[str, Any]:
    """Run the modes `rounds` times each, interleaved; figures are totals over the rounds. Before them,
    the model sees every batch shape once (kernel compilation and autotuning are per shape), then
    `warmup_rounds` rounds of every mode run uncounted (default: 1 on CUDA, where the naive mode's
    per-sample shapes and the gather kernel compile too; 0 on CPU). Stores and naive files go to a
    temporary folder in `out_dir` (default: the system's), whose plain sequential write speed is
    measured too (`ceiling_bytes` per pass), so the report can say whether the disk binds; `config.out`
    is neither read nor written."""
    unknown = set(modes) - set(MODES)
    if unknown or "streamx" not in modes:
        raise ValueError(f"modes must include streamx and be among {', '.join(MODES)}; got {', '.join(modes)}")
    library_bars(progress)
    with tempfile.TemporaryDirectory(prefix="streamx-bench-", dir=out_dir) as tmp:
        # what `streamx run` would do, loaded once for every mode, planned into the scratch folder: bench writes
        # only temporary stores, so a store at --out (another run's) is neither read nor refused
        plan = make_plan(config.replace(out=str(Path(tmp) / "store.zarr")), log=log)
        return _bench(plan, Path(tmp), rounds, progress, log, modes, out_dir, ceiling_bytes, warmup_rounds)


def _bench(plan: RunPlan, scratch: Path, rounds: int, progress: bool, log: Callable[[str], None],
           modes: tuple[str, ...], out_dir: str | None, ceiling_bytes: int,
           warmup_rounds: int | None) -> dict[str, Any]:
    """bench's modes over `plan`, their stores and files in `scratch`."""
    if not plan.packing.on:  # the forward pass over padded batches is forward_only itself
        modes = tuple(m for m in modes if m != "forward_padded")
    if not plan.sharing.on:  # streamx computes every row in full already
        modes = tuple(m for m in modes if m != "streamx_unshared")
    if not plan.config.audit_every:  # streamx audits nothing already
        modes = tuple(m for m in modes if m != "streamx_unaudited")
    work = Workload.build(plan, padded="forward_padded" in modes)
    work.warm_up(padded="forward_padded" in modes)
    device = plan.device
    warmups = (1 if device.type == "cuda" else 0) if warmup_rounds is None else warmup_rounds
    peak, host_copy = matmul_peak_tflops(device), host_copy_gb_per_s(device)
    ceiling = write_ceiling(out_dir, ceiling_bytes)
    totals = {m: {"seconds": 0.0, "rounds": [], "peak_rss_bytes": 0, "peak_device_bytes": 0, "bytes_written": 0}
              for m in modes}
    stages: dict[str, float] = {}
    fills: dict[str, float] = {}
    shared: SharedKinds | None = None
    audited = None
    samples, real = len(work.samples), work.tokens
    for r in range(warmups + rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                out, summary = run_mode(mode, work, scratch, r)
                seconds = time.perf_counter() - t0
            if r < warmups:
                log(f"warm-up round {r + 1}/{warmups} {mode:<12} {real / seconds:10,.0f} tokens/s (not counted)")
                continue
            if summary is not None and mode == "streamx":
                for k, v in summary.stage_seconds.items():
                    stages[k] = stages.get(k, 0.0) + v
                fills, shared = summary.queue_fill, summary.shared
                audited = summary.audit
            t = totals[mode]
            t["seconds"] += seconds
            t["rounds"].append(seconds)
            t["peak_rss_bytes"] = max(t["peak_rss_bytes"], rss.peak)
            t["bytes_written"] = out["bytes_written"]  # per round
            if device.type == "cuda":
                t["peak_device_bytes"] = max(t["peak_device_bytes"], torch.cuda.max_memory_allocated(device))
            if progress:
                log(f"round {r - warmups + 1}/{rounds} {mode:<12} {samples / seconds:8.2f} samples/s "
                    f"{real / seconds:10,.0f} tokens/s")
    busy = {k: v / rounds for k, v in stages.items()}
    out = report(work, modes, totals, busy, fills, rounds, warmups,
                 {"bf16_matmul_peak_tflops": peak, "host_copy_gb_per_s": host_copy, "write_gb_per_s": ceiling / 1e9},
                 shared)
    out["streamx"]["audit"] = audited.to_json() if audited is not None else None
    return out


def report(work: Workload, modes: tuple[str, ...], totals: dict[str, dict[str, Any]], busy: dict[str, float],
           fills: dict[str, float], rounds: int, warmups: int, ceilings: dict[str, float | None],
           shared: SharedKinds | None = None) -> dict[str, Any]:
    """The figures of the measured rounds: per mode, the streamx run's stages and ceilings, the ratios; `shared`:
    what the streamx run's store shares, by kind."""
    plan, samples, real = work.plan, len(work.samples), work.tokens
    peak, ceiling = ceilings["bf16_matmul_peak_tflops"], ceilings["write_gb_per_s"] * 1e9
    out: dict[str, Any] = {}
    for mode in modes:
        t = totals[mode]
        out[mode] = {
            "samples_per_s": rounds * samples / t["seconds"],
            "tokens_per_s": rounds * real / t["seconds"],
            "rounds_tokens_per_s": [real / seconds for seconds in t["rounds"]],  # drift shows here
            "spread": (max(t["rounds"]) - min(t["rounds"])) / (t["seconds"] / rounds),  # of round times
            "seconds": t["seconds"] / rounds,
            "padding_efficiency": 1.0 if mode in ("naive", "streamx_unshared") else _padding_efficiency(
                work.padded_batches if mode == "forward_padded" else work.batches),
            "peak_rss_bytes": t["peak_rss_bytes"],
            "peak_device_bytes": t["peak_device_bytes"],
            "bytes_written_per_token": t["bytes_written"] / real,
        }
    for mode in ("forward_only", "streamx"):
        if mode in out:  # both compute the model's forward over the same batches: the same model FLOPs
            achieved = work.round_flops / out[mode]["seconds"] / 1e12
            out[mode]["model_tflops_per_s"] = achieved
            out[mode]["fraction_of_matmul_peak"] = achieved / peak if peak else None
    s = out["streamx"]
    s["stage_seconds"] = busy
    s["queue_fill"] = fills
    state_bytes = work.computed_tokens * plan.layout.bytes_per_token  # per round
    s["write_ceiling_bytes_per_s"] = ceiling
    s["host_copy_bytes_per_s"] = ceilings["host_copy_gb_per_s"] * 1e9 if ceilings["host_copy_gb_per_s"] else None
    s["writer_bytes_per_s"] = state_bytes / busy["write"] if busy.get("write") else None
    at_forward = out.get("forward_only", {}).get("seconds")
    s["bytes_per_s_at_forward_only"] = state_bytes / at_forward if at_forward else None
    s["bottleneck"] = bottleneck(busy, state_bytes, ceiling, plan.device.type == "cuda")
    out["ratios"] = {f"streamx_vs_{m}": out["streamx"]["tokens_per_s"] / out[m]["tokens_per_s"]
                     for m in modes if m != "streamx"}
    # each round's ratio (the modes of a round run back to back): how far one round's figure may swing
    mine = totals["streamx"]["rounds"]
    out["ratios_by_round"] = {f"streamx_vs_{m}": [a / b for a, b in zip(totals[m]["rounds"], mine, strict=True)]
                              for m in modes if m != "streamx"}
    if "streamx_unshared" in out:
        out["ratios"]["bytes_shared_vs_unshared"] = (out["streamx"]["bytes_written_per_token"]
                                                     / out["streamx_unshared"]["bytes_written_per_token"])
    if "forward_padded" in out and "forward_only" in out:
        out["ratios"]["packed_vs_padded_forward"] = (out["forward_only"]["tokens_per_s"]
                                                     / out["forward_padded"]["tokens_per_s"])
    out["workload"] = {"samples": samples, "tokens": real, "computed_tokens": work.computed_tokens,
                       "sharing": str(plan.sharing), "shared": asdict(shared) if shared else None,
                       "padded_tokens": sum(b.padded_tokens for b in work.batches),
                       "batches": len(work.batches), "batch_shapes": len(work.flops_by_shape),
                       "packing": str(plan.packing), "layer_ids": plan.layer_ids, "rounds": rounds,
                       "warmup_rounds": warmups, "model_flops_per_round": work.round_flops,
                       "model_flops_per_real_token": work.round_flops / work.computed_tokens}
    out["ceilings"] = ceilings
    out["machine"] = machine()
    info = plan.info
    out["model"] = {"model": info.model, "architecture": info.architecture, "num_layers": info.num_layers,
                    "hidden_size": info.hidden_size, "dtype": info.dtype, "device": info.device,
                    "random_weights": info.random_weights}
    out["config"] = plan.config.to_dict()
    return out


def _padding_efficiency(batches: list[Batch]) -> float:
    return sum(b.num_tokens for b in batches) / sum(b.padded_tokens for b in batches)


def bottleneck(busy: dict[str, float], state_bytes: int, ceiling: float, cuda: bool) -> str:
    """The stage thread whose busy time is closest to the wall time bounds the run (they overlap).
    The writer's busy time includes waiting for the filesystem: when writing the bytes at the
    measured ceiling would take most of it, the disk binds rather than the writer's own work."""
    model = "GPU stage (forward, gather, copy to host)" if cuda else "model stage (forward, gather)"
    threads = {"producer (source, tokenize, batching)": busy.get("source_tokenize", 0) + busy.get("batching", 0),
               model: sum(busy.get(stage, 0) for stage in ("forward", "gather", "quantize", "d2h")),
               "writer": busy.get("write", 0)}
    name = max(threads, key=threads.get)
    if name == "writer" and state_bytes / ceiling >= 0.8 * threads["writer"]:
        return "disk (the writer moves bytes at the filesystem's plain write speed)"
    return name


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def format_report(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"{report['model']['model']} on {report['model']['device']} ({report['model']['dtype']}), "
             f"{w['samples']} samples, {w['tokens']:,} tokens, layers {w['layer_ids']}, {w['rounds']} rounds after "
             f"{w['warmup_rounds']} warm-up round(s) and one forward per batch shape ({w['batch_shapes']})",
             f"{'mode':<18}{'samples/s':>11}{'tokens/s':>12}{'pad eff':>9}{'peak RSS':>11}{'dev mem':>10}"
             f"{'B/token':>10}"]
    for mode in (m for m in MODES if m in report):
        m = report[mode]
        lines.append(f"{mode:<18}{m['samples_per_s']:>11.2f}{m['tokens_per_s']:>12,.0f}{m['padding_efficiency']:>9.1%}"
                     f"{m['peak_rss_bytes'] / 2**30:>9.2f}GB{m['peak_device_bytes'] / 2**30:>8.2f}GB"
                     f"{m['bytes_written_per_token']:>10,.0f}")
    by_round = report.get("ratios_by_round", {})
    lines.append(", ".join(f"streamx / {k.removeprefix('streamx_vs_')} = {v:.3f}x"
                           + (f" (rounds {min(by_round[k]):.2f}-{max(by_round[k]):.2f}x)"
                              if len(by_round.get(k, [])) > 1 else "")
                           for k, v in report["ratios"].items() if k.startswith("streamx_vs_")))
    if "bytes_shared_vs_unshared" in report["ratios"]:
        lines.append(f"sharing ({w['sharing']}): {w['computed_tokens']:,} of {w['tokens']:,} row tokens computed and "
                     f"stored ({w['computed_tokens'] / w['tokens']:.1%}"
                     + (f"; shared: {SharedKinds(**w['shared']).phrase(w['tokens'])}" if w.get("shared") else "")
                     + "); streamx / streamx_unshared = "
                     f"{report['ratios']['streamx_vs_streamx_unshared']:.3f}x the speed, "
                     f"{report['ratios']['bytes_shared_vs_unshared']:.3f}x the bytes")
    if "streamx_vs_streamx_unaudited" in report["ratios"]:
        audit = report["streamx"].get("audit") or {}
        ratio = report["ratios"]["streamx_vs_streamx_unaudited"]
        share = audit["seconds"] / audit["forward_seconds"] if audit.get("forward_seconds") else 0.0
        found = audit.get("found") or []
        lines.append(f"in-run audit: {audit.get('rows', 0):,} rows ({audit.get('tokens', 0):,} tokens) recomputed "
                     f"alone per round, {share:.1%} of the forward time; streamx / streamx_unaudited = {ratio:.3f}x "
                     "the speed" + Audited.from_json(audit).judged()
                     + (f"; ways found wrong: {' | '.join(f['way'] for f in found)}" if found else ""))
    if "packed_vs_padded_forward" in report["ratios"]:
        lines.append(f"forward pass, packed / padded batches = {report['ratios']['packed_vs_padded_forward']:.3f}x "
                     f"(padding efficiency {report['forward_padded']['padding_efficiency']:.1%} when padded)")
    peak = report["ceilings"]["bf16_matmul_peak_tflops"]
    lines.append(f"model FLOPs: {_flop(w['model_flops_per_real_token'])} per computed token (padding included); "
                 + "; ".join(f"{mode} {_flop(report[mode]['model_tflops_per_s'] * 1e12)}/s"
                             + (f" ({report[mode]['fraction_of_matmul_peak']:.0%} of the bf16 matmul peak, "
                                f"{peak:.0f} TFLOP/s measured in this run)" if peak else "")
                             for mode in ("forward_only", "streamx") if mode in report))
    lines.append("tokens/s per round: " + "; ".join(
        f"{mode} " + " ".join(f"{x:,.0f}" for x in report[mode]["rounds_tokens_per_s"])
        + f" (spread {report[mode]['spread']:.0%})" for mode in MODES if mode in report))
    s = report["streamx"]
    lines.append("streamx stage busy time (s/round): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in s["stage_seconds"].items()))
    rates = [f"write ceiling {_rate(s['write_ceiling_bytes_per_s'])} (plain sequential writes to the output "
             f"filesystem, measured in this run)"]
    if s["host_copy_bytes_per_s"]:
        rates.append(f"device-to-host copy {_rate(s['host_copy_bytes_per_s'])} (pinned)")
    if s["writer_bytes_per_s"]:
        rates.append(f"writer {_rate(s['writer_bytes_per_s'])} while busy")
    if s["bytes_per_s_at_forward_only"]:
        rates.append(f"the forward pass's rate needs {_rate(s['bytes_per_s_at_forward_only'])}")
    lines.append("; ".join(rates))
    lines.append("queue fill: " + ", ".join(f"{k} {v:.0%}" for k, v in s["queue_fill"].items())
                 + f"; bottleneck: {s['bottleneck']}")
    return "\n".join(lines)


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _flop(flop: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flop >= scale:
            return f"{flop / scale:.2f} {unit}"
    return f"{flop:,.0f} FLOP"
