"""`streamx convert --format specforge-eagle3|specforge-dflash|modelopt|torchspec`, proven by each trainer's own
reader in a venv of its own (trainer_check.py; TorchSpec's, which no package holds, as its published source reads):
every row as the trainer hands it to training equals the store (ids, masks, aux layers bit for bit) and an
independent unbatched HF forward (the layers as the trainer counts them, the last state after the final norm:
`output_hidden_states`' last entry)."""

import json
import os
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import pytest
import torch
import trainer_check
from helpers import small_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import streamx.train.export as export_module
from streamx.config import resolve_layer_ids
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.convert import ConvertError
from streamx.train.export import EXPORT, export
from streamx.train.folder import staging

CHECK = str(Path(__file__).with_name("trainer_check.py"))
TRAIN = str(Path(__file__).with_name("trainer_train.py"))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst token's error relative to its own norm."""
    got, want = got.float(), want.float()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).max())


def row_of(name: str) -> int:
    return int(name.split("_")[1].split(".")[0])


def reference(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids[None], output_hidden_states=True).hidden_states


def check_rows(store, model, found: dict, eagle3: list[int], dflash: list[int] | None) -> dict[str, int]:
    """Every row each trainer read against the store and the reference; returns the rows each read."""
    L, held = store.metadata.num_layers, store.layer_ids
    slots = lambda blocks: [held.index(k + 1) for k in blocks]  # noqa: E731 - the store's slot of block k's output
    worst = {"aux": 0.0, "last": 0.0, "pre_norm_last": float("inf")}
    for fmt, rows in found.items():
        if fmt == "versions":
            continue
        for r in rows:
            s = store.sample(row_of(r["file"]))
            ref = reference(model, s.input_ids)
            blocks = dflash if fmt == "specforge-dflash" else eagle3
            want_aux = s.hidden_states[:, slots(blocks)].reshape(len(s.input_ids), -1)
            if fmt == "modelopt":
                ids, mask, aux, last = r["input_ids"], r["loss_mask"], r["aux_hidden_states"], \
                    r["base_model_hidden_states"]
                assert torch.equal(mask, s.loss_mask.long()) and not r["base_hidden_prenorm"]
            elif fmt == "torchspec":
                ids, mask, aux, last = r["input_ids"][0], r["loss_mask"], r["hidden_states"][0], \
                    r["last_hidden_states"][0]
                assert torch.equal(mask, s.loss_mask.long()) and not r["prenorm"] and r["seq_len"] == len(ids)
            else:
                ids, mask = r["input_ids"][0], r["loss_mask"][0]
                aux = r["hidden_state" if fmt == "specforge-eagle3" else "hidden_states"][0]
                last = r["target"][0] if fmt == "specforge-eagle3" else None
                assert torch.equal(mask[:-1], s.loss_mask[:-1].long()) and mask[-1] == 0  # its loader zeroes the last
            assert torch.equal(ids, s.input_ids.long()), (fmt, r["file"])
            assert aux.dtype == torch.bfloat16 and torch.equal(aux.view(torch.int16), want_aux.view(torch.int16))
            want = torch.cat([ref[k + 1][0] for k in blocks], dim=-1)  # block k's output: HF's hidden_states[k+1]
            worst["aux"] = max(worst["aux"], relative_error(aux.view(len(ids), len(blocks), -1),
                                                            want.view(len(ids), len(blocks), -1)))
            if last is not None:
                worst["last"] = max(worst["last"], relative_error(last, ref[-1][0]))  # after the final norm
                worst["pre_norm_last"] = min(worst["pre_norm_last"],
                                             relative_error(s.hidden_states[:, held.index(L)], ref[-1][0]))
    print(json.dumps(worst))  # shown with -s
    assert worst["aux"] < 1e-2 and worst["last"] < 1e-2
    assert worst["pre_norm_last"] > 0.1  # the check tells a state before the norm from one after it
    return {fmt: len(rows) for fmt, rows in found.items() if fmt != "versions"}


def convert_all(store: str, tmp_path, eagle3: list[int], dflash: list[int] | None) -> dict[str, str]:
    folders = {}
    for fmt, ids in (("specforge-eagle3", eagle3), ("modelopt", eagle3), ("torchspec", eagle3),
                     ("specforge-dflash", dflash)):
        if ids is None:
            continue
        folders[fmt] = str(tmp_path / fmt)
        export(store, folders[fmt], fmt, ids, progress=False, log=lambda m: None)
    return folders


