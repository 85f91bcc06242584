"""`streamx plan` and the free-space checks: the estimate against the store a run then writes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import small_config
from typer.testing import CliRunner

import streamx.pipeline.plan as plan
import streamx.store.space as space
from streamx.cli import app
from streamx.data.source import open_source
from streamx.pipeline.estimate import estimate, sampled
from streamx.pipeline.runner import run
from streamx.store import Output, StoreError, open_store


def on_disk(path) -> tuple[int, int]:
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), len(files)


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_estimate_is_the_store_a_run_writes(tiny_chat_model_dir, chat_jsonl, tmp_path, storage):
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", storage=storage, sharing="off")
    est = estimate(cfg)  # (with --sharing the rows' tokens and the stored ones differ: the test below)
    summary = run(cfg, progress=False, log=lambda m: None)
    store = open_store(cfg.out)
    assert est.exact and est.rows == est.sampled_rows == sum(1 for _ in open(chat_jsonl))
    assert (est.samples, est.tokens, est.trainable_tokens) == (len(store), store.num_tokens, summary.trainable_tokens)
    assert est.longest_sample == max(len(s.input_ids) for s in store.samples())
    nbytes, files = on_disk(cfg.out)
    size = est.sizes[storage]
    assert size.files == files and abs(size.bytes - nbytes) / nbytes < 0.01, (size, nbytes, files)
    assert size.bytes_per_token == store.metadata.bytes_per_token
    assert est.sizes["fp8"].bytes < 0.6 * est.sizes["bf16"].bytes


def test_the_estimate_with_sharing_is_what_a_shared_run_computes_and_stores(tiny_chat_model_dir, chat_jsonl,
                                                                            tmp_path):
    """--sharing on: the plan counts the tokens a run computes and stores, with leading runs shared (packed, the
    model continues them) and with prefix rows only (padded); the row tokens stay the rows'."""
    for packing in ("on", "off"):
        cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / f"{packing}.zarr", sharing="on",
                           packing=packing)
        est = estimate(cfg)
        summary = run(cfg, progress=False, log=lambda m: None)
        store = open_store(cfg.out)
        assert est.tokens == store.row_tokens == summary.row_tokens
        stored = est.shared.leading_runs if packing == "on" else est.shared.prefix_rows
        assert stored == store.num_tokens == summary.real_tokens
        assert packing == "off" or stored < est.shared.prefix_rows  # the chats' system prompt, once a batch
    assert est.shared.prefix_rows == est.shared.leading_runs  # padded: no leading runs are shared


