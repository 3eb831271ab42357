"""Several models in one process (miniserve/models/registry.py), completion mode from the command
line,
and the loader's answers to files it cannot use."""

import copy
import gc
import json
import threading
import time
import weakref
from pathlib import Path

import pytest
from test_cli import generate_json, run

from miniserve.core import heap
from miniserve.core.config import SamplingParams
from miniserve.models.registry import (
    Models,
    ModelSpecError,
    UnknownModel,
    load_specs_file,
    open_models,
    parse_spec,
)
from miniserve.runners.loader import ModelLoadError, check_gguf, load_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


# -- the --model values and models.yaml ------------------------------------------------------
def test_model_values_name_sources_and_urls():
    assert parse_spec("default").name == "SmolLM2-135M-Instruct"
    assert parse_spec("mine=default") == parse_spec("default").__class__("mine", "default")
    remote = parse_spec("http://gpu-box:8000/v1#Qwen/Qwen2.5-7B", context=32768, api_key="k")
    assert (
        remote.name,
        remote.source,
        remote.remote,
        remote.served_name,
        remote.context,
        remote.api_key,
    ) == ("Qwen/Qwen2.5-7B", "http://gpu-box:8000/v1", True, "Qwen/Qwen2.5-7B", 32768, "k")
    assert parse_spec("http://gpu-box:8000/v1/").name == "gpu-box:8000"
    assert parse_spec("big=https://h/v1#m").name == "big"
    assert parse_spec("/models/x.gguf").name == "x"
    assert parse_spec("gemma-3-270m").name == "gemma-3-270m"
    with pytest.raises(ModelSpecError, match="named 'SmolLM2-135M-Instruct'"):
        open_models(["default", "default"])
    with pytest.raises(ModelSpecError, match="empty"):
        parse_spec(" ")
    with pytest.raises(ModelSpecError, match="give the source after '='"):
        parse_spec("mine=")
    with pytest.raises(ModelSpecError, match="not a valid URL: Invalid port"):
        parse_spec("http://gpu-box:abc/v1")


def test_models_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_KEY", "secret")
    f = tmp_path / "models.yaml"
    f.write_text(
        "models:\n  - default\n  - {name: big, source: 'http://h:1/v1#m', context: 8192,"
        " api_key_env: GPU_KEY}\n  - {name: team/small, source: default}\n"
    )
    specs = load_specs_file(str(f))
    assert [s.name for s in specs] == ["SmolLM2-135M-Instruct", "big", "team/small"]
    assert specs[2].source == "default"
    assert (specs[1].context, specs[1].api_key, specs[1].served_name) == (8192, "secret", "m")
    for text, says in (
        ("[]", "a list of models"),
        ("- {name: x}", "'source'"),
        ("- {source: default, colour: red}", "unknown key(s) colour"),
        ("- {source: default, context: -3}", "'context'"),
        ("a: [", "cannot be read"),
        ("- {source: default, name: ''}", "'name' must be a non-empty string"),
        ("- {source: default, api_key_env: 3}", "'api_key_env'"),
    ):
        f.write_text(text)
        with pytest.raises(ModelSpecError, match=said(says)):
            load_specs_file(str(f))


def said(text):
    import re

    return re.escape(text)


# -- the registry: load on first use, least recently used idle model unloaded -----------------
@pytest.fixture(scope="module")
def two():
    """Two names over the embedded model, at most one loaded at a time."""
    models = open_models(["a=default", "b=default"], max_loaded=1)
    yield models
    models.close()


