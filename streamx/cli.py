"""The `streamx` command: a thin shell over the Python API (streamx.pipeline.run, streamx.store.open_store)."""

from __future__ import annotations

import functools
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import fields
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Any, Optional, get_args, get_type_hints

import typer

from .config import RunConfig, load_config
from .metrics import gb

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Stream a causal LM's selected hidden states over a chat dataset into a Zarr store "
                       "for speculative-decoding drafter training.")


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML file of run settings; flags override it. "
                                                    "The defaults shown are configs/default.yaml's.")]


def with_run_settings(command: Callable[..., None]) -> Callable[..., None]:
    """Give a command one option per RunConfig field (its declared help, the effective default shown)
    plus --config. The command's first parameter receives the RunConfig: defaults < --config < flags."""
    own = list(signature(command).parameters.values())[1:]
    hints = get_type_hints(RunConfig)
    shown = load_config(None).to_dict()  # the dataclass defaults, then configs/default.yaml
    settings = []
    for f in fields(RunConfig):
        kind = next(t for t in (*get_args(hints[f.name]), hints[f.name]) if t is not type(None))
        flag = "--" + f.name.replace("_", "-")
        decl = f"{flag}/--no-{flag[2:]}" if kind is bool else flag
        value = shown[f.name]
        default = "unset" if value is None else str(value).lower() if kind is bool else str(value)
        option = typer.Option(None, decl, help=f"{f.metadata['help']}  [default: {default}]", show_default=False)
        settings.append(Parameter(f.name, Parameter.KEYWORD_ONLY, default=option, annotation=Optional[kind]))
    config = Parameter("config", Parameter.KEYWORD_ONLY, default=None, annotation=ConfigOpt)

    @functools.wraps(command)
    def wrapper(*, config: Path | None = None, **options: Any) -> None:
        overrides = {f.name: options.pop(f.name) for f in fields(RunConfig)}
        try:
            run_config = load_config(config, **overrides)
        except Exception as err:  # noqa: BLE001 - a bad setting is one line for the user
            _fail(err)
        command(run_config, **options)

    own = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in own]
    wrapper.__signature__ = Signature([config, *settings, *own])
    return wrapper


def _fail(err: BaseException) -> None:
    """One line on stderr and exit 1; STREAMX_DEBUG=1 shows the traceback instead."""
    if os.environ.get("STREAMX_DEBUG"):
        raise err
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@app.command()
@with_run_settings
def run(
    cfg: RunConfig,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the live progress bar."),
) -> None:
    """Run the model over the data and write the selected layers' hidden states to a store."""
    from .pipeline import run as run_pipeline

    try:
        summary = run_pipeline(cfg, progress=progress, log=lambda m: typer.echo(m, err=True))
    except Exception as err:  # noqa: BLE001 - every failure is one line for the user
        _fail(err)
    rejects = ", ".join(f"{k}: {v}" for k, v in sorted(summary.reject_counts.items())) or "none"
    if summary.rank:  # under torchrun, rank 0 prints the whole summary
        typer.echo(f"[rank {summary.rank}] committed {summary.samples:,} samples, rejected {summary.rejects:,} "
                   f"({rejects})")
        return
    typer.echo(
        f"committed {summary.samples:,} samples ({summary.tokens:,} tokens, {summary.trainable_tokens:,} trainable) "
        f"in {summary.seconds:.0f} s; rejected {summary.rejects:,} ({rejects})\n"
        f"layer ids {summary.layer_ids} (speculators convention; id {summary.num_layers} = the last layer's output "
        f"before the final norm)\n"
        f"hidden states written: {gb(summary.hidden_bytes)}; padding efficiency {summary.padding_efficiency:.1%}"
        + (f"; {summary.resumed_rows:,} rows were already committed" if summary.resumed_rows else "")
        + f"\nstore: {summary.out} ({summary.store_samples:,} samples, {summary.store_tokens:,} tokens in total)\n"
        f"next: streamx inspect {summary.out}   |   streamx convert {summary.out} --out SPEC_DIR (speculators "
        f"training data)   |   python: streamx.open_store({summary.out!r}).sample(row_id)"
    )


