"""--tp on the CPU (torchrun, gloo): the model sharded over the processes of a group by transformers' tp_plan, the
group's first process capturing and writing. The reference is one process of the same model (the sharded matmuls
reduce in another order: the stored bf16 states agree within their rounding, the ids and masks exactly)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import cli, committed_samples, distinct_copies, kill_the_last_worker_mid_run, run_args, worst_row
from transformers import AutoTokenizer, GPT2Config
from zoo_models import zoo_model

from streamx.model.support import TP_TESTED
from streamx.store import open_store
from streamx.train.verify import check_audit

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
FAMILIES = ["llama3", "qwen3_moe", "qwen3_5"]  # dense, MoE, and the hybrid's gated delta-net layers


@pytest.fixture(scope="module")
def checkpoints(smollm2_dir, tmp_path_factory) -> dict[str, str]:
    """The zoo's tiny models of FAMILIES, saved with SmolLM2's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tp-{family}")
        zoo_model(family).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = str(path)
    return out


@pytest.fixture(scope="module")
def long_data(checkpoints, chat_jsonl, tmp_path_factory) -> tuple[str, str]:
    """Data long enough to stop a run mid-way (its rows all differ), and one process's store of it on llama3."""
    folder = tmp_path_factory.mktemp("tp-long")
    data = folder / "data.jsonl"
    data.write_text(distinct_copies(chat_jsonl, 3))
    launch(checkpoints["llama3"], str(data), folder / "one.zarr")
    return str(data), str(folder / "one.zarr")


def flags(model: str, data: str, out, **settings) -> list[str]:
    """`run` and its flags, for these tests' settings."""
    return run_args(model, data, out, sort_window=8, layers="0,2,4", dtype="float32", **settings)


def command(model: str, data: str, out, processes: int, **settings) -> list[str]:
    """`streamx run` under torchrun in `processes` (with --tp in `settings`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "streamx", *flags(model, data, out, **settings)]


def launch(model: str, data: str, out, processes: int = 1, **settings) -> subprocess.CompletedProcess:
    """The run, and that it succeeded: one process in this one (no interpreter to start), more under torchrun."""
    if processes == 1:
        result = cli(*flags(model, data, out, **settings))
    else:
        result = subprocess.run(command(model, data, out, processes, **settings), env=ENV, capture_output=True,
                                text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_close_samples(reference, other) -> None:
    """Every row of `reference` in `other`: ids and masks equal, every state within bf16's rounding of it."""
    a, b = open_store(str(reference)), open_store(str(other))
    assert sorted(a.row_ids().tolist()) == sorted(b.row_ids().tolist()) and len(a) > 0
    for row in a.row_ids().tolist():
        x, y = a.sample(row), b.sample(row)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        torch.testing.assert_close(y.hidden_states.float(), x.hidden_states.float(), rtol=2 ** -7, atol=1e-5)


def test_the_support_tables_tp_column_is_these_tests():
    from zoo_models import zoo_config

    assert sorted(TP_TESTED) == sorted(zoo_config(family).model_type for family in FAMILIES)


@pytest.mark.parametrize("family, ep", [(family, False) for family in FAMILIES] + [("qwen3_moe", True)],
                         ids=[*FAMILIES, "qwen3_moe-ep"])
def test_tp_2_equals_one_process(family, ep, checkpoints, chat_jsonl, tmp_path):
    """Packed, with shared prefixes continued (the hybrid's conv and recurrent states handed over too); with --ep the
    MoE's experts spread whole over the two processes (transformers 5.25 leaves them whole on each under TP alone)."""
    model = checkpoints[family]
    launch(model, chat_jsonl, tmp_path / "one.zarr")
    result = launch(model, chat_jsonl, tmp_path / "tp2.zarr", processes=2, tp=2, **({"ep": True} if ep else {}))
    assert "[rank 0, tensor-parallel 1] ran its share" in result.stdout
    store = open_store(str(tmp_path / "tp2.zarr"))
    assert list(store.parts) == ["part-00000"] and store.num_tokens < store.row_tokens  # one group, shared
    assert_close_samples(tmp_path / "one.zarr", tmp_path / "tp2.zarr")


