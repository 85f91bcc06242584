"""`streamx verify`: a right store passes; stores broken in each way the field has seen are named, on a
Llama-family model and on a hybrid Qwen3.5 (gated delta-net) model."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import streamx.train.verify as verify_module
from streamx.cli import app
from streamx.config import load_config
from streamx.data.tokenize import Reject
from streamx.pipeline.runner import run
from streamx.pipeline.writer import PartWriter
from streamx.store import OwnedPart, bf16_to_bits, make_layout, open_for_run, open_store, prepare
from streamx.train.verify import verify

CLAIMED = [1, 2, 4]  # the ids the test stores say they hold (L = 4)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def full_store(request, smollm2_dir, chat_jsonl, tmp_path_factory):
    """A store of every id 0..4 made by `streamx run` with a tiny model of the family and SmolLM2's tokenizer."""
    from tiny_models import tiny_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(f"verify-{request.param}")
    model = tiny_model(request.param)
    model.config.vocab_size = 49152
    model.resize_token_embeddings(49152)
    model.save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(root / "model")
    cfg = load_config(None, model=str(root / "model"), data=chat_jsonl, out=str(root / "all.zarr"), layers="0,1,2,3,4",
                      max_samples=16, token_budget=1024, max_length=256, chunk_tokens=16, shard_tokens=64)
    run(cfg, progress=False, log=lambda m: None)
    return str(root / "all.zarr")


def write_store(full: str, out: Path, fill, slots=(1, 2, 4), parts=1) -> str:
    """A store that says it holds ids CLAIMED, with each sample's states from `fill(sample, states)` where states
    are the full store's slots `slots` (float32); `parts` > 1 writes the first sample again in another part."""
    source = open_store(full)
    meta = dataclasses.replace(source.metadata, layer_ids=CLAIMED,
                               compat=dataclasses.replace(source.metadata.compat, layer_ids=CLAIMED))
    prepare(str(out), meta)
    layout = make_layout(len(CLAIMED), meta.hidden_size, 16, 64)
    samples = [source.at(i) for i in range(len(source))]
    for k in range(parts):
        writer = PartWriter(OwnedPart(str(out), f"part-{k:05d}").open(open_for_run(str(out), meta), layout))
        for s in samples if k == 0 else samples[:1]:
            states = fill(s, s.hidden_states[:, list(slots)].float()).to(torch.bfloat16)
            writer.append(s.row_id, s.input_ids.numpy(), s.loss_mask.numpy().astype(np.uint8), bf16_to_bits(states))
        writer.close()
    return str(out)


def failures(report) -> dict[str, list[str]]:
    return {c.name: c.problems for c in report.checks if not c.passed}


