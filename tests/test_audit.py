"""The in-run audit (streamx.proof.audit): rows of the run's own batches recomputed alone through the model's own
forward. A way of computing rows that the start-up check's probe rows never reach (here: packed batches of more
rows than the probes pack, with their positions shifted) passes the check; the audit finds it on the run's own
rows, the run drops it (streamx.proof.ladder), computes the batch again, computes again the rows it committed
that way before (streamx.pipeline.heal) and ends normally with every row right; with the audit off the same run
writes wrong states (the control). The audit's figures reach the store, inspect and verify."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import broken_packed_batch, small_config, worst_row
from transformers import AutoModelForCausalLM

from streamx.config import RunConfig, load_config
from streamx.data import batching
from streamx.pipeline.heal import unranged
from streamx.pipeline.plan import make_plan
from streamx.pipeline.runner import run
from streamx.proof import audit
from streamx.proof.tolerance import Noise, Tolerance
from streamx.store import open_store
from streamx.train.verify import check_audit, verify


def shift_positions_past_the_probes(monkeypatch, after: int = 0) -> None:
    """Packed batches of more segments than any probe's, from the `after`-th such batch on, with a rope off by two
    (helpers.broken_packed_batch)."""
    monkeypatch.setattr(batching, "packed_batch", broken_packed_batch(after))


def test_a_broken_way_the_probes_miss_is_dropped_and_the_run_ends_right(peaked_model_dir, chat_jsonl, tmp_path,
                                                                         monkeypatch):
    shift_positions_past_the_probes(monkeypatch)
    # the control: no audit, the start-up check passes the broken way, and the store holds wrong states
    lines: list[str] = []
    run(small_config(peaked_model_dir, chat_jsonl, tmp_path / "unaudited.zarr", audit_every=0), progress=False,
        log=lines.append)
    assert any(line.startswith("  packing on:") for line in lines)
    assert worst_row(peaked_model_dir, tmp_path / "unaudited.zarr") > 0.05

    # audited (the rows it picks, whatever they cost: the budget reads the clock): the run finds the way, drops it,
    # and ends with every row right
    lines = []
    summary = run(small_config(peaked_model_dir, chat_jsonl, tmp_path / "audited.zarr", audit_share=0),
                  progress=False, log=lines.append)
    found = [line for line in lines if line.startswith("audit: row")]
    assert found and "packed beside other rows" in found[0] and "layer id" in found[0] and "token" in found[0]
    assert "the run now computes its rows" in found[0]
    store = open_store(str(tmp_path / "audited.zarr"))
    assert len(store) == len(open_store(str(tmp_path / "unaudited.zarr")))  # every row, none lost
    assert worst_row(peaked_model_dir, tmp_path / "audited.zarr") < 0.01, "\n".join(lines)
    audited = store.audit()
    assert audited.found and audited.rung and not audited.to_heal and audited.recomputed >= 1
    assert summary.audit.found == audited.found and "found wrong: row" in check_audit(store).summary
    assert verify(str(tmp_path / "audited.zarr"), use_model=False, log=lambda m: None).passed


def test_a_way_that_turns_wrong_after_some_batches_is_healed(peaked_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """The way is right for its first batches, which the run commits, then wrong: the run drops it, and before it
    ends computes again every row it committed that way, so that the store equals the model's own forward of each
    row alone, and the log, the store and verify say what was computed again."""
    shift_positions_past_the_probes(monkeypatch, after=2)
    lines: list[str] = []
    out = tmp_path / "s.zarr"
    summary = run(small_config(peaked_model_dir, chat_jsonl, out, audit_every=1, audit_share=0), progress=False,
                  log=lines.append)
    healed = [line for line in lines if "committed rows computed again" in line]
    assert healed and any(line.startswith("audit: row") for line in lines), "\n".join(lines)
    store = open_store(str(out))
    assert worst_row(peaked_model_dir, out) < 0.01
    assert summary.samples == len(store) and store.completeness().problems() == []
    audited = store.audit()
    # besides the batch it found, rows of the batches before it, committed before the way turned wrong
    rewritten = int(healed[0].split("audit: ")[1].split(" committed")[0].replace(",", ""))
    assert rewritten >= 1 and audited.recomputed > rewritten and not audited.to_heal
    assert f"{audited.recomputed:,} rows computed again" in audited.phrase()
    assert verify(str(out), use_model=False, log=lambda m: None).passed


def test_bf16_rounding_of_a_deep_model_is_not_taken_for_a_wrong_way(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2-135M's 30 layers in bf16: its own forwards of a row alone and among copies of itself differ by ~0.05 on
    a token, so a fixed tolerance of 0.05 found right ways wrong on real chats (three, and the run ended one row per
    forward). Judged by the model's own noise, measured at start-up, the run keeps its packed and shared ways, its
    rows pass verify's recomputation alone, and a way wrong by a rope off by two is still found."""
    settings = dict(model=smollm2_dir, data="chatterbot:english", dtype="bfloat16", audit_share=0)
    lines: list[str] = []
    right = run(load_config(None, out=str(tmp_path / "right.zarr"), max_samples=200, **settings), progress=False,
                log=lines.append)
    assert right.audit.rows >= 4 and not right.audit.found, "\n".join(lines)
    store = open_store(str(tmp_path / "right.zarr"))
    assert store.metadata.packing == "on" and store.audit().tolerance == right.audit.tolerance
    judged = right.audit.tolerance
    assert judged["dtype"] == "bfloat16" and judged["noise_worst"] > 0.01 and judged["token"] > 0.05
    assert "bfloat16 noise of this model" in right.audit.phrase()
    assert verify(str(tmp_path / "right.zarr"), samples=8, log=lambda m: None).passed

    shift_positions_past_the_probes(monkeypatch)
    lines = []
    wrong = run(load_config(None, out=str(tmp_path / "wrong.zarr"), max_samples=120, sharing="off", **settings),
                progress=False, log=lines.append)
    assert wrong.audit.found and wrong.audit.found[0]["way"] == "packed beside other rows", "\n".join(lines)
    assert verify(str(tmp_path / "wrong.zarr"), samples=8, log=lambda m: None).passed


