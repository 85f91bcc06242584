"""The in-run audit (streamx.pipeline.audit): rows of the run's own batches recomputed alone through the model's own
forward. A way of computing rows that the start-up check's probe rows never reach (here: packed batches of more
rows than the probes pack, with their positions shifted) passes the check, and the audit stops the run at the first
such row, before its batch is written; with the audit off the same run writes wrong states (the control). The audit's
figures reach the store, inspect and verify."""

import numpy as np
import pytest
import torch
from helpers import reference_states, small_config
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from streamx.data import batching
from streamx.pipeline.audit import AuditError
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.verify import check_audit


@pytest.fixture(scope="module")
def peaked_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """A 4-layer random Llama with weights drawn as the zoo's (std 0.1): attention peaked enough that a position
    off by two moves the states (at std 0.02 it is nearly uniform); SmolLM2's tokenizer and chat template."""
    path = tmp_path_factory.mktemp("peaked-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 initializer_range=0.1)).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


PROBED_SEGMENTS = 3  # the most segments a start-up probe's forward holds (a shared prefix and two rows continuing it)


def shift_positions_past_the_probes(monkeypatch) -> None:
    """Packed batches of more segments than any probe's: each segment from the fourth on gets its positions past
    its 8th token shifted by 2, a rope off by two (a uniform shift would change nothing under relative rope)."""
    packed_batch = batching.packed_batch

    def broken(pieces):
        batch = packed_batch(pieces)
        if len(batch.segment_lengths) > PROBED_SEGMENTS:
            starts = batch.cu_seq_lens.tolist()
            for a, b in zip(starts[PROBED_SEGMENTS:-1], starts[PROBED_SEGMENTS + 1:], strict=True):
                batch.position_ids[0, a + 8 : b] += 2
        return batch

    monkeypatch.setattr(batching, "packed_batch", broken)


def worst_row(model_dir: str, out) -> float:
    """The largest per-token relative difference of a stored row from the model's own forward of it alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    store, worst = open_store(str(out)), 0.0
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        want = torch.stack(reference_states(model, sample.input_ids), dim=1)[:, store.metadata.layer_ids]
        got = sample.hidden_states.float()
        worst = max(worst, float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()))
    return worst


def test_a_broken_way_the_probes_miss_is_caught_in_the_run(peaked_model_dir, chat_jsonl, tmp_path, monkeypatch):
    shift_positions_past_the_probes(monkeypatch)
    # the control: no audit, the start-up check passes the broken way, and the store holds wrong states
    lines: list[str] = []
    run(small_config(peaked_model_dir, chat_jsonl, tmp_path / "unaudited.zarr", audit_every=0), progress=False,
        log=lines.append)
    assert any(line.startswith("  packing on:") for line in lines)
    assert worst_row(peaked_model_dir, tmp_path / "unaudited.zarr") > 0.05

    # the audit stops the run at the first row computed the broken way, and names the setting that avoids its way;
    # following it down the ladder ends in a run that is right
    advice = []
    for settings in ({}, {"sharing": "rows"}):
        with pytest.raises(AuditError) as caught:
            run(small_config(peaked_model_dir, chat_jsonl, tmp_path / "audited.zarr", overwrite=True, **settings),
                progress=False, log=lambda m: None)
        said = str(caught.value)
        assert "packed beside other rows" in said and "layer id" in said and "token" in said and "row" in said
        advice.append(said)
        # the batch it found was not written, and nothing committed before it is wrong
        store = open_store(str(tmp_path / "audited.zarr"))
        assert len(store) < len(open_store(str(tmp_path / "unaudited.zarr")))
        assert worst_row(peaked_model_dir, tmp_path / "audited.zarr") < 0.01
    assert "shared prefix" in advice[0] and "--sharing rows" in advice[0]
    assert "shared prefix" not in advice[1] and "--packing off" in advice[1]
    run(small_config(peaked_model_dir, chat_jsonl, tmp_path / "audited.zarr", overwrite=True, sharing="rows",
                     packing="off"), progress=False, log=lambda m: None)
    assert worst_row(peaked_model_dir, tmp_path / "audited.zarr") < 0.01


def test_the_audit_figures_reach_the_store_inspect_and_verify(tiny_chat_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "s.zarr"
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, out, audit_every=7), progress=False,
                  log=lambda m: None)
    audited = summary.audit
    store = open_store(str(out))
    ids = store.row_ids()
    # the first row of each way, and every row id that is a multiple of 7 among the computed rows
    assert audited.rows >= max(len(audited.ways), int(np.count_nonzero(ids % 7 == 0)) // 2)
    assert any(way.startswith("packed beside other rows") for way in audited.ways)
    assert any("shared prefix" in way for way in audited.ways)  # the chats share their leading turns
    assert 0 < audited.worst < 0.01 and audited.seconds > 0 and audited.forward_seconds > audited.seconds
    assert store.audit() == audited
    assert any(line.startswith("audit ") for line in store.describe())
    check = check_audit(store)
    assert check.passed and not check.skipped and f"{audited.rows:,} rows" in check.summary
    # none when the run did not audit
    run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "n.zarr", audit_every=0), progress=False,
        log=lambda m: None)
    unaudited = open_store(str(tmp_path / "n.zarr"))
    assert unaudited.audit() is None and check_audit(unaudited).skipped
