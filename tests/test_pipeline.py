"""End to end: `streamx run` on real chat data into a store, checked against independent references."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_samples,
    cli,
    cli_process,
    committed_samples,
    reference_states,
    run_args,
    small_config,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamx.pipeline.plan import make_plan
from streamx.pipeline.runner import run
from streamx.store import open_store

BF16_ULP = 2.0**-7


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.mark.parametrize("packing", ["on", "off"])
def test_store_matches_unbatched_reference(tiny_chat_model_dir, chat_jsonl, tmp_path, packing):
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", packing=packing), progress=False)
    store = open_store(str(tmp_path / "s.zarr"))
    rows = [json.loads(line) for line in open(chat_jsonl)]
    assert summary.samples == len(store) == len(rows) and summary.rejects == 0
    assert store.metadata.packing == packing
    # packed: every token computed is real; padded: the batches really were padded
    assert (summary.padded_tokens == summary.real_tokens) if packing == "on" else \
        (summary.padded_tokens > summary.real_tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    for row_id, row in enumerate(rows):
        got = store.sample(row_id)
        ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert got.input_ids.tolist() == ids[:256]
        assert 0 < got.loss_mask.sum() < len(ids)
        ref = reference_states(model, got.input_ids)
        for slot, layer_id in enumerate([0, 2, 4]):
            want = ref[layer_id].to(torch.bfloat16).float()
            torch.testing.assert_close(got.hidden_states[:, slot].float(), want, rtol=BF16_ULP,
                                       atol=1e-5 * want.abs().max().item())
    meta = store.metadata
    assert meta.layer_ids == [0, 2, 4] and meta.last_id_is_pre_norm and meta.num_layers == 4
    assert meta.hidden_states_dtype == "bfloat16" and meta.config["data"] == chat_jsonl


def test_bad_rows_are_rejected_with_reasons_and_the_run_goes_on(tiny_chat_model_dir, tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
    rows = [good, "{not json", {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
            {"messages": [{"role": "user", "content": 3}]}, {"messages": [{"role": "user", "content": "only"}]},
            good, {"text": "plain text row"}, {"input_ids": [1, 2, 3, 4]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    summary = run(small_config(tiny_chat_model_dir, data, tmp_path / "s.zarr"), progress=False)
    assert summary.reject_counts == {"malformed_json": 1, "empty_conversation": 1, "unknown_role": 1,
                                     "non_string_content": 1, "no_assistant_tokens": 1}
    store = open_store(str(tmp_path / "s.zarr"))
    assert sorted(store.row_ids().tolist()) == [0, 6, 7, 8]
    assert sorted(store.rejected()) == [(1, "malformed_json"), (2, "empty_conversation"), (3, "unknown_role"),
                                        (4, "non_string_content"), (5, "no_assistant_tokens")]
    assert store.sample(8).input_ids.tolist() == [1, 2, 3, 4]


def test_non_finite_states_are_rejected(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """A sample whose activations are NaN is rejected as non_finite; its batch neighbours are stored. With shared
    prefixes (the default), every row that reads the poisoned token is rejected, and only those."""
    import streamx.model.capture as capture
    import streamx.proof.audit as audit
    import streamx.proof.check as check

    real_gather, real_forward = capture.LayerCapture._gather, capture.LayerCapture.forward
    poisoned_rows = []

    def forward(self, batch, states):  # the rows that read the batch's last computed token
        poisoned_rows.extend(s.row_id for s, ranges in zip(batch.samples, batch.row_ranges, strict=True)
                             if ranges[-1][0] + ranges[-1][1] == batch.num_tokens)
        real_forward(self, batch, states)

    def poisoned(self, slot, hidden, stop):
        hidden = hidden.clone()
        hidden[0, -1, 0] = float("nan")  # the last token of every (packed) batch, in every slot
        real_gather(self, slot, hidden, stop)

    # the start-up check's captures stay clean (it would find the model wrong and refuse it); the in-run audit's
    # are poisoned as the run's are (a model that overflows on a row does so alone too: nothing to compare), and
    # its forwards of one row are not the run's
    clean = type("Clean", (capture.LayerCapture,), {"forward": real_forward, "_gather": real_gather})
    monkeypatch.setattr(check, "LayerCapture", clean)
    monkeypatch.setattr(audit, "LayerCapture", type("Audited", (capture.LayerCapture,), {"forward": real_forward}))
    monkeypatch.setattr(capture.LayerCapture, "forward", forward)
    monkeypatch.setattr(capture.LayerCapture, "_gather", poisoned)
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", max_samples=30), progress=False)
    assert len(poisoned_rows) > 1 and summary.reject_counts == {"non_finite": len(poisoned_rows)}
    store = open_store(str(tmp_path / "s.zarr"))
    assert sorted(store.rejected()) == sorted((row, "non_finite") for row in poisoned_rows)
    assert sorted(store.row_ids().tolist()) == sorted(set(range(30)) - set(poisoned_rows))
    assert all(torch.isfinite(s.hidden_states.float()).all() for s in store.samples())


def test_abnormal_reject_rate_stops_the_run(tiny_chat_model_dir, tmp_path):
    rows = ["{broken"] * 150 + [{"text": "fine"}] * 10
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(RuntimeError, match="rejected.*top reason: malformed_json"):
        run(small_config(tiny_chat_model_dir, data, tmp_path / "s.zarr"), progress=False)


def test_rerun_resumes_and_incompatible_rerun_is_refused(tiny_chat_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "s.zarr"
    first = run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=30), progress=False)
    more = run(small_config(tiny_chat_model_dir, chat_jsonl, out), progress=False)  # extends to all rows
    assert more.resumed_rows == 30 and first.samples + more.samples == len(open_store(str(out)))
    again = run(small_config(tiny_chat_model_dir, chat_jsonl, out), progress=False)
    assert again.samples == 0 and open_store(str(out)).summary()["duplicate_rows"] == 0
    with pytest.raises(RuntimeError, match="incompatible run.*layer_ids"):
        run(small_config(tiny_chat_model_dir, chat_jsonl, out, layers="1,4"), progress=False)
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, layers="1,4", max_samples=5, overwrite=True), progress=False)
    assert len(open_store(str(out))) == 5


def test_kill_9_then_rerun_equals_an_uninterrupted_run(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """Also where a shared prefix's later batches continue what an earlier batch kept (the chats' system prompt
    over windows of more tokens than a batch): the kills may fall between them."""
    plan = make_plan(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "plan.zarr"), log=lambda m: None)
    carried = [b for b in plan.batch_stream() if getattr(b, "carry", None) is not None and b.carry.parents]
    assert len(carried) >= 3
    reference = tmp_path / "ref.zarr"
    assert cli(*run_args(tiny_chat_model_dir, chat_jsonl, reference)).returncode == 0
    out = tmp_path / "killed.zarr"
    kills = 0
    for _ in range(2):  # kill twice at different points, then finish
        proc = subprocess.Popen([sys.executable, "-m", "streamx", *run_args(tiny_chat_model_dir, chat_jsonl, out)],
                                env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        target = committed_samples(out) + 5
        deadline = time.time() + 120
        while proc.poll() is None and committed_samples(out) < target and time.time() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills >= 1
    partial = committed_samples(out)
    result = cli(*run_args(tiny_chat_model_dir, chat_jsonl, out))
    assert result.returncode == 0, result.stderr
    assert 0 < partial < len(open_store(str(reference)))
    assert_same_samples(reference, out)


def error_line(result) -> str:
    """A failed run ends with exit code 1 and one `error:` line (after the banner), never a traceback."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    return last


