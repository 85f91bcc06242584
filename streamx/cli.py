"""The `streamx` command: a thin shell over the Python API. Each command parses its options, calls the
API, and prints the text its result gives (`lines()`); the run settings' options are generated from
RunConfig."""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import fields
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import typer

from .base.location import local_path
from .base.threads import Interrupted
from .config import RegenerateConfig, RunConfig, StorageName, load_config

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Stream a causal LM's selected hidden states over a chat dataset into a Zarr store "
                       "for speculative-decoding drafter training.")


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML file of settings, e.g. "
                                                    "configs/default.yaml (run) or configs/regenerate.yaml; flags "
                                                    "override it.")]


def _option_type(hint: Any) -> Any:
    """The type a setting's option parses: Optional[X] or X | None -> X (Literal choices are kept, typer lists
    them)."""
    if get_origin(hint) in (Union, types.UnionType):
        return next(t for t in get_args(hint) if t is not type(None))
    return hint


def with_settings(cls: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one option per field of the settings class `cls` (RunConfig, RegenerateConfig: its declared
    help, the default shown) plus --config. The command's first parameter receives the settings: defaults <
    --config < flags."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = list(signature(command).parameters.values())[1:]
        hints = get_type_hints(cls)
        defaults = cls().to_dict()
        settings = []
        for f in fields(cls):
            kind = _option_type(hints[f.name])
            flag = "--" + f.name.replace("_", "-")
            decl = f"{flag}/--no-{flag[2:]}" if kind is bool else flag
            value = defaults[f.name]
            default = "unset" if value is None else str(value).lower() if kind is bool else str(value)
            repeated = get_origin(kind) is list  # e.g. --endpoint A --endpoint B
            option = typer.Option(None, decl, help=f"{f.metadata['help']}  [default: {default}]", show_default=False,
                                  metavar=f"<{get_args(kind)[0].__name__}>..." if repeated else None)
            settings.append(Parameter(f.name, Parameter.KEYWORD_ONLY, default=option, annotation=Optional[kind]))
        config = Parameter("config", Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOpt)

        @functools.wraps(command)
        def wrapper(*, config: Path | None = None, **options: Any) -> None:
            overrides = {f.name: options.pop(f.name) for f in fields(cls)}
            try:
                loaded = load_config(config, cls, **overrides)
            except Exception as err:  # noqa: BLE001 - a bad setting is one line for the user
                _fail(err)
            command(loaded, **options)

        own = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in own]
        wrapper.__signature__ = Signature([config, *settings, *own])
        return wrapper

    return decorate


with_run_settings = with_settings(RunConfig)


def _fail(err: BaseException) -> None:
    """One line on stderr and exit 1 (a second signal: 128 + its number); STREAMX_DEBUG=1 shows the traceback
    instead."""
    if os.environ.get("STREAMX_DEBUG"):
        raise err
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(128 + err.signal.value if isinstance(err, Interrupted) else 1)


def _version(show: bool) -> None:
    if show:
        from . import __version__
        typer.echo(f"streamx {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print streamx's version and exit.")) -> None:
    """Stream a causal LM's selected hidden states over a chat dataset into a Zarr store for speculative-decoding
    drafter training."""


def _this_command() -> str:
    """The command line this process was started with, as the user types it again to resume."""
    return shlex.join(["streamx", *sys.argv[1:]])


def _log(message: str) -> None:
    typer.echo(message, err=True)


def _quiet(message: str) -> None:
    pass


@app.command()
@with_run_settings
def run(
    cfg: RunConfig,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress: a live bar on a terminal, "
                                  "a status line every 30 s in a log."),
) -> None:
    """Run the model over the data and write the selected layers' hidden states to a store. Ctrl-C or SIGTERM
    commits what is written and exits 130 / 143; the same command resumes."""
    from .pipeline.runner import run as run_pipeline

    try:
        summary = run_pipeline(cfg, progress=progress, log=_log)
    except (Exception, Interrupted) as err:  # noqa: BLE001 - every failure is one line for the user
        _fail(err)
    typer.echo("\n".join(summary.lines(command=_this_command())))
    if summary.stopped_by:  # the shell's convention for a process ended by a signal: 128 + its number
        raise typer.Exit(128 + signal.Signals[summary.stopped_by].value)
    if summary.committed_nothing:
        _fail(RuntimeError(f"this run committed none of its rows: all {summary.rejects:,} were rejected (above)"))


