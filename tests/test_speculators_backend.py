"""Train from the store, no second copy: `convert --hidden-states store` writes only the small files, and the
`streamx` backend, run in speculators 0.9.0's own environment with streamx installed as docs/speculators.md
says (tests/conftest.py), returns for every row exactly what speculators' file and fp8 backends load from a
normal convert of the same store and seed (tests/speculators_backend_check.py). tests/test_convert.py trains
EAGLE-3 and DFlash drafts through it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import copy_store, small_config

from streamx.pipeline.runner import run
from streamx.store import StoreError, open_store
from streamx.train.convert import convert
from streamx.train.dataset import StoreDataset
from streamx.train.meta import backend_layer_ids
from streamx.train.verify import verify

LAYERS = "1,2,3,4"  # more ids than one drafter uses (L = 4)
CHECK = str(Path(__file__).with_name("speculators_backend_check.py"))


def make_store(model_dir, data, out, **settings) -> str:
    run(small_config(model_dir, data, out, layers=LAYERS, **settings), progress=False, log=lambda m: None)
    return str(out)


def both_converts(store: str, root: Path, seed: int = 1) -> tuple[str, str]:
    """A normal convert (hs files) and a --hidden-states store one, same seed."""
    files, nocopy = root / "files", root / "nocopy"
    convert(store, str(files), seed=seed, progress=False, log=lambda m: None)
    convert(store, str(nocopy), seed=seed, progress=False, log=lambda m: None, hidden_states="store")
    return str(files), str(nocopy)


@pytest.fixture(scope="module")
def stores(tiny_chat_model_dir, chat_jsonl, tmp_path_factory):
    root = tmp_path_factory.mktemp("backend")
    bf16 = make_store(tiny_chat_model_dir, chat_jsonl, root / "bf16.zarr")
    fp8 = make_store(tiny_chat_model_dir, chat_jsonl, root / "fp8.zarr", storage="fp8", max_samples=30)
    samples = [(s.row_id, s.input_ids, s.loss_mask, s.hidden_states) for s in open_store(bf16).samples()]
    parts = copy_store(bf16, root / "parts.zarr", [samples[1::2], samples[::2][::-1]])  # as two ranks write it
    return {"bf16": bf16, "fp8": fp8, "parts": parts}


def test_no_copy_convert_writes_only_the_small_files(stores, tmp_path):
    files, nocopy = both_converts(stores["bf16"], tmp_path)
    assert sorted(p.name for p in Path(nocopy).iterdir()) == ["data-00000-of-00001.arrow", "dataset_info.json",
                                                              "state.json", "store_rows.npy", "streamx_meta.json",
                                                              "token_freq.pt"]
    for name in ("data-00000-of-00001.arrow", "token_freq.pt"):  # the same rows in the same order as the files'
        assert (Path(nocopy) / name).read_bytes() == (Path(files) / name).read_bytes()
    meta = json.loads((Path(nocopy) / "streamx_meta.json").read_text())
    for algo, argv in meta["speculators_train_argv"].items():
        assert argv[:3] == ["python", "-m", "streamx.speculators_backend"]
        assert argv[argv.index("--hidden-states-backend") + 1] == "streamx" and argv[-1] == algo
    store = open_store(stores["bf16"])
    rows = np.load(Path(nocopy) / "store_rows.npy")
    assert sorted(rows.tolist()) == store.row_ids().tolist()  # every row once, shuffled
    report = verify(nocopy, use_model=False, log=lambda m: None)  # the folder against its store, then the store
    assert report.passed and report.checks[0].name == "rows", report.lines()
    np.save(Path(nocopy) / "store_rows.npy", rows[::-1].copy())  # rows that are not the dataset's
    assert [c.name for c in verify(nocopy, use_model=False, log=lambda m: None).checks if not c.passed] == ["rows"]
    on_disk = sum(f.stat().st_size for f in Path(nocopy).rglob("*") if f.is_file())
    copied = sum(f.stat().st_size for f in Path(files).rglob("*") if f.is_file())
    assert on_disk < 0.05 * copied


def test_the_backend_returns_the_files_bytes(stores, speculators_venv, tmp_path):
    """bf16, fp8 (dequantised as speculators' fp8 backend does), a two-part store, and a subset of the stored
    ids (1 and 3 of 1..4): every row's tensors bit for bit, also read in spawned DataLoader workers."""
    pairs, subset = [], None
    for name, store in stores.items():
        files, nocopy = both_converts(store, tmp_path / name)
        pairs.append(f"{files}={nocopy}")
        if name == "bf16":
            subset = f"{files}={nocopy}=1,3"
    proc = speculators_venv(CHECK, *pairs, subset)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["speculators_requirements_broken"] == []  # installing streamx kept speculators' pins
    assert len(result["pairs"]) == 4
    for pair, r in result["pairs"].items():
        assert r["rows"] > 0 and r["equal"] == r["rows"] == r["in_workers_equal"], pair
        assert r["beyond_last_row"]
    assert result["pairs"][subset]["slots"] == [0, 2, 3] and result["pairs"][subset]["shapes"] == [[3, 64]]
    assert result["pairs"][pairs[0]]["slots"] == [0, 1, 2, 3] and result["pairs"][pairs[0]]["shapes"] == [[4, 64]]


def test_the_backend_refuses_a_store_it_cannot_serve(tiny_chat_model_dir, chat_jsonl, speculators_venv, tmp_path):
    grown = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "grown.zarr", max_samples=10)
    _, grown_dir = both_converts(grown, tmp_path / "grown")
    make_store(tiny_chat_model_dir, chat_jsonl, grown, max_samples=14)  # 4 more rows committed since
    other = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "other.zarr", max_samples=10)
    _, other_dir = both_converts(other, tmp_path / "other")
    run(small_config(tiny_chat_model_dir, chat_jsonl, other, layers="2,4", max_samples=10, overwrite=True),
        progress=False, log=lambda m: None)  # another run in its place
    moved = make_store(tiny_chat_model_dir, chat_jsonl, tmp_path / "moved.zarr", max_samples=10)
    _, moved_dir = both_converts(moved, tmp_path / "moved")
    shutil.move(moved, tmp_path / "elsewhere.zarr")
    files_dir = str(tmp_path / "grown" / "files")
    proc = speculators_venv(CHECK, "--refuse", f"missing_id={moved_dir}={tmp_path / 'elsewhere.zarr'}=0,2",
                            "--refuse", f"unsorted={moved_dir}={tmp_path / 'elsewhere.zarr'}=3,1",
                            "--refuse", f"grown={grown_dir}", "--refuse", f"other={other_dir}",
                            "--refuse", f"moved={moved_dir}", "--refuse", f"moved_found={moved_dir}="
                            f"{tmp_path / 'elsewhere.zarr'}=1,3", "--refuse", f"files={files_dir}",
                            "--refuse", f"default_ids={moved_dir}={tmp_path / 'elsewhere.zarr'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = json.loads(proc.stdout)["refusals"]
    assert said["missing_id"] == (f"StoreError: {tmp_path / 'elsewhere.zarr'} holds layer ids [1, 2, 3, 4], not "
                                  "[0]; extract them with `streamx run --layers ...` or choose among [1, 2, 3, 4]")
    assert said["unsorted"].startswith("ValueError: --target-layer-ids 3 1 must be ascending and distinct")
    assert said["grown"].startswith(f"ValueError: {grown} is not the store this folder was converted from: its "
                                    "committed rows changed (14 samples now, 10 when converted)")
    # (its creation time has one-second resolution: "it was created anew" may or may not be said as well)
    assert said["other"].startswith(f"ValueError: {other} is not the store this folder was converted from: ")
    assert "another model, layers or tokenization" in said["other"]
    assert said["moved"] == f"StoreError: {moved} does not exist; if it moved, pass --streamx-store NEWPATH"
    assert said["moved_found"] == "accepted"  # --streamx-store points at where it went
    # without --target-layer-ids, speculators' default 2, L//2, L-3: for this 4-layer model 2 2 1, refused
    assert said["default_ids"].startswith("ValueError: --target-layer-ids 2 2 1 must be ascending and distinct")
    assert said["files"].startswith(f"ValueError: {files_dir} holds hs files (bf16)")


def test_store_dataset_serves_any_trainer(stores, tmp_path):
    """sample i -> ids, mask and the chosen ids' states, as the store holds them; picklable for workers."""
    import pickle

    store = open_store(stores["fp8"])
    data = StoreDataset(stores["fp8"], layer_ids=[2, 4])
    assert len(data) == len(store) and data.rows.tolist() == store.row_ids().tolist()
    for i in (0, len(data) - 1):
        item, want = data[i], store.sample(int(store.row_ids()[i]))
        assert torch.equal(item["input_ids"], want.input_ids) and torch.equal(item["loss_mask"], want.loss_mask)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], want.hidden_states[:, [1, 3]])  # ids 2 and 4 of 1..4
    copy = pickle.loads(pickle.dumps(data))
    assert copy._store is None and torch.equal(copy[3]["hidden_states"], data[3]["hidden_states"])
    with pytest.raises(StoreError, match=r"holds layer ids \[1, 2, 3, 4\], not \[0\]"):
        StoreDataset(stores["fp8"], layer_ids=[0, 4])


