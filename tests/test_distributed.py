"""Scale-out on existing engines: torchrun (gloo on CPU) ranks and accelerate device maps."""

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import zarr
from helpers import (
    assert_same_samples,
    cli,
    committed_samples,
    distinct_copies,
    fail_at_batch,
    kill_the_last_worker_mid_run,
    run_args,
    small_config,
)

from streamx.config import load_config
from streamx.model.load import load_model
from streamx.pipeline.plan import make_plan
from streamx.pipeline.runner import run
from streamx.store import open_store
from streamx.train.verify import verify


def rank_args(model_dir, data, out) -> list[str]:
    """`streamx run`'s flags here: windows of 4 rows, so that each rank gets many."""
    return run_args(model_dir, data, out, sort_window=4)


def streamx_cmd(model_dir, data, out, nproc=None):
    """The run in a process of its own, or under torchrun in `nproc` ranks."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                 "-m", "streamx"] if nproc else [sys.executable, "-m", "streamx"])
    return [*launcher, *rank_args(model_dir, data, out)]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_two_ranks_equal_one_process_and_resume_after_a_rank_dies(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                  torch_threads):
    """torchrun gives each rank one thread (OMP_NUM_THREADS=1): the reference runs on one too (docs/scaling.md:
    on the CPU, another thread count changes the last bits of some small batches)."""
    torch_threads(1)
    data = tmp_path / "data.jsonl"  # long enough that a rank can be killed mid-run
    data.write_text(distinct_copies(chat_jsonl, 3))
    chat_jsonl = str(data)
    reference = tmp_path / "ref.zarr"
    assert cli(*rank_args(tiny_chat_model_dir, chat_jsonl, reference)).returncode == 0

    both = tmp_path / "two.zarr"
    result = subprocess.run(streamx_cmd(tiny_chat_model_dir, chat_jsonl, both, nproc=2), env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert committed_samples(both, "part-00000") > 0 and committed_samples(both, "part-00001") > 0  # both worked
    assert_same_samples(reference, both)

    # kill rank 1 mid-run: torchrun stops the whole job (no hang); one process then resumes it
    killed = tmp_path / "killed.zarr"
    kill_the_last_worker_mid_run(streamx_cmd(tiny_chat_model_dir, chat_jsonl, killed, nproc=2), ENV, killed,
                                 "part-00001")  # rank 1
    assert 0 < committed_samples(killed, "part-00001") < committed_samples(both, "part-00001")
    result = cli(*rank_args(tiny_chat_model_dir, chat_jsonl, killed))  # one process resumes
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_samples(reference, killed)


def test_device_map_split_model_gives_the_same_states(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """A model split in two parts (layers 2-3 offloaded by accelerate) captures the same states."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, model=tiny_chat_model_dir, data=chat_jsonl, layers="0,2,3,4", max_samples=10,
                      token_budget=512, max_length=256, out=str(tmp_path / "whole.zarr"))
    run(cfg, progress=False)
    model, tokenizer, info = load_model(tiny_chat_model_dir, "float32", "cpu")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu",
                  "lm_head": "cpu"}
    split = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32, device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert hasattr(split.model.layers[2], "_hf_hook")  # accelerate really manages these layers
    run(make_plan(cfg.replace(out=str(tmp_path / "split.zarr")), loaded=(split, tokenizer, replace(info))),
        progress=False)
    assert_same_samples(tmp_path / "whole.zarr", tmp_path / "split.zarr")