def test_a_way_that_moves_every_token_a_little_shows_in_the_median_token_of_a_loud_model():
    """Under a loud model's token tolerance (SmolLM2 in bf16, its noise as measured above), rounding moves a few tokens
    far and the median token little; a wrong way that moves every token by 0.1 passes the token tolerance but not
    the median's."""
    judged = Tolerance.of(audit.LOW_PRECISION_FLOOR, Noise(typical=0.016, worst=0.054, dtype="bfloat16"))
    rounding = torch.full((300, 4), 0.01)
    rounding[::50, 2] = 0.15  # a few tokens far
    assert not judged.past(*judged.judge(rounding))
    assert judged.past(*judged.judge(torch.full((300, 4), 0.1))) and judged.judge(torch.full((300, 4), 0.1))[0] == 0


def test_the_audit_figures_reach_the_store_inspect_and_verify(tiny_chat_model_dir, chat_jsonl, tmp_path):
    out = tmp_path / "s.zarr"
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, out, audit_every=7, audit_share=0), progress=False,
                  log=lambda m: None)
    audited = summary.audit
    store = open_store(str(out))
    ids = store.row_ids()
    # whatever it costs: the first row of each way, and every row id that is a multiple of 7 among the computed rows
    assert audited.rows >= max(len(audited.ways), int(np.count_nonzero(ids % 7 == 0)) // 2)
    assert set(audited.coverage) >= set(audited.ways) and all(audited.coverage[way][0] for way in audited.ways)
    assert all(f"{way} (" in audited.phrase() for way in audited.ways)
    assert any(way.startswith("packed beside other rows") for way in audited.ways)
    assert any("shared prefix" in way for way in audited.ways)  # the chats share their leading turns
    assert 0 < audited.worst < 0.01 and audited.seconds > 0 and audited.forward_seconds > audited.seconds
    assert store.audit() == audited
    assert any(line.startswith("audit ") for line in store.describe())
    check = check_audit(store)
    assert check.passed and not check.skipped and f"{audited.rows:,} rows" in check.summary
    # within its budget (by default 1% of the forward time of the tokens it plans to compute, and as much again from
    # the start): the audited tokens stay within as many tokens (a row alone costs at least what it does batched);
    # the ways and lengths the budget left are said
    config = small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "b.zarr")
    planned = make_plan(config, log=lambda m: None).tokens_to_compute
    short = run(config, progress=False, log=lambda m: None)
    assert planned > 0 and short.real_tokens > 0
    budgeted = short.audit
    assert budgeted.tokens <= audit.SHARE * (max(short.real_tokens, planned) + planned)
    for way in budgeted.unaudited():
        assert way in budgeted.phrase()
    # none when the run did not audit
    run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "n.zarr", audit_every=0), progress=False,
        log=lambda m: None)
    unaudited = open_store(str(tmp_path / "n.zarr"))
    assert unaudited.audit() is None and check_audit(unaudited).skipped


