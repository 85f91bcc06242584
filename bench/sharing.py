"""How many of the tokens `streamx run` computes are distinct: the target of shared-prefix computation (issue 32).

The rows are tokenized as the run tokenizes them (its SampleBuilder: chat template, --max-length, truncation).
A token trie over all rows holds each distinct prefix once; its size is the least any prefix sharing can
compute and store. It is measured exactly by sorting the rows' token ids and summing the longest common
prefix of neighbours: trie tokens = row tokens - sum of neighbours' common prefixes. Alongside, what each
kind of sharing alone would save:

  duplicates      rows whose ids equal an earlier row's
  prefix rows     rows whose ids are a proper prefix of another row's (fanned-out turns, agent steps)
  shared leading  beyond those, a common leading prefix of at least M tokens with another row, computed once
                  (system prompts, tool schemas, a shared history), for each M of --min-shared

    python bench/sharing.py                                   # the embedded default
    python bench/sharing.py --data chats.jsonl --fan-out      # one row per assistant turn, as speculators writes
    python bench/sharing.py --system-prompt-words 200        # every row behind one long system prompt
    python bench/sharing.py ... --write-rows rows.jsonl      # and write those rows, for `streamx bench --data`

Beside the trie, what `streamx run --sharing on` computes and stores of the same rows: the sharing it finds
within each sorting window (--sort-window), trees cut to --token-budget (a cut tree recomputes the segments
its pieces start with), with and without common leading runs (packed models that continue a prefix's state,
and the others).

With --flops, each share is also weighed by what its tokens cost the model: a token at position p costs
2 x (the decoder layers' weights) FLOPs plus 4 x heads x head_dim x (p + 1) in each attention layer (its
scores and its weighted values over p + 1 keys). A token left to compute sits after the tokens it shares, so
it costs more than the average row token: the FLOP share is the floor no exact computation goes under, and
what time follows where attention is a large part of a token's cost (a small model, long rows).

Prints one JSON document (--json FILE also writes it).
"""

import argparse
import json
from pathlib import Path

import torch

from streamx.data.sharing import pieces, share
from streamx.data.source import Row, open_source
from streamx.data.tokenize import Reject, SampleBuilder
from streamx.model.load import model_tokenizer, resolve_model_path


def fanned_out(rows: list[Row]) -> list[Row]:
    """One row per assistant turn, each holding the conversation up to and including that turn."""
    out = []
    for row in rows:
        messages = (row.record or {}).get("messages") or []
        for k, message in enumerate(messages):
            if message.get("role") == "assistant":
                out.append(Row(len(out), {"messages": messages[: k + 1]}))
    return out


def with_system_prompt(rows: list[Row], words: int) -> list[Row]:
    """Every row with the same long system prompt first (a tool schema, a policy)."""
    prompt = " ".join(f"rule{i % 97}" for i in range(words))
    return [Row(row.row_id, {"messages": [{"role": "system", "content": prompt},
                                          *(m for m in (row.record or {}).get("messages", [])
                                            if m["role"] != "system")]})
            for row in rows]