def test_a_job_array_without_rendezvous_equals_one_process(tiny_chat_model_dir, chat_jsonl, tmp_path):
    """Independent processes and no process group (a Slurm job array): one ranked by --rank/--world-size, the
    others by Slurm's array variables, started at once so that all find no store and create it together: the
    store holds a part per task whose samples equal one process's, bit for bit, as torchrun's would."""
    reference = tmp_path / "ref.zarr"
    assert cli(*rank_args(tiny_chat_model_dir, chat_jsonl, reference)).returncode == 0
    out, tasks = tmp_path / "array.zarr", 4
    jobs = [subprocess.Popen([*streamx_cmd(tiny_chat_model_dir, chat_jsonl, out), "--rank", "0", "--world-size",
                              str(tasks)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    jobs += [subprocess.Popen(streamx_cmd(tiny_chat_model_dir, chat_jsonl, out), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**ENV, "SLURM_ARRAY_TASK_ID": str(7 + task), "SLURM_ARRAY_TASK_MIN": "7",
                                   "SLURM_ARRAY_TASK_COUNT": str(tasks), "SLURM_ARRAY_TASK_STEP": "1"})
             for task in range(1, tasks)]
    for job in jobs:
        _, stderr = job.communicate(timeout=600)
        assert job.returncode == 0, stderr[-2000:]
    assert all(committed_samples(out, f"part-{task:05d}") > 0 for task in range(tasks))
    assert_same_samples(reference, out)


def _make_stores_at_once(folder: str, rounds: int, barrier, results) -> None:
    """A job array's task, as far as the store goes, in each of `rounds` instants shared with the other tasks: the
    run's check of --out before its model loads, then making (or opening) the store and its own part."""
    from helpers import tiny_metadata

    from streamx.store.format import create_part, make_layout
    from streamx.store.prepare import Output, prepare

    metadata, me = tiny_metadata(), os.getpid()
    layout = make_layout(metadata.num_slots, metadata.hidden_size, metadata.chunk_tokens, metadata.shard_tokens)
    for round_ in range(rounds):
        path = f"{folder}/round-{round_}.zarr"
        barrier.wait(timeout=300)
        try:
            Output.checked(path)
            create_part(prepare(path, metadata), f"part-{me}", layout)
            results.put(None)
        except Exception as err:  # noqa: BLE001 - reported to the test
            results.put(f"round {round_}: {type(err).__name__}: {err}")


def test_many_tasks_making_the_store_in_the_same_instant_all_open_it(tmp_path):
    """Tasks that find no store at the same instant, repeatedly: each makes it or opens the one another made, and
    none finds "files that are not a streamx store" in the window where another has marked it made (the check read
    before the store was marked made, the listing after: 10 of 160 tasks failed so, 16 at a time, before
    Output.checked); every part is there."""
    import multiprocessing

    tasks, rounds = 6, 10
    context = multiprocessing.get_context("spawn")  # (no fork of a process with threads)
    barrier, results = context.Barrier(tasks), context.Queue()
    workers = [context.Process(target=_make_stores_at_once, args=(str(tmp_path), rounds, barrier, results))
               for _ in range(tasks)]
    for worker in workers:
        worker.start()
    failures = [found for _ in range(tasks * rounds) if (found := results.get(timeout=600))]
    for worker in workers:
        worker.join(timeout=60)
    assert not failures, failures[:3]
    for round_ in range(rounds):
        assert len(zarr.open_group(str(tmp_path / f"round-{round_}.zarr"), mode="r")["parts"]) == tasks


def test_a_store_marked_made_between_the_checks_reads_is_opened_not_refused(tmp_path, monkeypatch):
    """The window itself: the check of --out reads no store (another task has not marked it made yet), then lists
    the store's files (it has): the check reads again and opens that store."""
    import importlib

    from helpers import tiny_metadata

    prepare_module = importlib.import_module("streamx.store.prepare")  # (the package's `prepare` is the function)
    path = str(tmp_path / "s.zarr")
    prepare_module.prepare(path, tiny_metadata())  # the other task's store
    found, reads = prepare_module._open_group, []

    def late(where, mode):
        reads.append(mode)
        return None if len(reads) == 1 else found(where, mode)  # the first read came before it was marked made

    monkeypatch.setattr(prepare_module, "_open_group", late)
    assert prepare_module.Output.checked(path).is_store
    with pytest.raises(prepare_module.StoreError, match="exists and is not a streamx store"):
        reads.clear()
        prepare_module.Output.read(path).check()  # one read, as the check was


@pytest.mark.parametrize("before, after", [(3, 1), (1, 2)])
def test_a_resume_at_another_world_size_finishes_the_store(tiny_chat_model_dir, chat_jsonl, tmp_path, monkeypatch,
                                                           before, after):
    """A job of `before` ranks stops part way (the last rank's disk goes away after a few batches; with 3 ranks,
    rank 1 is killed while creating its part, which it leaves half-made), and the same command resumes it with
    `after` ranks: the store completes, with every row as one process computes it, with no rank of the old world
    run again."""
    reference = tmp_path / "ref.zarr"
    run(small_config(tiny_chat_model_dir, chat_jsonl, reference, sort_window=4), progress=False, log=lambda m: None)
    out = tmp_path / "s.zarr"

    def ranks(world_size: int, **settings):
        for rank in range(world_size):
            yield small_config(tiny_chat_model_dir, chat_jsonl, out, sort_window=4, rank=rank, world_size=world_size,
                               **settings)
    *finished, last = ranks(before)
    for config in finished:
        if config.rank == 1:  # killed between creating its part's group and its arrays
            zarr.open_group(str(out), mode="r+").require_group("parts").create_group("part-00001")
            continue
        run(config, progress=False, log=lambda m: None)
    fail_at_batch(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        run(last, progress=False, log=lambda m: None)
    monkeypatch.undo()
    assert not open_store(str(out)).completeness().complete

    said = []
    for config in ranks(after):
        run(config, progress=False, log=said.append)
    store = open_store(str(out))
    assert store.completeness().complete, store.completeness().problems()
    assert_same_samples(reference, out)
    assert verify(str(out), use_model=False, log=lambda m: None).passed
    if before > after:
        assert sorted(store.parts) == ["part-00000", "part-00002"]  # the half-made part-00001 removed
        assert [line for line in said if line.startswith(("closed", "removed"))] == [
            "removed part-00001, left half-made by a killed rank: no rank of this world of 1 writes it",
            "closed part-00002: no rank of this world of 1 writes it, and every row of the data is committed"]


def test_ranks_from_flags_torchrun_and_slurm(monkeypatch):
    from streamx.pipeline.ranks import Rank, init_from_env

    for name in ("WORLD_SIZE", "RANK", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                 "SLURM_ARRAY_TASK_STEP"):
        monkeypatch.delenv(name, raising=False)
    assert init_from_env() == Rank()
    assert init_from_env(2, 4) == Rank(2, 4) and Rank(2, 4).independent and not Rank(2, 4).group
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "14")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", "2")  # --array=10-16:2
    assert init_from_env() == Rank(2, 4)
    assert init_from_env(0, 4) == Rank(0, 4)  # flags win
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "30")  # --array=10,12,14,30: listed ids
    with pytest.raises(ValueError, match=r"task 30 .*needs --rank and --world-size\): rank 10 of a world of 4"):
        init_from_env()
    with pytest.raises(ValueError, match="--rank and --world-size go together"):
        init_from_env(1, None)


SLOW_STREAMX = '''"""streamx's CLI with each forward of the run taking 2 s more (a real model's pace on a tiny
one) and torch's default collective timeout at 10 s, as STREAMX_WAIT_MINUTES sets streamx's own."""
import sys
import time
from datetime import timedelta

import torch.distributed.distributed_c10d as c10d

c10d.default_pg_timeout = timedelta(seconds=10)
from streamx.model.capture import LayerCapture  # noqa: E402

forward = LayerCapture.forward


def slow(self, batch, states):
    if batch.num_tokens > 64:  # the run's batches, not the start-up check's rows
        time.sleep(2)
    return forward(self, batch, states)


LayerCapture.forward = slow
from streamx.cli import main  # noqa: E402

sys.argv[0] = "streamx"
main()
'''


def test_a_rank_that_finished_does_not_stop_the_ones_still_computing(tiny_chat_model_dir, chat_jsonl, tmp_path,
                                                                     torch_threads):
    """The usual resume after a rank died: rank 0's share is done (here a job-array task ran it), rank 1 has all of
    its rows left. Under torchrun with the collectives' timeout at 10 s (STREAMX_WAIT_MINUTES) and rank 1's work
    taking longer than that, rank 0 ends at once without waiting for it (no barrier at the end to time out and have
    torchrun stop the job), rank 1 finishes, says the whole summary, and the store equals one process's."""
    torch_threads(1)
    reference = tmp_path / "ref.zarr"
    assert cli(*rank_args(tiny_chat_model_dir, chat_jsonl, reference)).returncode == 0
    out = tmp_path / "s.zarr"
    assert cli(*rank_args(tiny_chat_model_dir, chat_jsonl, out), "--rank", "0", "--world-size", "2").returncode == 0
    left = open_store(str(reference)).row_ids().size - open_store(str(out)).row_ids().size
    wrapper = tmp_path / "slow_streamx.py"
    wrapper.write_text(SLOW_STREAMX)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(wrapper), *rank_args(tiny_chat_model_dir, chat_jsonl, out)],
                            env={**ENV, "STREAMX_WAIT_MINUTES": str(10 / 60)}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started > 12, "rank 1's work must outlast the collectives' timeout for this to show"
    # rank 0 had nothing left; rank 1, the last to finish, finds the store complete and says the whole summary
    assert "this run committed 0 samples" in result.stdout and f"this run committed {left} samples" in result.stdout
    assert_same_samples(reference, out)