def test_tp_4_over_two_nodes_past_the_kv_heads_copies_them_and_equals_one_process(checkpoints, chat_jsonl, tmp_path):
    """2 KV heads at --tp 4: each is copied to the two processes whose query heads read it, as vLLM and SGLang serve
    Qwen3-235B-A22B's 4 at TP 8 with its experts spread (--ep; its per-head query and key norms too; a dense model at
    --tp 8: the next test). The group spans two torchrun agents of 2 processes each, as on two nodes (--nnodes 2,
    rendezvous at the first): the second's local ranks 0 and 1 are ranks 2 and 3 of the group."""
    from streamx.model.load import read_text_config

    model = checkpoints["qwen3_moe"]
    config = read_text_config(model)
    assert config.num_key_value_heads == 2 and config.num_attention_heads == 4
    launch(model, chat_jsonl, tmp_path / "one.zarr")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    logs = [(open(tmp_path / f"node{node}.out", "w"), open(tmp_path / f"node{node}.err", "w")) for node in (0, 1)]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "streamx",
         *flags(model, chat_jsonl, tmp_path / "tp4.zarr", tp=4, ep=True)],
        env=ENV, stdout=out, stderr=err, text=True) for node, (out, err) in enumerate(logs)]  # files: no pipe fills
    try:
        codes = [node.wait(timeout=600) for node in nodes]
    finally:
        for node, files in zip(nodes, logs, strict=True):
            node.kill()
            for file in files:
                file.close()
    out, err, second, second_err = ((tmp_path / f"node{node}.{kind}").read_text() for node in (0, 1)
                                    for kind in ("out", "err"))
    assert codes == [0, 0], (err[-3000:], second_err[-3000:])
    assert "[rank 0, tensor-parallel 1] ran its share" in out and "[rank 0, tensor-parallel 3] ran its share" in second
    assert "ranks   1 data-parallel groups of --tp 4 --ep, each with its share of the rows: this is data-parallel " \
           "rank 0, tensor-parallel rank 0 (process 0)" in err  # the banner
    assert "  tp      this process holds " in err and "whole on every process" not in err
    assert_close_samples(tmp_path / "one.zarr", tmp_path / "tp4.zarr")