def test_models_load_on_first_use_and_make_room(two):
    assert two.loaded() == [] and two.default == "a"
    said_ = []
    a = two.get("default", progress=said_.append)  # the API's placeholder: the default
    assert a.name == "a" and two.loaded() == ["a"] and any("Loaded" in m for m in said_)
    assert two.get("a") is a  # loaded once
    with pytest.raises(UnknownModel, match="choose one of: a, b"):
        two.get("c")
    # a is in use (a reply streams from it): b loads beside it, over the limit, rather than
    # unloading a model under a running request
    with two.use("a"):
        stream = a.complete_text("Once upon a time", GREEDY.replace(max_new_tokens=60))
        next(stream)
        b = two.get("b")
        assert two.loaded() == ["a", "b"] and "".join(c.text for c in stream)
    # a's last user left: the registry goes back within max_loaded, unloading the least
    # recently used idle model (on a thread of its own)
    deadline = time.monotonic() + 30
    while len(two.loaded()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert two.loaded() == ["b"]
    text_b = "".join(c.text for c in b.complete_text("Once upon a time", GREEDY))
    two.max_loaded = 2
    assert two.get("a") is not a and two.loaded() == ["b", "a"]
    two._make_room(keep="x", adding=1)  # one more to come: the least recently used idle one goes
    assert two.loaded() == ["a"]
    again = "".join(c.text for c in two.get("a").complete_text("Once upon a time", GREEDY))
    assert again == text_b  # the same weights, the same arithmetic, the same tokens


def test_a_loaded_model_is_left_out_of_collections_and_an_unloaded_one_goes(two):
    # A load sets what exists aside from the collector's full passes (gc.freeze: one over
    # torch's and transformers' objects stalled a decoding step by ~100 ms); an unload takes
    # it back and collects, so that garbage in reference cycles (a model's, here a stand-in
    # made before the load) does not outlive the model.
    class Ring:
        pass

    ring = Ring()
    ring.me = ring
    gone = weakref.ref(ring)
    two.max_loaded = 2
    heap.starting()  # as a command starts: full collections rarer while it imports
    assert gc.get_threshold() != heap.USUAL
    engine = two.get("b")
    assert gc.get_threshold() == heap.USUAL  # the usual ones once a model is loaded
    assert gc.get_freeze_count() > 100_000  # the imports and the model, frozen
    assert len(gc.get_objects()) < 50_000  # what a full pass walks now
    runner = weakref.ref(engine.runner)  # in reference cycles of its own
    del ring, engine
    gc.collect()
    assert gone() is not None and runner() is not None  # frozen: full passes leave them
    two.unload("b")
    assert gone() is None and runner() is None  # the model's memory went with it


def test_a_closed_engines_model_goes_at_the_next_load():
    # a runner sits in reference cycles: frozen at its load, it would stay after its engine
    # closed; the close thaws the heap and the next load collects before it freezes
    from miniserve.engine.engine import start_engine

    first = start_engine()
    runner = weakref.ref(first.runner)
    first.close()
    del first
    second = start_engine()
    try:
        assert runner() is None
    finally:
        second.close()


def test_a_model_that_fails_to_load_leaves_the_others_working(tmp_path):
    models = open_models(["default", f"broken={tmp_path / 'missing.gguf'}"])
    try:
        with pytest.raises(ModelLoadError, match="does not exist"):
            models.get("broken")
        text, _ = models.get(None).chat_text(
            [{"role": "user", "content": "Hi"}], GREEDY.replace(max_new_tokens=3)
        )
        assert text
    finally:
        models.close()


def test_concurrent_first_requests_load_a_model_once():
    models = open_models(["default"])
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.get(None))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(e) for e in got}) == 1
    models.close()


# -- completion mode -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_engine(engine):
    """The embedded model as a base model would be: the same weights, no chat template."""
    from miniserve.engine.engine import Engine

    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = None
    loaded = copy.copy(engine.loaded)
    loaded.tokenizer = tokenizer
    base = Engine(loaded, name="base")
    yield base
    base.close()


def test_completion_mode_continues_text_without_a_template(engine, base_engine):
    from miniserve.engine.chat import NoChatTemplate

    prompt = "The three primary colours are"
    ids = engine.tokenizer(prompt)["input_ids"]
    assert base_engine.prompt_ids(prompt, GREEDY) == ids  # plain text, no template
    chunks = list(base_engine.complete_text(prompt, GREEDY))
    same = list(base_engine.complete_text(ids, GREEDY))
    assert "".join(c.text for c in chunks) == "".join(c.text for c in same)
    assert chunks[-1].stats.prompt_tokens == len(ids)
    with pytest.raises(NoChatTemplate, match="completion mode"):
        base_engine.chat([{"role": "user", "content": "Hi"}], GREEDY)
    assert base_engine.info()["chat"] is False and engine.info()["chat"] is True
    # a notebook past the context keeps its newest tokens; the API's prompt is refused
    long = " word" * 9000
    kept = base_engine.prompt_ids(long, GREEDY, trim=True)
    assert len(kept) == base_engine.context_length - GREEDY.max_new_tokens
    from miniserve.engine.chat import ChatError

    n = len(engine.tokenizer(long)["input_ids"])
    with pytest.raises(ChatError, match=f"'prompt' is {n} tokens, but with max_new_tokens=12"):
        base_engine.prompt_ids(long, GREEDY)


def test_a_notebook_past_the_context_keeps_its_bos():
    """Trimmed from the left, a prompt keeps the BOS its tokenizer puts first (Gemma, Llama)."""
    from miniserve.engine.chat import completion_ids

    class WithBos:  # a tokenizer that starts every text with BOS = 2, a token a word
        bos_token_id = 2

        def __call__(self, text):
            return {"input_ids": [2] + [10 + len(w) for w in text.split()]}

    ids = completion_ids(
        WithBos(), "a bb ccc dddd eeeee", context_length=5, max_new_tokens=2, trim=True
    )
    assert ids == [2, 14, 15]


