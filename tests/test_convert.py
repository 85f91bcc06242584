"""`streamx convert`: store -> speculators training data, checked file by file against the store and, in
an isolated venv, with speculators' own loader, drafts and target reconstruction (tests/speculators_check.py)."""

import json
import math
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import load_from_disk
from helpers import copy_store, small_config
from safetensors import safe_open
from typer.testing import CliRunner

import streamx.train.convert as convert_module
import streamx.train.files as files_module
from streamx.cli import app
from streamx.model.load import load_model
from streamx.pipeline.plan import make_plan
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.store.fp8 import quantize_fp8
from streamx.train.convert import ConvertError, convert

LAYERS = [1, 2, 4]  # the tiny model has L = 4


def make_store(model_dir, data, out, layers=",".join(map(str, LAYERS)), loaded=None, **kw):
    config = small_config(model_dir, data, out, layers=layers, **kw)
    run(make_plan(config, loaded=loaded) if loaded else config, progress=False, log=lambda m: None)
    return str(out)


@pytest.fixture(scope="module")
def tiny_store(tiny_chat_model_dir, chat_jsonl, tmp_path_factory):
    return make_store(tiny_chat_model_dir, chat_jsonl, tmp_path_factory.mktemp("store") / "s.zarr")


def tree(path):
    """Every file under path -> its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def hs_file(out, i):
    with safe_open(str(Path(out) / "hidden_states" / f"hs_{i}.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def bits(t):
    return t.contiguous().view(torch.int16)


def test_output_is_the_store_in_speculators_format(tiny_store, tmp_path):
    out = tmp_path / "spec"
    summary = convert(tiny_store, str(out), seed=0, block_rows=5, progress=False)
    store = open_store(tiny_store)
    n = len(store)
    assert summary.rows == n and summary.skipped == {} and summary.tokens == store.row_tokens

    ds = load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == n
    assert ds.format["type"] == "torch"
    assert {k: str(v) for k, v in ds.features.items()} == {"input_ids": "List(Value('int64'))",
                                                           "loss_mask": "List(Value('int64'))",
                                                           "seq_len": "Value('int64')"}
    assert sorted(os.listdir(out / "hidden_states")) == sorted(f"hs_{i}.safetensors" for i in range(n))

    stored = {row: store.sample(row) for row in store.row_ids().tolist()}
    order = []
    for i in range(n):
        row = ds[i]
        f = hs_file(out, i)
        hs, ids = f["hidden_states"], f["token_ids"]
        assert set(f) == {"hidden_states", "token_ids"}
        assert hs.dtype == torch.bfloat16 and hs.is_contiguous() and ids.dtype == torch.int64
        T = len(row["input_ids"])
        assert hs.shape == (T, len(LAYERS), 64) and row["seq_len"] == T
        assert row["input_ids"].dtype == torch.int64 and row["loss_mask"].dtype == torch.int64
        assert torch.equal(ids, row["input_ids"])
        # which source row is this? the one with these ids and bit-identical hidden states
        match = [r for r, s in stored.items()
                 if torch.equal(s.input_ids, ids) and torch.equal(bits(s.hidden_states), bits(hs))]
        assert len(match) == 1
        s = stored[match[0]]
        assert torch.equal(row["loss_mask"], s.loss_mask)
        # the last slot is the store's id-L slot (pre-norm), bit for bit
        assert torch.equal(bits(hs[:, -1]), bits(s.hidden_states[:, LAYERS.index(4)]))
        order.append(match[0])
    assert sorted(order) == sorted(stored) and order != sorted(order)  # every row once, shuffled

    meta = json.loads((out / "streamx_meta.json").read_text())
    assert meta["layer_ids"] == LAYERS and meta["target_layer_ids"] == [1, 2] and meta["num_layers"] == 4
    assert meta["last_id_is_pre_norm"] and meta["layer_convention"] == "speculators"
    assert meta["counts"] == {"rows": n, "tokens": store.row_tokens, "skipped": 0,
                              "trainable_tokens": int(sum(s.loss_mask.sum() for s in stored.values()))}
    assert meta["source"]["store"] == str(Path(tiny_store).resolve())
    for algo in ("eagle3", "dflash"):
        argv = meta["speculators_train_argv"][algo]
        assert argv[:2] == ["speculators", "train"]
        flags = " ".join(argv)
        assert f"--data-path {out.resolve()}" in flags and "--on-missing raise" in flags
        assert "--target-layer-ids 1 2 " in flags and f"--speculator-type {algo}" in flags
    assert sorted(os.listdir(out)) == ["data-00000-of-00001.arrow", "dataset_info.json", "hidden_states",
                                       "state.json", "store_rows.npy", "streamx_meta.json", "token_freq.pt"]
    assert np.load(out / "store_rows.npy").tolist() == order  # file i is the store sample of source row rows[i]


def test_token_freq_counts_loss_mask_tokens(tiny_store, tmp_path):
    convert(tiny_store, str(tmp_path / "spec"), progress=False)
    want = Counter()
    for s in open_store(tiny_store).samples():
        want.update(int(t) for t, m in zip(s.input_ids.tolist(), s.loss_mask.tolist(), strict=True) if m == 1)
    got = torch.load(tmp_path / "spec" / "token_freq.pt", weights_only=True)
    assert got == dict(want) and all(type(k) is int and type(v) is int for k, v in got.items())


def test_shuffle_depends_only_on_seed_and_row_ids(tiny_store, tmp_path):
    """The same rows written by two processes, in another order, convert to the same bytes."""
    store = open_store(tiny_store)
    samples = [(s.row_id, s.input_ids, s.loss_mask, s.hidden_states) for s in store.samples()]
    two_parts = copy_store(tiny_store, tmp_path / "two.zarr", [samples[1::2], samples[::2][::-1]])
    assert len(open_store(two_parts).parts) == 2
    convert(tiny_store, str(tmp_path / "a"), seed=7, progress=False)
    convert(two_parts, str(tmp_path / "b"), seed=7, progress=False)
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    a.pop("streamx_meta.json"), b.pop("streamx_meta.json")  # names its own source and output paths
    assert a == b
    convert(tiny_store, str(tmp_path / "c"), seed=8, progress=False)
    c = tree(tmp_path / "c")
    assert c["hidden_states/hs_0.safetensors"] != a["hidden_states/hs_0.safetensors"]


def test_interrupted_convert_resumes_to_identical_output(tiny_store, tmp_path, monkeypatch):
    out = tmp_path / "spec"
    convert(tiny_store, str(out), seed=3, block_rows=4, progress=False)
    reference = tree(out)
    shutil.rmtree(out)

    writes = []
    real_write = files_module.write_hs

    def crash_after_ten(path, sample):
        if len(writes) == 10:
            raise OSError("simulated crash")
        writes.append(path)
        real_write(path, sample)

    monkeypatch.setattr(files_module, "write_hs", crash_after_ten)
    with pytest.raises(OSError, match="simulated crash"):
        convert(tiny_store, str(out), seed=3, block_rows=4, progress=False, workers=1)
    monkeypatch.undo()
    # nothing but complete files under final names; the dataset, token_freq.pt and the meta come last
    assert not any((out / name).exists() for name in ("streamx_meta.json", "token_freq.pt", "state.json"))
    written = sorted((out / "hidden_states").iterdir())
    assert len(written) == 10
    for path in written:
        f = hs_file(out, int(path.stem[3:]))
        assert f["hidden_states"].shape[0] == f["token_ids"].shape[0]
    (out / "hidden_states" / ".hs_11.safetensors.tmp-1-2").write_bytes(b"torn")  # a kill mid-write leaves this

    summary = convert(tiny_store, str(out), seed=3, block_rows=4, progress=False)
    assert summary.kept_files == 2  # hs files of the unfinished block written before the crash
    assert tree(out) == reference

    for i in (0, 5, summary.rows - 1):  # files lost after completion are written again, identically
        (out / "hidden_states" / f"hs_{i}.safetensors").unlink()
    (out / "token_freq.pt").unlink()
    assert not convert(tiny_store, str(out), seed=3, block_rows=4, progress=False).already_complete
    assert tree(out) == reference
    assert convert(tiny_store, str(out), seed=3, block_rows=4, progress=False).already_complete


def test_a_damaged_convert_folder_is_one_line_or_converted_again(tiny_store, tmp_path):
    """Files of a convert folder damaged outside streamx: a block file is converted again, a damaged state.json
    makes the folder incomplete (converted again), and a damaged meta or plan is refused in one line naming it,
    which --overwrite replaces (it was a conversion)."""
    out = tmp_path / "spec"
    convert(tiny_store, str(out), seed=3, block_rows=4, progress=False)
    reference = tree(out)
    (out / "state.json").write_text("{not json")
    assert not convert(tiny_store, str(out), seed=3, block_rows=4, progress=False).already_complete
    assert tree(out) == reference
    (out / "streamx_meta.json").write_text('{"counts": 1}')
    with pytest.raises(ConvertError, match=r"holds a damaged conversion \(streamx_meta.json cannot be read\); pass "
                                           r"--overwrite to convert it again"):
        convert(tiny_store, str(out), seed=3, block_rows=4, progress=False)
    convert(tiny_store, str(out), seed=3, block_rows=4, progress=False, overwrite=True)
    assert tree(out) == reference
    shutil.rmtree(out)

    real_write, writes = files_module.write_hs, []

    def crash_after_six(path, sample):
        if len(writes) == 6:
            raise OSError("simulated crash")
        writes.append(path)
        real_write(path, sample)

    files_module.write_hs = crash_after_six
    try:
        with pytest.raises(OSError, match="simulated crash"):
            convert(tiny_store, str(out), seed=3, block_rows=4, progress=False, workers=1)
    finally:
        files_module.write_hs = real_write
    block = out / ".streamx-convert" / "block-000000.safetensors"
    block.write_bytes(block.read_bytes()[:40])  # torn by something else
    convert(tiny_store, str(out), seed=3, block_rows=4, progress=False)
    assert tree(out) == reference


def test_samples_in_flight_are_bounded(tiny_store, tmp_path, monkeypatch):
    """Memory does not grow with the store: reads run at most a few samples ahead of slow writes."""
    live, peak, lock = [0], [0], threading.Lock()
    real_load, real_write = convert_module.training_sample, files_module.write_hs

    def load(*args):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        return real_load(*args)

    def slow_write(path, sample):
        time.sleep(0.02)
        real_write(path, sample)
        with lock:
            live[0] -= 1

    monkeypatch.setattr(convert_module, "training_sample", load)
    monkeypatch.setattr(files_module, "write_hs", slow_write)
    summary = convert(tiny_store, str(tmp_path / "spec"), workers=2, block_rows=1000, progress=False)
    depth = 2 * 2  # convert's samples in flight per stage for 2 workers
    assert summary.rows > 4 * depth and peak[0] <= 2 * depth + 2


def test_other_conversion_in_out_is_refused_unless_overwrite(tiny_store, tmp_path):
    out = tmp_path / "spec"
    convert(tiny_store, str(out), seed=0, progress=False)
    with pytest.raises(ConvertError, match="--overwrite"):
        convert(tiny_store, str(out), seed=1, progress=False)
    convert(tiny_store, str(out), seed=1, overwrite=True, progress=False)
    convert(tiny_store, str(tmp_path / "fresh"), seed=1, progress=False)
    a, b = tree(out), tree(tmp_path / "fresh")
    assert a.pop("streamx_meta.json") != b.pop("streamx_meta.json") and a == b
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # a folder streamx did not make is never emptied
        with pytest.raises(ConvertError, match="not a streamx conversion"):
            convert(tiny_store, str(tmp_path / "other"), progress=False, overwrite=overwrite)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    (out / "notes.txt").write_text("put there since")  # inside a conversion: --overwrite empties it
    (out / "hidden_states" / "hs_999.safetensors").write_bytes(b"stale")
    convert(tiny_store, str(out), seed=1, overwrite=True, progress=False)
    c = tree(out)
    c.pop("streamx_meta.json")
    assert c == b
    with pytest.raises(ConvertError, match="holds the store"):  # --out around the store would delete it
        convert(tiny_store, str(Path(tiny_store).parent), overwrite=True, progress=False)
    assert open_store(tiny_store).row_ids().size


def test_out_that_is_a_file_is_refused_in_one_line(tiny_store, tmp_path):
    """--out naming a file, or a path under one, is refused as `run` refuses it: one line, nothing written (no lock
    file beside it either)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out in (notes, notes / "spec"):
        refused = CliRunner().invoke(app, ["convert", tiny_store, "--out", str(out)])
        assert refused.exit_code == 1
        assert refused.stderr.strip() == f"error: cannot write the convert folder at {out}: {notes} is not a folder"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and notes.read_text() == "mine"


