import fcntl
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

# Tests never reach the HF hub: set before transformers / huggingface_hub are imported (they read it at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two test processes (pytest-xdist) share the machine's cores: torch runs on one intra-op thread in each, and in
# every process a test starts (they inherit it). The tests' models are tiny: with two threads each on 2 cores, the
# threads wait on one another at every small op. A test that needs another count asks for `torch_threads`.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from streamx.model.load import EMBEDDED_MODEL, cache_dir, load_model, resolve_model_path

# Tests that load the embedded model (directly or through a fixture built on it), build the
# speculators venv or start an S3 server are integration tests: `pytest -m "not integration"` runs
# the rest (stages on plain Python objects and tiny in-memory models) in seconds.
INTEGRATION_FIXTURES = {"smollm2_dir", "speculators_python", "s3_env", "chat_server", "trainer_venv"}


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: needs the embedded model, a venv, a server or subprocesses")
    config.addinivalue_line("markers", "speculators: needs the speculators venv (built once per Python version)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if INTEGRATION_FIXTURES & fixtures:
            item.add_marker(pytest.mark.integration)
        if "speculators_python" in fixtures:
            item.add_marker(pytest.mark.speculators)


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
def peaked_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """A 4-layer random Llama with weights drawn as the zoo's (std 0.1): attention peaked enough that a position
    off by two moves the states (at std 0.02 it is nearly uniform); SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("peaked-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 initializer_range=0.1)).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


@pytest.fixture
def torch_threads():
    """`torch_threads(n)`: torch on n intra-op threads for the rest of the test (the session's are restored)."""
    import torch

    threads = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def chat_jsonl(tmp_path_factory) -> str:
    """Real chatterbot conversations as a jsonl file, some joined into longer multi-turn chats."""
    from streamx.data.source import open_source

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


# speculators 0.9.0 pins transformers<=5.19, datasets<=5.1, torch<=2.14.1: it lives in its own venv. torch 2.13.0
# is pinned first (the CPU build here, ~1.5 GB venv instead of ~6 GB with 2.14.1's CUDA build); torchvision 0.28
# is the one matching it (pip would otherwise upgrade torch for 0.29).
SPECULATORS_PINS = ("torch==2.13.0", "torchvision==0.28.*", "speculators==0.9.0")
# what docs/speculators.md installs beside speculators for its `streamx` backend: streamx without its own
# dependencies, the store reader's two (neither touches torch, transformers or datasets), and s3fs at the
# version of the fsspec that datasets brought (for s3:// stores)
STREAMX_IN_SPECULATORS = ("zarr>=3.1", "google-crc32c>=1.5")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def speculators_python(pytestconfig) -> str:
    """A venv with speculators==0.9.0 (cached per machine; a half-built one is rebuilt) and this checkout's
    streamx installed into it as docs/speculators.md says (every session: the checkout changes), its python."""
    root = cache_dir() / "venvs" / "speculators-0.9.0"
    python, ready = root / "bin" / "python", root / ".streamx-ready"
    key = f"{sys.version} {' '.join(SPECULATORS_PINS)}"
    root.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    with open(root.parent / "speculators-0.9.0.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine
        if not (ready.exists() and ready.read_text() == key and python.exists()):
            with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
                print(f"\nbuilding the speculators venv once into {root} (~1.5 GB, a minute or two) ...", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
            subprocess.run([*pip, "install", *SPECULATORS_PINS], check=True, timeout=3600)
            # speculators declares torchvision and torchaudio but never imports them; PyPI's torchvision is built
            # for CUDA torch and fails to load next to a CPU torch, which breaks transformers' imports
            subprocess.run([*pip, "uninstall", "--yes", "torchvision", "torchaudio"], check=True)
            ready.write_text(key)
        # as docs/speculators.md installs streamx there (a no-op once done, but the checkout itself changes)
        fsspec = subprocess.run([str(python), "-c", "import fsspec; print(fsspec.__version__)"], check=True,
                                capture_output=True, text=True).stdout.strip()
        subprocess.run([*pip, "install", *STREAMX_IN_SPECULATORS, f"s3fs=={fsspec}"], check=True, timeout=600)
        # the distribution was named streamx before 0.4 (now streamx-hs): a venv built then still lists it
        subprocess.run([*pip, "uninstall", "--yes", "streamx"], check=True, timeout=600, capture_output=True)
        subprocess.run([*pip, "install", "--no-deps", "--force-reinstall", REPO], check=True, timeout=600,
                       capture_output=True)
    return str(python)


@pytest.fixture(scope="session")
def speculators_venv(speculators_python):
    """Runs a script (and its arguments) in the speculators venv, offline; returns the finished process."""

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONNOUSERSITE="1")
        return subprocess.run([speculators_python, *args], env=env, capture_output=True, text=True, timeout=timeout)

    return run


# The other trainers' own readers and drafts, each in a venv of its own that sees this environment's torch and
# transformers (a .pth file naming its site-packages) and holds the trainer's package alone: SpecForge 0.2.0 without
# its declared dependencies (sglang 0.5.14 and torch 2.11: CUDA builds of gigabytes, which its offline training never
# imports), ModelOpt 0.47.0 with its own (light: pulp, omegaconf, nvidia-ml-py, ...) and the transformers it supports
# (< 5.15: its EAGLE draft builds rotary embeddings in a way later ones refuse); nemo-automodel 0.7.0 without its
# declared dependencies (its offline caches' readers need torch and safetensors alone).
TRAINER_PACKAGES = {"specforge": ("--no-deps", "specforge==0.2.0"),
                    "modelopt": ("nvidia-modelopt==0.47.0", "transformers>=4.57,<5.15"),
                    "nemo": ("--no-deps", "nemo-automodel==0.7.0")}


@pytest.fixture(scope="session")
def trainer_venv():
    """`run(trainer, *args)`: a script run in that trainer's venv (built once per machine), offline."""

    def python(trainer: str) -> str:
        packages = TRAINER_PACKAGES[trainer]
        root = cache_dir() / "venvs" / f"trainer-{trainer}"
        py, ready, key = root / "bin" / "python", root / ".streamx-ready", f"{sys.version} {' '.join(packages)}"
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.parent / f"trainer-{trainer}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine
            if not (ready.exists() and ready.read_text() == key and py.exists()):
                shutil.rmtree(root, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
                # this environment's packages after the venv's own, whether it is the system's or a venv itself
                site_dir = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                          check=True, capture_output=True, text=True).stdout.strip()
                Path(site_dir, "streamx-parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
                subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", "--quiet", "install", *packages],
                               check=True, timeout=1800)
                ready.write_text(key)
        return str(py)

    def run(trainer: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1")
        return subprocess.run([python(trainer), *args], env=env, capture_output=True, text=True, timeout=timeout)

    return run


class ChatServer:
    """`transformers serve` (transformers' `serving` extra) on a free localhost port with one model preloaded:
    the OpenAI-compatible server `streamx regenerate` is tested against. `kill()` ends it at once."""

    def __init__(self, model_dir: str, log_path):
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = model_dir
        self.log = open(log_path, "w")
        exe = shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable), "transformers")
        self.proc = subprocess.Popen([exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--device", "cpu", "--log-level", "warning"], stdout=self.log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self._wait_healthy(timeout=180)

    def _wait_healthy(self, timeout: float) -> None:
        import time
        import urllib.request
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"transformers serve did not answer in {timeout} s; see {self.log.name}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="session")
def chat_server(tiny_chat_model_dir, tmp_path_factory):
    """One `transformers serve` for the session's regenerate tests, of the tiny random Llama with SmolLM2's
    tokenizer and chat template: what the client is tested on is the protocol, and it answers ~20x faster than
    the embedded model on a CPU."""
    server = ChatServer(tiny_chat_model_dir, tmp_path_factory.mktemp("server") / "serve.log")
    yield server
    server.kill()
