"""Shared fixtures: the real embedded model is loaded once per test session."""

import contextlib
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
    from reference import remembered_twin

    return remembered_twin(loaded.model)


@pytest.fixture(scope="session")
def ref16(bf16):
    """The bfloat16-rounded weights in float64: the reference for runners over bf16 weights."""
    from reference import remembered_twin

    return remembered_twin(bf16.model)


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


def tiny_shape(**changes) -> dict:
    """The sizes of the tiny random transformers models (a transformers config's keywords):
    hidden 64, 2 layers, 4 query heads over 2 key/value heads; `changes` replace some."""
    return {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **changes,
    }


@pytest.fixture(scope="module")
def presets():
    """The presets (presets.yaml and the built-in greedy), as the app loads them."""
    from miniserve.core.config import load_presets

    return load_presets()


@pytest.fixture(scope="session")
def tiny_model():
    """A randomly initialised Llama with the real architecture, for fast unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = tiny_shape(vocab_size=320, intermediate_size=128, max_position_embeddings=256)
    return LlamaForCausalLM(LlamaConfig(**shape, eos_token_id=2, bos_token_id=1)).eval()


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


def assert_same_whatever_shares_the_pass(step, new_cache, ids, whole, chunk: int):
    """A sequence's logits alone in one pass (`whole`) are the same bits with its prompt in
    chunks of 7, and in chunks of `chunk` in passes beside two other sequences (one of them
    still reading its prompt). `step([(ids, cache), ...], all_logits=True)` is one pass, as
    NativeRunner.native and StoredRunner.step run it."""
    cache, pieces = new_cache(), []
    for a in range(0, len(ids), 7):
        pieces.append(step([(ids[a : a + 7], cache)], all_logits=True))
    assert torch.equal(torch.cat(pieces), whole)
    mine, other, third = new_cache(), new_cache(), new_cache()
    step([([9] * 40, other)])
    rows = []
    for a in range(0, len(ids), chunk):
        got = step([([4] * 3, third), (ids[a : a + chunk], mine), ([11], other)], all_logits=True)
        rows.append(got[3 : 3 + len(ids[a : a + chunk])])
    assert torch.equal(torch.cat(rows), whole)


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


@contextlib.contextmanager
def page_at(browser, url, width=1400, height=1000):
    """A new page of `browser` (the fixture) showing `url`; closed at the end."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(url)
    yield page
    page.close()