def test_invalid_samples_are_skipped_and_reported(tiny_store, tmp_path):
    store = open_store(tiny_store)
    samples = [(s.row_id, s.input_ids, s.loss_mask, s.hidden_states.clone()) for s in store.samples()]
    samples[3][3][1, 0, 5] = float("nan")
    samples[6][1][2] = -1
    bad = copy_store(tiny_store, tmp_path / "bad.zarr", [samples, samples[:1]])  # row 0 written twice
    summary = convert(bad, str(tmp_path / "spec"), progress=False, block_rows=4)
    assert summary.skipped == {"bad_token_id": 1, "duplicate_row": 1, "non_finite": 1}
    assert summary.rows == len(samples) - 2
    assert len(load_from_disk(str(tmp_path / "spec"))) == summary.rows
    assert sorted(os.listdir(tmp_path / "spec" / "hidden_states")) == sorted(
        f"hs_{i}.safetensors" for i in range(summary.rows))
    meta = json.loads((tmp_path / "spec" / "streamx_meta.json").read_text())
    assert sorted((e["row_id"], e["reason"]) for e in meta["skipped_examples"]) == sorted(
        [(samples[3][0], "non_finite"), (samples[6][0], "bad_token_id"), (samples[0][0], "duplicate_row")])


def test_store_without_last_layer_is_refused_in_one_line(tiny_chat_model_dir, chat_jsonl, tmp_path):
    no_last = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "a.zarr", layers="1,2", max_samples=4,
                         any_layers=True)
    with pytest.raises(ConvertError, match=r"lack 4, .*--layers 1,2,4"):
        convert(no_last, str(tmp_path / "spec"), progress=False)
    result = CliRunner().invoke(app, ["convert", no_last, "--out", str(tmp_path / "spec")])
    assert result.exit_code == 1 and result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: ") and "--layers 1,2,4" in result.stderr
    only_last = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "b.zarr", layers="4", max_samples=4,
                           any_layers=True)
    with pytest.raises(ConvertError, match=r"layer id 4 alone .*--layers eagle3"):
        convert(only_last, str(tmp_path / "spec"), progress=False)
    assert not (tmp_path / "spec").exists()