def test_cli_errors_are_one_line(tiny_chat_model_dir, chat_jsonl, tmp_path):
    bad_model = cli_process("run", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o.zarr"))
    assert "nope" in error_line(bad_model)
    args = run_args(tiny_chat_model_dir, chat_jsonl, tmp_path / "o.zarr")
    bad_layers = cli_process(*[("2,9" if a == "0,2,4" else a) for a in args])
    assert "valid ids are 0..4" in error_line(bad_layers)
    bad_data = cli_process("run", "--model", tiny_chat_model_dir, "--data", str(tmp_path / "missing.jsonl"),
                   "--out", str(tmp_path / "o.zarr"))
    assert "missing.jsonl" in error_line(bad_data)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    unwritable = cli_process(*run_args(tiny_chat_model_dir, chat_jsonl, blocker / "o.zarr"))
    assert f"{blocker} is not a folder" in error_line(unwritable)


def test_inspect(tiny_chat_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=10), progress=False)
    text = cli("inspect", str(out))
    assert text.returncode == 0 and "[0, 2, 4]" in text.stdout and "10 committed" in text.stdout
    data = json.loads(cli("inspect", str(out), "--json").stdout)
    assert data["samples"] == 10 and data["metadata"]["layer_ids"] == [0, 2, 4]
    assert data["tokens"] == sum(len(s.input_ids) for s in open_store(str(out)).samples())


