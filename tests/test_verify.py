"""`streamx verify`: a right store passes; stores broken in each way the field has seen are named, on a
Llama-family model and on a hybrid Qwen3.5 (gated delta-net) model."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
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
SYSTEM = 9690  # "system": token 1 of every chat row (the template's system turn), and no other token


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def full_store(request, smollm2_dir, chat_jsonl, tmp_path_factory):
    """A store of every id 0..4 made by `streamx run` with a tiny model of the family and SmolLM2's tokenizer."""
    from tiny_models import tiny_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(f"verify-{request.param}")
    model = tiny_model(request.param)
    model.config.vocab_size = 49152
    model.resize_token_embeddings(49152)
    # a massive activation at token 1, ~200 times the other tokens' largest value, as real models have on their first
    # tokens (SmolLM2: ~25,000 in one value at token 0, ~150 elsewhere): 98% of a row's squared norm
    with torch.no_grad():
        model.get_input_embeddings().weight[SYSTEM, 7] = 30.0
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
    assert [c.name for c in report.checks] == ["complete", "commits", "audit", "index", "rows", "read", "token_ids",
                                               "loss_mask", "states", "data", "weights", "model"]
    result = CliRunner().invoke(app, ["verify", good, "--samples", "4", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["passed"] is True


@pytest.mark.parametrize(("storage", "dtype"), [("fp8", "float32"), ("bf16", "bfloat16")])
def test_a_right_store_passes_in_fp8_and_from_a_bf16_forward(full_store, chat_jsonl, tmp_path, storage, dtype):
    """Rounding stays well inside the model check's tolerance, token by token: fp8's 3 mantissa bits, and a bf16
    forward batched against one unbatched."""
    out = str(tmp_path / "s.zarr")
    run(load_config(None, model=str(Path(full_store).parent / "model"), data=chat_jsonl, out=out, layers="1,2,4",
                    max_samples=16, token_budget=1024, max_length=256, storage=storage, dtype=dtype),
        progress=False, log=lambda m: None)
    report = verify(out, samples=8, log=lambda m: None)
    assert report.passed, report.lines()
    largest = float(report.checks[-1].summary.split("largest relative difference ")[1].split()[0])
    assert largest < verify_module.tolerance_for(open_store(out)) / 2


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
    assert list(failures(report)) == ["data", "model"]
    assert [p.split(":")[0] for p in failures(report)["data"]] == [f"row {int(source.index.rows[b])}"]  # cut short
    problems = failures(report)["model"]
    assert len(problems) == 2 * 3 and all("states swapped between samples" in p for p in problems)


@pytest.mark.parametrize("fault", ["zeroed", "scaled by 1.5", "id 1's states"])
def test_a_slot_wrong_after_the_first_tokens_fails_the_model_check(full_store, tmp_path, fault):
    """Issue 48: the massive activation of token 1 no longer sets the scale of the whole row; a slot wrong at every
    token from token 4 on (the first tokens right) fails, each token measured against its own size."""
    source = open_store(full_store)
    victim = int(source.index.rows[np.argmax(source.index.lengths)])  # the longest: always recomputed

    def damage(sample, x):
        if sample.row_id == victim:
            x[4:, 1] = 0 if fault == "zeroed" else 1.5 * x[4:, 1] if fault == "scaled by 1.5" else x[4:, 0]
        return x

    report = verify(write_store(full_store, tmp_path / "s.zarr", damage), samples=4, log=lambda m: None)
    assert list(failures(report)) == ["model"], report.lines()
    (problem,) = failures(report)["model"]
    assert problem.startswith(f"row {victim}: slot 1 (id 2) differs from the model's states at ")


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
    assert list(failures(report)) == ["data"]  # (its rows hold one row's ids, not their data's)
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


def test_each_token_is_measured_against_its_own_size():
    ref = torch.tensor([[25000.0, 0.0], [3.0, 4.0], [0.0, 0.0]])  # a massive token, a plain one, an all-zero one
    got = torch.tensor([[25000.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert verify_module.token_errors(got, ref).tolist() == [0.0, 1.0, 0.0]
    got[2, 0] = 0.005  # a zero token counts as a thousandth of the row's median token norm (5)
    assert verify_module.token_errors(got, ref)[2] == pytest.approx(1.0)


def tokenized_rows() -> list[dict]:
    """20 pre-tokenized rows, then 8 repeats of earlier ones (the same ids and mask)."""
    rng = np.random.default_rng(5)
    rows = [{"input_ids": rng.integers(10, 40000, int(n)).tolist(), "loss_mask": [0] * 3 + [1] * (int(n) - 3)}
            for n in rng.integers(8, 40, 20)]
    return rows + [dict(rows[i]) for i in (0, 3, 3, 7, 11, 2, 19, 5)]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenized_store(model_dir: str, tmp_path: Path, rows: list[dict]) -> tuple[str, Path]:
    """A store of `rows` (the repeats stored as repeats: --sharing on, the default), and its data file."""
    data = tmp_path / "rows.jsonl"
    out = tmp_path / "s.zarr"
    cfg = load_config(None, model=model_dir, data=write_rows(data, rows), out=str(out), layers="1,2,4", sort_window=4,
                      token_budget=256, max_length=256)
    run(cfg, progress=False, log=lambda m: None)
    return str(out), data


def test_rows_read_again_from_the_data_hold_the_stored_ids(tiny_chat_model_dir, tmp_path):
    """Issue 48: rows are read again from the data the store was made from, through the run's own source and
    tokenizer; a row whose data and stored ids disagree fails, named, whichever side changed."""
    rows = tokenized_rows()
    out, data = tokenized_store(tiny_chat_model_dir, tmp_path, rows)
    report = verify(out, use_model=False, log=lambda m: None)
    assert report.passed, report.lines()
    check = next(c for c in report.checks if c.name == "data")
    assert not check.skipped and check.summary.startswith(f"{len(rows)} rows read again from {data}")

    rows[4]["input_ids"] = [*rows[4]["input_ids"][:-1], rows[4]["input_ids"][-1] + 1]  # the data changed
    write_rows(data, rows)
    report = verify(out, use_model=False, log=lambda m: None)
    assert failures(report) == {
        "data": [f"row 4: its token ids in the store and in the data differ at token {len(rows[4]['input_ids']) - 1}"]}
    assert report.checks[-1].summary == f"1 of {len(rows)} rows differ from the data; the data changed since the run"

    write_rows(data, tokenized_rows())  # the data as it was, and the store's ids changed on disk
    (a, _), = open_store(out).ranges(open_store(out).position(9))
    ids = zarr.open_array(f"{out}/parts/part-00000/input_ids", mode="r+")
    ids[a] = ids[a] + 1
    report = verify(out, use_model=False, log=lambda m: None)
    assert failures(report) == {"data": ["row 9: its token ids in the store and in the data differ at token 0"]}
    assert report.checks[-1].summary == f"1 of {len(rows)} rows differ from the data"


def test_repeated_rows_are_read_again_first(tiny_chat_model_dir, tmp_path, monkeypatch):
    """A row stored as a repeat reads its first row's ids (a content-key collision would serve it another row's):
    those rows are read again before the others, and one whose data is not its first row's fails."""
    rows = tokenized_rows()
    out, data = tokenized_store(tiny_chat_model_dir, tmp_path, rows)
    store = open_store(out)
    repeats = np.flatnonzero(store.same_as >= 0)
    assert store.index.rows[repeats].tolist() == list(range(20, 28))
    assert set(repeats) <= set(verify_module.data_rows(store, 16, seed=0))  # all of them, then 8 others
    assert len(set(repeats) & set(verify_module.data_rows(store, 4, seed=0))) == 2  # half, where there are more

    rows[-1] = {**rows[-1], "loss_mask": [1] * len(rows[-1]["input_ids"])}  # row 27, stored as row 5's repeat
    write_rows(data, rows)
    monkeypatch.setattr(verify_module, "DATA_ROWS", 16)
    assert failures(verify(out, use_model=False, log=lambda m: None)) == {
        "data": ["row 27: its loss mask in the store and in the data differ at token 0; it is stored as a repeat of "
                 "row 5 and reads its tokens"]}


def test_the_data_check_is_skipped_when_the_data_is_gone(tiny_chat_model_dir, tmp_path):
    out, data = tokenized_store(tiny_chat_model_dir, tmp_path, tokenized_rows())
    data.rename(tmp_path / "moved.jsonl")
    report = verify(out, use_model=False, log=lambda m: None)
    assert report.passed, report.lines()
    check = next(c for c in report.checks if c.name == "data")
    assert check.skipped and check.summary.startswith("skipped: ") and str(data) in check.summary
    assert f"skip data         {check.summary}" in report.lines()