def test_the_same_run_with_its_data_moved_keeps_the_convert_folder(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                   speculators_venv):
    """The data copied elsewhere (a node's local disk) and the same run resumed from there, with nothing to do: the
    data is its bytes, not its path, so the store's compat record stays as it was, and the --hidden-states store
    folder converted before the move is still complete for convert and accepted by the streamx backend."""
    data = shutil.copy(chat_jsonl, tmp_path / "chat.jsonl")
    store = make_store(tiny_chat_model_dir, str(data), tmp_path / "s.zarr", max_samples=10)
    out = str(tmp_path / "spec")
    convert(store, out, hidden_states="store", progress=False, log=lambda m: None)
    compat = open_store(store).root.attrs["streamx"]["compat"]
    (tmp_path / "nvme").mkdir()
    moved = shutil.copy(data, tmp_path / "nvme" / "chat.jsonl")
    make_store(tiny_chat_model_dir, str(moved), store, max_samples=10)  # resumed: every row is there already
    assert open_store(store).root.attrs["streamx"]["compat"] == compat
    assert convert(store, out, hidden_states="store", progress=False, log=lambda m: None).already_complete
    check = str(Path(__file__).with_name("speculators_backend_check.py"))
    proc = speculators_venv(check, "--refuse", f"moved_data={out}==1,2")  # the backend's check at start
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["refusals"]["moved_data"] == "accepted"


