"""`streamx bench` smoke test: the report's structure and counts; no speed is asserted."""

import json

from streamx.bench import MODES, bench, format_report
from streamx.config import load_config
from streamx.store import open_store


def test_bench_report(tiny_chat_model_dir, chat_jsonl, tmp_path):
    cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, max_samples=12, layers="1,4",
                      token_budget=512, max_length=256)
    report = bench(cfg, rounds=2, progress=False)
    expected_tokens = sum(len(s.input_ids) for s in _stored(cfg, tmp_path))
    assert report["workload"]["samples"] == 12 and report["workload"]["tokens"] == expected_tokens
    for mode in MODES:
        m = report[mode]
        assert m["tokens_per_s"] > 0 and m["samples_per_s"] > 0 and m["peak_rss_bytes"] > 0
        assert abs(m["tokens_per_s"] / m["samples_per_s"] - expected_tokens / 12) < 1e-6 * expected_tokens
    # streamx stores K x H x 2 bytes per token plus ids, masks and metadata; forward_only writes nothing
    assert report["streamx"]["bytes_written_per_token"] >= 2 * 64 * 2
    assert report["forward_only"]["bytes_written_per_token"] == 0
    assert report["naive"]["bytes_written_per_token"] >= 2 * 64 * 2
    assert set(report["streamx"]["stage_seconds"]) >= {"source_tokenize", "forward", "pack", "write"}
    assert report["streamx"]["bottleneck"]
    r = report["ratios"]
    assert abs(r["streamx_vs_forward_only"] - report["streamx"]["tokens_per_s"] / report["forward_only"]["tokens_per_s"]) < 1e-9
    assert abs(r["streamx_vs_naive"] - report["streamx"]["tokens_per_s"] / report["naive"]["tokens_per_s"]) < 1e-9
    assert report["config"]["max_samples"] == 12 and report["machine"]["torch"]
    json.dumps(report)  # serialisable for --json
    assert "streamx / forward_only" in format_report(report)


def _stored(cfg, tmp_path):
    from streamx.pipeline import run

    run(cfg.replace(out=str(tmp_path / "ref.zarr")), progress=False)
    return list(open_store(str(tmp_path / "ref.zarr")).samples())