def test_a_sample_of_rows_is_spread_and_scaled(tiny_chat_model_dir, chat_jsonl, tmp_path):
    n = sum(1 for _ in open(chat_jsonl))  # 48
    rows, total = sampled(open_source(chat_jsonl), n // 4)
    ids = [r.row_id for r in rows]
    assert total == n and len(ids) == n // 4 and ids == sorted(set(ids)) and ids[-1] >= n // 2  # spread, in order
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr")
    exact, part = estimate(cfg), estimate(cfg, sample_rows=n // 4)
    assert not part.exact and part.sampled_rows == n // 4 and part.rows == n and part.samples == n
    assert 0.7 < part.tokens / exact.tokens < 1.3 and part.tokens != exact.tokens  # scaled up from n/4 rows


def fanned_out_turns(path, conversations: int) -> str:
    """Pre-tokenized conversations of 5 turns behind one system prompt, one row per turn, each row a prefix of the
    next: --sharing stores each conversation's last row only, under a quarter of the rows' tokens."""
    rng = np.random.default_rng(0)
    system = rng.integers(2, 1000, 60).tolist()
    rows = []
    for _ in range(conversations):
        chat = system + rng.integers(2, 1000, 40).tolist()
        rows += [{"input_ids": chat[: 60 + 8 * t], "loss_mask": [0] * 60 + [1] * (8 * t)} for t in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_sampled_estimate_sizes_the_shared_store_and_the_space_check_takes_it(tiny_chat_model_dir, tmp_path,
                                                                                monkeypatch):
    """Over 4,096 rows the rows are sampled: --sharing's store is measured on runs of consecutive rows within
    sorting windows and scaled up, a little above what tokenizing every row finds (an upper bound), far under
    the unshared size; the free-space check then starts the run with twice the store free."""
    data = fanned_out_turns(tmp_path / "rows.jsonl", 820)  # 4,100 rows
    cfg = small_config(tiny_chat_model_dir, data, tmp_path / "s.zarr", sharing="on", sort_window=1024)
    sampled_est, exact = estimate(cfg), estimate(cfg, sample_rows=4100)
    assert exact.exact and not sampled_est.exact and exact.tokens > 4 * exact.shared.prefix_rows
    assert 1.0 <= sampled_est.shared.prefix_rows / exact.shared.prefix_rows < 1.1
    assert 1.0 <= sampled_est.sizes["bf16"].bytes / exact.sizes["bf16"].bytes < 1.1
    free = 2 * exact.sizes["bf16"].bytes
    monkeypatch.setattr(plan, "free_bytes", lambda path: free)
    logged = []
    plan.check_space(cfg, open_source(data), Output.read(cfg.out), log=logged.append)
    assert f"{sampled_est.stored_tokens:,} stored: shared leading runs" in logged[0]
    monkeypatch.setattr(plan, "free_bytes", lambda path: exact.sizes["bf16"].bytes // 2)
    with pytest.raises(StoreError, match="has .* MB free and the store needs about"):
        plan.check_space(cfg, open_source(data), Output.read(cfg.out), log=logged.append)


def test_run_refuses_to_start_without_room_and_no_weights_are_read(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                   monkeypatch):
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr")
    needed = estimate(cfg).sizes["bf16"].bytes
    usage = type("Usage", (), {"free": needed // 2, "total": needed})
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage)

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the space check")

    monkeypatch.setattr("streamx.pipeline.plan.load_model", no_weights)
    with pytest.raises(StoreError, match=r"has .* MB free and the store needs about .* MB; .*--no-space-check"):
        run(cfg, progress=False, log=lambda m: None)
    with pytest.raises(AssertionError, match="the model was loaded"):  # --no-space-check: on to the weights
        run(cfg.replace(space_check=False), progress=False, log=lambda m: None)


def test_a_run_stops_cleanly_before_the_disk_fills_then_resumes(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                monkeypatch):
    """With --no-space-check too: it skips the check at the start, never the guard while the run writes."""
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", space_check=False)
    real_free = space.free_bytes
    checks = []

    def filling_up(path):  # the disk fills after the third shard's commit
        checks.append(path)
        return real_free(path) if len(checks) < 3 else 10 << 20

    monkeypatch.setattr(space, "free_bytes", filling_up)
    with pytest.raises(StoreError, match=r"stopped: 10.5 MB left .* under the .* reserve; everything written so far "
                                         r"is committed: free space and re-run"):
        run(cfg, progress=False, log=lambda m: None)
    partial = open_store(cfg.out)
    assert partial.num_tokens >= 2 * 64 and len(partial) > 0  # the shards committed before the stop are kept
    kept = {r: partial.sample(r) for r in partial.row_ids().tolist()}
    monkeypatch.setattr(space, "free_bytes", real_free)
    run(cfg, progress=False, log=lambda m: None)
    final = open_store(cfg.out)
    assert len(final) == sum(1 for _ in open(chat_jsonl)) and final.summary()["duplicate_rows"] == 0
    for r, s in kept.items():
        assert torch.equal(final.sample(r).hidden_states.view(torch.int16), s.hidden_states.view(torch.int16))


def test_plan_command(tiny_chat_model_dir, chat_jsonl, tmp_path):
    args = ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(tmp_path / "s.zarr"),
            "--layers", "0,2,4", "--max-length", "256", "--token-budget", "512"]
    text = CliRunner().invoke(app, [*args, "--tokens-per-s", "100"])
    assert text.exit_code == 0, text.output
    est = estimate(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", chunk_tokens=0, shard_tokens=0,
                                sort_window=1024))  # the plan command's own settings
    assert f"tokens       {est.tokens:,} ({est.trainable_tokens:,} trainable)" in text.stdout
    assert "<- --storage" in next(line for line in text.stdout.splitlines() if line.startswith("  bf16"))
    assert "fits" in text.stdout
    assert f"sharing      {est.shared.leading_runs:,} tokens computed and stored" in text.stdout
    assert est.shared.leading_runs < est.shared.prefix_rows  # (a Llama: the support table says it continues them)
    assert f"stored       {est.shared.leading_runs:,} tokens (shared leading runs (Llama 3" in text.stdout
    seconds = round(est.shared.leading_runs / 100)  # what the forward computes, as the store's size
    assert f"time         {seconds // 60} min {seconds % 60:02d} s at 100 tokens/s (given)" in text.stdout

    calibrated = CliRunner().invoke(app, [*args, "--storage", "fp8", "--calibrate", "--json", "--sample-rows", "24"])
    assert calibrated.exit_code == 0, calibrated.output
    plan = json.loads(calibrated.stdout)
    assert plan["storage"] == "fp8" and plan["sampled_rows"] == 24 and plan["rows"] == 48 and not plan["exact"]
    assert plan["tokens_per_s"] > 0 and plan["seconds"] == pytest.approx(plan["stored_tokens"] / plan["tokens_per_s"])
    assert plan["sizes"]["fp8"]["bytes_per_token"] == 3 * 64 + 4

    bad = CliRunner().invoke(app, [*args, "--sample-rows", "0"])
    assert bad.exit_code == 1 and bad.stderr.strip() == "error: --sample-rows must be >= 1; got 0"


def test_rows_past_max_length_are_counted_and_said_by_plan_run_store_and_inspect(tiny_chat_model_dir, chat_jsonl,
                                                                                  tmp_path):
    """Rows longer than --max-length are cut there (the default --truncation): plan counts them and their tokens past
    it and names the --max-length that keeps them whole, the run's summary and the store say them, and `inspect
    --sample` marks a cut row; each figure against the rows' own lengths, from the tokenizer's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    rows = [json.loads(line) for line in open(chat_jsonl)]
    lengths = np.array([len(tokenizer(tokenizer.apply_chat_template(r["messages"], tokenize=False),
                                      add_special_tokens=False)["input_ids"]) for r in rows])
    max_length = int(np.median(lengths))
    out = tmp_path / "s.zarr"
    config = small_config(tiny_chat_model_dir, chat_jsonl, out, layers="0,2,4", max_length=max_length)
    summary = run(config, progress=False, log=lambda m: None)
    store = open_store(str(out))
    kept = lengths[store.row_ids()]  # the rows that became samples (a cut that left nothing to train is a reject)
    rows_cut, tokens_cut = int((kept > max_length).sum()), int(np.maximum(kept - max_length, 0).sum())
    assert rows_cut > 5 and (summary.cut_rows, summary.cut_tokens) == (rows_cut, tokens_cut)
    assert f"cut at --max-length {max_length:,}: {rows_cut:,} of these samples were longer, and their " \
           f"{tokens_cut:,} tokens past it are not stored" in "\n".join(summary.lines())
    assert (store.summary()["cut_rows"], store.summary()["cut_tokens"]) == (rows_cut, tokens_cut)
    assert f"{rows_cut:,} rows were longer and cut there: {tokens_cut:,} tokens past it not stored" in \
        next(line for line in store.describe() if line.startswith("data "))

    est = estimate(config)
    assert (est.cut_rows, est.cut_tokens, est.keeps_all) == (rows_cut, tokens_cut, int(kept.max()))
    said = CliRunner().invoke(app, ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(out),
                                    "--max-length", str(max_length), "--layers", "0,2,4", "--tokens-per-s",
                                    "100"])
    assert said.exit_code == 0, said.output
    assert f"cut          {rows_cut:,} rows " in said.stdout and f"--max-length {int(kept.max()):,} keeps every row " \
        "whole" in said.stdout

    cut_row = next(r for r in store.row_ids().tolist() if lengths[r] > max_length)
    whole_row = next(r for r in store.row_ids().tolist() if lengths[r] <= max_length)
    shown = CliRunner().invoke(app, ["inspect", str(out), "--sample", str(cut_row)])
    assert shown.exit_code == 0, shown.output
    assert f"CUT at --max-length: its last {lengths[cut_row] - max_length:,} tokens are not stored" in shown.stdout
    assert "CUT" not in CliRunner().invoke(app, ["inspect", str(out), "--sample", str(whole_row)]).stdout


def test_plan_on_a_disk_too_small_lists_what_fits_and_exits_1(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                               monkeypatch):
    """With a third of the store's bytes free, plan says TOO SMALL, then each setting that makes the store smaller
    with the store it makes (fp8, fewer ids, a subset that fits), and exits 1; with room, 0."""
    import streamx.pipeline.estimate as estimate_module

    config = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", layers="0,1,2,3,4",
                          chunk_tokens=0, shard_tokens=0, sort_window=1024)
    needed = estimate(config).sizes["bf16"].bytes
    monkeypatch.setattr(estimate_module, "free_bytes", lambda path: needed // 3)
    args = ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(tmp_path / "s.zarr"),
            "--layers", "0,1,2,3,4", "--tokens-per-s", "100"]
    said = CliRunner().invoke(app, args)
    assert said.exit_code == 1, said.output
    lines = said.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("free ") and "TOO SMALL" in line)
    ways = lines[at + 1 :]
    assert ways[0].startswith("  ways out  each the store it makes")
    assert any(line.startswith("    --storage fp8") for line in ways)
    assert any(line.startswith("    --layers eagle3 (4 ids instead of 5") for line in ways)
    subset = next(line for line in ways if line.startswith("    --max-samples "))
    assert subset.endswith("fits") and int(subset.split()[1].replace(",", "")) < 48
    monkeypatch.setattr(estimate_module, "free_bytes", lambda path: needed * 2)
    assert CliRunner().invoke(app, args).exit_code == 0


def test_plan_knows_the_cards_users_have(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """--gpu NAME sizes each --tp against its memory and times the job at its peak, said as assumed."""
    args = ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out", str(tmp_path / "s.zarr")]
    b300 = CliRunner().invoke(app, [*args, "--gpu", "b300", "--gpus", "8"])
    assert b300.exit_code == 0, b300.output
    assert "(assumed: 8 B300 GPUs at 40% (an assumed MFU) of 2,250 TFLOPS" in b300.stdout
    assert "against 288.0 GB GPUs" in b300.stdout
    given = CliRunner().invoke(app, [*args, "--gpu", "rtx-pro-6000", "--gpu-memory", "48"])
    assert "against 48.0 GB GPUs" in given.stdout and "of 500 TFLOPS" in given.stdout
    bad = CliRunner().invoke(app, [*args, "--gpu", "v100"])
    assert bad.exit_code == 1 and bad.stderr.strip().startswith("error: --gpu must be one of h100, h200, b200")


def test_plan_counts_duplicates_and_sizes_the_store_without_them(tiny_chat_model_dir, chat_jsonl, tmp_path):
    rows = [json.loads(line) for line in open(chat_jsonl)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:10]))  # the first 10 twice
    cfg = small_config(tiny_chat_model_dir, str(data), tmp_path / "s.zarr", skip_duplicates=True)
    est = estimate(cfg, count_duplicates=True)
    run(cfg, progress=False, log=lambda m: None)
    store = open_store(cfg.out)
    assert est.duplicates == 10 and est.rejects == {"duplicate_content": 10}
    assert (est.samples, est.tokens) == (len(store), store.row_tokens) == (len(rows), store.row_tokens)
    sampled_est = estimate(cfg, sample_rows=len(rows) // 2, count_duplicates=True)  # repeats counted over every row
    assert sampled_est.duplicates == 10 and sampled_est.samples == len(rows)
    assert estimate(cfg.replace(skip_duplicates=False), count_duplicates=True).samples == len(rows) + 10


def test_the_plan_sizes_the_store_on_what_the_support_table_says_the_family_shares(tiny_chat_model_dir, chat_jsonl,
                                                                                   tmp_path):
    """The store and the time are sized on the shared leading runs where batches are packed and the family
    continues a shared prefix (a Llama), on prefix rows only where it does not (MiniMax-Text-01's lightning
    attention, a family not in the table, --packing off); a run's free-space check takes the same size."""
    from transformers import LlamaConfig, MiniMaxConfig

    from streamx.pipeline.estimate import expected_stored

    cfg = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr")
    est = estimate(cfg)
    shared = est.shared
    assert shared.leading_runs < shared.prefix_rows <= est.tokens
    assert est.stored_tokens == shared.leading_runs
    assert est.sizes[cfg.storage].bytes < estimate(cfg.replace(packing="off")).sizes[cfg.storage].bytes
    unknown = LlamaConfig()
    unknown.model_type = "not_a_family"
    for config, text_config, stored, why in [
            (cfg, LlamaConfig(), shared.leading_runs, "Llama 3: packed and shared"),
            (cfg, MiniMaxConfig(), shared.prefix_rows, "MiniMax-Text-01: padded, prefix rows shared"),
            (cfg, unknown, shared.prefix_rows, "not_a_family is not in the support table"),
            (cfg.replace(packing="off"), LlamaConfig(), shared.prefix_rows, "--packing off"),
            (cfg.replace(sharing="off"), LlamaConfig(), est.tokens, "every row's tokens")]:
        tokens, said = expected_stored(config, None if config.sharing == "off" else shared, est.tokens, text_config)
        assert tokens == stored and why in said, (tokens, said)


def test_the_plan_sizes_each_gpu_at_each_tp(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """The weights per GPU are the checkpoint's bytes at --tp 1 (its safetensors file, read independently of the
    meta model), their decoder layers split N ways above; 4 query heads and 2 key-value heads: --tp 4 copies each
    key-value head to two GPUs (its kept keys then split 2 ways, not 4), --tp 8 is refused with why; the smallest
    --tp that fits the given GPUs is named, and none where none does."""
    import safetensors

    from streamx.model.footprint import HEADROOM, fit_lines, footprints
    from streamx.model.load import meta_model

    model = meta_model(tiny_chat_model_dir, torch.float32)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    found = footprints(model, 512, 3)
    assert [(f.tp, f.kv_copies, bool(f.refused)) for f in found] == [(1, 1, False), (2, 1, False), (4, 2, False),
                                                                     (8, 1, True), (16, 1, True)]
    assert "num_attention_heads 4" in found[3].refused and found[2].kept == found[1].kept
    lines = fit_lines(found, 10**12, torch.float32, 512)
    assert "(each key-value head on 2 GPUs)" in lines[3] and lines[4].startswith("  --tp 8      refused: does not")
    with safetensors.safe_open(str(Path(tiny_chat_model_dir) / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(name).numel() * f.get_tensor(name).element_size() for name in f.keys())
    one, two = found[:2]
    found = found[:2]
    assert one.weights == stored and one.weights > two.weights > one.weights / 2  # (embeddings whole on each GPU)
    assert two.kept == one.kept // 2 and two.activations < one.activations
    fits_two = int(two.total / HEADROOM) + 1  # fits --tp 2, not --tp 1
    assert "--tp 2 is the smallest that fits" in fit_lines(found, fits_two, torch.float32, 512)[-1]
    assert "no --tp of [1, 2] fits" in fit_lines(found, fits_two // 2, torch.float32, 512)[-1]
    text = CliRunner().invoke(app, ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out",
                                    str(tmp_path / "s.zarr"), "--gpu-memory", "1"])
    assert text.exit_code == 0 and "--tp 1 is the smallest that fits" in text.stdout, text.output
    # `plan --tp 8` refuses what the run refuses before reading a weight, with its words and exit code
    from streamx.model.load import check_tensor_parallel

    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(tiny_chat_model_dir, 8)
    refusal = CliRunner().invoke(app, ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out",
                                       str(tmp_path / "s.zarr"), "--tp", "8"])
    assert refusal.exit_code == 1 and str(refused.value) in refusal.output, refusal.output
    check_tensor_parallel(tiny_chat_model_dir, 4)  # the key-value heads copied


def test_a_moes_experts_split_over_the_gpus_only_with_ep():
    """transformers' tensor-parallel plan leaves a MoE's experts whole on every process (tests/test_tensor_parallel.py
    runs it): the plan counts them whole at --tp N, and split N ways with --ep."""
    from zoo_models import zoo_config

    from streamx.model.footprint import HEADROOM, fit_lines, footprints

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(zoo_config("qwen3_moe"))
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
    plain, spread = footprints(model, 512, 3, sizes=(1, 2)), footprints(model, 512, 3, ep=True, sizes=(1, 2))
    assert experts > 0 and plain[0].weights == spread[0].weights  # --tp 1: all on one GPU either way
    assert plain[1].weights - spread[1].weights == experts - experts // 2 == plain[1].ep_saves
    assert spread[1].ep_saves == 0 and plain[0].ep_saves == 0
    # GPUs that --tp 2 fits only with --ep: the plan says so beside "no --tp fits"
    gpu = int((spread[1].total + plain[1].total) / 2 / HEADROOM)
    lines = fit_lines(plain, gpu, torch.float32, 512)
    assert "no --tp of [1, 2] fits" in lines[-2] and lines[-1].startswith("  --tp 2 --ep fits: ")
    assert not any("--ep fits" in line for line in fit_lines(spread, gpu, torch.float32, 512))


def test_sizes_read_in_the_unit_that_fits_them():
    from streamx.base.units import gb

    assert [gb(n) for n in (5e7, 1.5e9, 87_198.75e9, 2.5e15)] == ["50.0 MB", "1.50 GB", "87.20 TB", "2,500.00 TB"]


def test_a_quantized_checkpoint_is_sized_as_it_stores_its_weights():
    """From the config's quantization_config alone: gpt-oss's MXFP4 experts at 4.25 bits (4-bit values, an 8-bit
    scale per 32), the rest in bf16; an FP8 checkpoint's decoder linear layers at 8 bits plus a float32 scale per
    128 x 128 block, its embeddings and norms in bf16. Expected sizes from the configs' shapes, not the code's."""
    import math

    from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig

    from streamx.model.quantized import describe, weight_bytes

    E, H, M, L = 4, 64, 32, 2  # experts, hidden, intermediate, layers
    oss = GptOssConfig(hidden_size=H, intermediate_size=M, num_hidden_layers=L, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, vocab_size=256,
                       quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                           "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(oss, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    experts = L * E * (H * 2 * M + M * H)  # gate_up_proj [E, H, 2I] and down_proj [E, M, H] per layer
    assert sum(weight_bytes(model, 2).values()) == 2 * (total - experts) + experts * 17 // 32
    assert describe(oss).startswith("MXFP4 experts at 4.25 bits as stored, as transformers keeps them")

    llama = LlamaConfig(hidden_size=H, intermediate_size=M, num_hidden_layers=L, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256,
                        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    shapes = [(H, H), (H // 2, H), (H // 2, H), (H, H), (M, H), (M, H), (H, M)]  # q k v o gate up down
    linear = L * sum(a * b for a, b in shapes)
    fp8 = L * sum(math.ceil(a * b * (8 + 32 / 128 ** 2) / 8) for a, b in shapes)
    assert sum(weight_bytes(model, 2).values()) == 2 * (total - linear) + fp8
    assert describe(LlamaConfig()) is None


def test_the_hours_without_a_measured_rate_come_from_the_models_flops_and_say_their_assumption(
        tiny_chat_model_dir, chat_jsonl, tmp_path):
    """2 FLOPs per decoder weight (a MoE's experts at top-k / E) and the attention's two matmuls over the context,
    against sizes from the config's shapes; the plan prints the rate with what it assumed."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    from streamx.model.flops import assumed_rate, token_cost

    H, M, L = 64, 32, 2
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=H, intermediate_size=M, num_hidden_layers=L,
                                                             num_attention_heads=4, num_key_value_heads=2,
                                                             vocab_size=256))
        moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=M,
                                                              num_hidden_layers=L, num_attention_heads=4,
                                                              num_key_value_heads=2, head_dim=16, num_experts=8,
                                                              num_experts_per_tok=2, vocab_size=256))
    attention = H * H + 2 * (H // 2) * H + H * H  # q, k, v (2 KV heads of 16), o
    cost = token_cost(dense, 100.0)
    assert cost.active_params == L * (attention + 3 * H * M + 2 * H)  # + MLP and two norms per layer
    assert cost.attention == 4 * H * L * 100.0
    experts_active = 2 * 3 * H * M  # 2 of 8 experts' gate, up and down
    router, norms = 8 * H, 2 * H + 2 * 16  # + per-head q and k norms
    assert token_cost(moe, 100.0).active_params == L * (attention + experts_active + router + norms)
    rate, said = assumed_rate(cost, 8, 0.5, 1000.0)
    assert rate == 8 * 0.5 * 1e15 / cost.flops
    assert said.startswith("assumed: 8 GPUs at 50% (an assumed MFU) of 1,000 TFLOPS")
    text = CliRunner().invoke(app, ["plan", "--model", tiny_chat_model_dir, "--data", chat_jsonl, "--out",
                                    str(tmp_path / "s.zarr"), "--gpus", "2"])
    assert text.exit_code == 0 and "tokens/s (assumed: 2 GPUs at 40% (an assumed MFU) of 989 TFLOPS" in text.stdout, \
        text.output
