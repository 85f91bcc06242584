"""Write long multi-turn chats (~800 tokens) built from the real chatterbot-corpus conversations.

The corpus is short Q/A (~60 tokens per chat); long-sequence behaviour (bucketing, padding,
the forward pass near its arithmetic peak) needs longer rows. Consecutive conversations are
joined, in corpus order, until a chat reaches the target number of characters.

    python bench/long_chats.py --out long_chats.jsonl --rows 200 --chars 3200
"""

import argparse
import json

from streamx.source import open_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--chars", type=int, default=3200, help="target characters per chat (~4 per token)")
    args = parser.parse_args()
    convs = [row.record["messages"] for row in open_source("chatterbot:english") if row.record]
    written, i = 0, 0
    with open(args.out, "w") as f:
        while written < args.rows:
            messages: list[dict] = []
            while sum(len(m["content"]) for m in messages) < args.chars:
                messages += convs[i % len(convs)]
                i += 1
            f.write(json.dumps({"messages": messages}) + "\n")
            written += 1
    print(f"wrote {written} chats to {args.out}")


if __name__ == "__main__":
    main()
