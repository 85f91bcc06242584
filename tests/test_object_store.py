"""A store on S3-compatible object storage (a moto server on 127.0.0.1, through s3fs and zarr's
fsspec store) keeps the commit and resume guarantees of a local store."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_same_samples, cli, committed_samples, distinct_copies, run_args

from streamx.store import open_store
from streamx.train.convert import convert


@pytest.fixture(scope="module")
def s3_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the usual environment: credentials never go through streamx flags
    try:
        import s3fs

        # filesystems made under an earlier server of this module (xdist may tear a module's fixture down and set
        # it up again on another port when it hands tests between workers) would still point at that one
        s3fs.S3FileSystem.clear_instance_cache()
        deadline = time.time() + 30
        while True:
            try:
                s3fs.S3FileSystem(skip_instance_cache=True).mkdir("streamx-test")
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        yield {**os.environ, "HF_HUB_OFFLINE": "1"}
    finally:
        server.terminate()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_run_args(model_dir, data, out) -> list[str]:
    # shards of 256 tokens: still dozens of commits a run, at a quarter of the small runs' requests to the server
    return run_args(model_dir, data, out, sort_window=4, chunk_tokens=64, shard_tokens=256)


def test_s3_store_run_kill_resume_equals_local(tiny_chat_model_dir, chat_jsonl, tmp_path, s3_env):
    data = tmp_path / "data.jsonl"
    data.write_text(distinct_copies(chat_jsonl, 2))
    local = tmp_path / "local.zarr"
    assert cli(*s3_run_args(tiny_chat_model_dir, str(data), str(local))).returncode == 0

    remote = "s3://streamx-test/run.zarr"
    job = subprocess.Popen([sys.executable, "-m", "streamx", *s3_run_args(tiny_chat_model_dir, str(data), remote)],
                           env=s3_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while committed_samples(remote) < 5 and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, "the run ended before it could be killed"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    assert 0 < committed_samples(remote) < len(open_store(str(local)))
    result = cli(*s3_run_args(tiny_chat_model_dir, str(data), remote))  # the same command resumes
    assert result.returncode == 0, result.stderr[-2000:]

    assert_same_samples(local, remote)
    ref = open_store(str(local))

    # converting the remote store gives the same training files as converting the local one
    convert(str(local), str(tmp_path / "spec-local"), progress=False, log=lambda m: None)
    convert(remote, str(tmp_path / "spec-remote"), progress=False, log=lambda m: None)
    local_files = sorted((tmp_path / "spec-local" / "hidden_states").iterdir())
    assert len(local_files) == len(ref)
    for f in local_files:
        assert f.read_bytes() == (tmp_path / "spec-remote" / "hidden_states" / f.name).read_bytes(), f.name


def test_speculators_reads_an_s3_store_through_the_streamx_backend(tiny_chat_model_dir, chat_jsonl, tmp_path, s3_env,
                                                                   speculators_venv):
    """Train from an object store, no copy: the backend in speculators' environment (s3fs beside it, credentials
    from the environment) returns every row as the hs files of a convert of the same store hold it."""
    remote = "s3://streamx-test/backend.zarr"
    result = cli(*s3_run_args(tiny_chat_model_dir, chat_jsonl, remote))
    assert result.returncode == 0, result.stderr[-2000:]
    files, nocopy = tmp_path / "files", tmp_path / "nocopy"
    convert(remote, str(files), seed=3, progress=False, log=lambda m: None)
    convert(remote, str(nocopy), seed=3, progress=False, log=lambda m: None, hidden_states="store")
    meta = json.loads((nocopy / "streamx_meta.json").read_text())
    assert meta["source"]["store"] == remote and not (nocopy / "hidden_states").exists()
    check = str(Path(__file__).with_name("speculators_backend_check.py"))
    proc = speculators_venv(check, f"{files}={nocopy}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)["pairs"][f"{files}={nocopy}"]
    assert r["rows"] == len(open_store(remote)) and r["equal"] == r["rows"] == r["in_workers_equal"]


def test_overwrite_never_deletes_a_prefix_that_is_not_a_store(s3_env, tmp_path):
    """`--overwrite --out s3://...` replaces a streamx store, never a prefix holding other objects; the same for
    a local folder."""
    import s3fs
    from helpers import tiny_metadata

    from streamx.store import StoreError, prepare

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe("streamx-test/notes/precious.txt", b"a month of work")
    local = tmp_path / "experiments"
    (local / "sub").mkdir(parents=True)
    (local / "sub" / "precious.txt").write_text("a month of work")
    for out in ("s3://streamx-test/notes", str(local)):
        for overwrite in (False, True):
            with pytest.raises(StoreError, match=r"exists and is not a streamx store; choose an empty or new --out "
                                                 r"\(--overwrite replaces only a streamx store\)"):
                prepare(out, tiny_metadata(), overwrite=overwrite)
    fs.invalidate_cache()
    assert fs.cat("streamx-test/notes/precious.txt") == b"a month of work"
    assert (local / "sub" / "precious.txt").read_text() == "a month of work"
    prepare("s3://streamx-test/fresh", tiny_metadata())  # a new prefix, then a store there: replaced
    prepare("s3://streamx-test/fresh", tiny_metadata(), overwrite=True)
    assert open_store("s3://streamx-test/fresh").metadata.layer_ids == [1, 2, 3]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_store_dataset_in_forked_and_spawned_workers(s3_env, tmp_path, where):
    """StoreDataset in DataLoader workers, forked (torch's default on Linux: the workers inherit the parent's
    opened store, and an s3 session bound to the parent's event loop) and spawned: every item equals the
    parent's read."""
    import torch
    from helpers import write_tiny_store

    from streamx.train.dataset import StoreDataset

    path = write_tiny_store("s3://streamx-test/fork.zarr" if where == "s3" else str(tmp_path / "fork.zarr"))
    data = StoreDataset(path)
    expected = [data[i] for i in range(len(data))]  # the parent has opened and read the store
    for context in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, multiprocessing_context=context,
                                             timeout=120)
        got = list(loader)
        assert len(got) == len(expected), context
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            assert torch.equal(a["hidden_states"].view(torch.int16), b["hidden_states"].view(torch.int16)), context