def common_prefix(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def measure(token_rows: list[tuple], min_shared: list[int]) -> dict:
    total = sum(map(len, token_rows))
    seen, duplicates = set(), 0
    for ids in token_rows:
        duplicates += len(ids) if ids in seen else 0
        seen.add(ids)
    distinct = sorted(seen)
    # a distinct row is a proper prefix of another exactly when its sorted successor starts with it
    is_prefix = [len(b) > len(a) and b[: len(a)] == a for a, b in zip(distinct, distinct[1:], strict=False)]
    prefix_rows = sum(len(a) for a, p in zip(distinct, is_prefix, strict=False) if p)
    leaves = [a for a, p in zip(distinct, [*is_prefix, False][: len(distinct)], strict=True) if not p]  # sorted still
    lcp = [common_prefix(a, b) for a, b in zip(leaves, leaves[1:], strict=False)]
    leaf_tokens = sum(map(len, leaves))
    trie = leaf_tokens - sum(lcp)  # duplicates and prefix rows add no node to the trie
    leading = {}
    for m in min_shared:  # beyond duplicates and prefix rows, each common leading run of >= m tokens computed once
        computed = leaf_tokens - sum(k for k in lcp if k >= m)
        leading[str(m)] = {"computed_tokens": computed, "share": computed / total}
    return {"rows": len(token_rows), "row_tokens": total, "trie_tokens": trie, "trie_share": trie / total,
            "duplicate_tokens": duplicates, "after_duplicates_share": (total - duplicates) / total,
            "prefix_row_tokens": prefix_rows,
            "after_duplicates_and_prefix_rows_share": leaf_tokens / total,
            "shared_leading_prefix": leading}


def streamx_computes(samples: list, sort_window: int, token_budget: int, min_shared: int | None) -> list[range]:
    """The positions of the tokens `streamx run --sharing on` computes and stores (streamx.data.sharing), one
    range a segment, window by window."""
    windows: dict[int, list] = {}
    for sample in samples:
        windows.setdefault(sample.row_id // sort_window, []).append(sample)
    return [range(segment.depth, segment.end) for rows in windows.values()
            for piece in pieces(share(rows, min_shared), token_budget) for segment in piece.segments]


def token_flops(model: str) -> tuple[float, float]:
    """(FLOPs of a token through the decoder layers' weights, FLOPs it adds per key it attends to), from the
    model's config (weights counted on the meta device: nothing loaded). A mixture of experts counts every
    expert's weights: an upper bound."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", config)
    with torch.device("meta"):
        decoder = AutoModelForCausalLM.from_config(config)
    layers = next(m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList))
    weights = sum(p.numel() for p in layers.parameters())
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_key = 4 * text.num_attention_heads * head_dim * sum(kind == "full_attention" for kind in kinds)
    return 2.0 * weights, float(per_key)


def flops(spans: list[range], weights: float, per_key: float) -> float:
    """What computing the tokens at these positions costs: a token at p attends to p + 1 keys."""
    return sum(len(r) * weights + per_key * (r.start + r.stop + 1) * len(r) / 2 for r in spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default="chatterbot:english")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--fan-out", action="store_true", help="one row per assistant turn")
    parser.add_argument("--system-prompt-words", type=int, default=0, help="give every row this long a system prompt")
    parser.add_argument("--min-shared", default="8,16,32,64,128", help="shared leading prefix lengths to measure")
    parser.add_argument("--sort-window", type=int, default=1024)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--min-shared-tokens", type=int, default=16)
    parser.add_argument("--flops", action="store_true", help="also weigh each share by its tokens' FLOPs")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--write-rows", type=Path, default=None, help="also write the rows measured (fanned out, "
                        "behind the system prompt) as jsonl, for `streamx bench --data`")
    args = parser.parse_args()
    rows = list(open_source(args.data, max_samples=args.max_samples))
    if args.fan_out:
        rows = fanned_out(rows)
    if args.system_prompt_words:
        rows = with_system_prompt(rows, args.system_prompt_words)
    if args.write_rows:
        args.write_rows.write_text("".join(json.dumps(row.record) + "\n" for row in rows if row.record is not None))
    builder = SampleBuilder(model_tokenizer(resolve_model_path(args.model)), args.max_length)
    samples = [s for s in map(builder, rows) if not isinstance(s, Reject)]
    report = {"data": args.data, "fan_out": args.fan_out, "system_prompt_words": args.system_prompt_words,
              "samples": len(samples),
              **measure([tuple(s.input_ids.tolist()) for s in samples], [int(m) for m in args.min_shared.split(",")])}
    total = report["row_tokens"]
    cost = token_flops(resolve_model_path(args.model)) if args.flops else None
    if cost:
        report["row_flops"] = flops([range(len(s.input_ids)) for s in samples], *cost)
    for name, min_shared in (("streamx_leading_runs", args.min_shared_tokens), ("streamx_prefix_rows", None)):
        spans = streamx_computes(samples, args.sort_window, args.token_budget, min_shared)
        computed = sum(map(len, spans))
        report[name] = {"computed_tokens": computed, "share": computed / total,
                        "vs_trie": computed / report["trie_tokens"]}
        if cost:
            report[name]["flop_share"] = flops(spans, *cost) / report["row_flops"]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
