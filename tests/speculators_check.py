"""Runs inside the isolated speculators==0.9.0 venv (see tests/test_convert.py); imports streamx only where a
folder trains through its backend, as `python -m streamx.speculators_backend` does.

For each `ALGO[:TAG]=DIR` argument, DIR being a `streamx convert` output: resolve the exact `speculators train`
argv that convert saved in DIR/streamx_meta.json with speculators' own config resolver (plus CPU-only
settings), build the draft the way `speculators train` does, load every row through speculators' own
train/val loaders with --on-missing raise, and run one forward and backward pass. Then rebuild the
verifier's logits the way speculators does (its verifier norm and lm_head over the loaded last slot)
and compare them with the verifier's real logits from a plain transformers forward of the same ids.
Prints one JSON document.
"""

import argparse
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import torch
from hs_connectors import HiddenStatesBackend
from speculators.model import SpeculatorModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
from speculators.train.config import TrainConfig
from speculators.train.dataloader import create_train_val_loaders
from transformers import AutoModelForCausalLM

VERSIONS = ("speculators", "torch", "transformers", "datasets")
# CPU-only settings on top of convert's flags: no flex attention, no fused loss, no worker processes
CPU_FLAGS = ["--draft-attn-impl", "eager", "--loss-implementation", "eager", "--num-workers", "0",
             "--total-seq-len", "512", "--max-anchors", "16"]


def train_step(argv: list[str], scratch: Path) -> tuple[dict, torch.nn.Module, list]:
    cfg = TrainConfig.resolve([*argv, *CPU_FLAGS, "--save-path", str(scratch / "ckpt"), "--log-dir", str(scratch)])
    args = argparse.Namespace(**cfg.flatten())
    set_seed(args.seed)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)  # reads token_freq.pt when --draft-vocab-size is set
    model_class = SpeculatorModel.registry[args.speculator_type]
    draft = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size)
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    train_loader, val_loader = create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len,
        hidden_states_dtype=getattr(torch, args.hidden_states_dtype), transfer=transfer,
        vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing, verifier_name_or_path=args.verifier_name_or_path,
        request_timeout=args.request_timeout, max_retries=args.max_retries,
        generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures,
        hidden_size=draft.config.transformer_layer_config.hidden_size, num_target_layers=len(draft.target_layer_ids),
        num_workers=args.num_workers, prefetch_factor=args.prefetch_factor,
        preprocess=shift_batch if args.speculator_type == "eagle3" else None,
        train_data_ratio=args.train_data_ratio, seed=args.seed)
    # every row, through the loaders the trainer uses (--on-missing raise: a missing hs file raises)
    batches = {"train": list(train_loader), "val": list(val_loader)}
    loaded = {split: sum(int((b["document_ids"] != -1).sum()) for b in bs) for split, bs in batches.items()}
    dropped = sum(b["error_records"] for bs in batches.values() for b in bs)  # e.g. token_ids != input_ids

    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    draft.train()
    # in float32, where speculators' Trainer autocasts to bf16: on a CPU without bf16 instructions that took 100 s
    # per EAGLE-3 step, and what is checked here is the data path and that gradients flow
    batch = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in batches["train"][0].items()}
    _, loss, _ = draft(**batch, **train_kwargs)
    loss.backward()
    grads = [p.grad for p in draft.parameters() if p.requires_grad and p.grad is not None]
    result = {
        "argv": argv,
        "hidden_states_backend": args.hidden_states_backend,
        "target_layer_ids": list(draft.target_layer_ids),
        "draft_vocab_size": int(draft.draft_vocab_size),
        "draft_vocab_has_every_trained_token": draft_vocab_covers(draft, Path(args.data_path) / "token_freq.pt"),
        "aux_features": int(batches["train"][0]["hidden_states"].shape[-1]),
        "rows": {"train": len(train_loader.dataset), "val": len(val_loader.dataset)},
        "val_start": val_loader.dataset.start_file_idx,
        "tokens_loaded": loaded,
        "dropped_rows": int(dropped),
        "loss": float(loss.detach()),
        "grads": len(grads),
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
        "grad_norm": math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads)),
    }
    return result, draft, [train_loader.dataset, val_loader.dataset]


