"""Nothing lost when the machine dies: the order of fsyncs and renames behind every commit, one writer per
part or convert folder, and SIGINT / SIGTERM committing what was written."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_same_samples,
    cli,
    committed_samples,
    distinct_copies,
    fail_at_batch,
    run_args,
    small_config,
)

from streamx.base.locks import Lock, lock_file
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.convert import convert

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def real(path) -> str:
    """The path with its folder resolved (the file itself may not exist yet)."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


class FileCalls:
    """The fsyncs and renames this process makes under `root`, in order: ("fsync", path, size) and
    ("replace", src, dst, size, the commit record a part's zarr.json is replaced with, or None)."""

    def __init__(self, root: Path, monkeypatch):
        self.root, self.events, self.lock = os.path.realpath(root), [], threading.Lock()
        fsync, replace = os.fsync, os.replace

        def recorded_fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")  # resolved, as the paths recorded below
            fsync(fd)
            if path.startswith(self.root):
                with self.lock:
                    self.events.append(("fsync", path, os.fstat(fd).st_size))

        def recorded_replace(src, dst, **kw):
            src, dst = real(src), real(dst)
            commit = None
            if dst.startswith(self.root) and Path(dst).name == "zarr.json" and Path(dst).parent.parent.name == "parts":
                commit = json.loads(Path(src).read_text())["attributes"].get("commit")
            size = os.stat(src).st_size
            replace(src, dst, **kw)
            if dst.startswith(self.root):
                with self.lock:
                    self.events.append(("replace", src, dst, size, commit))

        monkeypatch.setattr(os, "fsync", recorded_fsync)
        monkeypatch.setattr(os, "replace", recorded_replace)

    def replaces(self):
        return [(i, e) for i, e in enumerate(self.events) if e[0] == "replace"]

    def assert_durable_before(self, point: int, replace_event: tuple, existed: set[str]) -> None:
        """The file `replace_event` put in place has its bytes (all of them) and its name on disk before event
        number `point`: its temporary file fsynced at its final size before the rename, its folder fsynced after
        it, and every folder on its path that it created fsynced in its parent."""
        i = self.events.index(replace_event)
        _, src, dst, size, _ = replace_event
        assert ("fsync", src, size) in self.events[:i], f"{dst} renamed into place before its bytes were fsynced"
        assert ("fsync", str(Path(dst).parent), ) in [e[:2] for e in self.events[i:point]], \
            f"the rename to {dst} was not made durable (its folder fsynced) before event {point}"
        for folder in Path(dst).parents:
            if str(folder) in existed or not str(folder).startswith(self.root):
                break
            assert ("fsync", str(folder.parent)) in [e[:2] for e in self.events[:point]], \
                f"the new folder {folder} was not made durable in its parent"