def test_rows_left_to_heal_by_a_stopped_run_are_healed_by_its_resume(peaked_model_dir, chat_jsonl, tmp_path,
                                                                      monkeypatch):
    """A run that found a way wrong and stopped before it computed again the rows it had committed that way leaves
    the part open, its record naming them (verify fails on it); the resume, even with --audit-every 0, starts on the
    rung the record names and computes them again before it closes the part."""
    from streamx.pipeline import runner

    shift_positions_past_the_probes(monkeypatch, after=2)
    out = tmp_path / "s.zarr"
    real_heal = runner.heal

    def killed(*args, **kwargs):
        raise RuntimeError("killed before healing")

    monkeypatch.setattr(runner, "heal", killed)
    with pytest.raises(RuntimeError, match="killed before healing"):
        run(small_config(peaked_model_dir, chat_jsonl, out, audit_every=1, audit_share=0), progress=False,
            log=lambda m: None)
    store = open_store(str(out))
    waiting = store.audit().to_heal
    assert waiting and store.completeness().problems() and not check_audit(store).passed
    assert set(unranged(waiting).tolist()) <= set(store.row_ids().tolist())  # committed rows, named

    monkeypatch.setattr(runner, "heal", real_heal)
    lines: list[str] = []
    summary = run(small_config(peaked_model_dir, chat_jsonl, out, audit_every=0), progress=False, log=lines.append)
    assert summary.samples == 0 and any("committed rows computed again" in line for line in lines), "\n".join(lines)
    store = open_store(str(out))
    assert not store.audit().to_heal and store.completeness().problems() == [] and check_audit(store).passed
    assert worst_row(peaked_model_dir, out) < 0.01


def test_a_resume_that_finds_a_way_wrong_heals_the_rows_earlier_runs_computed_so(peaked_model_dir, chat_jsonl,
                                                                                    tmp_path, monkeypatch):
    """Each committed row records how it was computed (sample_way): a resume that finds a way wrong computes again
    the rows an earlier run of the part committed that way too, here written wrong by a first run without the
    audit, so that the finished store equals the model's own forward of every row alone."""
    shift_positions_past_the_probes(monkeypatch)
    out = tmp_path / "s.zarr"
    run(small_config(peaked_model_dir, chat_jsonl, out, max_samples=24, audit_every=0), progress=False,
        log=lambda m: None)
    assert worst_row(peaked_model_dir, out) > 0.05  # the first run's rows, computed the broken way
    lines: list[str] = []
    run(small_config(peaked_model_dir, chat_jsonl, out, audit_share=0), progress=False, log=lines.append)
    store = open_store(str(out))
    found = store.audit().found
    assert found and all(f["earlier_rows"] == 0 for f in found), found
    assert any("committed rows computed again" in line for line in lines), "\n".join(lines)
    assert worst_row(peaked_model_dir, out) < 0.01
    assert store.completeness().problems() == [] and check_audit(store).passed


def test_a_resume_of_a_part_without_recorded_ways_says_what_earlier_runs_computed_so(peaked_model_dir, chat_jsonl,
                                                                                    tmp_path, monkeypatch):
    """A part from before streamx recorded each row's way counts, per way, the rows each run computed, not which:
    a resume that finds a way wrong heals its own rows and says how many rows earlier runs computed that way (the
    log, the record, verify)."""
    import zarr

    out = tmp_path / "s.zarr"
    run(small_config(peaked_model_dir, chat_jsonl, out, max_samples=24), progress=False, log=lambda m: None)
    before = open_store(str(out)).audit().coverage
    del zarr.open_group(str(out))["parts/part-00000"]["sample_way"]  # as streamx 0.8.0 wrote it
    shift_positions_past_the_probes(monkeypatch)
    lines: list[str] = []
    run(small_config(peaked_model_dir, chat_jsonl, out, audit_share=0), progress=False, log=lines.append)
    store = open_store(str(out))
    found = store.audit().found
    assert found and all(0 < f["earlier_rows"] <= before.get(f["way"], [0, 0, 0, 0])[2] or
                         not before.get(f["way"], [0, 0, 0, 0])[2] for f in found), (found, before)
    said = [f for f in found if f["earlier_rows"]]
    assert said, f"no way found wrong was computed by the first run: {found}, {before}"
    assert any("rows an earlier run of this part computed that way are not told apart" in line for line in lines)
    assert "not recomputed: which ones is not recorded" in check_audit(store).summary