def draft_vocab_covers(draft: torch.nn.Module, token_freq: Path) -> bool | None:
    """With fewer distinct trained tokens than --draft-vocab-size, speculators keeps all of token_freq.pt's."""
    if not draft.use_draft_vocab:
        return None
    kept = set(torch.nonzero(draft.t2d).flatten().tolist())
    return set(torch.load(token_freq, weights_only=True)) <= kept


class Verifier:
    """The verifier's real logits and final pre-norm state of a row, from a plain transformers forward; each
    distinct row once, whichever run (store, algorithm, backend) loads it."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pre_norm, self.done = [], {}
        self.model.model.norm.register_forward_hook(lambda mod, args, out: self.pre_norm.append(args[0][0]))

    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(input_ids.tolist())
        if key not in self.done:
            self.done[key] = self.model(input_ids=input_ids[None]).logits[0], self.pre_norm.pop()
        return self.done[key]


VERIFIERS: dict[str, Verifier] = {}


@torch.no_grad()
def target_check(draft: torch.nn.Module, datasets: list, verifier: str) -> dict:
    """speculators' targets = verifier_lm_head(verifier_norm(last slot)) vs the verifier's own logits."""
    if verifier not in VERIFIERS:
        VERIFIERS[verifier] = Verifier(verifier)
    forward = VERIFIERS[verifier]
    norm, head = draft.verifier_norm.float(), draft.verifier_lm_head.float()
    worst, scale, agree, total, twice, slot = 0.0, 0.0, 0, 0, 0.0, 0.0
    for ds in datasets:
        for i in range(len(ds)):
            item = ds[i]
            last = item["verifier_last_hidden_states"].float()
            targets = head(norm(last))
            real, pre_norm = forward(item["input_ids"])
            if draft.use_draft_vocab:  # a reduced draft vocabulary: speculators' targets are those columns
                real = real[:, draft.t2d.bool()]
            worst = max(worst, float((targets - real).abs().max()))
            scale = max(scale, float(real.abs().max()))
            agree += int((targets.argmax(-1) == real.argmax(-1)).sum())
            total += real.shape[0]
            # the loaded last slot is the verifier's final hidden state before its norm, in bf16
            slot = max(slot, float((last - pre_norm).abs().max() / last.abs().max()))
            # negative control: a post-norm last slot would get the norm twice
            twice = max(twice, float((head(norm(norm(last))) - real).abs().max()))
    return {"rows": sum(len(ds) for ds in datasets), "tokens": total, "max_abs_diff": worst, "logit_scale": scale,
            "argmax_agreement": agree / total, "last_slot_vs_pre_norm_rel": slot,
            "double_norm_max_abs_diff": twice}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="ALGO[:TAG]=DIR: a streamx convert output to train ALGO on")
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--extra", action="append", default=[], help="ALGO=FLAG,VALUE,... added to ALGO's argv")
    opts = parser.parse_args()
    extra = {}
    for item in opts.extra:
        algo, flags = item.split("=", 1)
        extra[algo] = flags.split(",")
    torch.manual_seed(0)
    out = {"versions": {name: importlib.metadata.version(name) for name in VERSIONS}}
    for run in opts.runs:
        name, data = run.split("=", 1)
        algo = name.split(":")[0]
        meta = json.loads((Path(data) / "streamx_meta.json").read_text())
        argv = meta["speculators_train_argv"][algo]
        if argv[:3] == ["python", "-m", "streamx.speculators_backend"]:
            import streamx.speculators_backend  # noqa: F401 - what that wrapper does before speculators resolves
        argv = argv[argv.index("--data-path"):]  # drop the launcher: `speculators train` or the wrapper
        result, draft, datasets = train_step([*argv, *extra.get(algo, [])], Path(opts.scratch) / name.replace(":", "-"))
        verifier = argv[argv.index("--verifier-name-or-path") + 1]
        result["targets"] = target_check(draft, datasets, verifier)
        out[name] = result
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
