"""Write long multi-turn chats built from the real chatterbot-corpus conversations.

The corpus is short Q/A (~60 tokens per chat); long-sequence behaviour (bucketing, padding,
the forward pass near its arithmetic peak) needs longer rows. Consecutive conversations are
joined, in corpus order, until a chat reaches its target number of characters: the same
target for every chat (--chars, near-uniform lengths), or with --min-chars a target drawn for
each chat log-uniformly between --min-chars and --chars (seeded), so that lengths spread
widely, as real chats' do (200 to 8,000 characters is about 50 to 2,000 tokens).

    python bench/long_chats.py --out long_chats.jsonl --rows 200 --chars 3200
    python bench/long_chats.py --out spread_chats.jsonl --rows 200 --min-chars 200 --chars 8000
"""

import argparse
import json
import math
import random

from streamx.data.source import open_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--chars", type=int, default=3200, help="target characters per chat (~4 per token)")
    parser.add_argument("--min-chars", type=int, default=None, help="spread: each chat's target drawn "
                        "log-uniformly in [--min-chars, --chars]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    convs = [row.record["messages"] for row in open_source("chatterbot:english") if row.record]
    written, i = 0, 0
    with open(args.out, "w") as f:
        while written < args.rows:
            target = args.chars if args.min_chars is None else \
                math.exp(rng.uniform(math.log(args.min_chars), math.log(args.chars)))
            messages: list[dict] = []
            while sum(len(m["content"]) for m in messages) < target:
                messages += convs[i % len(convs)]
                i += 1
            f.write(json.dumps({"messages": messages}) + "\n")
            written += 1
    print(f"wrote {written} chats to {args.out}")


if __name__ == "__main__":
    main()