def test_cli_convert_prints_the_train_commands(tiny_store, tmp_path):
    out = tmp_path / "spec"
    result = CliRunner().invoke(app, ["convert", tiny_store, "--out", str(out), "--seed", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "streamx_meta.json").read_text())
    for algo in ("eagle3", "dflash"):
        assert meta["speculators_train"][algo] in result.stdout
    assert meta["shuffle"]["seed"] == 2
    model = open_store(tiny_store).metadata.model  # which weights speculators must load, said in words
    assert f"speculators loads the verifier {model['path']}" in result.stdout
    assert model["weights_fingerprint"][:12] in result.stdout
    again = CliRunner().invoke(app, ["convert", str(out), "--out", str(tmp_path / "y")])  # a folder, not a store
    assert again.exit_code == 1 and f"{out} is a folder `streamx convert` wrote (speculators training data), not a " \
        f"store; it was converted from {Path(tiny_store).resolve()}" in again.stderr
    bad = CliRunner().invoke(app, ["convert", tiny_store, "--out", str(tmp_path / "x"), "--format", "eagle"])
    assert bad.exit_code == 2 and "'eagle' is not one of 'speculators'" in bad.output  # a Literal option


def test_convert_offers_only_the_drafts_the_stores_ids_suit():
    """On a 30-layer model the presets' auxiliary ids are EAGLE-3 [2, 15, 27] and DFlash [2, 9, 15, 21, 28]
    (5 spread over layer outputs 1..27, +1 in the speculators convention). An EAGLE-3 store gets no DFlash
    command but what to extract for one; a union store serves both, each its own ids when read from the store;
    ids of one's own choice get both commands, as asked."""
    from streamx.train.convert import ConvertSummary
    from streamx.train.meta import draft_layer_ids, train_commands

    suited, unsuited = draft_layer_ids([2, 15, 27], 30, files=True)
    assert suited == {"eagle3": [2, 15, 27]} and list(unsuited) == ["dflash"]
    assert "[2, 9, 15, 21, 28]" in unsuited["dflash"] and "--layers dflash" in unsuited["dflash"]
    assert "--layers 2,9,15,21,27,28,30" in unsuited["dflash"]  # the union of both presets
    union = [2, 9, 15, 21, 27, 28]
    assert draft_layer_ids(union, 30, files=False) == ({"eagle3": [2, 15, 27], "dflash": [2, 9, 15, 21, 28]}, {})
    assert draft_layer_ids(union, 30, files=True) == ({"eagle3": union, "dflash": union}, {})
    assert draft_layer_ids([5, 10], 30, files=True) == ({"eagle3": [5, 10], "dflash": [5, 10]}, {})

    commands = train_commands("/d", "/m", suited)
    text = "\n".join(ConvertSummary("/d", 1, 1, 1, {}, 0, 0.0, commands, {"path": "/m", "model": "m",
                                      "weights_fingerprint": "f" * 64}, unsuited=unsuited).lines("s.zarr"))
    assert "train an EAGLE-3 draft:" in text and "--target-layer-ids 2 15 27 --speculator-type eagle3" in text
    assert "DFlash draft:" not in text and "no DFlash command: the store lacks the ids of DFlash drafts" in text