def read_by_trainers(trainer_venv, folders: dict[str, str], tmp_path) -> dict:
    found = {"versions": {}}
    for trainer in ("specforge", "modelopt"):
        mine = [f"{fmt}={path}" for fmt, path in folders.items() if fmt.startswith(trainer)]
        result = tmp_path / f"{trainer}.pt"
        proc = trainer_venv(trainer, CHECK, str(result), *mine)
        assert proc.returncode == 0, proc.stderr[-4000:]
        got = torch.load(result, weights_only=False)
        found["versions"].update(got.pop("versions"))
        found.update(got)
    found["torchspec"] = trainer_check.torchspec(folders["torchspec"])  # no package: as its source reads (torch only)
    return found


def test_specforge_and_modelopt_read_the_embedded_models_store_as_an_independent_forward_has_it(
        smollm2_dir, smollm2, trainer_venv, tmp_path):
    """SmolLM2 on real chats that share their system prompt (stored once, --sharing): EAGLE-3 for SpecForge and
    ModelOpt at their default layers, DFlash for SpecForge at the dflash preset's five."""
    model, _ = smollm2
    L = model.config.num_hidden_layers
    layers = sorted(set(resolve_layer_ids("eagle3", L)) | set(resolve_layer_ids("dflash", L)))
    store = str(tmp_path / "s.zarr")
    run(small_config(smollm2_dir, "chatterbot:english", store, layers=",".join(map(str, layers)), max_samples=24,
                     dtype="float32"), progress=False, log=lambda m: None)
    s = open_store(store)
    assert s.summary()["shared"]  # rows computed from shared prefixes: what the trainers read is still each row's
    eagle3 = [1, L // 2 - 1, L - 4]  # SpecForge's and ModelOpt's default, as they count
    dflash = [k - 1 for k in resolve_layer_ids("dflash", L) if k < L]
    folders = convert_all(store, tmp_path, eagle3, dflash)
    found = read_by_trainers(trainer_venv, folders, tmp_path)
    assert found["versions"] == {"specforge": "0.2.0", "modelopt": "0.47.0"}
    counts = check_rows(s, model, found, eagle3, dflash)
    skipped = json.loads((Path(folders["specforge-dflash"]) / EXPORT).read_text())["skipped"]
    assert counts["specforge-eagle3"] == counts["modelopt"] == counts["torchspec"] == len(np.unique(s.row_ids()))
    assert counts["specforge-dflash"] + skipped.get("untrainable", 0) == len(np.unique(s.row_ids()))
    trained = train_by_trainers(trainer_venv, smollm2_dir, folders, eagle3, dflash, tmp_path)
    for name, got in trained.items():  # every row read, each step a finite loss and gradient
        print(name, json.dumps(got))
        assert got["global_step"] == len(got["losses"]) == 2, (name, got)
        assert all(0 < x < float("inf") for x in got["losses"] + got["grad_norms"]), (name, got)
        assert got["rows_read"] == counts["specforge-dflash" if name == "specforge-dflash" else "modelopt"], name
    assert trained["specforge-eagle3"]["draft_vocab"] == 32000  # its vocab mapping, built from the folder


def train_by_trainers(trainer_venv, target: str, folders: dict[str, str], eagle3: list[int], dflash: list[int],
                      tmp_path) -> dict[str, dict]:
    """Two training steps of each trainer's own draft on the CPU from the converted folders (trainer_train.py)."""
    ids = lambda blocks: ",".join(map(str, blocks))  # noqa: E731
    runs = {"specforge": [f"eagle3={folders['specforge-eagle3']}:{ids(eagle3)}",
                          f"dflash={folders['specforge-dflash']}:{ids(dflash)}"],
            "modelopt": [f"{strategy}={folders['modelopt']}:{ids(eagle3)}" for strategy in ("eagle3", "dflash")]}
    trained = {}
    for trainer, folder_args in runs.items():
        result = tmp_path / f"{trainer}-trained.json"
        proc = trainer_venv(trainer, TRAIN, str(result), trainer, target, str(tmp_path / f"{trainer}-work"),
                            *folder_args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        for strategy, got in json.loads(result.read_text()).items():
            trained[f"{trainer}-{strategy}"] = got
    return trained


def test_a_hybrid_qwen3_5_checkpoint_converts_with_its_own_final_norm(smollm2_dir, trainer_venv, tmp_path):
    """Qwen3.5 as released (decoder under model.language_model; Gated DeltaNet and gated attention; its norm
    scales by 1 + weight): the last state through the checkpoint's own norm, read without loading the model."""
    from zoo_models import zoo_model

    from streamx.model.load import load_tokenizer

    model = zoo_model("qwen3_5_multimodal")
    with torch.no_grad():  # a norm weight away from its init, so that 1 + w and w differ visibly
        model.model.language_model.norm.weight.uniform_(-0.5, 0.5)
    checkpoint = tmp_path / "qwen3_5"
    model.save_pretrained(checkpoint)
    load_tokenizer(smollm2_dir).save_pretrained(checkpoint)
    store = str(tmp_path / "s.zarr")
    run(small_config(str(checkpoint), "chatterbot:english", store, layers="1,2,3,4", max_samples=12, dtype="float32"),
        progress=False, log=lambda m: None)
    folders = convert_all(store, tmp_path, [0, 1, 2], None)
    found = read_by_trainers(trainer_venv, folders, tmp_path)
    counts = check_rows(open_store(store), model.eval(), found, [0, 1, 2], None)
    assert counts == {"specforge-eagle3": 12, "modelopt": 12, "torchspec": 12}


def killed_export(monkeypatch, store: str, out: Path, fmt: str, ids: list[int], rows: int = 10) -> None:
    """A convert killed as it writes its row file after `rows` of them, leaving that one torn (half written under
    its temporary name)."""
    real_write, written = export_module.durable.write_file, []

    def dying(path, write, exclusive=False):
        if path.name != EXPORT and len(written) == rows:
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / f".{path.name}.tmp-torn").write_bytes(b"half")  # a write killed mid-way
            raise KeyboardInterrupt
        real_write(path, write, exclusive)
        if path.name != EXPORT:
            written.append(path)

    monkeypatch.setattr(export_module.durable, "write_file", dying)
    with pytest.raises(KeyboardInterrupt):
        export(store, str(out), fmt, ids, workers=1, progress=False, log=lambda m: None)
    monkeypatch.setattr(export_module.durable, "write_file", real_write)


@pytest.mark.parametrize("fmt", ["modelopt", "torchspec"])
def test_a_convert_killed_part_way_is_resumed_with_every_row_once(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                    monkeypatch, fmt):
    """Resumed by the same command, with the rows written kept; also where an earlier streamx's killed convert left
    them in the folder itself."""
    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,2,3,4"), progress=False, log=lambda m: None)
    rows = len(np.unique(open_store(store).row_ids()))
    out = tmp_path / fmt
    killed_export(monkeypatch, store, out, fmt, [0, 1])
    assert not out.exists() and not json.loads((staging(out) / EXPORT).read_text()).get("complete")
    if fmt == "modelopt":
        staging(out).rename(out)  # where an earlier streamx left a killed convert's rows
    summary = export(store, str(out), fmt, [0, 1], workers=3, progress=False, log=lambda m: None)
    files = sorted(out.rglob("*.pt"))
    assert summary.rows == rows == len(files) and summary.kept_files == 10
    assert not list(out.rglob(".*tmp*")) and not staging(out).exists()  # the torn file is gone, and the staging
    assert sorted(row_of(f.name) for f in files) == sorted(np.unique(open_store(store).row_ids()).tolist())
    if fmt == "torchspec":  # its manifest lists each row once, each file as it holds it
        read = trainer_check.torchspec(str(out))
        assert sorted(row_of(r["file"]) for r in read) == sorted(row_of(f.name) for f in files)
    messages = []
    again = export(store, str(out), fmt, [0, 1], progress=False, log=messages.append)
    assert again.rows == rows and "nothing to do" in messages[0]
    with pytest.raises(ConvertError, match="another conversion"):
        export(store, str(out), fmt, [0, 2], progress=False, log=lambda m: None)


def test_a_killed_converts_folder_gives_each_trainers_own_reader_nothing_to_train_on(tiny_chat_model_dir, chat_jsonl,
                                                                                    trainer_venv, tmp_path,
                                                                                    monkeypatch):
    """SpecForge lists every file under its folder and ModelOpt's examples glob it, hidden folders too: a killed
    convert's rows there were read as a smaller dataset. Pointed at the folder of a convert killed after 10 rows,
    each trainer's own reader finds no row (TorchSpec's: no dataset.json); resumed, all of them."""
    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,2,3,4"), progress=False, log=lambda m: None)
    rows = len(np.unique(open_store(store).row_ids()))
    reads = []
    for fmt in ("specforge-eagle3", "modelopt", "torchspec"):
        killed, resumed = tmp_path / f"{fmt}-killed", tmp_path / fmt
        for out in (killed, resumed):
            killed_export(monkeypatch, store, out, fmt, [0, 1])
        assert len(list(staging(killed).rglob("row_*"))) == 10
        export(store, str(resumed), fmt, [0, 1], progress=False, log=lambda m: None)
        reads += [f"{fmt}@killed={killed}", f"{fmt}={resumed}"]
    found = {}
    for trainer in ("specforge", "modelopt"):
        result = tmp_path / f"{trainer}.pt"
        proc = trainer_venv(trainer, CHECK, str(result), *[r for r in reads if r.startswith(trainer)])
        assert proc.returncode == 0, proc.stderr[-4000:]
        found.update(torch.load(result, weights_only=False))
    with pytest.raises(FileNotFoundError):
        trainer_check.torchspec(str(tmp_path / "torchspec-killed"))
    found["torchspec"] = trainer_check.torchspec(str(tmp_path / "torchspec"))
    assert len(found["specforge-eagle3@killed"]) == len(found["modelopt@killed"]) == 0
    assert len(found["specforge-eagle3"]) == len(found["modelopt"]) == len(found["torchspec"]) == rows


def test_layers_the_store_lacks_and_another_checkpoint_are_refused_in_one_line(
        tiny_chat_model_dir, chat_jsonl, tmp_path, smollm2_dir):
    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,3,4", max_samples=8), progress=False,
        log=lambda m: None)
    with pytest.raises(ConvertError, match=r"lacks \[2\]: extract them with `streamx run --layers 1,2,3,4`"):
        export(store, str(tmp_path / "a"), "specforge-eagle3", [0, 1, 2], progress=False, log=lambda m: None)
    with pytest.raises(ConvertError, match="blocks 0..2"):
        export(store, str(tmp_path / "b"), "modelopt", [0, 3], progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="not the one the store was made with"):
        export(store, str(tmp_path / "c"), "modelopt", [0, 2], model=smollm2_dir, progress=False, log=lambda m: None)
    export(store, str(tmp_path / "d"), "specforge-dflash", [0, 2], progress=False, log=lambda m: None)  # no norm


