import os

# Tests never reach the HF hub: set before transformers / huggingface_hub are imported (they read it at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from streamx.models import EMBEDDED_MODEL, load_model, resolve_model_path


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF directory (converted once per machine into the normal cache)."""
    return resolve_model_path(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model in float32 on CPU, tokenizer)."""
    model, tokenizer, _ = load_model(smollm2_dir, dtype="float32", device="cpu")
    return model, tokenizer
