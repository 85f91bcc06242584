"""The command line is generated from RunConfig: every setting declared once, flags > --config > defaults."""

from dataclasses import fields
from typing import get_args

import typer
from typer.testing import CliRunner

from streamx.cli import app, with_run_settings
from streamx.config import Compressor, RunConfig

runner = CliRunner()


def probe_app(seen: dict) -> typer.Typer:
    probe = typer.Typer(rich_markup_mode=None)

    @probe.command()
    @with_run_settings
    def main(cfg: RunConfig, extra: int = typer.Option(1, help="A command's own option.")) -> None:
        seen.update(cfg=cfg, extra=extra)

    return probe


def test_flags_override_the_config_file_which_overrides_the_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_length: 512\ntoken_budget: 1024\noverwrite: true\nlayers: [1, 2]\n")
    seen: dict = {}
    result = runner.invoke(probe_app(seen), ["--config", str(config), "--token-budget", "2048", "--no-overwrite",
                                             "--extra", "3"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.token_budget, cfg.overwrite) == (2048, False)  # flags
    assert (cfg.max_length, cfg.layers) == (512, "1,2")  # the file
    assert cfg.sort_window == RunConfig().sort_window and seen["extra"] == 3  # defaults, the command's own option


def test_a_bad_choice_is_refused_naming_the_choices(tmp_path):
    """Choice settings are Literal-typed: the CLI refuses a bad flag value itself, and a bad value from a
    config file is one line."""
    result = runner.invoke(probe_app({}), ["--truncation", "sometimes"])
    assert result.exit_code == 2 and "'sometimes' is not one of 'truncate', 'skip'" in result.output
    config = tmp_path / "c.yaml"
    config.write_text("truncation: sometimes\n")
    result = runner.invoke(probe_app({}), ["--config", str(config)])
    assert result.exit_code == 1
    assert result.output.strip() == "error: truncation must be one of truncate, skip; got 'sometimes'"


def test_help_lists_every_setting_with_its_help_and_effective_default():
    text = runner.invoke(app, ["run", "--help"], terminal_width=200, max_content_width=200).output
    entries = {line.split()[0]: " ".join(line.split()) for line in text.split("\n  --")[1:]}  # one per option
    defaults = RunConfig().to_dict()
    for f in fields(RunConfig):
        entry = entries[f.name.replace("_", "-")]
        assert " ".join(f.metadata["help"].split()) in entry
        value = defaults[f.name]
        shown = "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        assert entry.endswith(f"[default: {shown}]"), entry
    assert "overwrite / --no-overwrite" in entries["overwrite"] and "<bool>" not in text
    compressors = "|".join(get_args(Compressor))  # a Literal setting lists its choices, from the one declaration
    assert entries["compressor"].startswith(f"compressor <{compressors}>") and compressors.count("|") == 5


def test_a_misspelt_layers_preset_is_refused_naming_the_close_one(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """`--layers eagle` (EAGLE-3's drafter named without its number) is one line that suggests eagle3; nothing is
    written."""
    out = tmp_path / "s.zarr"
    for typed, meant in (("eagle", "eagle3"), ("DFlash", "dflash")):
        result = runner.invoke(app, ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(out),
                                     "--layers", typed])
        assert result.exit_code == 1
        assert result.stderr.strip() == (f"error: --layers must be a preset (eagle3, dflash) or comma-separated "
                                         f"integers; got {typed!r}: did you mean --layers {meant}?")
    assert not out.exists()


def test_a_model_load_keeps_the_libraries_bars_out_of_a_log_file(tiny_chat_model_dir, capsys):
    """stderr not a terminal (a log file; here pytest's capture): transformers' "Loading weights" bar stays out
    of it on every load, also for the commands that show no bars of their own (verify, plan --calibrate)."""
    from transformers.utils import logging as hf_logging

    from streamx.model.load import load_model

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process: an earlier test's run may have turned them off
    try:
        load_model(tiny_chat_model_dir, dtype="float32", device="cpu")
    finally:
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    assert "Loading weights" not in capsys.readouterr().err


def test_a_run_that_commits_none_of_its_rows_exits_nonzero(smollm2_dir, chat_jsonl, tmp_path):
    """Every row rejected (here a model whose states are NaN; in Mllama a layer its forward skips): the run says so
    in its summary and in one error line, and exits 1 (it exited 0 with "committed 0 samples")."""
    import torch
    from helpers import cli, run_args
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path / "nan-llama"
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    result = cli(*run_args(str(path), chat_jsonl, tmp_path / "s.zarr", layers="0,1,2", max_samples=6,
                           max_reject_fraction=1.0))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "committed 0 samples" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "error: this run committed none of its rows: all 6 were " \
                                                      "rejected (above)"