def test_an_fp8_store_converts_dequantized_to_bf16(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """The fp8 store's own values (its scales applied), in bf16, as the trainer reads them: bit for bit the store's
    dequantized slots, and within fp8's rounding of an independent float32 forward (0.035 here; the next layer is
    0.98 away, the state before the norm 44)."""
    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,2,3,4", max_samples=6, storage="fp8"),
        progress=False, log=lambda m: None)
    s = open_store(store)
    assert s.metadata.storage == "fp8"
    export(store, str(tmp_path / "ts"), "torchspec", [0, 2], progress=False, log=lambda m: None)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    read = trainer_check.torchspec(str(tmp_path / "ts"))
    assert len(read) == 6
    for r in read:
        x = s.sample(row_of(r["file"]))
        T, held = len(x.input_ids), s.layer_ids
        aux, last = r["hidden_states"][0], r["last_hidden_states"][0]
        want = x.hidden_states[:, [held.index(1), held.index(3)]].reshape(T, -1)
        assert aux.dtype == last.dtype == torch.bfloat16 and torch.equal(aux.view(torch.int16), want.view(torch.int16))
        ref = reference(model, x.input_ids)
        assert relative_error(aux.view(T, 2, -1), torch.stack([ref[1][0], ref[3][0]], dim=1)) < 0.1
        assert relative_error(last, ref[-1][0]) < 0.1  # through the final norm