def test_inspect_shows_a_sample_with_its_trained_spans_and_draws_the_store(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """--sample ROW: the text the tokenizer decodes, each trained run of tokens between « and », and each slot's
    RMS, min and max; the plain summary gives the lengths and the trained share; --plot draws a PNG or a page."""
    import base64

    import numpy as np
    from transformers import AutoTokenizer

    out = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=10), progress=False)
    store = open_store(str(out))
    row = int(store.row_ids()[3])
    sample = store.sample(row)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    shown = cli("inspect", str(out), "--sample", str(row))
    assert shown.returncode == 0, shown.stderr
    body = shown.stdout.split("\n", 2)[2]  # after the heading and a blank line, up to the slots' table
    text = body[: body.rindex(f"\n\n{'id':>6}")]
    marked = [piece.split("»")[0] for piece in text.split("«")[1:]]
    runs, k = [], 0  # the trained runs, decoded here on their own
    while k < len(ids):
        if mask[k]:
            end = next((j for j in range(k, len(ids)) if not mask[j]), len(ids))
            runs.append(tokenizer.decode(ids[k:end]))
            k = end
        else:
            k += 1
    assert marked == runs and text.replace("«", "").replace("»", "") == tokenizer.decode(ids)
    for slot, layer_id in enumerate(store.layer_ids):
        x = sample.hidden_states[:, slot].float()
        want = f"{layer_id:>6}{float(x.pow(2).mean().sqrt()):>11.4g}{float(x.min()):>11.4g}{float(x.max()):>11.4g}"
        assert want in shown.stdout.splitlines()
    summary = cli("inspect", str(out)).stdout
    lengths = store.index.lengths
    assert f"min {lengths.min():,}, median {int(np.percentile(lengths, 50, method='lower')):,}" in summary
    share = sum(int(s.loss_mask.sum()) for s in store.samples()) / store.row_tokens
    assert f"trainable, {share:.1%})" in summary
    for picture in ("look.png", "look.html"):
        drawn = cli("inspect", str(out), "--plot", str(tmp_path / picture))
        assert drawn.returncode == 0 and f"picture: {tmp_path / picture}" in drawn.stdout, drawn.stderr
    assert (tmp_path / "look.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "look.html").read_text()
    svg = base64.b64decode(page.split("data:image/svg+xml;base64,")[1].split("'")[0])
    assert b"<svg" in svg and b"token norms per layer id" in svg


def test_progress_in_a_log_file_is_plain_lines(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """stderr piped, as under Slurm or nohup: status lines end with a newline, never a carriage return."""
    args = [a for a in run_args(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr") if a != "--no-progress"]
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    rows = sum(1 for _ in open(chat_jsonl))
    status = [line for line in result.stderr.splitlines() if line.startswith("streamx run: ")]
    assert "\r" not in result.stderr and status and status[-1].startswith(f"streamx run: {rows}/{rows} rows [")


def test_no_chat_template_is_fatal_with_one_line(tiny_chat_model_dir, chat_jsonl, tmp_path):
    import shutil

    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_chat_model_dir, model_dir)
    for name in ("chat_template.jinja", "chat_template.json"):
        (model_dir / name).unlink(missing_ok=True)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    result = cli_process(*run_args(str(model_dir), chat_jsonl, tmp_path / "o.zarr"))
    assert "no chat template" in error_line(result)


def test_disk_full_keeps_committed_data_and_resumes(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    from streamx.store.shards import StreamedShards

    out = tmp_path / "s.zarr"
    real_finish = StreamedShards.finish
    calls = []

    def fail_on_sixth_shard(self, *args):  # the sixth shard's states are written, its index is not
        if self.arr.name.endswith("hidden_states"):
            calls.append(args)
            if len(calls) == 6:
                raise OSError(28, "No space left on device")
        real_finish(self, *args)

    monkeypatch.setattr(StreamedShards, "finish", fail_on_sixth_shard)
    with pytest.raises(OSError, match="No space left"):
        run(small_config(tiny_chat_model_dir, chat_jsonl, out), progress=False)
    partial = open_store(str(out))
    assert 0 < len(partial) and partial.num_tokens <= 5 * 64  # the five shards written before the failure
    kept = {r: partial.sample(r) for r in partial.row_ids().tolist()}
    monkeypatch.setattr(StreamedShards, "finish", real_finish)
    run(small_config(tiny_chat_model_dir, chat_jsonl, out), progress=False)
    final = open_store(str(out))
    assert len(final) == sum(1 for _ in open(chat_jsonl)) and final.summary()["duplicate_rows"] == 0
    for r, s in kept.items():
        assert torch.equal(final.sample(r).hidden_states.view(torch.int16), s.hidden_states.view(torch.int16))


def test_producer_streams_with_bounded_read_ahead(tiny_chat_model_dir, tmp_path, monkeypatch):
    """Host memory must not grow with the dataset: the producer may only run a bounded way ahead
    of the forward pass (sort window + bounded queues), however long the source is."""
    import streamx.pipeline.plan as plan
    from streamx.model.capture import LayerCapture

    rows = [{"text": f"row {i} " + "word " * (i % 7)} for i in range(400)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    yielded, lead = [0], []
    real_open = plan.open_source

    def counting_source(*args, **kw):
        source = real_open(*args, **kw)
        inner = source.rows

        def rows_counted(*args, **kw):
            for row in inner(*args, **kw):
                yielded[0] += 1
                yield row

        source.rows = rows_counted
        return source

    real_forward = LayerCapture.forward
    forwarded = [0]

    def slow_forward(self, batch, packed):
        time.sleep(0.01)  # a slow GPU stage: the producer would race ahead if nothing bounded it
        real_forward(self, batch, packed)
        forwarded[0] += len(batch.samples)
        lead.append(yielded[0] - forwarded[0])

    monkeypatch.setattr(plan, "open_source", counting_source)
    monkeypatch.setattr(LayerCapture, "forward", slow_forward)
    # no space check: its size estimate reads the source once before the run, which is not the producer
    cfg = small_config(tiny_chat_model_dir, data, tmp_path / "s.zarr", sort_window=8, max_batch_size=4, queue_batches=2,
                 space_check=False)
    run(cfg, progress=False)
    # at most: the window being tokenized + batches in the queue + the one being handed over
    bound = cfg.sort_window * 2 + (cfg.queue_batches + 2) * cfg.max_batch_size
    assert max(lead) <= bound and yielded[0] == 400


def test_random_weights_store_is_marked_and_convert_refuses_it(tiny_chat_model_dir, chat_jsonl, tmp_path):
    from streamx.train.convert import ConvertError, convert

    config_file = tmp_path / "config.json"  # the model's config alone: no weights next to it
    config_file.write_text((Path(tiny_chat_model_dir) / "config.json").read_text())
    out = tmp_path / "random.zarr"
    run(small_config(str(config_file), chat_jsonl, out, random_weights=True, tokenizer=tiny_chat_model_dir,
                     max_samples=6), progress=False)
    store = open_store(str(out))
    assert len(store) == 6 and store.metadata.random_weights
    with pytest.raises(ConvertError, match="--random-weights"):
        convert(str(out), str(tmp_path / "spec"), progress=False)
    assert convert(str(out), str(tmp_path / "spec"), progress=False, allow_random_weights=True).rows == 6


def chats_with_repeats(chat_jsonl, path):
    """The chats, then a third of them again (each with an id field of its own, which does not make it new), and
    the ids of the rows whose messages an earlier row had, counted here on the raw lists."""
    rows = [json.loads(line) for line in open(chat_jsonl)]
    rows += [{"id": f"again-{i}", **r} for i, r in enumerate(rows[::3])]
    seen, repeats = [], set()
    for i, r in enumerate(rows):
        if r["messages"] in seen:
            repeats.add(i)
        seen.append(r["messages"])
    return write_jsonl(path, rows), repeats


def test_duplicates_are_counted_or_skipped_the_same_on_resume(tiny_chat_model_dir, chat_jsonl, tmp_path):
    data, repeats = chats_with_repeats(chat_jsonl, tmp_path / "data.jsonl")
    rows = len(open(data).read().splitlines())
    assert repeats
    kept = run(small_config(tiny_chat_model_dir, data, tmp_path / "kept.zarr"), progress=False)
    store = open_store(str(tmp_path / "kept.zarr"))
    assert kept.duplicates == len(repeats) == store.summary()["duplicate_content_kept"] and kept.samples == rows
    first = {json.dumps(json.loads(line)["messages"]): i for i, line in reversed(list(enumerate(open(data))))}
    for row in repeats:  # a repeat's sample is its first occurrence's (computed in another window: within rounding)
        original = first[json.dumps(json.loads(open(data).read().splitlines()[row])["messages"])]
        want = store.sample(original).hidden_states.float()
        torch.testing.assert_close(store.sample(row).hidden_states.float(), want, rtol=2.0**-7,
                                   atol=1e-5 * want.abs().max().item())
    assert any("repeat an earlier row's content" in line for line in store.describe())

    skipped = tmp_path / "skipped.zarr"
    summary = run(small_config(tiny_chat_model_dir, data, skipped, skip_duplicates=True), progress=False)
    assert summary.reject_counts == {"duplicate_content": len(repeats)} and summary.duplicates == 0
    assert sorted(open_store(str(skipped)).row_ids().tolist()) == sorted(set(range(rows)) - repeats)
    with pytest.raises(RuntimeError, match="incompatible run.*skip_duplicates"):  # no mixing on a resume
        run(small_config(tiny_chat_model_dir, data, skipped), progress=False)
    # resumed from a first run that ends before the repeats: the rows it committed still count as earlier
    resumed = tmp_path / "resumed.zarr"
    before = small_config(tiny_chat_model_dir, data, resumed, skip_duplicates=True, max_samples=min(repeats))
    run(before, progress=False)
    run(small_config(tiny_chat_model_dir, data, resumed, skip_duplicates=True), progress=False)
    assert_same_samples(skipped, resumed)
    assert open_store(str(resumed)).summary()["reject_counts"] == {"duplicate_content": len(repeats)}


def test_a_resume_does_not_parse_the_rows_it_holds(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """The windows a store holds whole are skipped unparsed (their content keys come from the store), and the
    resumed store is the uninterrupted one; a part from before streamx recorded content keys resumes too, by
    parsing every row."""
    import shutil
    import types

    import streamx.data.source as source_module

    data, repeats = chats_with_repeats(chat_jsonl, tmp_path / "data.jsonl")
    rows = len(open(data).read().splitlines())
    reference = tmp_path / "ref.zarr"
    run(small_config(tiny_chat_model_dir, data, reference, skip_duplicates=True), progress=False)
    parsed = []
    counting = types.SimpleNamespace(loads=lambda line: parsed.append(line) or json.loads(line), load=json.load)
    monkeypatch.setattr(source_module, "json", counting)  # the source's parsing only
    for name, drop_keys in (("resumed.zarr", False), ("old.zarr", True)):
        out = tmp_path / name
        first = small_config(tiny_chat_model_dir, data, out, skip_duplicates=True, max_samples=min(repeats) + 5)
        run(first, progress=False)
        if drop_keys:  # as a part written before the content keys were
            for array in ("sample_content_key", "reject_content_key"):
                shutil.rmtree(out / "parts" / "part-00000" / array)
        parsed.clear()
        run(small_config(tiny_chat_model_dir, data, out, skip_duplicates=True, space_check=False), progress=False)
        whole = (min(repeats) + 5) // 16 * 16  # the windows (16 rows) the first run committed whole
        assert len(parsed) == (rows if drop_keys else rows - whole), name
        assert_same_samples(reference, out)
        assert open_store(str(out)).summary()["reject_counts"] == {"duplicate_content": len(repeats)}


def test_progress_ends_on_its_total_with_no_time_left_also_on_a_resume(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                       capsys):
    """With --sharing, repeated rows are never computed: the ETA counts the tokens still to compute, so the last
    status line has none left; a resume's bar counts the rows left and ends on that total, never past it."""
    chats = [json.loads(line) for line in open(chat_jsonl)]
    rows = 5 * len(chats)  # 4 of 5 repeat an earlier row, as in a corpus of many repeats (the embedded default's)
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": i, **chats[i % len(chats)]} for i in range(rows)])
    fresh, resumed = tmp_path / "fresh.zarr", tmp_path / "resumed.zarr"
    # the resume's first sorting window holds done rows and rows to run
    for out, max_samples, total in [(fresh, None, rows), (resumed, 10, 10), (resumed, None, rows - 10)]:
        capsys.readouterr()
        run(small_config(tiny_chat_model_dir, data, out, max_samples=max_samples), progress=True)
        status = [line for line in capsys.readouterr().err.splitlines() if line.startswith("streamx run: ")]
        shown = [int(line.split()[2].split("/")[0]) for line in status]
        assert status and status[-1].startswith(f"streamx run: {total}/{total} rows [") and max(shown) == total
        assert status[-1].endswith(", ETA 00:00]"), status[-1]
    assert open_store(str(fresh)).summary()["duplicate_content_kept"] == rows - len(chats)


def test_summary_says_the_computed_tokens_per_s_and_the_cpu_share(tiny_chat_model_dir, chat_jsonl, tmp_path):
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr"), progress=False)
    cores = len(os.sched_getaffinity(0))
    assert summary.tokens_per_s == pytest.approx(summary.real_tokens / summary.seconds)
    assert 0 < summary.cpu_share <= 1 and summary.cores == cores
    line = summary.lines()[0]
    assert f"{summary.tokens_per_s:,.0f} computed tokens/s, {summary.cpu_share:.0%} of {cores} cores" in line, line


def test_a_ranks_progress_total_is_the_rows_of_its_windows_left_to_run():
    from streamx.pipeline.ranks import Rank
    from streamx.pipeline.runner import rows_to_run

    done = {*range(21), 40, 70, 120}  # 120: past the rows of a run with a smaller --max-samples
    # windows of 16 rows go round 3 ranks: rank 1 runs rows 16-31 and 64-79, of which 16-20 and 70 are done
    assert rows_to_run(100, done, 16, Rank(1, 3)) == 32 - 6
    assert rows_to_run(100, done, 16, Rank(0, 1)) == 100 - 23
    assert sum(rows_to_run(100, done, 16, Rank(r, 3)) for r in range(3)) == 100 - 23


def test_a_resume_on_data_edited_in_the_middle_is_refused_before_it_computes_a_row(tiny_chat_model_dir, chat_jsonl,
                                                                                    tmp_path):
    """r22: an edit that keeps the file's size and its first and last MiB (the fingerprint) is seen as the resume
    reads the rows again, in a window it skips unparsed too; nothing is committed from the edited data, and the
    same command on the data the store was made from completes it as an uninterrupted run would."""
    from streamx.data.provenance import DataChanged, fingerprint

    junk = {"note": "x" * (1200 << 10)}  # a first and a last line of 1.2 MiB (rejected: no messages)
    chats = [json.loads(line) for line in open(chat_jsonl)]
    rows = [junk, *chats, junk]
    v1 = write_jsonl(tmp_path / "v1.jsonl", rows)
    edited = [dict(r) for r in rows]
    for k in (5, 22, 30):  # rows of a window the first run commits whole (skipped unparsed on resume), of a window
        # it commits in part, and one it never reads
        text = edited[k]["messages"][0]["content"]
        edited[k] = {"messages": [{**edited[k]["messages"][0], "content": text.swapcase()}, *edited[k]["messages"][1:]]}
        assert text.swapcase() != text
    v2 = write_jsonl(tmp_path / "v2.jsonl", edited)
    assert fingerprint(v1) == fingerprint(v2)
    reference, out = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    for store in (reference, out):  # windows of 16 rows: the first whole, the second part committed
        run(small_config(tiny_chat_model_dir, v1, store, max_samples=24), progress=False)
    committed = committed_samples(out)
    for edit in (5, 22):
        data = write_jsonl(tmp_path / f"v2-{edit}.jsonl", [*rows[:edit], edited[edit], *rows[edit + 1:]])
        with pytest.raises(DataChanged, match=r"v2-.*changed since .*rows 0 to 23 differ"):
            run(small_config(tiny_chat_model_dir, data, out, space_check=False), progress=False)
        assert committed_samples(out) == committed
    run(small_config(tiny_chat_model_dir, v1, out, space_check=False), progress=False)
    run(small_config(tiny_chat_model_dir, v1, reference, space_check=False), progress=False)
    assert_same_samples(reference, out)
    # an edit in rows the store never read (past --max-samples) is the new data's to give
    later = tmp_path / "later.zarr"
    run(small_config(tiny_chat_model_dir, v1, later, max_samples=24), progress=False)
    run(small_config(tiny_chat_model_dir, write_jsonl(tmp_path / "v3.jsonl", [*rows[:30], edited[30], *rows[31:]]),
                     later, space_check=False), progress=False)
    assert open_store(str(later)).sample(30).input_ids.tolist() != open_store(str(out)).sample(30).input_ids.tolist()