@pytest.fixture(scope="module")
def multimodal_store(smollm2_dir, chat_jsonl, tmp_path_factory):
    """A store made with a tiny Qwen3.5 multimodal checkpoint (Qwen3_5ForConditionalGeneration) saved with
    SmolLM2's tokenizer and no processor files, which speculators cannot load its processor from."""
    from transformers import AutoTokenizer
    from zoo_models import zoo_model

    root = tmp_path_factory.mktemp("multimodal")
    zoo_model("qwen3_5_multimodal").save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(root / "model")
    return make_store(str(root / "model"), chat_jsonl, root / "s.zarr", max_samples=12)


def tokenizer_dirs(smollm2_dir, root) -> dict[str, tuple[str, int]]:
    """Verifiers (a config and SmolLM2's tokenizer, no weights) -> the mask token id speculators picks for each:
    its tokenizer's mask token; else <|MASK|>, added as id 49152 where the embedding has rows beyond the tokenizer's
    49152; else the pad token (2, <|im_end|>); and for a multimodal config as for a text one."""
    from transformers import AutoTokenizer, LlamaConfig
    from zoo_models import zoo_config

    dirs = {}
    for name, config, mask, expected in (
            ("full", LlamaConfig(vocab_size=49152), None, 2), ("spare", LlamaConfig(vocab_size=49200), None, 49152),
            ("masked", LlamaConfig(vocab_size=49152), "<|endoftext|>", 0),
            ("multimodal", zoo_config("qwen3_5_multimodal"), None, 2)):
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        if mask:
            tokenizer.mask_token = mask
        config.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = (str(root / name), expected)
    return dirs


