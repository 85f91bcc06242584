"""`streamx inspect` where a first look goes astray: a rejected row asked for by --sample, a folder `streamx convert`
wrote given for a store, and the massive activations the per-layer boxes leave out of the picture."""

import dataclasses

import numpy as np
import torch
from helpers import cli, tiny_metadata

from streamx.data.tokenize import Reject
from streamx.pipeline.writer import PartWriter
from streamx.store import OwnedPart, bf16_to_bits, make_layout, open_for_run, open_store, prepare

REJECTS = [Reject(4, "too_long", "300 tokens > max_length 256"), Reject(5, "too_long", "400 tokens > max_length 256"),
           Reject(6, "malformed_json", "line 7: Expecting value")]


def store_with_rejects(path: str, rows: int = 4, peak: tuple[int, int, int, int, float] | None = None) -> str:
    """A finished tiny store (no model: random states) of samples for rows 0..rows-1 and REJECTS after them;
    `peak` (row, token, slot, dim, value) plants one massive activation."""
    meta = dataclasses.replace(tiny_metadata(), model={"model": "m", "path": "m", "weights_fingerprint": "0" * 64})
    prepare(path, meta)
    layout = make_layout(meta.num_slots, meta.hidden_size, meta.chunk_tokens, meta.shard_tokens)
    g = torch.Generator().manual_seed(0)
    with OwnedPart(path, "part-00000") as part:
        writer = PartWriter(part.open(open_for_run(path, meta), layout))
        for row in range(rows):
            n = 3 + row
            hidden = torch.randn(n, meta.num_slots, meta.hidden_size, generator=g)
            if peak is not None and peak[0] == row:
                hidden[peak[1], peak[2], peak[3]] = peak[4]
            writer.append(row, torch.randint(0, 1000, (n,), generator=g).numpy(), np.ones(n, dtype=np.uint8),
                          bf16_to_bits(hidden.to(torch.bfloat16)))
        for reject in REJECTS:
            writer.reject(reject)
        writer.close(source_rows=rows + len(REJECTS))
    return path


def test_the_sample_of_a_rejected_row_says_it_was_rejected_and_why(tmp_path):
    """--sample ROW of a rejected row: the reason, and the detail the store kept (the first row of each reason's;
    another row of that reason gets the kept example). A row in no part is one line naming it."""
    store = store_with_rejects(str(tmp_path / "s.zarr"))
    shown = [cli("inspect", store, "--sample", str(r.row_id)) for r in REJECTS]
    assert [s.returncode for s in shown] == [0, 0, 0], [s.stderr for s in shown]
    assert [s.stdout.strip() for s in shown] == [
        "row 4 was rejected by the run, so it has no sample: too_long (300 tokens > max_length 256)",
        "row 5 was rejected by the run, so it has no sample: too_long (the store keeps the detail of one row per "
        "reason, e.g. row 4: 300 tokens > max_length 256)",
        "row 6 was rejected by the run, so it has no sample: malformed_json (line 7: Expecting value)"]
    missing = cli("inspect", store, "--sample", "9")
    assert missing.returncode == 1
    assert missing.stderr == f"error: source row 9 is not in {store}: no sample and no reject\n"


def test_a_convert_folder_is_named_and_its_store_pointed_at(tmp_path):
    """`inspect` of a folder `streamx convert` wrote says what it is in one line and which store to inspect
    instead; asked for a store's content (--json, --sample, --plot), that line is the error."""
    store = store_with_rejects(str(tmp_path / "s.zarr"))
    spec = tmp_path / "spec"
    converted = cli("convert", store, "--out", str(spec), "--no-progress")
    assert converted.returncode == 0, converted.stderr
    files = len(list((spec / "hidden_states").glob("hs_*.safetensors")))
    line = (f"{spec} is a speculators training folder converted from {store} ({files} rows, {files} hs files); "
            f"inspect the store: streamx inspect {store}")
    shown = cli("inspect", str(spec))
    assert files == 4 and shown.returncode == 0 and shown.stdout == line + "\n", shown.stderr
    assert cli("inspect", str(spec), "--json").stderr == f"error: {line}\n"
    assert cli("inspect", store).returncode == 0  # the command it points at


def test_the_picture_marks_each_layers_largest_value(tmp_path):
    """The per-layer panel's numbers hold each layer id's largest |value| over the samples, where it is, as torch
    finds them over every sample read here; a massive activation planted in one is the largest of its layer, and
    the picture names it."""
    import base64

    from streamx.measure.look import layer_spread

    planted = (3, 2, 1, 5, 3072.0)  # row 3, token 2, slot 1, dim 5: 3072 is exact in bf16
    store = open_store(store_with_rejects(str(tmp_path / "s.zarr"), rows=6, peak=planted))
    spread = layer_spread(store)
    for slot, layer_id in enumerate(store.layer_ids):
        states = {row: store.sample(row).hidden_states[:, slot].float().abs() for row in store.row_ids().tolist()}
        row = max(states, key=lambda r: float(states[r].max()))
        token, dim = np.unravel_index(int(states[row].argmax()), tuple(states[row].shape))
        assert spread[layer_id].peak == float(states[row].max())
        assert spread[layer_id].peak_at == (row, int(token), int(dim))
        assert spread[layer_id].norms.size == sum(s.shape[0] for s in states.values())
    assert spread[store.layer_ids[1]].peak_at == (3, 2, 5) and spread[store.layer_ids[1]].peak == 3072.0
    drawn = cli("inspect", store.path, "--plot", str(tmp_path / "look.html"))
    assert drawn.returncode == 0, drawn.stderr
    page = (tmp_path / "look.html").read_text()
    svg = base64.b64decode(page.split("data:image/svg+xml;base64,")[1].split("'")[0])
    assert f"largest |value|: 3,072 at id {store.layer_ids[1]} (row 3, token 2, dim 5)".encode() in svg
