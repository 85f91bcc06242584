"""open_source on the real chatterbot corpus and on files written here with json/datasets."""
import json
import tracemalloc
from importlib.util import find_spec
from pathlib import Path

import datasets
import pytest
import yaml

from streamx.data.source import Row, open_source

CORPUS = Path(next(iter(find_spec("chatterbot_corpus").submodule_search_locations))) / "data"

RECORDS = [
    {"messages": [{"role": "user", "content": "What is AI?"}, {"role": "assistant", "content": "A field."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": "ünïcode ✓"}, {"role": "assistant", "content": "日本語"}]},
]


def corpus_conversations(language):
    """Every `conversations` entry of the language's YAML files, in file-name order."""
    out = []
    for f in sorted((CORPUS / language).glob("*.yml")):
        out += [(f.name, c) for c in yaml.safe_load(f.read_text(encoding="utf-8"))["conversations"]]
    return out


def test_chatterbot_english():
    src = open_source("chatterbot:english")
    rows = list(src)
    convs = [(f, c) for f, c in corpus_conversations("english") if not isinstance(c, list) or len(c) >= 2]
    # OFFLINE.md's 2,026 includes one trivia.yml entry that YAML folds into a single string
    assert len(convs) == 2026 and src.num_rows == 2026 and len(rows) == 2026
    assert [r.row_id for r in rows] == list(range(2026))
    bad = [(r, f) for r, (f, c) in zip(rows, convs, strict=True) if not isinstance(c, list)]
    assert len(bad) == 1 and bad[0][1] == "trivia.yml"
    assert bad[0][0].record is None and bad[0][0].error[0] == "unrecognised_row" and "trivia.yml" in bad[0][0].error[1]
    assert rows[0].record == {"messages": [
        {"role": "user", "content": "What is AI?"},
        {"role": "assistant", "content": "Artificial Intelligence is the branch of engineering and science "
                                         "devoted to constructing machines that think."}]}
    for row, (_, conv) in zip(rows, convs, strict=True):
        if row.error is None:
            assert [m["content"] for m in row.record["messages"]] == conv
            assert [m["role"] for m in row.record["messages"]] == ["user", "assistant"] * (len(conv) // 2) + \
                ["user"] * (len(conv) % 2)
    assert max(len(r.record["messages"]) for r in rows if r.record) == 26  # multi-turn conversations are kept
    assert [r.record for r in src] == [r.record for r in rows]  # re-iterable, same ids and order


def test_chatterbot_drops_single_utterances_and_flags_non_lists():
    convs = corpus_conversations("ukrainian")  # has both kinds of YAML slip
    kept = [c for _, c in convs if not isinstance(c, list) or len(c) >= 2]
    assert (len(convs), len(kept)) == (465, 463)
    rows = list(open_source("chatterbot:ukrainian"))
    assert [r.row_id for r in rows] == list(range(463))
    assert [r.error is not None for r in rows] == [not isinstance(c, list) for c in kept]
    contents = [[m["content"] for m in r.record["messages"]] for r in rows if r.record]
    assert contents == [c for c in kept if isinstance(c, list)]
    with pytest.raises(ValueError, match="no language 'klingon'.*english"):
        open_source("chatterbot:klingon")


def test_max_samples():
    src = open_source("chatterbot:english", max_samples=5)
    assert src.num_rows == 5 and [r.row_id for r in src] == [0, 1, 2, 3, 4]
    assert open_source("chatterbot:english", max_samples=10**6).num_rows == 2026
    assert list(open_source("chatterbot:english", max_samples=0)) == []
    with pytest.raises(ValueError, match="max_samples"):
        open_source("chatterbot:english", max_samples=-1)


def test_jsonl_malformed_line_keeps_ids(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(RECORDS[0]), '{"messages": [', "", json.dumps(RECORDS[1]), "[1, 2]",
             json.dumps(RECORDS[2], ensure_ascii=False), "  "]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows = list(open_source(str(path)))
    assert [r.row_id for r in rows] == [0, 1, 2, 3, 4]  # blank lines are not rows
    assert rows[0] == Row(0, RECORDS[0]) and rows[2] == Row(2, RECORDS[1]) and rows[4] == Row(4, RECORDS[2])
    assert rows[1].record is None and rows[1].error[0] == "malformed_json" and rows[1].error[1].startswith("line 2:")
    assert rows[3] == Row(3, None, ("unrecognised_row", "expected a JSON object, got list"))
    assert open_source(str(path)).num_rows == 5
    src = open_source(str(path), max_samples=2)
    assert src.num_rows == 2 and [r.row_id for r in src] == [0, 1]


def test_max_samples_stops_counting_a_jsonl_there(tmp_path, monkeypatch):
    """--max-samples N: the row count reads N rows of a jsonl, not the whole file (a run's banner and bench's
    rounds ask for it)."""
    import streamx.data.source as source

    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5000)))
    read = []
    real_open = open

    def counting_open(file, mode="r", *args, **kw):
        handle = real_open(file, mode, *args, **kw)
        if str(file) == str(path):
            lines = iter(handle)

            class Counted:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    handle.close()

                def __iter__(self):
                    for line in lines:
                        read.append(1)
                        yield line
            return Counted()
        return handle

    monkeypatch.setattr(source, "open", counting_open, raising=False)
    assert source.open_source(str(path), max_samples=10).num_rows == 10 and len(read) == 10
    read.clear()
    assert source.open_source(str(path)).num_rows == 5000 and len(read) == 5000
    assert source.open_source(str(path), max_samples=10**6).num_rows == 5000


def test_jsonl_streams_in_constant_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    rec = {"messages": [{"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "a" * 100}]}
    path.write_text((json.dumps(rec) + "\n") * 20_000)  # 5 MB of text; as dicts far more
    src = open_source(str(path))
    tracemalloc.start()
    n = sum(1 for r in src if r.record == rec)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 20_000 and peak < 1_000_000


def test_json_array_and_json_lines(tmp_path):
    arr, lines = tmp_path / "a.json", tmp_path / "l.json"
    arr.write_text(json.dumps(RECORDS + ["oops"], indent=2))
    lines.write_text("\n".join(json.dumps(r) for r in RECORDS))
    rows = list(open_source(str(arr)))
    assert [r.record for r in rows[:3]] == RECORDS and rows[3].error[0] == "unrecognised_row"
    assert open_source(str(arr)).num_rows == 4
    assert [r.record for r in open_source(str(lines))] == RECORDS


def test_parquet_arrow_and_save_to_disk_round_trip(tmp_path):
    ds = datasets.Dataset.from_list(RECORDS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    ds.with_format("torch").save_to_disk(str(tmp_path / "torch_fmt"))  # a saved format must not leak through
    datasets.DatasetDict({"train": ds, "test": ds.select([2])}).save_to_disk(str(tmp_path / "dict"))
    for data in (tmp_path / "d.parquet", arrow, tmp_path / "saved", tmp_path / "torch_fmt", tmp_path / "dict"):
        src = open_source(str(data))
        assert src.num_rows == 3, data
        assert list(src) == [Row(i, r) for i, r in enumerate(RECORDS)], data
    assert list(open_source(str(tmp_path / "dict"), split="test")) == [Row(0, RECORDS[2])]
    with pytest.raises(ValueError, match="no split 'validation'"):
        open_source(str(tmp_path / "dict"), split="validation")


def test_pretokenized_columns_come_back_as_lists(tmp_path):
    recs = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [7], "loss_mask": [1]}]
    datasets.Dataset.from_list(recs).with_format("torch").save_to_disk(str(tmp_path / "tok"))
    assert [r.record for r in open_source(str(tmp_path / "tok"))] == recs


def test_missing_and_unsupported_paths(tmp_path):
    for missing in (str(tmp_path / "nope.jsonl"), "./nope.parquet", "data.json", "a/b/c", "~/nope"):
        with pytest.raises(FileNotFoundError, match="no such file"):
            open_source(missing)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file"):
        open_source(str(tmp_path / "x.csv"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets.save_to_disk"):
        open_source(str(tmp_path / "plain_dir"))


def test_hub_names_stream_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split, streaming):
        calls.append((name, split, streaming))
        return [{"text": "a"}, {"text": "b"}, "c"]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = open_source("org/chat-set", split="train_sft", max_samples=2)
    assert calls == [("org/chat-set", "train_sft", True)]
    assert src.num_rows is None  # unknown without split info
    assert list(src) == [Row(0, {"text": "a"}), Row(1, {"text": "b"})]
    assert list(open_source("imdb"))[2] == Row(2, None, ("unrecognised_row", "expected a JSON object, got str"))


def test_rows_at_equals_the_rows_of_a_full_pass_in_every_format(tmp_path, monkeypatch):
    """rows_at (the sample `streamx plan` and the free-space check tokenize) gives exactly the rows a full
    pass gives for those ids, in every format; on jsonl it parses only those lines."""
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(40)]
    lines = [json.dumps(r) for r in records]
    lines[7], lines[20] = '{"messages": [', ""  # a malformed row keeps its id; a blank line is no row
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "a.json").write_text(json.dumps(records))
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    ids = [0, 3, 7, 19, 20, 38]
    for data in ("d.jsonl", "a.json", "d.parquet", "saved", arrow, "chatterbot:english"):
        data = str(tmp_path / data) if not str(data).startswith(("chatterbot", "/")) else str(data)
        for max_samples in (None, 20):
            src = open_source(data, max_samples=max_samples)
            want = [row for row in src if row.row_id in ids]
            assert list(src.rows_at(ids)) == want and len(want) == (4 if max_samples else 6), (data, max_samples)

    parsed = []
    monkeypatch.setattr("streamx.data.source.json.loads", lambda line: parsed.append(line) or json.JSONDecoder().decode(
        line.decode()))
    assert [r.row_id for r in open_source(str(tmp_path / "d.jsonl")).rows_at([3, 19])] == [3, 19]
    assert len(parsed) == 2


# ---- the rows' digests: what a resume compares (data.provenance.RowDigests) ----

def numbered_rows(n: int) -> list[dict]:
    """Rows of one message each whose content has the same number of characters whatever the row."""
    return [{"messages": [{"role": "user", "content": f"question {i:05d}"}]} for i in range(n)]


def same_size_edit(rows: list[dict], row: int) -> list[dict]:
    """The rows with one row's content changed in a character: the file keeps its size."""
    edited = [dict(r) for r in rows]
    edited[row] = {"messages": [{"role": "user", "content": rows[row]["messages"][0]["content"].replace("q", "Q")}]}
    return edited


def read_all(data: str, digests, skip=None, max_samples=None) -> list[int]:
    return [r.row_id for r in digests.held(open_source(data, max_samples=max_samples).rows(skip, digests))]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_same_size_edit_anywhere_stops_a_resume_at_its_window_before_any_of_its_rows(tmp_path, suffix):
    from streamx.data.provenance import DIGEST_ROWS, DataChanged, RowDigests

    def write(name, rows):
        path = tmp_path / (name + suffix)
        if suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            datasets.Dataset.from_list(rows).to_parquet(str(path))
        return str(path)

    rows = numbered_rows(3 * DIGEST_ROWS - 100)
    v1, v2 = write("v1", rows), write("v2", same_size_edit(rows, 2 * DIGEST_ROWS + 7))
    if suffix == ".jsonl":
        assert Path(v1).stat().st_size == Path(v2).stat().st_size
    first = RowDigests()
    assert read_all(v1, first) == list(range(len(rows)))
    recorded = first.of(range(len(rows)))  # what the parts would record, every row committed
    assert sorted(recorded) == ["0", "1024", "2048"] and recorded["2048"][0] == len(rows) - 2 * DIGEST_ROWS
    assert read_all(v1, RowDigests([recorded])) == list(range(len(rows)))  # the same data: no word
    seen, digests = [], RowDigests([recorded])
    with pytest.raises(DataChanged, match=f"rows {2 * DIGEST_ROWS:,} to {len(rows) - 1:,} differ"):
        for row in digests.held(open_source(v2).rows(None, digests)):
            seen.append(row.row_id)
    assert seen == list(range(2 * DIGEST_ROWS))  # every row before the changed window, none of it
    if suffix == ".jsonl":  # windows a resume skips unparsed are digested all the same
        with pytest.raises(DataChanged, match=f"rows {2 * DIGEST_ROWS:,}"):
            read_all(v2, RowDigests([recorded]), skip=lambda row_id: True)


def test_digests_compare_what_was_read_before_and_nothing_else(tmp_path):
    """A store made with --max-samples records its last window part read: a resume with more rows compares that
    part only; an edit past it, or in rows never committed, is the new data's to give."""
    from streamx.data.provenance import DIGEST_ROWS, DataChanged, RowDigests

    rows = numbered_rows(2 * DIGEST_ROWS)
    v1, limit = tmp_path / "v1.jsonl", DIGEST_ROWS + 300
    v1.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = RowDigests(limit=limit)
    assert read_all(str(v1), first, max_samples=limit) == list(range(limit))
    recorded = first.of([5, DIGEST_ROWS + 5])
    assert recorded == {"0": [DIGEST_ROWS, recorded["0"][1]], str(DIGEST_ROWS): [300, recorded[str(DIGEST_ROWS)][1]]}
    later = tmp_path / "later.jsonl"
    later.write_text("".join(json.dumps(r) + "\n" for r in same_size_edit(rows, limit + 10)))
    assert read_all(str(later), RowDigests([recorded])) == list(range(2 * DIGEST_ROWS))
    inside = tmp_path / "inside.jsonl"
    inside.write_text("".join(json.dumps(r) + "\n" for r in same_size_edit(rows, limit - 1)))
    with pytest.raises(DataChanged, match=f"rows {DIGEST_ROWS:,} to {limit - 1:,} differ"):
        read_all(str(inside), RowDigests([recorded]))
    # two parts' records of one window (a sorting window smaller than it: each rank committed its rows) both count
    with pytest.raises(DataChanged):
        read_all(str(inside), RowDigests([{"0": recorded["0"]}, {str(DIGEST_ROWS): recorded[str(DIGEST_ROWS)]}]))


def test_a_window_read_shorter_than_its_record_is_refused_not_taken_unread(tmp_path):
    """r25: a resume that reads fewer rows of a window than the store's record of it (a smaller --max-samples, or data
    that lost rows: a hub dataset whose last window shrank) cannot compare it, and would batch its rows unread: it
    is refused in one line, naming the --max-samples that compares it."""
    from streamx.data.provenance import DIGEST_ROWS, DataChanged, RowDigests

    rows = numbered_rows(DIGEST_ROWS + 50)
    v1 = tmp_path / "v1.jsonl"
    v1.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = RowDigests(limit=DIGEST_ROWS + 41)
    read_all(str(v1), first, max_samples=DIGEST_ROWS + 41)
    recorded = first.of([DIGEST_ROWS + 5])
    assert recorded[str(DIGEST_ROWS)][0] == 41
    edited = tmp_path / "edited.jsonl"  # an edit in the rows the smaller resume would not read
    edited.write_text("".join(json.dumps(r) + "\n" for r in same_size_edit(rows, DIGEST_ROWS + 35)))
    with pytest.raises(DataChanged, match=f"--max-samples {DIGEST_ROWS + 31:,} reads 31 of the 41 rows from row "
                                          f"{DIGEST_ROWS:,} .* run with --max-samples {DIGEST_ROWS + 41:,} or more"):
        read_all(str(edited), RowDigests([recorded], limit=DIGEST_ROWS + 31), max_samples=DIGEST_ROWS + 31)
    assert read_all(str(v1), RowDigests([recorded], limit=DIGEST_ROWS + 50),  # more rows than recorded: compared
                    max_samples=DIGEST_ROWS + 50) == list(range(DIGEST_ROWS + 50))
    shorter = tmp_path / "shorter.jsonl"  # the data lost its last rows
    shorter.write_text("".join(json.dumps(r) + "\n" for r in rows[: DIGEST_ROWS + 20]))
    with pytest.raises(DataChanged, match=f"it has 20 rows from row {DIGEST_ROWS:,} where it had 41"):
        read_all(str(shorter), RowDigests([recorded]))