VOCAB = 512


def word_level_model(model, path) -> str:
    """`model` saved at `path` with a word-level tokenizer of its vocabulary (rows here are pre-tokenized)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(path)
    return str(path)


def token_rows(path, lengths: list[int], seed: int) -> str:
    rng = np.random.default_rng(seed)
    rows = [{"input_ids": rng.integers(3, VOCAB, n).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2)} for n in lengths]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@torch.inference_mode()
def worst_token(model, out) -> tuple[float, int]:
    """The largest per-token relative difference of the stored ids 1 and 2 from the model's own forward of each row
    alone (in its dtype), and how many tokens are over 5e-2."""
    store, worst, over = open_store(str(out)), 0.0, 0
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        hidden = model.model(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states
        want = torch.stack([hidden[1][0], hidden[2][0]], dim=1).float().flatten(2)
        got = sample.hidden_states[:, :2].float().flatten(2)
        error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max(dim=1).values
        worst, over = max(worst, float(error.max())), over + int((error > 0.05).sum())
    return worst, over


def test_rows_past_a_window_the_probes_did_not_reach_are_audited(tmp_path, monkeypatch):
    """r26: the start-up check's rows stop short of a sliding window (--token-budget 90: probes of at most 45
    tokens, window 48), and packed attention is wrong past it (here: its window 8 tokens wider than the layer's).
    Rows past the window are packed longest first beside shorter ones; the audit takes the first row past the
    window whatever else it audits, finds the way wrong, and the run ends with every row its own forward's."""
    from transformers import MistralConfig, MistralForCausalLM

    from streamx.model import attention

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=48, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=1, attn_implementation="sdpa")).eval()
    checkpoint = word_level_model(model, tmp_path / "mistral")
    data = token_rows(tmp_path / "rows.jsonl", [34, 56] * 8, seed=0)
    found = attention.LayerAttention.of
    monkeypatch.setattr(attention.LayerAttention, "of", classmethod(
        lambda cls, *args: (lambda la: dataclasses.replace(la, window=la.window + 8) if la.window else la)(
            found(*args))))
    lines: list[str] = []
    summary = run(RunConfig(model=checkpoint, data=data, out=str(tmp_path / "s.zarr"), layers="1,2,4",
                            token_budget=90, max_length=90, sort_window=64), progress=False, log=lines.append)
    assert any("past the window" in line or "in-run audit alone" in line for line in lines), "\n".join(lines)
    assert summary.audit.found and any(line.startswith("audit: row") for line in lines)
    assert worst_token(model, tmp_path / "s.zarr")[0] < 0.01


def deepseek_v4_past_its_reach(tmp_path):
    """r27: DeepSeek-V4 (a MoE: in bf16 a row may have a token over the tolerance, a router's near tie) at a seed and
    vocabulary where rows padded beside longer ones past its compressed attention's reach differ from their own
    forward, while a short row padded beside a long one agrees; 24 rows of 20 to 200 tokens. Its checkpoint, data,
    own bf16 forward, and run settings."""
    from zoo_models import zoo_model

    model = zoo_model("deepseek_v4", vocab_size=VOCAB)
    checkpoint = word_level_model(model, tmp_path / "dsv4")
    rng = np.random.default_rng(2)
    data = token_rows(tmp_path / "rows.jsonl", [int(n) for n in rng.integers(20, 200, 24)], seed=2)
    own = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    return own, dict(model=checkpoint, data=data, layers="1,2,4", token_budget=4096, max_length=2048,
                     dtype="bfloat16")