def test_the_mask_token_is_passed_only_where_speculators_cannot_resolve_it(smollm2_dir, tmp_path):
    """speculators resolves the drafts' mask token from the tokenizer it loads through AutoProcessor, which builds a
    multimodal verifier's processor and fails without its files; only there is --mask-token-id passed, the id
    speculators picks (test_speculators_builds_a_multimodal_verifiers_drafts checks that against speculators)."""
    from streamx.train.mask_token import lacks_processor, mask_token_id

    dirs = tokenizer_dirs(smollm2_dir, tmp_path)
    assert {name: mask_token_id(path) for name, (path, _) in dirs.items()} == \
        {name: expected for name, (_, expected) in dirs.items()}
    assert [name for name, (path, _) in dirs.items() if lacks_processor(path)] == ["multimodal"]
    (Path(dirs["multimodal"][0]) / "preprocessor_config.json").write_text("{}")  # AutoProcessor then loads it
    assert not lacks_processor(dirs["multimodal"][0])
    assert not lacks_processor(str(tmp_path / "gone"))  # not readable here: verify --speculators tells where it trains


def test_a_multimodal_verifier_without_processor_files_gets_a_mask_token_id(multimodal_store, tiny_store, tmp_path):
    """The printed commands of a store made with a multimodal checkpoint that has no processor files pass the mask
    token speculators cannot resolve itself (issue 49), to both drafts (speculators resolves one for either); a
    text-only verifier's commands are unchanged."""
    for name, store, mask in (("text", tiny_store, []), ("multimodal", multimodal_store, ["--mask-token-id", "2"])):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        meta = json.loads((out / "streamx_meta.json").read_text())
        for algo in ("eagle3", "dflash"):
            assert meta["speculators_train_argv"][algo] == [
                "speculators", "train", "--data-path", str(out.resolve()), "--verifier-name-or-path",
                open_store(store).metadata.model["path"], "--on-missing", "raise", "--target-layer-ids", "1", "2",
                *mask, "--speculator-type", algo]
            assert f"  {meta['speculators_train'][algo]}\n" in result.stdout


# -- the proof: speculators' own loader and drafts, in an isolated venv