def test_a_right_store_passes(full_store, tmp_path):
    good = write_store(full_store, tmp_path / "good.zarr", lambda s, x: x)
    report = verify(good, samples=6, log=lambda m: None)
    assert report.passed, report.lines()
    assert [c.name for c in report.checks] == ["complete", "commits", "index", "rows", "read", "token_ids",
                                               "loss_mask", "states", "weights", "model"]
    result = CliRunner().invoke(app, ["verify", good, "--samples", "4", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["passed"] is True


def test_an_off_by_one_hook_is_named(full_store, tmp_path):
    shifted = write_store(full_store, tmp_path / "s.zarr", lambda s, x: x, slots=(0, 1, 3))  # each one layer early
    report = verify(shifted, samples=4, log=lambda m: None)
    assert list(failures(report)) == ["model"]
    assert all("an off-by-one hook" in p for p in failures(report)["model"])
    assert any("slot 2 (id 4) holds id 3" in p for p in failures(report)["model"])


def test_a_post_norm_last_slot_is_named(full_store, tmp_path):
    from transformers import AutoModelForCausalLM

    meta = open_store(full_store).metadata
    norm = AutoModelForCausalLM.from_pretrained(meta.model["path"], dtype=torch.float32).model.norm

    def normed(sample, states):
        with torch.no_grad():
            states[:, 2] = norm(states[:, 2])
        return states

    report = verify(write_store(full_store, tmp_path / "s.zarr", normed), samples=4, log=lambda m: None)
    assert list(failures(report)) == ["model"]
    assert all("slot 2 (id 4) holds the final norm's output" in p and "post-norm" in p
               for p in failures(report)["model"])


def test_states_swapped_between_samples_are_named(full_store, tmp_path):
    source = open_store(full_store)
    lengths = source.index.lengths
    a, b = (int(i) for i in np.argsort(lengths)[-2:])  # two long samples, cut to the same length
    T = int(lengths[a])
    states = {i: source.at(i).hidden_states[:T, [1, 2, 4]].float() for i in (a, b)}
    rows = {int(source.index.rows[a]): b, int(source.index.rows[b]): a}

    def swap(sample, x):
        return states[rows[sample.row_id]] if sample.row_id in rows else x

    def cut(sample):  # both samples keep their first T tokens
        return dataclasses.replace(sample, input_ids=sample.input_ids[:T], loss_mask=sample.loss_mask[:T],
                                   hidden_states=sample.hidden_states[:T]) if sample.row_id in rows else sample

    real_at = type(source).at
    try:
        type(source).at = lambda self, i, raw=False: cut(real_at(self, i, raw))
        out = write_store(full_store, tmp_path / "s.zarr", swap)
    finally:
        type(source).at = real_at
    report = verify(out, samples=len(source), log=lambda m: None)
    assert list(failures(report)) == ["model"]
    problems = failures(report)["model"]
    assert len(problems) == 2 * 3 and all("states swapped between samples" in p for p in problems)


@pytest.mark.parametrize("fault", ["zeroed slot", "NaN"])
def test_zero_and_nan_states_are_named_without_the_model(full_store, tmp_path, fault):
    victim = int(open_store(full_store).index.rows[3])

    def damage(sample, x):
        if sample.row_id == victim:
            if fault == "NaN":
                x[2, 1, 5] = float("nan")
            else:
                x[:, 1] = 0
        return x

    report = verify(write_store(full_store, tmp_path / "s.zarr", damage), use_model=False)
    assert list(failures(report)) == ["states"]
    want = f"row {victim}: id 2 holds NaN or Inf" if fault == "NaN" else f"row {victim}: id 2 is all zero"
    assert failures(report)["states"] == [want]


def test_a_row_both_sample_and_reject_is_named(full_store, tmp_path):
    out = write_store(full_store, tmp_path / "s.zarr", lambda s, x: x)
    row = int(open_store(out).index.rows[2])
    meta = open_store(out).metadata
    layout = make_layout(len(CLAIMED), meta.hidden_size, 16, 64)
    writer = PartWriter(OwnedPart(out, "part-00001").open(open_for_run(out, meta), layout))
    writer.reject(Reject(row, "too_long", "x"))
    writer.close()
    assert failures(verify(out, use_model=False))["rows"] == [f"row {row} is both a sample and a reject"]


def test_a_truncated_part_and_a_duplicated_row_are_named(full_store, tmp_path):
    out = write_store(full_store, tmp_path / "s.zarr", lambda s, x: x, parts=2)
    report = verify(out, use_model=False)
    assert list(failures(report)) == ["rows"]
    assert failures(report)["rows"] == [f"row {int(open_store(out).index.rows[0])} stored 2 times"]

    shard = sorted(p for p in (Path(out) / "parts/part-00000/hidden_states/c").rglob("*") if p.is_file())[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # a crash mid-file, or a copy that stopped short
    result = CliRunner().invoke(app, ["verify", out, "--no-model"])
    assert result.exit_code == 1
    assert any(line.startswith("FAIL read") for line in result.stdout.splitlines())
    assert "part-00000: tokens 0.." in result.stdout and "cannot be read" in result.stdout


def test_a_converted_folder_is_checked_against_its_store(full_store, tmp_path):
    from streamx.train.convert import convert

    good = write_store(full_store, tmp_path / "good.zarr", lambda s, x: x)
    spec = tmp_path / "spec"
    convert(good, str(spec), progress=False, log=lambda m: None)
    report = verify(str(spec), samples=2, log=lambda m: None)
    assert report.passed, report.lines()
    assert report.checks[0].name == "files" and report.checks[-1].name == "model"  # then the store's own checks

    hs = spec / "hidden_states"
    (hs / "hs_0.safetensors").rename(hs / "tmp")  # two files swapped
    (hs / "hs_1.safetensors").rename(hs / "hs_0.safetensors")
    (hs / "tmp").rename(hs / "hs_1.safetensors")
    result = CliRunner().invoke(app, ["verify", str(spec), "--no-model"])
    assert result.exit_code == 1
    assert "FAIL files        2 of" in result.stdout
    assert "hidden_states/hs_0.safetensors: token ids differ from dataset row 0's input_ids" in result.stdout


def test_a_folder_of_repeated_samples_is_checked_with_one_read_a_file(full_store, tmp_path, monkeypatch):
    """Rows whose token ids repeat (55% of the embedded corpus's samples repeat another) cost one store read per
    hs file, through store_rows.npy, not one per file and per repeat (the embedded default's convert read 106 GB
    for a 0.5 GB folder that way)."""
    from helpers import copy_store

    import streamx.train.convert as convert_module

    first = open_store(full_store).at(0)
    repeated = [(k, first.input_ids, first.loss_mask, first.hidden_states) for k in range(12)]
    store = copy_store(full_store, tmp_path / "repeated.zarr", [repeated])
    spec = tmp_path / "spec"
    convert_module.convert(store, str(spec), progress=False, log=lambda m: None)
    reads = []
    real = convert_module.training_sample
    monkeypatch.setattr(convert_module, "training_sample", lambda *args: reads.append(args[-1]) or real(*args))
    report = verify(str(spec), use_model=False, log=lambda m: None)
    assert report.passed, report.lines()
    assert sorted(reads) == list(range(12))  # each row once


def test_the_structural_pass_reads_in_bounded_slices(full_store, tmp_path, monkeypatch):
    """A 50 TB store is read a slice at a time: a NaN in a later slice is still found."""
    out = write_store(full_store, tmp_path / "s.zarr", lambda s, x: x)
    store = open_store(out)
    victim = int(store.index.rows[-1])
    monkeypatch.setattr(verify_module, "READ_BYTES", 3 * 64 * 4 * 20)  # ~20 tokens a read
    reads = []
    real_states = verify_module._states
    monkeypatch.setattr(verify_module, "_states", lambda *a: reads.append(a[3] - a[2]) or real_states(*a))
    assert verify(out, use_model=False).passed and len(reads) > 10 and max(reads) <= max(20, *store.index.lengths)

    def nan_last(sample, x):
        if sample.row_id == victim:
            x[-1, 0, 0] = float("nan")
        return x

    report = verify(write_store(full_store, tmp_path / "n.zarr", nan_last), use_model=False)
    assert failures(report) == {"states": [f"row {victim}: id 1 holds NaN or Inf"]}
