"""Fanned-out rows (one row per assistant turn, with the whole history before it) of real multi-turn chatterbot
conversations: on Qwen3's template a row is never its previous row's token prefix (the empty think block is
rendered before the last turn only), under ChatML it always is; --train-turns last trains each row's last turn
only. References come from the chat template itself, not from the code under test."""
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_tokenize
import torch
from helpers import small_config
from test_tokenize import EMPTY_THINK, QWEN_DIR
from transformers import AutoTokenizer, Qwen3Config

from streamx.config import RunConfig
from streamx.data.fanout import FanOut
from streamx.data.source import Row, open_source
from streamx.data.tokenize import Reject, SampleBuilder, _vocabulary
from streamx.pipeline.estimate import Forecast, estimate
from streamx.pipeline.runner import run
from streamx.store import open_store

qwen, chatml = test_tokenize.qwen, test_tokenize.chatml  # its fixtures: Qwen3, and Qwen3 under SmolLM2's ChatML


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    """The first 12 chatterbot conversations with 2 assistant turns or more (real multi-turn chats)."""
    chats = [r.record["messages"] for r in open_source("chatterbot:english") if r.record]
    return [m for m in chats if sum(x["role"] == "assistant" for x in m) >= 2][:12]


def fanned_out(conversations: list[list[dict]]) -> list[Row]:
    """Row k of a conversation: its messages up to and including its k-th assistant turn."""
    messages = [chat[: k + 1] for chat in conversations for k, m in enumerate(chat) if m["role"] == "assistant"]
    return [Row(i, {"messages": m}) for i, m in enumerate(messages)]


def detected(tokenizer, rows: list[Row], **kwargs) -> FanOut:
    builder = SampleBuilder(tokenizer, 4096)
    builder.fanout = FanOut(tokenizer, **kwargs)
    assert not any(isinstance(builder(row), Reject) for row in rows)
    return builder.fanout