def test_speculators_trains_eagle3_and_dflash_on_converted_data(smollm2_dir, speculators_venv, tmp_path):
    """bf16 files, and fp8 files through speculators' fp8 backend: from an fp8 store (quantised by the run) for
    EAGLE-3 and from a bf16 store quantised by convert for DFlash; and, with no files (--hidden-states store),
    both drafts reading the stores through the streamx backend (issue 21)."""
    loaded = load_model(smollm2_dir, dtype="float32", device="cpu")
    stores = {name: make_store(smollm2_dir, "chatterbot:english", tmp_path / f"{name}.zarr", layers=layers,
                               max_samples=12, token_budget=2048, max_length=512, dtype="float32", loaded=loaded,
                               storage=storage)
              for name, layers, storage in (("eagle3", "2,15,27,30", "bf16"), ("eagle3-fp8", "2,15,27,30", "fp8"),
                                            ("dflash", "dflash", "bf16"))}
    del loaded
    specs = {}
    for name, store, hidden_states in (("eagle3", "eagle3", None), ("eagle3:fp8", "eagle3-fp8", None),
                                       ("dflash", "dflash", None), ("dflash:fp8", "dflash", "fp8"),
                                       ("eagle3:store", "eagle3-fp8", "store"), ("dflash:store", "dflash", "store")):
        out = tmp_path / name.replace(":", "-")
        convert(stores[store], str(out), seed=0, progress=False, hidden_states=hidden_states)
        specs[name] = (open_store(stores[store]), json.loads((out / "streamx_meta.json").read_text()))

    proc = speculators_venv(str(Path(__file__).with_name("speculators_check.py")),
                            *(f"{name}={tmp_path / name.replace(':', '-')}" for name in specs),
                            "--scratch", str(tmp_path / "scratch"),
                            "--extra", "dflash=--draft-vocab-size,2048")  # a reduced vocabulary from token_freq.pt
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["versions"]["speculators"] == "0.9.0"
    print(json.dumps({name: r["targets"] for name, r in result.items() if name != "versions"}))  # shown with -s

    for name, (store, meta) in specs.items():  # the no-copy runs read the store through the streamx backend
        assert store.num_tokens < store.row_tokens  # a shared store: the template's system prompt stored once
        algo, tag = (*name.split(":"), "")[:2]
        fp8 = tag == "fp8" or store.metadata.storage == "fp8"
        r = result[name]
        assert r["hidden_states_backend"] == {"fp8": "fp8", "store": "streamx"}.get(tag, "file")
        n, aux = len(store), meta["target_layer_ids"]
        assert aux == [i for i in store.layer_ids if i != 30] and r["target_layer_ids"] == aux
        assert r["aux_features"] == len(aux) * 576
        assert r["rows"] == {"train": int(n * 0.9), "val": n - int(n * 0.9)} and r["val_start"] == int(n * 0.9)
        shifted = n if algo == "eagle3" else 0  # EAGLE-3 drops one token per row at load time
        assert sum(r["tokens_loaded"].values()) == store.row_tokens - shifted and r["dropped_rows"] == 0
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["grads"] > 0 and r["grads_finite"] and r["grad_norm"] > 0
        t = r["targets"]
        assert t["rows"] == n and t["tokens"] == store.row_tokens
        # the slot speculators loads as the verifier's last state is its pre-norm output, within 2 bf16 ulps (fp8:
        # 3 mantissa bits, one scale per token over every slot; measured 0.0099 against bf16's 0.0027)
        assert t["last_slot_vs_pre_norm_rel"] < (2**-5 if fp8 else 2**-7)
        # and the logits speculators rebuilds from it are the verifier's, up to that rounding (fp8 measured: max
        # error 5% of the logit scale, argmax agreement 96-97%, against 0.35% and 99.5% for bf16)
        assert t["max_abs_diff"] < (0.1 if fp8 else 0.02) * t["logit_scale"]
        assert t["argmax_agreement"] > (0.9 if fp8 else 0.98)
        assert t["double_norm_max_abs_diff"] > 10 * t["max_abs_diff"]  # the check tells a post-norm slot apart
    assert result["dflash"]["draft_vocab_size"] == 2048 and result["dflash"]["draft_vocab_has_every_trained_token"]
    assert result["eagle3"]["draft_vocab_size"] == 49152


