"""What several test modules share: small run settings (as a RunConfig and as `streamx run` flags), the
CLI (in this process, or in one of its own), a part's commit record, the bit-for-bit store comparison, a tiny
store written without a model, the independent reference (an unbatched HF forward), and a fault the start-up check
cannot see (broken_packed_batch)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import zarr
from torch import nn

from streamx.config import RunConfig, load_config
from streamx.data import batching
from streamx.data.tokenize import REJECT_REASONS
from streamx.pipeline.writer import PartWriter
from streamx.store import (
    Compat,
    OwnedPart,
    StoreMetadata,
    bf16_to_bits,
    make_layout,
    open_for_run,
    open_store,
    prepare,
)

# small shards and chunks, so that a few dozen chat rows span many shards and commits
SMALL_RUN = dict(layers="0,2,4", token_budget=512, max_length=256, sort_window=16, chunk_tokens=16, shard_tokens=64)


def small_config(model_dir, data, out, **settings) -> RunConfig:
    return load_config(None, **{**SMALL_RUN, "model": model_dir, "data": data, "out": str(out), **settings})


def run_args(model_dir, data, out, **settings) -> list[str]:
    """`streamx run` and its flags for the same settings as small_config."""
    values = {**SMALL_RUN, "model": model_dir, "data": data, "out": str(out), **settings}
    flags = [part for name, value in values.items() for part in
             ([("--" if value else "--no-") + name.replace("_", "-")] if isinstance(value, bool) else
              ["--" + name.replace("_", "-"), str(value)])]
    return ["run", *flags, "--no-progress"]


def copy_store(src, dst, parts):
    """A store with src's metadata whose samples are `parts`: lists of (row_id, input_ids, loss_mask, hidden)."""
    meta = open_store(src).metadata
    prepare(str(dst), meta)
    layout = make_layout(meta.num_slots, meta.hidden_size, 16, 64)
    for k, samples in enumerate(parts):
        writer = PartWriter(OwnedPart(str(dst), f"part-{k:05d}").open(open_for_run(str(dst), meta), layout))
        for row, ids, mask, hidden in samples:
            writer.append(row, ids.numpy(), mask.numpy().astype(np.uint8), bf16_to_bits(hidden))
        writer.close()
    return str(dst)


def tiny_metadata(storage="bf16", hidden_size=8, **compat) -> StoreMetadata:
    """A store's metadata for layer ids 1..3 of a 3-layer model, hidden size 8, 4-token chunks in 8-token shards."""
    return StoreMetadata(
        layer_ids=[1, 2, 3], num_layers=3, hidden_size=hidden_size, chunk_tokens=4, shard_tokens=8,
        compressor="none", model={"model": "m"}, tokenizer={}, max_length=64, truncation="truncate", config={},
        versions={}, reject_reasons=list(REJECT_REASONS), storage=storage,
        compat=Compat(**{"model": "m", "compute_dtype": "float32", "layer_ids": [1, 2, 3], "tokenization": "t",
                         "data": "d", "split": "train", "storage": storage, **compat}))