@app.command()
@with_settings(RegenerateConfig)
def regenerate(
    cfg: RegenerateConfig,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress: a live bar on a terminal, "
                                  "a status line every 30 s in a log."),
) -> None:
    """Let the target model write every assistant turn of the data again, turn by turn on its own earlier replies,
    into a .jsonl that `streamx run --data` reads. Re-running resumes (every row exactly once); rows that fail
    go to OUT.errors.jsonl and are tried again by the next run. Ctrl-C or SIGTERM finishes the rows in flight and
    exits 130 / 143."""
    from .regen.runner import regenerate as run_regenerate

    try:
        summary = run_regenerate(cfg, progress=progress, log=_log)
    except (Exception, Interrupted) as err:  # noqa: BLE001 - every failure is one line for the user
        _fail(err)
    typer.echo("\n".join(summary.lines(command=_this_command())))
    if summary.stopped_by:
        raise typer.Exit(128 + signal.Signals[summary.stopped_by].value)
    if summary.errors and not summary.rows:  # every row tried failed: for scripts, a failure
        raise typer.Exit(1)


@app.command()
@with_run_settings
def plan(
    cfg: RunConfig,
    sample_rows: int = typer.Option(4096, help="Rows to tokenize, spread over the data (all rows when there are no "
                                    "more); with --sharing, as many again in 16 runs of consecutive rows, to size "
                                    "what sharing stores."),
    tokens_per_s: Optional[float] = typer.Option(None, help="The run's rate, for the time estimate (e.g. from "
                                                 "streamx bench)."),
    calibrate: bool = typer.Option(False, "--calibrate/--no-calibrate", help="Load the model and time its forward "
                                   "pass on a few batches of the data, for the time estimate."),
    gpu: Optional[str] = typer.Option(None, "--gpu", metavar="NAME", help="The GPUs the job runs on, for the memory "
                                      "each --tp needs and the time estimate: h100, h200, b200, b300, rtx-pro-6000, "
                                      "a100 (their data sheets' memory and dense bf16 peak; --gpu-memory and "
                                      "--gpu-tflops override them)."),
    gpu_memory: Optional[float] = typer.Option(None, help="The GPUs' memory in GB, to say which --tp fits (default: "
                                               "--gpu's, else this machine's first GPU, else 80)."),
    gpus: int = typer.Option(1, help="GPUs the whole job runs on, for the time estimate where no rate is given or "
                             "calibrated."),
    mfu: float = typer.Option(0.4, help="The share of each GPU's peak the forward sustains, for that estimate (an "
                              "assumption: --tokens-per-s from `streamx bench` replaces it)."),
    gpu_tflops: Optional[float] = typer.Option(None, help="Each GPU's dense bf16 peak in TFLOPS, for that estimate "
                                               "(default: --gpu's, else 989: H100 and H200)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Say what `streamx run` with the same settings would write, before running it: rows, tokens, the
    store's bytes and files for each storage choice, the free space at --out, the time, and the memory per GPU
    at each --tp (which fits). Exit code 1 where the store does not fit the free space (with the settings that make
    it fit) or no --tp fits the GPUs."""
    import torch

    from .measure.bench import calibrate as calibrate_rate
    from .model.flops import CARDS, H100_BF16_TFLOPS
    from .pipeline.estimate import estimate, gpu_forecast
    from .pipeline.plan import check_parallel, preflight

    try:
        if sample_rows < 1:
            raise ValueError(f"--sample-rows must be >= 1; got {sample_rows}")
        if gpu is not None and gpu.lower() not in CARDS:
            raise ValueError(f"--gpu must be one of {', '.join(CARDS)}; got {gpu!r} (or give --gpu-memory and "
                             "--gpu-tflops)")
        card = CARDS.get((gpu or "").lower())
        check_parallel(cfg)  # what `streamx run` would refuse, refused here
        preflight(cfg, cfg.device, _log)
        est = estimate(cfg, sample_rows=sample_rows, count_duplicates=True)
        rate, how = tokens_per_s, "given"
        if rate is None and calibrate:
            rate, how = calibrate_rate(cfg, log=_log), "calibrated: forward pass alone"
        gpu_memory = gpu_memory or (card.memory_gb if card else None)
        gpu_bytes = round(gpu_memory * 1e9) if gpu_memory else torch.cuda.get_device_properties(0).total_memory \
            if torch.cuda.is_available() else 80 * 10**9
        forecast = gpu_forecast(cfg, est, rate, how, gpu_bytes, gpus, mfu,
                                gpu_tflops or (card.tflops if card else H100_BF16_TFLOPS), card.name if card else "")
    except (Exception, Interrupted) as err:  # noqa: BLE001
        _fail(err)
    typer.echo(json.dumps(forecast.to_json(), indent=2) if as_json else "\n".join(forecast.lines()))
    if not forecast.fits:
        raise typer.Exit(1)


@app.command()
def inspect(
    store: str = typer.Argument(..., metavar="STORE", help="Store path."),
    sample: Optional[int] = typer.Option(None, "--sample", metavar="ROW", help="Show source row ROW's sample: its "
                                         "text with the trained spans marked «...», and each slot's RMS, min, max; "
                                         "for a row the run rejected, why."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE", help="Draw the sample lengths, the trained "
                                        "share and the per-layer token norms, each layer's largest |value| marked "
                                        "(massive activations), into FILE (.png, .svg, or .html: one page); needs "
                                        "matplotlib (the plot extra)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full summary and metadata as JSON."),
) -> None:
    """Show what a store holds: model, layers, counts, lengths, sizes, reject reasons, completeness; or one
    sample (--sample), or a picture (--plot). Given a folder `streamx convert` wrote, it names the store."""
    from .measure.look import converted_folder_line, plot_store, row_lines
    from .store import StoreError, open_store, to_json

    try:
        folder = converted_folder_line(store)
        if folder is not None and (sample is not None or plot is not None or as_json):
            raise StoreError(folder)  # they ask for a store's content
        if folder is not None:
            typer.echo(folder)
            return
        opened = open_store(store)
        if sample is not None:
            text = "\n".join(row_lines(opened, sample))
        else:
            text = to_json(opened.summary()) if as_json else "\n".join(opened.describe())
        if plot is not None:
            plot_store(opened, str(plot))
            text += f"\npicture: {plot}"
    except (Exception, Interrupted) as err:  # noqa: BLE001
        _fail(err)
    typer.echo(text)


@app.command()
def verify(
    store: str = typer.Argument(..., metavar="STORE|DIR", help="Store path, or a folder `streamx convert` wrote (any "
                                "--format)."),
    samples: int = typer.Option(32, help="Samples recomputed alone with the model, spread over the lengths (the "
                                "longest always among them)."),
    seed: int = typer.Option(0, help="Seed of that choice."),
    device: str = typer.Option("auto", help="Where the model runs: auto, cpu, cuda, cuda:N."),
    model: bool = typer.Option(True, "--model/--no-model", help="--no-model: only the structural checks, which "
                               "read the whole store but no weights, and the rows read again from the data."),
    speculators: bool = typer.Option(False, "--speculators", help="A convert folder only, in the environment "
                                     "that trains: speculators builds each draft as the printed train command "
                                     "does and its own loaders read a batch of each, on the CPU."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", metavar="DIR", help="The target's checkpoint folder, "
                                          "where the path the store records is not on this machine: the model check "
                                          "loads it, a trainer folder's check reads its final norm."),
) -> None:
    """Check a finished store before training on it: its structure over every sample, and a few samples
    recomputed with the model. Exit code 0 only when every check passes (docs/verify.md)."""
    from .train.verify import verify as run_verify

    try:
        report = run_verify(store, samples=samples, seed=seed, device=device, use_model=model,
                            log=_quiet if as_json else _log, speculators=speculators, checkpoint=checkpoint)
    except (Exception, Interrupted) as err:  # noqa: BLE001
        _fail(err)
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else "\n".join(report.lines()))
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def convert(
    store: str = typer.Argument(..., metavar="STORE", help="Store path; a store written by several processes "
                                "converts as one."),
    out: str = typer.Option(..., "--out", metavar="DIR", help="Output directory, the `speculators train "
                            "--data-path`. Re-running resumes."),
    fmt: Literal["speculators", "specforge-eagle3", "specforge-dflash", "modelopt", "torchspec", "nemo-dspark",
                 "nemo-eagle3"] = typer.Option(
        "speculators", "--format", help="Whose training data: speculators (Arrow rows + hs_{i}.safetensors); "
        "specforge-eagle3 or specforge-dflash (SpecForge's offline .ckpt rows); modelopt (ModelOpt's offline .pt "
        "rows, EAGLE-3 and DFlash); torchspec (TorchSpec's offline dataset: dataset.json, manifest.jsonl and .pt "
        "rows, EAGLE-3 and DFlash); nemo-dspark or nemo-eagle3 (NeMo AutoModel's offline caches: padded shards and "
        "a manifest; EAGLE-3's with the target's next-token probabilities). One store converts to each; "
        "docs/trainers.md."),
    trainer_layers: Optional[str] = typer.Option(None, "--trainer-layers", metavar="IDS", help="The layers the "
                                                 "trainer's draft reads, as it counts them (the output of block k = "
                                                 "streamx id k+1; NeMo's DSpark: -1 the embeddings and L-1 after the "
                                                 "final norm), comma-separated. Default: the trainer's own (EAGLE-3: "
                                                 "1, L//2-1, L-4; DFlash: every layer the store holds; NeMo's DSpark: "
                                                 "five from block 1 to L-1)."),
    model: Optional[str] = typer.Option(None, "--model", metavar="DIR", help="The target's checkpoint, where the "
                                        "one the store records is not on this machine: SpecForge EAGLE-3, "
                                        "ModelOpt, TorchSpec and NeMo take the last state after its final norm "
                                        "(NeMo: its embeddings and lm_head too), read from it."),
    draft_vocab_size: Optional[int] = typer.Option(None, "--draft-vocab-size", metavar="N", help="nemo-eagle3: the "
                                                   "draft's vocabulary (the special tokens, then the most frequent "
                                                   "supervised ones). Default: the target's whole vocabulary."),
    target_probs_topk: Optional[int] = typer.Option(None, "--target-probs-topk", metavar="K", help="nemo-eagle3: keep "
                                                    "the K most probable of the target's next-token probabilities "
                                                    "(renormalised) instead of all of the draft vocabulary's."),
    seed: Optional[int] = typer.Option(None, help="speculators: the row shuffle seed (speculators validates on the "
                                       "last rows). Default 0."),
    hidden_states: Optional[Literal[StorageName, "store"]] = typer.Option(
        None, "--hidden-states", help="store: no hs files, speculators reads the store itself through the streamx "
        "backend (python -m streamx.speculators_backend; docs/speculators.md), no second copy of the states. Or the "
        "hs files' states: bf16, or fp8 (speculators' fp8 backend: half the bytes; an fp8 store's own bytes, a bf16 "
        "store's quantised). Default: files in the store's storage."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the conversion in --out: the folder is "
                                   "emptied first (a folder of other files is never touched)."),
    workers: int = typer.Option(4, help="Threads reading the store and writing files."),
    allow_random_weights: bool = typer.Option(False, "--allow-random-weights", help="Convert a store made with "
                                              "--random-weights anyway (for testing the output, not for training)."),
    allow_partial: bool = typer.Option(False, "--allow-partial", help="Convert an unfinished store (a run still "
                                       "going, stopped or killed: some of its data missing) as far as it goes."),
    merge_prefix_rows: bool = typer.Option(False, "--merge-prefix-rows", help="Fold each row that is a prefix of "
                                           "another row (fanned-out turns, agent steps, duplicates) into that row, "
                                           "with the union of their loss masks: training then computes each token "
                                           "once too. Off: every row stays a row, as the data has it."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Write a store as a drafter trainer's training data (speculators by default) and print how to train on it."""
    from .train.convert import ConvertError
    from .train.convert import convert as run_convert
    from .train.export import export
    from .train.nemo import export_nemo

    try:
        nemo_only = [flag for flag, given in (("--draft-vocab-size", draft_vocab_size is not None),
                                              ("--target-probs-topk", target_probs_topk is not None)) if given]
        if nemo_only and fmt != "nemo-eagle3":
            raise ConvertError(f"{', '.join(nemo_only)} {'is' if len(nemo_only) == 1 else 'are'} for --format "
                               "nemo-eagle3 (its draft vocabulary and target probabilities)")
        if fmt != "speculators":
            speculators_only = [flag for flag, given in (("--seed", seed is not None),
                                                         ("--hidden-states", hidden_states is not None),
                                                         ("--merge-prefix-rows", merge_prefix_rows)) if given]
            if speculators_only:
                raise ConvertError(f"{', '.join(speculators_only)} {'is' if len(speculators_only) == 1 else 'are'} "
                                   "for the speculators format (its row shuffle, hs-file dtype and merged prefix "
                                   f"rows); --format {fmt} writes each row as it is, in bf16")
            try:
                ids = None if trainer_layers is None else [int(k) for k in trainer_layers.split(",") if k.strip()]
            except ValueError:
                raise ConvertError(f"--trainer-layers takes comma-separated integers; got {trainer_layers!r}") from None
            if fmt.startswith("nemo-"):
                summary = export_nemo(store, out, fmt, ids, model, draft_vocab_size, target_probs_topk, overwrite,
                                      progress, _log, allow_partial, allow_random_weights)
            else:
                summary = export(store, out, fmt, ids, model, overwrite=overwrite, workers=workers, progress=progress,
                                 log=_log, allow_partial=allow_partial, allow_random_weights=allow_random_weights)
            typer.echo("\n".join(summary.lines(store)))
            return
        if trainer_layers is not None or model is not None:
            raise ConvertError("--trainer-layers and --model are for the other trainers' formats: speculators takes "
                               "every layer the store holds and the last state before the norm as stored")
        summary = run_convert(store, out, seed=seed or 0, overwrite=overwrite, workers=workers, progress=progress,
                              log=_log, allow_random_weights=allow_random_weights, hidden_states=hidden_states,
                              allow_partial=allow_partial, merge_prefix_rows=merge_prefix_rows)
    except (Exception, Interrupted) as err:  # noqa: BLE001
        _fail(err)
    typer.echo("\n".join(summary.lines(store)))


@app.command()
@with_run_settings
def bench(
    cfg: RunConfig,
    rounds: int = typer.Option(2, help="Rounds of each mode, interleaved so that machine drift hits all modes."),
    warmup_rounds: Optional[int] = typer.Option(None, help="Uncounted rounds of every mode first (default: 1 on "
                                                "CUDA, where kernels compile per shape; 0 on CPU)."),
    skip_naive: bool = typer.Option(False, "--skip-naive/--with-naive", help="Leave out the (slow) naive per-sample "
                                    "mode."),
    modes: Optional[str] = typer.Option(None, help="Only these modes, comma-separated (streamx among them): "
                                        "forward_only, forward_padded, streamx, streamx_unshared, streamx_unaudited "
                                        "(--audit-every 0), naive. Default: all (less naive with --skip-naive)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the full report as JSON here."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE", help="Also draw tokens/s per mode and the "
                                        "stages' busy time into FILE (.png, .svg, or .html); needs matplotlib."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Print each round as it finishes."),
) -> None:
    """Measure streamx against the plain forward pass and the naive per-sample approach, in one process.
    Temporary stores go in the folder of --out, whose plain write speed is measured in the same run."""
    from .measure.bench import MODES, format_report
    from .measure.bench import bench as run_bench
    from .measure.look import plot_bench

    chosen = tuple(m.strip() for m in modes.split(",")) if modes else MODES
    chosen = tuple(m for m in chosen if not (skip_naive and m == "naive"))
    _measure(lambda scratch: run_bench(cfg, rounds=rounds, progress=progress, log=_log if progress else _quiet,
                                       modes=chosen, out_dir=scratch, warmup_rounds=warmup_rounds),
             format_report, cfg.out, json_out, draw=None if plot is None else lambda report: plot_bench(report,
                                                                                                        str(plot)))


@app.command("bench-writer")
def bench_writer(
    out: str = typer.Option("streamx-out/store.zarr", "--out", help="Measure the filesystem of this path's folder "
                            "(its temporary files go there)."),
    processes: str = typer.Option("1,2", help="Writer process counts to measure, e.g. 1,2,4,8."),
    gib: float = typer.Option(2.0, "--gib", help="GiB of hidden states per pass (all processes together)."),
    slots: int = typer.Option(6, help="Layer slots K per token."),
    hidden_size: int = typer.Option(4096, help="Hidden size H."),
    sample_tokens: int = typer.Option(800, help="Mean sample length in tokens."),
    rounds: int = typer.Option(2, help="Rounds of each mode, interleaved."),
    sync: bool = typer.Option(False, "--sync/--no-sync", help="Time until the bytes are on disk (os.sync), not only "
                              "in the page cache."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the full report as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Print each process count as it finishes."),
) -> None:
    """Measure the store writer on synthetic batches against plain sequential writes of the same bytes, with
    1..N writer processes (as torchrun ranks write their own parts); no model, no data."""
    from .measure.writebench import WriteWorkload, format_writer_report, writer_bench

    def measure(scratch: str | None) -> dict[str, Any]:
        counts = tuple(int(p) for p in processes.split(",") if p.strip())
        if not counts or min(counts) < 1:
            raise ValueError(f"--processes must be positive integers, e.g. 1,2,4; got {processes!r}")
        workload = WriteWorkload(total_bytes=int(gib * 2**30), num_slots=slots, hidden_size=hidden_size,
                                 sample_tokens=sample_tokens, rounds=rounds, sync=sync)
        return writer_bench(workload, scratch, counts, log=_log if progress else _quiet)

    _measure(measure, format_writer_report, out, json_out)


def _measure(measure: Callable[[str | None], dict[str, Any]], render: Callable[[dict[str, Any]], str], out: str,
             json_out: Path | None, draw: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run a benchmark in the folder of `out` (its scratch files go there), save, draw and print its report."""
    local = local_path(out)
    scratch = str(local.parent) if local is not None else None
    try:
        if scratch:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        report = measure(scratch)
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=2))
        if draw is not None:
            draw(report)
    except (Exception, Interrupted) as err:  # noqa: BLE001
        _fail(err)
    typer.echo(render(report))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