def test_torchspecs_packed_loss_mask_unpacks_to_the_mask():
    from streamx.train.trainers import packed_loss_mask

    assert packed_loss_mask(torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0])) == "2,3,2,2,1"  # its docstring's example
    g = torch.Generator().manual_seed(0)
    masks = [torch.tensor(m) for m in ([1, 1, 0], [1], [0], [0, 1], [1, 0, 1, 0])]
    masks += [(torch.rand(n, generator=g) < 0.5).long() for n in (2, 7, 64, 300)]
    for mask in masks:  # a mask that starts supervised too (its packing starts with an empty run of 0s)
        assert torch.equal(trainer_check.unpack_loss_mask(packed_loss_mask(mask)), mask), mask


def test_the_final_norm_read_from_the_checkpoint_is_the_models_own(tiny_chat_model_dir):
    """FinalNorm against the loaded model's norm module on states of the model's scale."""
    from streamx.train.final_norm import FinalNorm

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32)
    states = torch.randn(7, model.config.hidden_size) * 3
    norm = FinalNorm.from_checkpoint(tiny_chat_model_dir)
    assert norm.name == "model.norm"
    assert torch.equal(norm(states), model.model.norm(states))
    assert os.path.isdir(tiny_chat_model_dir)


def test_the_cli_converts_for_a_trainer_and_says_how_to_train(tiny_chat_model_dir, chat_jsonl, tmp_path):
    from typer.testing import CliRunner

    import streamx.cli as cli_module
    import streamx.train.nemo as nemo
    from streamx.cli import app
    from streamx.train.trainers import TRAINERS

    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,2,4", max_samples=6), progress=False,
        log=lambda m: None)
    out = tmp_path / "sf"
    result = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--format", "specforge-eagle3",
                                      "--trainer-layers", "0,1", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "6 rows" in result.output and f"data.hidden_states_path={out.resolve()}" in result.output
    assert len(list(out.rglob("*.ckpt"))) == 6
    bad = CliRunner().invoke(app, ["convert", store, "--out", str(tmp_path / "x"), "--format", "modelopt",
                                   "--trainer-layers", "0,one"])
    assert bad.exit_code == 1 and "--trainer-layers takes comma-separated integers" in bad.output
    mixed = CliRunner().invoke(app, ["convert", store, "--out", str(tmp_path / "y"), "--trainer-layers", "0"])
    assert mixed.exit_code == 1 and "for the other trainers' formats" in mixed.output
    # the speculators format's own flags are refused by the others, as theirs are by it (r24)
    for flags in (["--merge-prefix-rows"], ["--hidden-states", "fp8"], ["--seed", "7"]):
        refused = CliRunner().invoke(app, ["convert", store, "--out", str(tmp_path / "z"), "--format",
                                           "specforge-dflash", *flags])
        assert refused.exit_code == 1 and f"error: {flags[0]} is for the speculators format" in refused.output
    assert not (tmp_path / "z").exists()
    # a folder one format wrote is another conversion to the other: refused, and replaced with --overwrite
    again = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--no-progress"])
    assert again.exit_code == 1 and "holds a conversion of another store" in again.output, again.output
    again = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--overwrite", "--no-progress"])
    assert again.exit_code == 0 and not list(out.rglob("*.ckpt")) and (out / "streamx_meta.json").exists()
    back = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--format", "modelopt", "--no-progress"])
    assert back.exit_code == 1 and "holds another conversion" in back.output, back.output
    back = CliRunner().invoke(app, ["convert", store, "--out", str(out), "--format", "modelopt", "--overwrite",
                                    "--no-progress"])
    assert back.exit_code == 0 and len(list(out.rglob("*.pt"))) == 6 and not (out / "streamx_meta.json").exists()
    ts = tmp_path / "ts"
    result = CliRunner().invoke(app, ["convert", store, "--out", str(ts), "--format", "torchspec", "--trainer-layers",
                                      "1,0", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"inference.offline.data_path={ts.resolve()}" in result.output
    assert "inference.aux_hidden_states_layers (DFlash: the draft config's target_layer_ids), in this order = [1, 0]" \
        in result.output
    H = open_store(store).metadata.hidden_size
    assert [r["hidden_states"].shape[-1] for r in trainer_check.torchspec(str(ts))] == [2 * H] * 6
    formats = get_args(get_type_hints(cli_module.convert)["fmt"])  # every trainer is offered, and only those
    assert formats == ("speculators", *TRAINERS, *nemo.FORMATS)


def test_verify_checks_a_trainer_folder_file_by_file_against_its_store(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """`streamx verify FOLDER` on a trainer's folder: every row's file as convert writes it (TorchSpec's: the last
    state through the final norm, within one bf16 step), then the store; a file missing, torn or with one value
    changed is named, and a convert that did not finish is said (its record as a killed convert leaves it)."""
    from typer.testing import CliRunner

    from streamx.cli import app
    from streamx.train.verify import verify

    store = str(tmp_path / "s.zarr")
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, layers="1,2,3,4", max_samples=8), progress=False,
        log=lambda m: None)
    out = tmp_path / "ts"
    export(store, str(out), "torchspec", [0, 1], progress=False, log=lambda m: None)
    report = verify(str(out), use_model=False, log=lambda m: None)
    assert report.passed and report.checks[0].name == "files", report.lines()
    assert report.checks[0].summary == "8 rows as convert writes them for TorchSpec (EAGLE-3, DFlash), from the " \
        "store", report.checks[0].summary

    files = sorted(out.rglob("row_*.pt"))
    files[0].unlink()
    files[1].write_bytes(files[1].read_bytes()[:100])
    changed = torch.load(files[2], weights_only=True)
    changed["last_hidden_states"][3, 5] += 1
    torch.save(changed, files[2])
    result = CliRunner().invoke(app, ["verify", str(out), "--no-model"])
    assert result.exit_code == 1
    for file, why in zip(files, ["missing", "cannot be read (", f"differs from what convert writes for row "
                                 f"{row_of(files[2].name)} of the store"], strict=False):
        assert f"{file.relative_to(out).as_posix()}: {why}" in result.output, result.output

    record = json.loads((out / EXPORT).read_text())
    assert record["final_norm_from"] == tiny_chat_model_dir  # the checkpoint the convert normed with (or --model)
    (out / EXPORT).write_text(json.dumps({**record, "final_norm_from": str(tmp_path / "moved")}))
    gone = verify(str(out), use_model=False, log=lambda m: None).checks[0]
    assert not gone.passed and gone.summary == "TorchSpec (EAGLE-3, DFlash): cannot rebuild what convert wrote"
    assert "is not on this machine" in gone.problems[0] and "verify --checkpoint DIR" in gone.problems[0]
    given = verify(str(out), use_model=False, log=lambda m: None, checkpoint=tiny_chat_model_dir).checks[0]
    assert given.summary == "3 of 8 rows", given  # rebuilt from the folder given: the three files above again
    out.rename(staging(out))  # as a killed convert leaves it: its rows beside the folder asked for, its record begun
    (staging(out) / EXPORT).write_text(json.dumps({"identity": record["identity"]}))
    unfinished = verify(str(out), use_model=False, log=lambda m: None)
    assert not unfinished.passed and [c.summary for c in unfinished.checks] == [
        f"TorchSpec (EAGLE-3, DFlash): the convert did not finish (its rows so far are in {staging(out)})"]


def test_the_trainers_default_eagle3_ids_are_each_once_and_within_a_small_model():
    """ModelOpt and SpecForge take blocks 1, L//2 - 1 and L - 4 as a set: on 6 layers 1 and 2 (their 2 once), and on
    a model too small for L - 4 none below block 0."""
    from streamx.train.trainers import eagle3_ids

    assert eagle3_ids(32, []) == [1, 15, 28]
    assert eagle3_ids(6, []) == [1, 2]
    assert eagle3_ids(2, []) == [0, 1]


NEMO_CHECK = str(Path(__file__).with_name("nemo_check.py"))


def test_nemos_own_readers_read_both_caches_as_an_independent_forward_has_them(smollm2_dir, smollm2, trainer_venv,
                                                                             tmp_path, monkeypatch):
    """NeMo AutoModel 0.7.0's readers and its recipes' manifest checks (tests/nemo_check.py) on SmolLM2's store, in
    shards of 4 samples: DSpark at NeMo's default ids and at ids given (-1, the embeddings; L-1, after the final
    norm), EAGLE-3 at its default and at ids given (L-1 before the norm) with a draft vocabulary and top-k
    probabilities. Every sample against the store and an unbatched HF forward: ids, masks (EAGLE-3's shifted by
    one), states within bf16, and the next token's probabilities over the draft vocabulary against the forward's
    softmax. A DSpark convert killed after a shard is no cache at --out, and one NeMo refuses as incomplete beside
    it; the same command then finishes it."""
    import streamx.train.nemo as nemo

    model, tokenizer = smollm2
    L = model.config.num_hidden_layers
    store_path = str(tmp_path / "s.zarr")
    run(small_config(smollm2_dir, "chatterbot:english", store_path, layers="0,2,3,4,9,10,15,16,23,27,30",
                     max_samples=10, max_length=96, dtype="float32"), progress=False, log=lambda m: None)
    store = open_store(store_path)
    monkeypatch.setattr(nemo, "SHARD_ROWS", 4)
    converts = {"nemo-dspark": dict(), "nemo-dspark@given": dict(layer_ids=[-1, 3, L - 1]),
                "nemo-eagle3": dict(), "nemo-eagle3@given": dict(layer_ids=[2, 9, L - 1], draft_vocab_size=4096,
                                                                   topk=8)}
    for key, settings in converts.items():
        nemo.export_nemo(store_path, str(tmp_path / key), key.split("@")[0], progress=False, log=lambda m: None,
                         **settings)
    killed, written = tmp_path / "killed", nemo._write_tensors

    def dying(path, tensors):
        if path.name == "shard-000001.safetensors":
            raise KeyboardInterrupt
        written(path, tensors)

    monkeypatch.setattr(nemo, "_write_tensors", dying)
    with pytest.raises(KeyboardInterrupt):
        nemo.export_nemo(store_path, str(killed), "nemo-dspark", progress=False, log=lambda m: None)
    monkeypatch.setattr(nemo, "_write_tensors", written)
    reads = [f"{key}={tmp_path / key}" for key in converts]
    reads += [f"nemo-dspark@killed={killed}", f"nemo-dspark@beside={staging(killed)}"]
    result = tmp_path / "nemo.pt"
    proc = trainer_venv("nemo", NEMO_CHECK, str(result), smollm2_dir, *reads)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = torch.load(result, weights_only=False)
    assert found["nemo-dspark@killed"]["error"].startswith("FileNotFoundError: DSpark cache manifest not found")
    assert "is marked incomplete" in found["nemo-dspark@beside"]["error"]
    from streamx.train.verify import verify

    unfinished = verify(str(killed), use_model=False, log=lambda m: None).checks[0]
    assert unfinished.summary == f"NeMo AutoModel's dspark cache: the convert did not finish (its rows so far are in " \
                                 f"{staging(killed)})"
    nemo.export_nemo(store_path, str(killed), "nemo-dspark", progress=False, log=lambda m: None)  # resumed

    for key in ("nemo-dspark@given", "nemo-eagle3@given"):  # verify rebuilds each shard from the store
        report = verify(str(tmp_path / key), use_model=False, log=lambda m: None)
        assert report.checks[0].passed and report.checks[0].summary.startswith("3 shards as convert writes"), \
            report.lines()
    broken = load_file(tmp_path / "nemo-eagle3@given" / "shard-000001.safetensors")
    broken["aux_hidden_states"][0, 3, 5] += 1
    save_file(broken, tmp_path / "nemo-eagle3@given" / "shard-000001.safetensors")
    report = verify(str(tmp_path / "nemo-eagle3@given"), use_model=False, log=lambda m: None)
    assert report.checks[0].problems == ["shard-000001.safetensors: differs from what convert writes for its rows of "
                                         "the store"]
    whole = sorted(p.name for p in (tmp_path / "nemo-dspark").iterdir())
    assert sorted(p.name for p in killed.iterdir()) == whole and not staging(killed).exists()
    assert all((killed / name).read_bytes() == (tmp_path / "nemo-dspark" / name).read_bytes()
               for name in whole if name.startswith(("shard-", "manifest")))  # each row once, as in one go

    last_block = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: last_block.update(
        state=out[0] if isinstance(out, tuple) else out))  # the last block's output, before the norm
    worst = {"states": 0.0, "probs": 0.0}
    try:
        check_nemo_samples(found, converts, store, model, tokenizer, last_block, worst)
    finally:
        hook.remove()  # (the model is the session's)
    print(json.dumps(worst))  # shown with -s
    # states within bf16's rounding; probabilities within their own (a bf16 value below 1 is within 2**-9) of the
    # stored state's, and within what that state's rounding moves them of the float32 forward's
    assert worst["states"] < 1e-2 and worst["probs"] < 4e-3 and worst["probs_fp32"] < 0.05