def prompt_tokens(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens the template renders before the last message, with the assistant header that opens it."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_on_qwen3_fanned_out_rows_extend_the_messages_not_the_tokens(qwen, conversations):
    rows = fanned_out(conversations)
    fanout = detected(qwen, rows)
    assert (fanout.rows, fanout.extending, fanout.token_prefixes) == (len(rows), len(rows) - len(conversations), 0)
    e = fanout.example
    assert (e.row, e.earlier) == (1, 0)  # the first conversation's second turn against its first
    # they part right after the assistant header of the earlier row's last turn: there the earlier row has the
    # empty think block, this row the answer itself
    assert e.position == len(prompt_tokens(qwen, rows[0].record["messages"]))
    assert e.earlier_snippet.startswith(EMPTY_THINK) and "<think>" not in e.snippet
    assert e.snippet.startswith(rows[0].record["messages"][-1]["content"][:10])
    note = fanout.note()
    assert note.startswith(f"{len(rows) - len(conversations):,} of {len(rows):,} rows extend an earlier row's")
    assert repr(e.earlier_snippet) in note and "--train-turns last trains each turn once" in note
    assert "each turn is trained once (--train-turns last)" in fanout.note("last")


@pytest.mark.parametrize("template", [pytest.param("smollm2", marks=pytest.mark.integration), "chatml"])
def test_under_chatml_each_fanned_out_row_is_the_next_ones_token_prefix(request, conversations, template):
    """The embedded SmolLM2's own tokenizer, and Qwen3's vocabulary under SmolLM2's ChatML template."""
    tokenizer = request.getfixturevalue("smollm2_tokenizer" if template == "smollm2" else "chatml")
    rows = fanned_out(conversations)
    fanout = detected(tokenizer, rows)
    assert fanout.extending == fanout.token_prefixes == len(rows) - len(conversations)
    assert fanout.example is None and fanout.note() is None


def test_a_repeated_row_extends_nothing_and_threads_count_as_one(qwen, conversations):
    rows = fanned_out(conversations)
    assert detected(qwen, [rows[0], Row(1, rows[0].record)]).extending == 0  # the same messages: a duplicate
    builder = SampleBuilder(qwen, 4096)
    builder.fanout = FanOut(qwen)
    with ThreadPoolExecutor(4) as pool:  # each conversation's rows in order, the conversations at once
        list(pool.map(lambda chat: [builder(row) for row in fanned_out([chat])], conversations))
    assert (builder.fanout.rows, builder.fanout.extending) == (len(rows), len(rows) - len(conversations))


def test_the_rows_kept_are_bounded_by_their_tokens(qwen, conversations):
    """Two conversations interleaved: kept whole, each row finds its turn before; with room for one row only, the
    other conversation's row has pushed it out."""
    a, b = (fanned_out([chat])[:2] for chat in conversations[:2])
    interleaved = [Row(i, row.record) for i, row in enumerate([a[0], b[0], a[1], b[1]])]
    assert detected(qwen, interleaved).extending == 2
    assert detected(qwen, interleaved, max_tokens=1).extending == 0


@pytest.mark.parametrize("template", ["qwen", "chatml"])
def test_last_trains_only_the_last_turn(request, conversations, template):
    """The mask of "last" is the mask of "all" from the last turn's prompt on (its length from the template),
    zero before; a row's first turn alone is trained the same either way."""
    tokenizer = request.getfixturevalue(template)
    every, last = SampleBuilder(tokenizer, 4096), SampleBuilder(tokenizer, 4096, train_turns="last")
    fewer = 0
    for row in fanned_out(conversations):
        full, only = every(row), last(row)
        prompt = prompt_tokens(tokenizer, row.record["messages"])
        assert torch.equal(full.input_ids, only.input_ids) and full.input_ids[: len(prompt)].tolist() == prompt
        want = full.loss_mask.clone()
        want[: len(prompt)] = 0
        assert torch.equal(only.loss_mask, want) and want.sum() > 0
        fewer += int(full.loss_mask.sum() > want.sum())
    assert fewer == len(fanned_out(conversations)) - len(conversations)  # every row past a conversation's first


def test_last_leaves_text_and_pre_tokenized_rows_alone(qwen):
    rows = [Row(0, {"text": "Hello there, plain text."}), Row(2, {"input_ids": [5, 6, 7]}),
            Row(1, {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 0, 1]})]
    every, last = SampleBuilder(qwen, 64), SampleBuilder(qwen, 64, train_turns="last")
    for row in rows:
        a, b = every(row), last(row)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


def fingerprint_before_train_turns(tokenizer, max_length: int, truncation: str) -> str:
    """tokenizer_fingerprint as streamx computed it before --train-turns: what existing stores hold."""
    h = hashlib.sha256()
    for part in (*_vocabulary(tokenizer), json.dumps(tokenizer.chat_template, sort_keys=True),
                 json.dumps(tokenizer.special_tokens_map, sort_keys=True), str(max_length), truncation):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def test_the_fingerprint_changes_with_last_and_stays_with_all(qwen):
    before = fingerprint_before_train_turns(qwen, 2048, "truncate")
    assert SampleBuilder(qwen, 2048).fingerprint == SampleBuilder(qwen, 2048, train_turns="all").fingerprint == before
    assert SampleBuilder(qwen, 2048, train_turns="last").fingerprint != before
    with pytest.raises(ValueError, match="train_turns must be 'all' or 'last'"):
        SampleBuilder(qwen, 2048, train_turns="first")
    with pytest.raises(ValueError, match="train_turns must be one of all, last"):
        RunConfig(train_turns="first")