def write_tiny_store(path: str, rows: int = 6, seed: int = 0) -> str:
    """A tiny_metadata store at `path` (local or s3://) of `rows` random samples (random ids, masks, states)."""
    meta = tiny_metadata()
    prepare(path, meta)
    layout = make_layout(meta.num_slots, meta.hidden_size, meta.chunk_tokens, meta.shard_tokens)
    writer = PartWriter(OwnedPart(path, "part-00000").open(open_for_run(path, meta), layout))
    g = torch.Generator().manual_seed(seed)
    for row in range(rows):
        n = 3 + row
        hidden = torch.randn(n, meta.num_slots, meta.hidden_size, generator=g).to(torch.bfloat16)
        mask = (torch.rand(n, generator=g) > 0.3).to(torch.uint8).numpy()
        writer.append(row, torch.randint(0, 1000, (n,), generator=g).numpy(), mask, bf16_to_bits(hidden))
    writer.close()
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`streamx ARGS` in this process, offline: its exit code, stdout and stderr as a subprocess gives them,
    without a new interpreter importing torch and transformers (~5 s each on 2 busy cores). The command line
    (sys.argv) is the one a user typed: the run prints it as the command that resumes, a lock records it."""
    from typer.testing import CliRunner

    from streamx.cli import app

    argv = sys.argv
    sys.argv = ["streamx", *args]
    try:
        result = CliRunner().invoke(app, list(args), env={"HF_HUB_OFFLINE": "1", **(env or {})},
                                    catch_exceptions=False)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["streamx", *args], result.exit_code, result.stdout, result.stderr)


def cli_process(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m streamx ARGS` offline in a process of its own, its output captured as text: for what only a
    whole process shows (everything the interpreter and the libraries print, not only the command's lines)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "streamx", *args], env=env, capture_output=True, text=True, **kw)


def distinct_copies(jsonl, copies: int) -> str:
    """The chats of `jsonl` `copies` times over, each copy's first message marked with its number: longer data
    whose rows all differ (--sharing would read a repeated row's states from its first row, not compute them)."""
    rows = [json.loads(line) for line in open(jsonl)]
    out = []
    for copy in range(copies):
        for row in rows:
            first = dict(row["messages"][0], content=f"{row['messages'][0]['content']} ({copy})" if copy else
                         row["messages"][0]["content"])
            out.append(json.dumps({**row, "messages": [first, *row["messages"][1:]]}) + "\n")
    return "".join(out)


def fail_at_batch(monkeypatch, n: int) -> None:
    """Each writer fails on the n-th batch it appends (OSError "injected: ..."), as when the disk goes away."""
    append = PartWriter.append_batch

    def failing(self, *args, **kwargs):
        self.batches = getattr(self, "batches", 0) + 1
        if self.batches == n:
            raise OSError("injected: the disk went away")
        return append(self, *args, **kwargs)

    monkeypatch.setattr(PartWriter, "append_batch", failing)


def committed_samples(out, part: str = "part-00000") -> int:
    """The samples a part's commit record names (0 before the part exists)."""
    try:
        return zarr.open_group(str(out), mode="r")[f"parts/{part}"].attrs["commit"]["samples"]
    except Exception:  # not created yet
        return 0


def kill_the_last_worker_mid_run(command: list[str], env: dict, out, part: str, workers: int = 2) -> None:
    """Start a torchrun job of `workers` workers, SIGKILL the last (workers start in rank order) once `part` of
    the store at `out` has committed 3 samples, and see the whole job fail (torchrun stops it: no hang)."""
    job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.time() + 120
    while committed_samples(out, part) < 3 and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    found = subprocess.run(["pgrep", "-f", "-P", str(job.pid), "streamx"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    assert job.poll() is None and len(pids) == workers, "the job ended before a worker could be killed"
    os.kill(max(pids), signal.SIGKILL)
    assert job.wait(timeout=120) != 0


def assert_same_samples(reference, got) -> None:
    """Every row of the reference store once in `got`, with the same ids, mask and states bit for bit."""
    ref, out = open_store(str(reference)), open_store(str(got))
    assert sorted(out.row_ids().tolist()) == sorted(ref.row_ids().tolist())  # none lost, none duplicated
    assert out.summary()["duplicate_rows"] == 0
    for row in ref.row_ids().tolist():
        a, b = ref.sample(row), out.sample(row)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.hidden_states.view(torch.int16), b.hidden_states.view(torch.int16)), row


@torch.inference_mode()
def reference_states(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """All L+1 ids of one sample alone: HF output_hidden_states of an unbatched forward, with the final norm
    replaced by identity, so that id L is the last layer's output before the norm (HF's own is after it)."""
    base = model.model
    norm, base.norm = base.norm, nn.Identity()
    try:
        ids = input_ids[None].to(next(model.parameters()).device)
        return [h[0] for h in model(input_ids=ids, output_hidden_states=True).hidden_states]
    finally:
        base.norm = norm


def reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """Variable-length attention written out in float64, with each query's log-sum-exp (what packing takes from
    torch's flash kernel, which needs CUDA): sequence i's queries on its keys, causal aligned at the end (and
    within `window` keys: its own and the window - 1 before it)."""
    outs, lses = [], []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        q, k, v = (t[c[i] : c[i + 1]].double().transpose(0, 1) for t, c in ((query, cu_q), (key, cu_k), (value, cu_k)))
        assert q.shape[1] <= max_q and k.shape[1] <= max_k
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        scores = q @ k.transpose(1, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if causal:
            at = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]  # each query's own key
            seen = torch.arange(k.shape[1])[None] <= at
            if window:
                seen &= torch.arange(k.shape[1])[None] > at - window
            scores = scores.masked_fill(~seen.to(scores.device), float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs).to(query.dtype), torch.cat(lses, dim=1).float()


def flash_varlen_on_cpu(query, key, value, cu_q, cu_k, max_q, max_k, *, return_aux, scale, window_size, enable_gqa):
    """torch's varlen_attn (flash attention over variable-length sequences, CUDA only), as packing calls it, on any
    device through reference_varlen: its heads of one size for queries, keys and values, as flash's kernels take."""
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash attention takes one head size"
    assert enable_gqa == (query.shape[1] != key.shape[1]) and return_aux.lse
    left, right = window_size
    assert right in (0, -1) and (left == -1 or right == 0)
    return reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, right == 0, scale,
                            left + 1 if left >= 0 else None)


def emulate_flash_varlen(monkeypatch) -> None:
    """Packed attention as it runs on CUDA in half precision (torch's flash varlen calls), here on the CPU."""
    from streamx.model import attention

    monkeypatch.setattr(attention, "_VARLEN", flash_varlen_on_cpu)
    monkeypatch.setattr(attention, "_uses_varlen", lambda query: True)


PROBED_SEGMENTS = 3  # the most segments a start-up probe's forward holds (a shared prefix and two rows continuing it)


def broken_packed_batch(after: int = 0):
    """batching.packed_batch, but packed batches of more segments than any probe's, from the `after`-th such batch
    on, get each segment from the fourth on its positions past its 8th token shifted by 2: a rope off by two (a
    uniform shift would change nothing under relative rope) that the start-up check passes and the audit finds."""
    packed_batch, seen = batching.packed_batch, []

    def broken(pieces):
        batch = packed_batch(pieces)
        if len(batch.segment_lengths) > PROBED_SEGMENTS:
            seen.append(batch)
            if len(seen) > after:
                starts = batch.cu_seq_lens.tolist()
                for a, b in zip(starts[PROBED_SEGMENTS:-1], starts[PROBED_SEGMENTS + 1:], strict=True):
                    batch.position_ids[0, a + 8 : b] += 2
        return batch

    return broken


def worst_row(model_dir: str, out) -> float:
    """The largest per-token relative difference of a stored row from the model's own forward of it alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    store, worst = open_store(str(out)), 0.0
    for row in store.row_ids().tolist():
        sample = store.sample(row)
        want = torch.stack(reference_states(model, sample.input_ids), dim=1)[:, store.metadata.layer_ids]
        got = sample.hidden_states.float()
        worst = max(worst, float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()))
    return worst