@app.command()
@with_run_settings
def plan(
    cfg: RunConfig,
    sample_rows: int = typer.Option(4096, help="Rows to tokenize, spread over the data (all rows when there are no "
                                    "more)."),
    tokens_per_s: Optional[float] = typer.Option(None, help="The run's rate, for the time estimate (e.g. from "
                                                 "streamx bench)."),
    calibrate: bool = typer.Option(False, "--calibrate/--no-calibrate", help="Load the model and time its forward "
                                   "pass on a few batches of the data, for the time estimate."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Say what `streamx run` with the same settings would write, before running it: rows, tokens, the
    store's bytes and files for each storage choice, the free space at --out, and the time."""
    from .bench import calibrate as calibrate_rate
    from .estimate import estimate
    from .store import free_bytes

    try:
        if sample_rows < 1:
            raise ValueError(f"--sample-rows must be >= 1; got {sample_rows}")
        est = estimate(cfg, sample_rows=sample_rows)
        rate, how = tokens_per_s, "given"
        if rate is None and calibrate:
            rate, how = calibrate_rate(cfg, log=lambda m: typer.echo(m, err=True)), "calibrated: forward pass alone"
    except Exception as err:  # noqa: BLE001
        _fail(err)
    free = free_bytes(cfg.out)
    seconds = est.tokens / rate if rate else None
    if as_json:
        typer.echo(json.dumps({**est.to_json(), "storage": cfg.storage, "free_bytes": free, "tokens_per_s": rate,
                               "seconds": seconds}, indent=2))
        return
    scaled = "" if est.exact else (f" (scaled from {est.sampled_rows:,} sampled rows)" if est.rows else
                                   f" in the first {est.sampled_rows:,} rows (the stream's length is not known)")
    rejects = ", ".join(f"{k} {v:,}" for k, v in sorted(est.rejects.items())) or "none"
    lines = [
        f"rows         {est.rows:,}" if est.rows is not None else "rows         unknown (a stream)",
        f"samples      {est.samples:,}, rejected {rejects}{scaled}",
        f"tokens       {est.tokens:,} ({est.trainable_tokens:,} trainable); longest sample {est.longest_sample:,}",
        f"layers       {est.layer_ids} of {est.num_layers}, hidden {est.hidden_size}",
        "storage      bytes/token   store        files" + ("   (uncompressed: an upper bound)"
                                                          if cfg.compressor != "none" else ""),
    ]
    for storage, size in est.sizes.items():
        chosen = "   <- --storage" if storage == cfg.storage else ""
        lines.append(f"  {storage:<10} {size.bytes_per_token:>11,}   {gb(size.bytes):<12} {size.files:,}{chosen}")
    if free is not None:
        needed = est.sizes[cfg.storage].bytes
        lines.append(f"free         {gb(free)} at {cfg.out}: " + ("fits" if free >= needed else
                                                                   f"TOO SMALL for {gb(needed)}"))
    if seconds is not None:
        note = "" if how == "given" else "; streamx measured 0.99x of the forward pass on CPU (bench/RESULTS.md)"
        lines.append(f"time         {_duration(seconds)} at {rate:,.0f} tokens/s ({how}{note})")
    else:
        lines.append("time         pass --tokens-per-s N (e.g. from streamx bench) or --calibrate")
    typer.echo("\n".join(lines))


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours:,} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


@app.command()
def inspect(
    store: str = typer.Argument(..., help="Store path."),
    as_json: bool = typer.Option(False, "--json", help="Print the full summary and metadata as JSON."),
) -> None:
    """Show what a store holds: model, layers, counts, sizes, reject reasons."""
    from .store import open_store, to_json

    try:
        opened = open_store(store)
        summary = opened.summary()
    except Exception as err:  # noqa: BLE001
        _fail(err)
    if as_json:
        typer.echo(to_json(summary))
        return
    meta, model = opened.metadata, opened.metadata.model
    random = "; RANDOM WEIGHTS (--random-weights)" if meta.random_weights else ""
    lines = [
        f"store        {summary['path']} ({meta.format})",
        f"model        {model['model']} ({model['architecture']}, {meta.num_layers} layers, hidden {meta.hidden_size}, "
        f"computed in {model['dtype']}; weights {model['weights_fingerprint'][:12]}{random})",
        f"layer ids    {meta.layer_ids} ({meta.layer_convention}: id {meta.num_layers} = last layer before the final "
        "norm)",
        f"data         {meta.config['data']} (split {meta.config['split']}), max_length {meta.max_length} "
        f"({meta.truncation})",
        f"samples      {summary['samples']:,} committed, {summary['rejected']:,} rejected"
        + (f", {summary['duplicate_rows']} DUPLICATE rows" if summary["duplicate_rows"] else ""),
        f"tokens       {summary['tokens']:,} ({summary['trainable_tokens']:,} trainable)",
        f"size         {gb(summary['hidden_state_bytes'])} of {meta.storage} hidden states"
        + (" (+ a float32 scale per token)" if meta.storage == "fp8" else "") + f", {meta.bytes_per_token:,} "
        f"bytes/token, chunks {meta.chunk_tokens} tokens, shards {meta.shard_tokens} tokens, compressor "
        f"{meta.compressor}",
    ]
    for reason, n in sorted(summary["reject_counts"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  rejected {n:>6,} {reason}  (e.g. {summary['reject_examples'].get(reason, '')})")
    for name, part in summary["parts"].items():
        state = "complete" if part["closed"] else "interrupted (re-run the same command to resume)"
        lines.append(f"part         {name}: {part['samples']:,} samples, {part['tokens']:,} tokens, {state}")
    typer.echo("\n".join(lines))


@app.command()
def verify(
    store: str = typer.Argument(..., help="Store path."),
    samples: int = typer.Option(32, help="Samples recomputed alone with the model, spread over the lengths (the "
                                "longest always among them)."),
    seed: int = typer.Option(0, help="Seed of that choice."),
    device: str = typer.Option("auto", help="Where the model runs: auto, cpu, cuda, cuda:N."),
    model: bool = typer.Option(True, "--model/--no-model", help="--no-model: only the structural checks, which "
                               "read the whole store but no weights."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check a finished store before training on it: its structure over every sample, and a few samples
    recomputed with the model. Exit code 0 only when every check passes (docs/verify.md)."""
    from .verify import verify as run_verify

    try:
        report = run_verify(store, samples=samples, seed=seed, device=device, use_model=model,
                            log=(lambda m: None) if as_json else (lambda m: typer.echo(m, err=True)))
    except Exception as err:  # noqa: BLE001
        _fail(err)
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else "\n".join(report.lines()))
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def convert(
    store: str = typer.Argument(..., help="Store path; a store written by several processes converts as one."),
    out: str = typer.Option(..., "--out", help="Output directory, the `speculators train --data-path`. Re-running "
                            "resumes."),
    fmt: str = typer.Option("speculators", "--format", help="Output format: speculators (Arrow rows + "
                            "hs_{i}.safetensors)."),
    seed: int = typer.Option(0, help="Row shuffle seed (speculators validates on the last rows)."),
    hidden_states: Optional[str] = typer.Option(None, "--hidden-states", help="The files' states: bf16, or fp8 "
                                                "(speculators' fp8 backend: half the bytes; an fp8 store's own "
                                                "bytes, a bf16 store's quantised). Default: the store's storage."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an --out that holds another conversion."),
    workers: int = typer.Option(4, help="Threads reading the store and writing files."),
    allow_random_weights: bool = typer.Option(False, "--allow-random-weights", help="Convert a store made with "
                                              "--random-weights anyway (for testing the output, not for training)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Write a store as speculators training data and print the `speculators train` flags to use."""
    from .convert import FORMATS
    from .convert import convert as run_convert

    try:
        if fmt not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
        summary = run_convert(store, out, seed=seed, overwrite=overwrite, workers=workers, progress=progress,
                              log=lambda m: typer.echo(m, err=True), allow_random_weights=allow_random_weights,
                              hidden_states=hidden_states)
    except Exception as err:  # noqa: BLE001
        _fail(err)
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted(summary.skipped.items())) or "none"
    commands = {algo: shlex.join(argv) for algo, argv in summary.commands.items()}
    typer.echo(
        f"{summary.rows:,} rows ({summary.tokens:,} tokens, {summary.trainable_tokens:,} trainable) in {out} "
        f"({summary.seconds:.0f} s); skipped {skipped}"
        + (f"; {summary.kept_files:,} hs files were already written" if summary.kept_files else "")
        + f"\ntrain an EAGLE-3 draft:\n  {commands['eagle3']}\nor a DFlash draft:\n  {commands['dflash']}\n"
        f"(add --draft-vocab-size N for a reduced draft vocabulary counted in token_freq.pt; "
        f"these commands are saved in {out}/streamx_meta.json)\n"
        f"speculators loads the verifier {summary.verifier['path']} (the model the store was made with, "
        f"{summary.verifier['model']}): it must be those very weights (fingerprint "
        f"{summary.verifier['weights_fingerprint'][:12]}); point --verifier-name-or-path at another copy of them "
        "if that path is not there when you train\n"
        f"before a long training run, check the store against the model: streamx verify {store}"
    )


@app.command()
@with_run_settings
def bench(
    cfg: RunConfig,
    rounds: int = typer.Option(2, help="Rounds of each mode, interleaved so that machine drift hits all modes."),
    warmup_rounds: Optional[int] = typer.Option(None, help="Uncounted rounds of every mode first (default: 1 on "
                                                "CUDA, where kernels compile per shape; 0 on CPU)."),
    skip_naive: bool = typer.Option(False, "--skip-naive/--with-naive", help="Leave out the (slow) naive per-sample "
                                    "mode."),
    writer_only: bool = typer.Option(False, "--writer-only/--full", help="Measure only the store writer on synthetic "
                                     "batches against plain sequential writes (no model, no data)."),
    processes: str = typer.Option("1,2", help="--writer-only: writer process counts to measure, e.g. 1,2,4,8."),
    gib: float = typer.Option(2.0, "--gib", help="--writer-only: GiB of hidden states per pass (all processes "
                              "together)."),
    slots: int = typer.Option(6, help="--writer-only: layer slots K per token."),
    hidden_size: int = typer.Option(4096, help="--writer-only: hidden size H."),
    sample_tokens: int = typer.Option(800, help="--writer-only: mean sample length in tokens."),
    sync: bool = typer.Option(False, "--sync/--no-sync", help="--writer-only: time until the bytes are on disk "
                              "(os.sync), not only in the page cache."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the full report as JSON here."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Print each round as it finishes."),
) -> None:
    """Measure streamx against the plain forward pass and the naive per-sample approach, in one process,
    or with --writer-only the store writer against the filesystem. Temporary stores go in the folder
    of --out, whose plain write speed is measured in the same run."""
    from .bench import MODES, format_report
    from .bench import bench as run_bench
    from .writebench import WriteWorkload, format_writer_report, writer_bench

    log = (lambda m: typer.echo(m, err=True)) if progress else (lambda m: None)
    scratch = str(Path(cfg.out).parent) if "://" not in cfg.out else None
    try:
        if scratch:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        if writer_only:
            counts = tuple(int(p) for p in processes.split(",") if p.strip())
            if not counts or min(counts) < 1:
                raise ValueError(f"--processes must be positive integers, e.g. 1,2,4; got {processes!r}")
            workload = WriteWorkload(total_bytes=int(gib * 2**30), num_slots=slots, hidden_size=hidden_size,
                                     sample_tokens=sample_tokens, rounds=rounds, sync=sync)
            report = writer_bench(workload, scratch, counts, log=log)
            text = format_writer_report(report)
        else:
            modes = tuple(m for m in MODES if not (skip_naive and m == "naive"))
            report = run_bench(cfg, rounds=rounds, progress=progress, log=log, modes=modes, out_dir=scratch,
                               warmup_rounds=warmup_rounds)
            text = format_report(report)
        if json_out is not None:
            json_out.write_text(json.dumps(report, indent=2))
    except Exception as err:  # noqa: BLE001
        _fail(err)
    typer.echo(text)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