def test_tp_8_with_4_kv_heads_equals_one_process(smollm2_dir, chat_jsonl, tmp_path):
    """Qwen3-235B-A22B's shape in small: 4 KV heads of 8 query heads at --tp 8, each KV head on two processes (eight
    processes on this machine's cores: slow, and the code path of a real 8-GPU node)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "llama-8q-4kv"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=8)).save_pretrained(model)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(model)
    launch(str(model), chat_jsonl, tmp_path / "one.zarr", max_samples=12)
    result = launch(str(model), chat_jsonl, tmp_path / "tp8.zarr", processes=8, tp=8, max_samples=12)
    assert "[rank 0, tensor-parallel 7] ran its share" in result.stdout
    assert_close_samples(tmp_path / "one.zarr", tmp_path / "tp8.zarr")


def test_a_plan_that_leaves_the_attention_whole_is_said_by_plan_and_the_run(smollm2_dir, chat_jsonl, tmp_path):
    """gpt-oss under transformers 5.25's tensor-parallel plan: only its embeddings and head split, its attention
    whole on every process (its experts too, without --ep). The run measures what each process holds and says so,
    and `plan` counts the attention whole and names it."""
    from typer.testing import CliRunner

    from streamx.cli import app
    from streamx.model.footprint import footprints
    from streamx.model.load import meta_model

    model = tmp_path / "gpt_oss"
    zoo_model("gpt_oss").save_pretrained(model)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(model)
    result = launch(str(model), chat_jsonl, tmp_path / "tp2.zarr", processes=2, tp=2)
    line = next(line for line in result.stderr.splitlines() if line.startswith("  tp      "))
    held = float(line.split("(")[1].split("%")[0]) / 100  # measured: each parameter's local shard
    assert line.endswith("transformers' plan leaves self_attn whole on every process")
    plan = footprints(meta_model(str(model), torch.float32), 512, 3, sizes=(1, 2))  # from the plan's rules
    assert abs(held - plan[1].weights / plan[0].weights) < 0.002, (held, plan[1].weights / plan[0].weights)
    text = CliRunner().invoke(app, ["plan", "--model", str(model), "--data", chat_jsonl, "--out",
                                    str(tmp_path / "p.zarr"), "--sample-rows", "16"])
    assert "transformers' tensor-parallel plan leaves self_attn whole on every GPU under --tp" in text.stdout


def test_a_job_array_of_tp_groups_equals_one_process(checkpoints, long_data, tmp_path):
    """Two array tasks, each a torchrun job of --tp 2 on its node, started together and sharing no process group:
    task 0 by --rank/--world-size, task 1 by the Slurm array's variables; each job's first process prepares the store,
    the tasks' groups are data-parallel ranks 0 and 1 of 2, and the store equals one process's."""
    data, one = long_data
    out = tmp_path / "array.zarr"
    slurm = {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_MIN": "7", "SLURM_ARRAY_TASK_COUNT": "2"}
    jobs = [subprocess.Popen(command(checkpoints["llama3"], data, out, processes=2, tp=2, rank=0, world_size=2),
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            subprocess.Popen(command(checkpoints["llama3"], data, out, processes=2, tp=2),
                             env={**ENV, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    results = [job.communicate(timeout=600) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-3000:] for _, err in results]
    store = open_store(str(out))
    assert list(store.parts) == ["part-00000", "part-00001"] and store.completeness().complete
    assert "[rank 1, tensor-parallel 1] ran its share" in results[1][0]
    assert_close_samples(one, out)


def test_tp_2_by_dp_2_and_a_kill_then_resume_equal_one_process(checkpoints, long_data, tmp_path):
    """Four processes in two groups of two write two parts; the second group's other process killed mid-run stops
    the whole job, and the same command resumes it."""
    (model, (data, reference)), out = (checkpoints["llama3"], long_data), tmp_path / "four.zarr"
    kill_the_last_worker_mid_run(command(model, data, out, processes=4, tp=2), ENV, out, "part-00001", workers=4)
    assert 0 < committed_samples(out, "part-00001") < len(open_store(reference))
    launch(model, data, out, processes=4, tp=2)
    assert list(open_store(str(out)).parts) == ["part-00000", "part-00001"]
    assert_close_samples(reference, out)


def test_a_family_without_a_tp_plan_is_refused_before_any_weight_is_read(smollm2_dir, chat_jsonl, tmp_path):
    """GPT-2 has no tensor-parallel plan in transformers: one line, and the checkpoint has no weights to read."""
    model = tmp_path / "gpt2"
    GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4).save_pretrained(model)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(model)
    result = subprocess.run(command(str(model), chat_jsonl, tmp_path / "s.zarr", processes=2, tp=2), env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "error: --tp 2: transformers has no tensor-parallel plan for gpt2; run it with --tp 1" in result.stderr
    alone = cli(*flags(str(model), chat_jsonl, tmp_path / "s.zarr", tp=2))
    assert alone.returncode != 0 and "error: --tp 2 shards the model over processes of one torchrun job" in alone.stderr
    no_tp = cli(*flags(str(model), chat_jsonl, tmp_path / "s.zarr", ep=True))
    assert no_tp.returncode != 0 and "error: --ep spreads a MoE's experts over a --tp group" in no_tp.stderr
    assert not (tmp_path / "s.zarr").exists()


def test_fp8_under_tp_stopped_by_sigterm_resumes_to_one_process(checkpoints, long_data, tmp_path):
    """--storage fp8 with --tp 2: SIGTERM to every process of the job (Slurm's way; torchrun passes its own on as
    well, a second signal that is the same request) winds the group up with what was written committed; the same
    command resumes, and every state is one process's within fp8's rounding."""
    (model, (data, reference)), out = (checkpoints["llama3"], long_data), tmp_path / "tp2.zarr"
    args = command(model, data, out, processes=2, tp=2, storage="fp8")
    job = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.time() + 120
        while committed_samples(out) < 3 and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert job.poll() is None, "the job ended before it could be stopped"
        os.killpg(job.pid, signal.SIGTERM)  # as Slurm does: each process, and torchrun passes it on again
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert "stopped by SIGTERM: what was written is committed" in stdout, stderr[-3000:]
    assert "stopped at once" not in stderr
    committed = committed_samples(out)
    assert 0 < committed < len(open_store(reference))
    resumed = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed: {committed} rows were committed before this run" in resumed.stdout
    store = open_store(str(out))
    assert store.metadata.storage == "fp8" and store.completeness().complete
    reference = open_store(reference)
    assert sorted(store.row_ids().tolist()) == sorted(reference.row_ids().tolist())
    for row in reference.row_ids().tolist():
        x, y = reference.sample(row), store.sample(row)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        # fp8 e4m3 keeps 3 mantissa bits (test_fp8): within 2^-4 of each value, or the token's subnormal step
        scale = store.sample(row, raw=True).hidden_states_scales.float()[:, None, None]
        bound = x.hidden_states.float().abs() * (2**-4 + 2**-7) + scale * 2**-8
        assert ((y.hidden_states.float() - x.hidden_states.float()).abs() <= bound).all(), row


BROKEN_RUN = os.path.join(os.path.dirname(__file__), "tp_broken_run.py")


def broken_launch(model: str, data: str, out, after: int | None, kill_heal: bool = False, **settings):
    """`streamx run --tp 2` in two processes with test_audit's settings, each with a way of packing rows that turns
    wrong after `after` batches (None: right), tp_broken_run.py; with `kill_heal`, the first process fails before it
    computes rows again."""
    env = {**ENV, **({"AFTER": str(after)} if after is not None else {}), **({"KILL_HEAL": "1"} if kill_heal else {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           BROKEN_RUN, *run_args(model, data, out, tp=2, **settings)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_audit_under_tp_finds_a_way_wrong_and_the_group_heals_it(peaked_model_dir, chat_jsonl, tmp_path):
    """The in-run audit under --tp: each audited row computed alone by the sharded model (the group's other process
    sent it), the way found wrong dropped by the whole group, the batches of the next rung and the rows committed
    the broken way computed again by both processes; the run ends normally and every stored row equals the model's
    own forward of it alone."""
    out = tmp_path / "tp2.zarr"
    result = broken_launch(peaked_model_dir, chat_jsonl, out, after=2, audit_every=1, audit_share=0)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "audit: row" in log and "committed rows computed again" in log, log[-3000:]
    assert "[rank 0, tensor-parallel 1] ran its share" in result.stdout
    store = open_store(str(out))
    audited = store.audit()
    assert audited.found and audited.rung and audited.recomputed > 0 and not audited.to_heal
    assert store.completeness().problems() == [] and check_audit(store).passed
    assert worst_row(peaked_model_dir, out) < 0.01


def test_rows_left_to_heal_under_tp_are_healed_by_the_groups_resume(peaked_model_dir, chat_jsonl, tmp_path):
    """A --tp run that found a way wrong and failed before computing its committed rows again leaves them named in
    its record; the group's resume (--audit-every 0, no fault) starts both processes on the recorded rung and heals
    them."""
    out = tmp_path / "tp2.zarr"
    failed = broken_launch(peaked_model_dir, chat_jsonl, out, after=2, kill_heal=True, audit_every=1, audit_share=0)
    assert failed.returncode != 0 and "killed before healing" in failed.stderr
    assert open_store(str(out)).audit().to_heal
    resumed = broken_launch(peaked_model_dir, chat_jsonl, out, after=None, audit_every=0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "committed rows computed again" in resumed.stdout + resumed.stderr
    store = open_store(str(out))
    assert not store.audit().to_heal and store.completeness().problems() == [] and check_audit(store).passed
    assert worst_row(peaked_model_dir, out) < 0.01