def check_nemo_samples(found: dict, converts: dict, store, model, tokenizer, last_block: dict, worst: dict) -> None:
    """Every sample NeMo's readers read (`found`) against the store and the model's own forward; the worst state
    and probability errors into `worst`."""
    L, rows = model.config.num_hidden_layers, np.unique(store.row_ids()).tolist()
    for key in converts:
        got = found[key]
        assert "error" not in got, got
        manifest, samples = got["manifest"], got["samples"]
        assert manifest["num_samples"] == len(samples) == len(rows) and manifest["seq_length"] == 96
        eagle = key.startswith("nemo-eagle3")
        ids = manifest["aux_layer_ids" if eagle else "target_layer_ids"]
        assert ids == converts[key].get("layer_ids", [1, L // 2 - 1, L - 4] if eagle else [1, 8, 15, 22, 29])
        embed = model.get_input_embeddings().weight.detach()
        assert torch.equal(got["embed"], embed.to(got["embed"].dtype))
        if not eagle:  # (SmolLM2 ties its lm_head to the embeddings)
            assert torch.equal(got["head"], model.get_output_embeddings().weight.detach().to(torch.bfloat16))
        selected = torch.tensor(manifest["selected_token_ids"]) if eagle else None
        for row, sample in zip(rows, samples, strict=True):
            s = store.sample(row)
            T = len(s.input_ids)
            with torch.no_grad():
                out = model(s.input_ids[None], output_hidden_states=True)
            hidden, logits = out.hidden_states, out.logits[0].float()
            if not eagle:
                assert torch.equal(sample["input_ids"][:T], s.input_ids) and torch.equal(sample["loss_mask"][:T],
                                                                                       s.loss_mask)
                assert (sample["input_ids"][T:] == tokenizer.pad_token_id).all() and not sample["loss_mask"][T:].any()
                want = [hidden[0 if k == -1 else k + 1][0] for k in ids]  # L-1: hidden_states[L], after the norm
                states = sample["target_hidden_states"][:T].view(T, len(ids), -1)
                worst["states"] = max(worst["states"], relative_error(states, torch.stack(want, dim=1)),
                                      relative_error(sample["target_last_hidden_states"][:T], hidden[L][0]))
                continue
            assert torch.equal(sample["input_ids"][: T - 1], s.input_ids[1:]) and sample["input_ids"][-1] == 0
            assert torch.equal(sample["loss_mask"][: T - 1], s.loss_mask[1:]) and not sample["loss_mask"][T - 1:].any()
            assert sample["attention_mask"].sum() == T
            want = [last_block["state"][0] if k == L - 1 else hidden[k + 1][0] for k in ids]  # L-1: before the norm
            worst["states"] = max(worst["states"], relative_error(sample["aux_hidden_states"][:T].view(T, 3, -1),
                                                                  torch.stack(want, dim=1)))
            # of the next token, over the draft vocabulary: from the model's own last block output as the store
            # holds it (bf16), through its own norm and lm_head; and from the float32 forward's logits
            with torch.no_grad():
                stored_logits = model.lm_head(model.model.norm(last_block["state"][0].bfloat16().float())).float()
            for name, source in (("probs", stored_logits), ("probs_fp32", logits)):
                probs = torch.softmax(source[1:, selected], dim=-1)
                if manifest["target_probs_topk"]:
                    top = probs.topk(manifest["target_probs_topk"], dim=-1)
                    probs = torch.zeros_like(probs).scatter_(-1, top.indices, top.values / top.values.sum(-1, True))
                error = float((sample["target_probs"][: T - 1].float() - probs).abs().max())
                worst[name] = max(worst.get(name, 0.0), error)
            supervised = s.loss_mask[1:].bool()
            in_draft = torch.zeros(logits.shape[-1], dtype=torch.bool)
            in_draft[selected] = True
            assert torch.equal(sample["position_mask"][: T - 1, 0], in_draft[stored_logits[1:].argmax(-1)] & supervised)