def shard_files(part: Path, tokens: int, shard_tokens: int) -> list[str]:
    """The shard files of the three token arrays (zarr's keys: c/<shard>/0/0 for [T, K, H]) holding tokens < tokens."""
    shards = range(-(-tokens // shard_tokens))
    return [str(part / name / "c" / str(s) / suffix) for s in shards
            for name, suffix in (("hidden_states", "0/0"), ("input_ids", ""), ("loss_mask", ""))]


def test_every_commit_names_only_what_is_on_disk(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """For every commit record of a run: each shard file it covers, and every other file of the store written
    before it (zarr's array shapes and index chunks), was fsynced before its rename, its rename made durable by an
    fsync of its folder, and only then the commit record written, the same way. A power loss can then lose only
    what no commit names. The same for convert's files before its completion record (the meta). Both go into
    folders that do not exist yet, each of which must be made durable in its parent too."""
    tmp_path = Path(os.path.realpath(tmp_path))
    out = tmp_path / "new" / "deeper" / "s.zarr"
    existed = {str(p) for p in (tmp_path, *tmp_path.parents)}
    calls = FileCalls(tmp_path, monkeypatch)
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=24), progress=False, log=lambda m: None)
    replaces = calls.replaces()
    commits = [(i, e) for i, e in replaces if e[4] is not None and e[4]["samples"] > 0]
    assert len(commits) >= 4  # 64-token shards: the run commits many times
    for point, commit in commits:
        for _, earlier in [(i, e) for i, e in replaces if i < point]:
            calls.assert_durable_before(point, earlier, existed)
        placed = {e[2] for i, e in replaces if i < point}
        missing = set(shard_files(out / "parts" / "part-00000", commit[4]["tokens"], 64)) - placed
        assert not missing, f"a commit of {commit[4]['tokens']} tokens before its shards {sorted(missing)[:3]}"
    last = replaces[-1][1]
    assert last[4] is not None and last[4]["closed"]  # the trim on close, then the closing commit, last of all
    calls.assert_durable_before(len(calls.events), last, existed)
    assert open_store(str(out)).summary()["samples"] == 24

    calls.events.clear()
    spec = tmp_path / "converted" / "spec"
    convert(str(out), str(spec), progress=False, allow_random_weights=True, block_rows=8)
    replaces = calls.replaces()
    meta = [i for i, e in replaces if Path(e[2]).name == "streamx_meta.json"]
    assert len(meta) == 1 and meta[0] == replaces[-1][0]  # the completion record is written last
    hs = [e for _, e in replaces if e[2].endswith(".safetensors") and "/hidden_states/" in e[2]]
    assert len(hs) == 24
    for _, e in replaces:
        calls.assert_durable_before(len(calls.events), e, existed)
        if Path(e[2]).name != "streamx_meta.json":
            calls.assert_durable_before(meta[0], e, existed)


def size(path) -> int:
    """The file's size, 0 once it is gone (renamed into place meanwhile)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wait_for(condition, proc, seconds=120.0):
    deadline = time.time() + seconds
    while not condition() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the test could act on it"


ROWS = 400  # of the long data: a run lasts long enough to act on it mid-way


def long_run(model_dir, data, out, **settings) -> list[str]:
    return run_args(model_dir, data, out, max_batch_size=2, max_samples=ROWS, **settings)


@pytest.fixture(scope="module")
def long_chats(tiny_chat_model_dir, chat_jsonl, tmp_path_factory):
    """(data, reference): the chats repeated, and the store an uninterrupted run writes of their first ROWS."""
    folder = tmp_path_factory.mktemp("long")
    data = folder / "data.jsonl"
    data.write_text(distinct_copies(chat_jsonl, ROWS // 40 + 1))
    reference = folder / "ref.zarr"
    result = cli(*long_run(tiny_chat_model_dir, str(data), reference, chunk_tokens=0, shard_tokens=0))
    assert result.returncode == 0, result.stderr
    return str(data), reference


def assert_committed_as_reference(reference, out) -> int:
    """Every sample `out` committed equals the uninterrupted run's, bit for bit; returns how many there are."""
    ref, got = open_store(str(reference)), open_store(str(out))
    for row in got.row_ids().tolist():
        a, b = ref.sample(row), got.sample(row)
        assert a.input_ids.equal(b.input_ids) and a.loss_mask.equal(b.loss_mask)
        assert a.hidden_states.view(torch.int16).equal(b.hidden_states.view(torch.int16)), row
    return len(got)


def test_a_second_run_on_the_same_part_is_refused_and_sigterm_commits(tiny_chat_model_dir, long_chats, tmp_path):
    """A double launch: the second process fails at once (before its model loads) naming the first, which goes
    on untouched; SIGTERM then stops the first with what it wrote committed (exit 143), and the same command
    resumes it to the store an uninterrupted run writes."""
    data, reference = long_chats
    out = tmp_path / "s.zarr"
    args = long_run(tiny_chat_model_dir, data, out)  # small shards: commits all along
    first = subprocess.Popen([sys.executable, "-m", "streamx", *args], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: committed_samples(out) > 0, first)
        second = cli(*args)
        assert first.poll() is None, "the first run ended before the second was refused"
        errors = second.stderr.strip().splitlines()
        assert second.returncode == 1 and len(errors) == 1, second.stderr  # refused before the banner
        assert "part-00000" in errors[0] and f"pid {first.pid} " in errors[0], errors[0]
        before = committed_samples(out)
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143, stderr[-2000:]
    assert "stopped by SIGTERM" in stdout
    # the one next step is the command that resumes, never convert: the store is unfinished
    assert [line for line in stdout.splitlines() if line.startswith("next:")] == \
        [f"next: {shlex.join(['streamx', *args])}   (resumes)"]
    assert before <= assert_committed_as_reference(reference, out) < ROWS
    assert cli(*args).returncode == 0
    assert_same_samples(reference, out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_commits_the_partial_shard(tiny_chat_model_dir, long_chats, tmp_path, sig):
    """With the default shard size nothing would commit for a long while (a ~256 MiB shard fills first); a
    signal still commits every sample written so far, each equal to an uninterrupted run's, and the same
    command resumes. (What the open part means to inspect, verify and convert does not depend on the signal:
    checked after SIGTERM.)"""
    data, reference = long_chats
    out = tmp_path / "s.zarr"
    args = long_run(tiny_chat_model_dir, data, out, chunk_tokens=0, shard_tokens=0)
    proc = subprocess.Popen([sys.executable, "-m", "streamx", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        partial = out / "parts" / "part-00000" / "hidden_states"
        # a shard under way (not the array's zarr.json, written the same way as the part is created, before the
        # run takes over SIGTERM)
        wait_for(lambda: any(size(p) > 0 for p in partial.rglob(".*.tmp-*") if "zarr.json" not in p.name), proc)
        assert committed_samples(out) == 0
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, stderr[-2000:]
    assert f"stopped by {sig.name}" in stdout
    assert 0 < assert_committed_as_reference(reference, out) < ROWS
    assert not open_store(str(out)).commits["part-00000"].closed  # open for the resume, as after a kill
    if sig == signal.SIGTERM:
        assert "interrupted" in cli("inspect", str(out)).stdout
        assert_unfinished_is_refused(out, tmp_path / "spec", "part part-00000 is open")
    assert cli(*args).returncode == 0
    assert_same_samples(reference, out)
    checked = cli("verify", str(out), "--no-model")
    assert checked.returncode == 0 and f"ok   complete     every part closed; all {ROWS} rows" in checked.stdout


def assert_unfinished_is_refused(store, spec, problem):
    """verify fails an unfinished store naming `problem`, convert refuses it (one line, naming --allow-partial)
    and converts what it holds with that flag; inspect says it is not complete."""
    checked = cli("verify", str(store), "--no-model")
    assert checked.returncode == 1 and f"FAIL complete     unfinished: {problem}" in checked.stdout, checked.stdout
    refused = cli("convert", str(store), "--out", str(spec), "--allow-random-weights", "--no-progress")
    assert refused.returncode == 1 and refused.stderr.startswith(f"error: {store} is unfinished: {problem}")
    assert "--allow-partial" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not spec.exists()
    partial = cli("convert", str(store), "--out", str(spec), "--allow-random-weights", "--allow-partial",
                  "--no-progress")
    assert partial.returncode == 0 and f"converting an unfinished store (--allow-partial): {problem}" in partial.stderr
    assert json.loads((spec / "streamx_meta.json").read_text())["counts"]["rows"] == len(open_store(str(store)))
    assert f"complete     NO: {problem}" in cli("inspect", str(store)).stdout


def test_a_rank_that_never_ran_leaves_its_rows_missing_and_named(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """Every row of the data is a sample or a reject of some part, or the store is unfinished: rank 0 of 2
    alone closes its part, and the rows of rank 1's windows are named missing until rank 1 runs."""
    out = tmp_path / "s.zarr"
    cfg = small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=40, world_size=2, rank=0)
    first = run(cfg, progress=False, log=lambda m: None)
    rank1_rows = [r for r in range(40) if (r // cfg.sort_window) % 2 == 1]  # whole sorting windows per rank
    state = open_store(str(out)).completeness()
    assert state.source_rows == 40 and not state.open_parts and state.missing_rows.tolist() == rank1_rows
    assert first.incomplete == state.problems() and "next: let every rank finish" in "\n".join(first.lines())
    assert_unfinished_is_refused(out, tmp_path / "spec",
                                 f"{len(rank1_rows)} of the data's 40 rows are in no part: rows "
                                 + ", ".join(map(str, rank1_rows[:10])))
    second = run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=40, world_size=2, rank=1),
                 progress=False, log=lambda m: None)
    assert second.incomplete == [] and open_store(str(out)).completeness().complete
    assert sorted([*open_store(str(out)).row_ids().tolist(), *(r for r, _ in open_store(str(out)).rejected())]) \
        == list(range(40))


def test_a_failed_command_leaves_no_lock_file_and_a_removed_lock_is_never_shared(tiny_chat_model_dir, chat_jsonl,
                                                                                  tmp_path, monkeypatch):
    """A command that fails before its output exists takes its lock file with it; a process that opened the
    lock file just before its holder removed it takes the new one, never the removed one beside a third."""
    import streamx.base.locks as locks

    out = tmp_path / "out"
    out.mkdir()
    failed = [cli(*run_args(tiny_chat_model_dir, chat_jsonl, out / "s.zarr", layers="1,2")),  # after its part lock
              cli("regenerate", "--data", chat_jsonl, "--out", str(out / "r.jsonl"), "--endpoint",
                  "http://127.0.0.1:9/v1", "--no-progress"),
              cli("convert", str(tmp_path / "none.zarr"), "--out", str(out / "spec"), "--no-progress")]
    assert [p.returncode for p in failed] == [1, 1, 1] and "--any-layers" in failed[0].stderr
    assert sorted(os.listdir(out)) == []

    path = tmp_path / ".x.streamx-lock"
    first = Lock(path, "x")
    real_flock, calls = locks.fcntl.flock, []

    def flock_after_the_holder_left(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            first.release()  # between the second process's open and its flock: the file goes
        return real_flock(fd, op)

    monkeypatch.setattr(locks.fcntl, "flock", flock_after_the_holder_left)
    second = Lock(path, "x")
    assert len(calls) == 2 and os.fstat(second.fd).st_ino == os.stat(path).st_ino  # the file at path, not the old
    with pytest.raises(locks.LockedError):
        Lock(path, "x")
    assert path.exists()  # the refused one did not remove the holder's file
    second.release()
    assert not path.exists()


@pytest.mark.parametrize("link", [os.symlink, os.link], ids=["symlink", "hard link"])
def test_a_lock_file_planted_as_a_link_is_refused_and_the_file_it_names_left_alone(tmp_path, link):
    """A lock file's name is predictable and its folder may be others' to write (a group's project folder): a
    link planted under that name to a file of the user's is refused, in one line naming it, and the file stays."""
    from streamx.store import OwnedPart

    victim, kept = tmp_path / "home" / ".bashrc", "export PATH=$HOME/bin:$PATH\n" * 20
    victim.parent.mkdir()
    victim.write_text(kept)
    store = tmp_path / "project" / "run.zarr"
    store.parent.mkdir()
    path = lock_file(store, "part-00000")
    link(victim, path)
    with pytest.raises(OSError, match="remove it and run again") as refused:
        OwnedPart(str(store), "part-00000")
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert victim.read_text() == kept


def test_a_lock_file_that_is_no_plain_file_of_this_user_is_never_written(tmp_path, monkeypatch):
    """A symlink to nothing yet (which would create its target), a FIFO or a folder under a lock file's name is
    refused. A plain file another user owns (a colleague's earlier run) is locked as it is, its content theirs."""
    import streamx.base.locks as locks

    target = tmp_path / "created"
    os.symlink(target, lock_file(tmp_path / "a"))
    os.mkfifo(lock_file(tmp_path / "b"))
    lock_file(tmp_path / "c").mkdir()
    for name in "abc":
        with pytest.raises(OSError, match="remove it and run again"):
            Lock(lock_file(tmp_path / name), name)
    assert not target.exists()
    theirs = lock_file(tmp_path / "d")
    theirs.write_text("pid 1 on their host\n")
    monkeypatch.setattr(os, "geteuid", lambda: theirs.stat().st_uid + 1)  # this process as another user
    with Lock(theirs, "d"):
        assert theirs.read_text() == "pid 1 on their host\n"
        with pytest.raises(locks.LockedError, match="pid 1 on their host"):
            Lock(theirs, "d")


def test_a_lock_dies_with_its_process_and_convert_takes_one(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """A convert into a folder another process is converting into is refused, naming it; once that process is
    killed (kill -9: no clean-up ran), the lock is gone and the convert runs."""
    store = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, store, max_samples=8), progress=False, log=lambda m: None)
    spec = tmp_path / "spec"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                               "from streamx.base.locks import Lock, lock_file; "
                               f"lock = Lock(lock_file({str(spec)!r}), 'x'); print('held', flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = cli("convert", str(store), "--out", str(spec), "--allow-random-weights", "--no-progress")
        assert refused.returncode == 1 and f"pid {holder.pid} " in refused.stderr, refused.stderr
        assert not spec.exists()  # refused before anything was written
        holder.kill()
        holder.wait()
    finally:
        holder.kill()
    done = cli("convert", str(store), "--out", str(spec), "--allow-random-weights", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert len(list((spec / "hidden_states").iterdir())) == 8
    with Lock(lock_file(str(spec)), "x"):  # a finished convert holds nothing
        pass


def test_a_resume_removes_a_killed_writers_temporary_files(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """kill -9 during a durable write leaves its temporary file beside zarr.json; zarr would warn about it as a
    stray member on every listing. The next run on the part removes them."""
    out = tmp_path / "s.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=8), progress=False, log=lambda m: None)
    part = out / "parts" / "part-00000"
    stale = [part / ".zarr.json.tmp-1-2-dead", part / "sample_row_id" / ".zarr.json.tmp-1-2-dead",
             part / "sample_row_id" / "c" / ".0.tmp-1-2-dead"]  # a chunk's, a level deeper
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr's "not recognized as a component of a Zarr hierarchy"
        run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=16), progress=False, log=lambda m: None)
        assert len(open_store(str(out))) == 16
    assert not any(p.exists() for p in stale)


def test_a_filesystem_without_flock_runs_with_a_warning(tmp_path, monkeypatch):
    """Where the filesystem offers no flock (Lustre without -o flock), the writer says so and goes on: the part
    is written and committed as anywhere else."""
    import errno
    import fcntl

    from helpers import write_tiny_store

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.warns(UserWarning, match="no flock"):
        write_tiny_store(str(tmp_path / "s.zarr"), rows=5)
    store = open_store(str(tmp_path / "s.zarr"))
    assert store.row_ids().tolist() == [0, 1, 2, 3, 4] and store.commits["part-00000"].closed


def test_a_signal_after_the_last_batch_changes_nothing(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """Ctrl-C while the writer closes a run whose data is all through: the run ends as usual, complete."""
    from streamx.pipeline.writer import PartWriter

    close = PartWriter.close

    def close_after_a_signal(self, *args):
        os.kill(os.getpid(), signal.SIGINT)  # handled on the main thread, which waits for the writer
        time.sleep(0.5)
        close(self, *args)

    monkeypatch.setattr(PartWriter, "close", close_after_a_signal)
    out = tmp_path / "s.zarr"
    summary = run(small_config(tiny_chat_model_dir, chat_jsonl, out, max_samples=8), progress=False, log=lambda m: None)
    assert summary.stopped_by is None and summary.samples == 8 and summary.incomplete == []
    assert open_store(str(out)).commits["part-00000"].closed and open_store(str(out)).completeness().complete


def test_every_way_zarr_writes_a_local_store_is_durable(tmp_path, monkeypatch):
    """zarr writes through `set`, `set_if_not_exists` (exclusive) and the sync API: each file's bytes are fsynced
    before its rename, the rename made durable, and the store's new folders made durable in their parents."""
    import asyncio

    from zarr.core.buffer import default_buffer_prototype

    from streamx.base.durable import DurableLocalStore

    tmp_path = Path(os.path.realpath(tmp_path))
    calls = FileCalls(tmp_path, monkeypatch)
    store = DurableLocalStore(tmp_path / "new" / "s.zarr")
    value = default_buffer_prototype().buffer.from_bytes(b"0123456789")
    asyncio.run(store.set("a/zarr.json", value))
    asyncio.run(store.set_if_not_exists("b/zarr.json", value))
    asyncio.run(store.set_if_not_exists("b/zarr.json", default_buffer_prototype().buffer.from_bytes(b"other")))
    store.set_sync("c/zarr.json", value)
    assert (tmp_path / "new/s.zarr/b/zarr.json").read_bytes() == b"0123456789"  # not replaced: exclusive
    existed = {str(p) for p in (tmp_path, *tmp_path.parents)}
    for name in ("a", "c"):
        replace = next(e for e in calls.events if e[0] == "replace" and e[2].endswith(f"/{name}/zarr.json"))
        calls.assert_durable_before(len(calls.events), replace, existed)
    b = str(tmp_path / "new/s.zarr/b")
    fsynced = [e[1] for e in calls.events if e[0] == "fsync"]
    assert b in fsynced and str(tmp_path / "new/s.zarr") in fsynced and str(tmp_path / "new") in fsynced
    assert not list(tmp_path.rglob(".*.tmp-*"))


def test_a_failed_run_leaves_no_thread_writing_its_store(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch):
    """A writer that fails while a commit is in flight lets that commit end before `run` raises: once the caller
    has the error, nothing writes the store (a caller that repairs or deletes it would race a late commit)."""
    from streamx.pipeline.writer import PartWriter

    publish = PartWriter._publish

    def slow_publish(self, *args, **kwargs):
        time.sleep(0.5)
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(PartWriter, "_publish", slow_publish)
    fail_at_batch(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        run(small_config(tiny_chat_model_dir, chat_jsonl, tmp_path / "s.zarr", max_batch_size=2), progress=False,
            log=lambda m: None)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("streamx-commit")]