def test_the_backend_contract_names_its_slots():
    """Which slots the backend returns: the target ids as given when ascending, then L; speculators' default
    without them; refused (one line naming the fix) when they would need reordering, are empty, repeat or hold L."""
    assert backend_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    assert backend_layer_ids(None, 30) == [2, 15, 27, 30]
    assert backend_layer_ids([5], 30) == [5, 30]
    for ids, said in (([15, 2, 27], "must be ascending and distinct, as vLLM captures them and speculators' file "
                                    "backend returns them: 2 15 27"),
                      ([2, 2], "must be ascending and distinct"), ([], "is empty"), ([2, 30], "holds 30, the last")):
        with pytest.raises(ValueError, match=said):
            backend_layer_ids(ids, 30)


def test_verify_speculators_reads_a_batch_through_speculators_own_loaders(stores, speculators_venv, tmp_path):
    """`streamx verify DIR --speculators` in speculators' environment builds each draft and its loaders as
    `speculators train` does and reads a batch, from hs files and from the store; a missing hs file fails it, and
    where speculators is not installed it says so."""
    from helpers import cli

    files, nocopy = both_converts(stores["bf16"], tmp_path)
    for folder in (files, nocopy):
        proc = speculators_venv("-m", "streamx", "verify", folder, "--speculators", "--no-model")
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
        assert "ok   speculators  speculators built each draft and read a batch: eagle3 " in proc.stdout and \
            "pin_memory" not in proc.stderr
    (Path(files) / "hidden_states" / "hs_0.safetensors").unlink()
    proc = speculators_venv("-m", "streamx", "verify", files, "--speculators", "--no-model")
    assert proc.returncode == 1 and "FAIL speculators  2 of 2 drafts fail" in proc.stdout, proc.stdout
    here = cli("verify", nocopy, "--speculators", "--no-model")
    assert here.returncode == 1 and "FAIL speculators  speculators is not importable here" in here.stdout
