import json
import os

# Tests never reach the HF hub: set before transformers / huggingface_hub are imported (they read it at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from streamx.models import EMBEDDED_MODEL, load_model, resolve_model_path

# Tests that load the embedded model (directly or through a fixture built on it), build the
# speculators venv or start an S3 server are integration tests: `pytest -m "not integration"` runs
# the rest (stages on plain Python objects and tiny in-memory models) in seconds.
INTEGRATION_FIXTURES = {"smollm2_dir", "speculators_python", "s3_env"}


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: needs the embedded model, a venv, a server or subprocesses")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def smollm2_dir(pytestconfig) -> str:
    """The embedded SmolLM2-135M-Instruct as an HF directory (converted once per machine into the normal cache)."""

    def say(message: str) -> None:
        with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            print(f"\n{message} ...", flush=True)

    return resolve_model_path(EMBEDDED_MODEL, say)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model in float32 on CPU, tokenizer)."""
    model, tokenizer, _ = load_model(smollm2_dir, dtype="float32", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_chat_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """A 4-layer random Llama with SmolLM2's real tokenizer and chat template: fast end-to-end runs."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def chat_jsonl(tmp_path_factory) -> str:
    """Real chatterbot conversations as a jsonl file, some joined into longer multi-turn chats."""
    from streamx.source import open_source

    rows = [row.record for row in open_source("chatterbot:english")]
    out, i = [], 0
    while i < 120:
        n = 1 + len(out) % 4  # 1..4 conversations joined: lengths vary for bucketing and padding
        messages = [m for r in rows[i : i + n] for m in r["messages"]]
        out.append({"messages": messages})
        i += n
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return str(path)