def test_the_start_up_check_pads_a_row_past_every_declared_span(tmp_path):
    """r27: the check's probes put a row past every declared span beside a longer one (the padding after it), and
    refuse DeepSeek-V4's padded batches at start: the run goes one row per forward and every row is its own
    forward's (before, the check padded only a row shorter than the reach and took padded batches)."""
    own, settings = deepseek_v4_past_its_reach(tmp_path)
    lines: list[str] = []
    run(RunConfig(out=str(tmp_path / "s.zarr"), **settings), progress=False, log=lines.append)
    packing_line = next(line for line in lines if line.startswith("  packing"))
    assert "one row per forward" in packing_line, packing_line
    assert worst_token(own, tmp_path / "s.zarr")[1] == 0


def test_a_padded_way_wrong_on_many_rows_is_not_taken_for_a_tie_in_bf16(tmp_path, monkeypatch):
    """r27 with probes that miss it (only the short row padded, as before the check padded a row past every span):
    the run takes padded batches; in bf16 the audit finds the padded way wrong (a tie is one token, not many), and
    the run ends with every row its own forward's; the control, the run's batches unaudited, keeps rows that
    differ."""
    from streamx.proof import check

    of = check.Probes.of.__func__

    def short_row_padded_only(cls, *args, **kwargs):
        probes = of(cls, *args, **kwargs)
        return dataclasses.replace(probes, together=[group for group in probes.together if 0 in group])

    monkeypatch.setattr(check.Probes, "of", classmethod(short_row_padded_only))
    own, settings = deepseek_v4_past_its_reach(tmp_path)
    run(RunConfig(out=str(tmp_path / "control.zarr"), audit_every=0, **settings), progress=False, log=lambda m: None)
    assert worst_token(own, tmp_path / "control.zarr")[1] > 1  # the padded way, unaudited: tokens far off
    summary = run(RunConfig(out=str(tmp_path / "s.zarr"), **settings), progress=False, log=lambda m: None)
    assert summary.audit.found and summary.audit.rung
    assert worst_token(own, tmp_path / "s.zarr")[1] == 0


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_rows_committed_wrong_before_the_audit_saw_them_are_written_over(peaked_model_dir, chat_jsonl, tmp_path,
                                                                        monkeypatch, storage):
    """A way wrong from the start whose first batches the audit did not look at (as when its budget leaves them):
    their rows are committed wrong, then written over once the way is found, their fp8 scales with them, so that
    every row ends within the storage's rounding of its own forward (the control, unaudited: far off)."""
    shift_positions_past_the_probes(monkeypatch)
    chosen, calls = audit.Audit.chosen, []

    def blind_at_first(self, batch, ways):
        calls.append(batch)
        return chosen(self, batch, ways) if len(calls) > 3 else {}

    monkeypatch.setattr(audit.Audit, "chosen", blind_at_first)
    lines: list[str] = []
    out = tmp_path / "s.zarr"
    run(small_config(peaked_model_dir, chat_jsonl, out, audit_every=1, audit_share=0, storage=storage),
        progress=False, log=lines.append)
    rewritten = [line for line in lines if line.startswith("audit: computing")]
    assert rewritten and int(rewritten[0].split()[2].replace(",", "")) >= 2, "\n".join(lines)
    # bf16: its rounding; fp8 e4m3: 3 mantissa bits; the wrong way moves states by 0.4-1
    assert worst_row(peaked_model_dir, out) < (0.01 if storage == "bf16" else 0.05)
    assert verify(str(out), use_model=False, log=lambda m: None).passed


def test_a_way_found_wrong_stays_in_the_record_through_a_resume_without_the_audit(peaked_model_dir, chat_jsonl,
                                                                                  tmp_path, monkeypatch):
    """An audit's finding is recorded in the store: a resume with --audit-every 0 continues on the rung the record
    names (never on the way found wrong), and the record and verify still say what was found."""
    shift_positions_past_the_probes(monkeypatch)
    out = tmp_path / "s.zarr"
    run(small_config(peaked_model_dir, chat_jsonl, out, max_samples=30, audit_share=0), progress=False,
        log=lambda m: None)
    first = open_store(str(out)).audit()
    assert first.found and first.rung
    summary = run(small_config(peaked_model_dir, chat_jsonl, out, audit_every=0), progress=False, log=lambda m: None)
    store = open_store(str(out))
    assert summary.samples > 0 and store.completeness().problems() == []
    assert store.audit().found == first.found and store.audit().rung == first.rung
    assert "found wrong: row" in check_audit(store).summary
    assert worst_row(peaked_model_dir, out) < 0.01  # the resume's rows too: computed on the rung, not the broken way
