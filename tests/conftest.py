"""Shared fixtures: the real embedded model is loaded once per test session."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Saved conversations of the app and CLI processes the tests start go to a folder of their own,
# never to the user's data folder.
if "MINISERVE_DATA_DIR" not in os.environ:
    import tempfile

    os.environ["MINISERVE_DATA_DIR"] = tempfile.mkdtemp(prefix="miniserve-test-data-")


@pytest.fixture(scope="session")
def loaded():
    """SmolLM2-135M-Instruct from the embedded GGUF, float32 (the reference precision)."""
    from miniserve.runners.loader import load_model

    return load_model(None, dtype="float32", progress=lambda m: None)


@pytest.fixture(scope="session")
def bf16():
    """The same model with bfloat16 weights."""
    from miniserve.runners.loader import load_model

    return load_model(None, dtype="bfloat16", progress=lambda m: None)


@pytest.fixture(scope="session")
def stored():
    """The same GGUF with its weights as stored (Q4_1 blocks, memory-mapped: the native
    runner's default), where the native runner runs."""
    if not native_expected():
        pytest.skip("MINISERVE_NATIVE=0: weights as stored need the native runner")
    from miniserve.runners.loader import load_model

    return load_model(None, dtype="stored", progress=lambda m: None)


@pytest.fixture(scope="session")
def stored_engine(stored):
    from miniserve.engine.engine import Engine

    return Engine(stored)


@pytest.fixture(scope="session")
def ref32(loaded):
    """The float32 model's weights in float64: the reference for float32 runners."""
    from reference import float64_twin

    return float64_twin(loaded.model)


@pytest.fixture(scope="session")
def ref16(bf16):
    """The bfloat16-rounded weights in float64: the reference for runners over bf16 weights."""
    from reference import float64_twin

    return float64_twin(bf16.model)


@pytest.fixture(scope="session")
def engine(loaded):
    from miniserve.engine.engine import Engine

    return Engine(loaded)


@pytest.fixture(scope="session")
def two_models():
    """Two names over the embedded GGUF, the default and "second", each its own engine,
    loaded on first use (the web app's and the API's several-model tests)."""
    from miniserve.models.registry import open_models

    models = open_models(["default", "second=default"])
    yield models
    models.close()


@pytest.fixture(scope="session")
def tokenizer(loaded):
    return loaded.tokenizer


@pytest.fixture(scope="session")
def tiny_model():
    """A randomly initialised Llama with the real architecture, for fast unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


def native_expected() -> bool:
    """The native runner runs unless this leg turned it off (make test-no-native)."""
    return os.environ.get("MINISERVE_NATIVE", "1") != "0"


def expected_runner() -> str:
    return "native" if native_expected() else "lean"


# A test on a runner it names (transformers, lean): the same computation in every leg that
# leaves the CPU's kernels alone, so the leg without the native runner leaves it out.
pinned_runner = pytest.mark.pinned_runner
# A test of behaviour no kernel's arithmetic changes (queues, budgets, errors, the fallback
# when the native library is missing): the legs that imitate other CPUs leave it out.
same_on_every_cpu = pytest.mark.same_on_every_cpu

needs_native = pytest.mark.skipif(
    not native_expected(),
    reason="MINISERVE_NATIVE=0: this leg runs without the native runner "
    "(the full leg runs this test)",
)


def chat_ids(tokenizer, text, system=None):
    from miniserve.engine.chat import render

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return render(tokenizer, messages)


@pytest.fixture(scope="session")
def app_server():
    """The real web app (UI + API on one port) with the embedded model."""
    from servers import Server

    server = Server(["app.py"])
    yield server
    server.stop()


CHROMIUM = os.environ.get("MINISERVE_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium, headless, driven by Playwright (`make chromium` installs it)."""
    import shutil

    if not shutil.which(CHROMIUM):
        pytest.fail(f"Chromium not found at {CHROMIUM}; `make chromium` installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()