def test_prompt_logprobs_match_one_forward_pass(engine):
    import torch

    ids = engine.tokenizer(
        "The capital of France is Paris, and the capital of Italy is Rome." * 12
    )["input_ids"]
    assert len(ids) > 128  # more than one piece
    got = engine.prompt_logprobs(ids, top=3)
    logits = engine.run_on_worker(
        lambda: engine.runner.forward(torch.tensor([ids]), all_logits=True)
    )
    want = torch.log_softmax(logits.float(), -1)
    assert len(got) == len(ids) - 1
    for pos, (lp, top) in enumerate(got):
        assert lp == pytest.approx(float(want[pos, ids[pos + 1]]), abs=1e-3)
        assert [t for t, _ in top] == want[pos].topk(3).indices.tolist() or top[0][
            1
        ] == pytest.approx(float(want[pos].max()), abs=1e-3)


# -- the command line ------------------------------------------------------------------------
def test_generate_raw_continues_the_prompt(engine):
    prompt = "The capital of France is"
    flags = ("--temperature", "0", "--repetition-penalty", "1", "--max-new-tokens", "10")
    out = generate_json("--raw", "--prompt", prompt, *flags, "--dtype", "float32")
    text = "".join(
        c.text
        for c in engine.complete_text(prompt, GREEDY.replace(max_new_tokens=10), reuse_prefix=False)
    )
    assert out["raw"] is True and out["text"] == text
    assert out["prompt_tokens"] == len(engine.tokenizer(prompt)["input_ids"])
    r = run("generate", "--raw", "--system", "x", "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--system" in r.stderr


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory, loaded):
    """A transformers folder of the embedded model whose tokenizer has no chat template."""
    folder = tmp_path_factory.mktemp("base-model")
    loaded.model.save_pretrained(folder)
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def test_a_base_model_gets_one_line_pointing_to_raw(base_folder):
    for command in (["generate", "--prompt", "hi"], ["chat"]):
        r = run(*command, "--model", str(base_folder), "--runner", "lean", stdin="hi\n")
        assert r.returncode == 2, r.stderr
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "no chat template" in lines[0] and "--raw" in lines[0]
        assert "Traceback" not in r.stderr
    r = run(
        "chat",
        "--raw",
        "--model",
        str(base_folder),
        "--runner",
        "lean",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        stdin="Once upon a time\nthere was\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tokens/s") == 2 and "Traceback" not in r.stderr


def test_chat_switches_models_by_name(base_folder):
    r = run(
        "chat",
        "--model",
        "default",
        "--model",
        f"base={base_folder}",
        "--runner",
        "lean",
        "--temperature",
        "0",
        "--max-new-tokens",
        "5",
        stdin="/model\nHi\n/model nope\n/model base\nOnce upon a time\n/model default\n/raw\nHi\n",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "also served: base (not loaded)" in out
    assert "model 'nope' is not served here; choose one of: SmolLM2-135M-Instruct, base" in out
    assert "base has no chat template (a base model): raw mode on" in out
    assert "raw mode off" in out and out.count("tokens/s") == 3


def test_model_flags_and_files_fail_in_one_line(tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_text("hello")
    from miniserve.runners.loader import embedded_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_gguf().read_bytes()[:5_000_000])
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, "mamba9")
    for args, says in (
        ([str(not_gguf)], "is not a GGUF file"),
        ([str(cut)], "truncated"),
        ([str(odd)], "architecture 'mamba9' runs neither natively"),
        (["a=default", "a=default"], "two models are named 'a'"),
        (["http://127.0.0.1:9/v1"], "127.0.0.1:9"),
    ):
        r = run("generate", "--prompt", "hi", *sum((["--model", a] for a in args), []))
        assert r.returncode in (1, 2), (args, r.stderr)
        errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], (args, r.stderr)
        assert "Traceback" not in r.stderr
    r = run("generate", "--prompt", "hi", "--max-loaded-models", "0")
    assert r.returncode == 2 and "--max-loaded-models must be from 1" in r.stderr


def write_gguf(path: Path, arch: str) -> None:
    """A small, whole GGUF of an architecture nobody loads."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_loader_checks_the_file_before_transformers_does(tmp_path):
    from miniserve.runners.loader import embedded_gguf

    assert check_gguf(embedded_gguf()) == "llama"
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, "mamba9")
    with pytest.raises(ModelLoadError, match="architecture 'mamba9' runs neither natively"):
        load_model(str(odd))


def test_models_of_an_engine(engine):
    models = Models.of(engine)
    assert models.names == [engine.name] and models.get("default") is engine
    assert Models.of(models) is models