def test_a_run_stores_the_last_turns_masks_and_refuses_a_resume_with_all(tiny_chat_model_dir, conversations,
                                                                          tmp_path):
    """Fanned-out ChatML rows run with last, in two goes: each stored mask is the last turn's (the reference above),
    rows are stored inside the rows that extend them, and a resume with all is refused."""
    rows = fanned_out(conversations)
    data = tmp_path / "fanned.jsonl"
    data.write_text("".join(json.dumps(row.record) + "\n" for row in rows))
    out = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, str(data), out, train_turns="last", max_samples=10), progress=False)
    more = run(small_config(tiny_chat_model_dir, str(data), out, train_turns="last"), progress=False)
    store, tokenizer = open_store(str(out)), AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    every = SampleBuilder(tokenizer, 256)  # (small_config's max_length)
    assert more.resumed_rows == 10 and len(store) == len(rows) and store.num_tokens < store.row_tokens
    for row in rows:
        stored, full = store.sample(row.row_id), every(row)
        want = full.loss_mask.clone()
        want[: len(prompt_tokens(tokenizer, row.record["messages"]))] = 0
        assert torch.equal(stored.input_ids, full.input_ids) and torch.equal(stored.loss_mask, want)
    with pytest.raises(RuntimeError, match="incompatible run.*train_turns: store has 'last', this run 'all'"):
        run(small_config(tiny_chat_model_dir, str(data), out), progress=False)


@pytest.fixture(scope="module")
def qwen_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen3 config (no weights: the plan reads none) with the real Qwen3 tokenizer."""
    path = tmp_path_factory.mktemp("qwen3-tiny")
    Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(path)
    AutoTokenizer.from_pretrained(QWEN_DIR).save_pretrained(path)
    return str(path)


def test_the_plan_says_so_from_every_row_and_from_runs_of_rows(qwen_model_dir, conversations, tmp_path):
    rows = fanned_out(conversations)
    data = tmp_path / "fanned.jsonl"
    data.write_text("".join(json.dumps(row.record) + "\n" for row in rows))
    cfg = RunConfig(model=qwen_model_dir, data=str(data), out=str(tmp_path / "s.zarr"), layers="eagle3")
    exact = Forecast(estimate(cfg), cfg, None, "given").lines()
    diverging = len(rows) - len(conversations)
    assert any(line.startswith(f"fan-out      {diverging:,} of {len(rows):,} rows extend") for line in exact)
    sampled = Forecast(estimate(cfg, sample_rows=len(rows) // 2), cfg, None, "given").lines()
    assert any(line.startswith("fan-out      in ") and "runs of consecutive rows" in line for line in sampled)
    last = estimate(cfg.replace(train_turns="last"))
    assert "each turn is trained once" in last.fanout and last.trainable_tokens < estimate(cfg).trainable_tokens


def test_the_run_and_inspect_say_so(qwen_model_dir, conversations, tmp_path):
    """A run over fanned-out rows on Qwen3's template says in its summary that they extend earlier rows' messages
    but not their tokens (with the count from the data, not from the detector), and the store records it for
    `inspect`, also after a resume that tokenizes fewer rows."""
    rows = fanned_out(conversations)
    data = tmp_path / "fanned.jsonl"
    data.write_text("".join(json.dumps(row.record) + "\n" for row in rows))
    out = tmp_path / "s.zarr"
    settings = dict(layers="1,8", random_weights=True, dtype="float32")
    first = run(small_config(qwen_model_dir, str(data), out, max_samples=len(rows) // 2, **settings), progress=False)
    run(small_config(qwen_model_dir, str(data), out, **settings), progress=False)
    half = rows[: len(rows) // 2]
    diverging = sum(1 for a, b in zip(half, half[1:], strict=False)
                    if b.record["messages"][: len(a.record["messages"])] == a.record["messages"])
    assert diverging > 0
    expected = f"fan-out: {diverging:,} of {len(half):,} rows extend an earlier row's messages but not its tokens"
    assert any(line.startswith(expected) for line in first.lines())
    described = [line for line in open_store(str(out)).describe() if line.startswith("fan-out      ")]
    assert len(described) == 1 and "--train-turns last" in described[0]