def test_speculators_builds_a_multimodal_verifiers_drafts(multimodal_store, smollm2_dir, speculators_python,
                                                          speculators_venv, tmp_path):
    """The printed DFlash command starts speculators' training for a multimodal verifier without processor files
    (its --dry-run builds the draft and saves it with the mask token passed); `verify --speculators` builds each
    draft as its command does, and for a command without the flag (a folder converted before) says what to add;
    and the mask token streamx picks is the one speculators resolves wherever it can."""
    out = tmp_path / "spec"
    convert(multimodal_store, str(out), progress=False, log=lambda m: None)
    meta_path = out / "streamx_meta.json"
    meta = json.loads(meta_path.read_text())
    dflash = meta["speculators_train_argv"]["dflash"]
    assert dflash[:2] == ["speculators", "train"]
    speculators = str(Path(speculators_python).with_name("speculators"))  # the `speculators` the command runs
    proc = speculators_venv(speculators, *dflash[1:], "--dry-run", "--save-path", str(tmp_path / "draft"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["mask_token_id"] == 2

    proc = speculators_venv("-m", "streamx", "verify", str(out), "--speculators", "--no-model")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "ok   speculators  speculators built each draft and read a batch: eagle3 " in proc.stdout
    for argv in meta["speculators_train_argv"].values():  # as convert wrote them before
        flag = argv.index("--mask-token-id")
        del argv[flag : flag + 2]
    meta_path.write_text(json.dumps(meta))
    proc = speculators_venv("-m", "streamx", "verify", str(out), "--speculators", "--no-model")
    verifier = open_store(multimodal_store).metadata.model["path"]
    assert proc.returncode == 1 and "FAIL speculators  2 of 2 drafts fail" in proc.stdout, proc.stdout
    for algo in ("eagle3", "dflash"):
        assert f"{algo}: speculators cannot resolve the draft's mask token (OSError: Can't load image processor for " \
               f"'{verifier}'): add --mask-token-id 2 to the train command" in proc.stdout, proc.stdout

    dirs = tokenizer_dirs(smollm2_dir, tmp_path / "tokenizers")
    del dirs["multimodal"]  # (speculators cannot load its processor: the case above)
    picked = "from speculators.train.utils import resolve_mask_token_id\n" \
             "from streamx.model.load import read_text_config\n" \
             "import sys\n" \
             "print(*(resolve_mask_token_id(p, read_text_config(p).vocab_size) for p in sys.argv[1:]))"
    proc = speculators_venv("-c", picked, *(path for path, _ in dirs.values()))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(expected) for _, expected in dirs.values()]


def test_fp8_files_hold_the_stores_fp8_bytes(tiny_chat_model_dir, chat_jsonl, tiny_store, tmp_path):
    """fp8 files from a bf16 store (quantised by convert) and from an fp8 store (its own bytes, not quantised
    twice), and bf16 files from an fp8 store (dequantised); the train commands name the fp8 backend."""
    fp8_store = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "fp8.zarr", storage="fp8")
    bf16 = open_store(tiny_store)
    for name, store, hidden_states in (("bf16-to-fp8", tiny_store, "fp8"), ("fp8", fp8_store, None),
                                       ("fp8-to-bf16", fp8_store, "bf16")):
        out = tmp_path / name
        summary = convert(store, str(out), seed=0, progress=False, hidden_states=hidden_states)
        fp8 = name != "fp8-to-bf16"
        meta = json.loads((out / "streamx_meta.json").read_text())
        assert meta["hidden_states_dtype"] == ("fp8" if fp8 else "bf16") and meta["identity"]["hidden_states"]
        for argv in summary.commands.values():
            assert (argv[argv.index("--hidden-states-backend") + 1] == "fp8") if fp8 else \
                "--hidden-states-backend" not in argv
        source = open_store(store)
        for i, row in enumerate(convert_module.training_order(source.row_ids(), 0).tolist()):
            f, want = hs_file(out, i), bf16.sample(row)
            assert torch.equal(f["token_ids"], want.input_ids)
            if fp8:
                values, scales = quantize_fp8(want.hidden_states)  # a bf16 store's states, quantised
                assert set(f) == {"hidden_states", "hidden_states_scales", "token_ids"}
                assert f["hidden_states"].dtype == torch.float8_e4m3fn and f["hidden_states_scales"].shape == (
                    len(want.input_ids), 1, 1)
                assert torch.equal(f["hidden_states"].view(torch.uint8), values.view(torch.uint8))
                assert torch.equal(f["hidden_states_scales"].flatten(), scales)
            else:
                assert set(f) == {"hidden_states", "token_ids"} and f["hidden_states"].dtype == torch.bfloat16
                assert torch.equal(f["hidden_states"], source.sample(row).hidden_states)
    with pytest.raises(ConvertError, match="--hidden-states must be one of bf16, fp8, store; got 'fp16'"):
        convert(tiny_store, str(tmp_path / "x"), progress=False, hidden_states="fp16")
    with pytest.raises(ConvertError, match="another store, seed, row set or hidden-state dtype"):
        convert(tiny_store, str(tmp_path / "bf16-to-fp8"), progress=False)  # there: the fp8 files of this store
