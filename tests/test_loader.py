"""Model sources: the embedded GGUF (and its weight cache), and clear errors for bad ones."""

import pytest
import torch

from miniserve.runners.loader import ModelLoadError, load_model, pick_device, resolve_source


@pytest.mark.parametrize(
    "source, words",
    [
        ("/no/such/model", ["/no/such/model", "does not exist"]),
        ("./missing-folder/x.gguf", ["missing-folder", "does not exist"]),
    ],
)
def test_bad_local_source_is_one_clear_sentence(source, words):
    with pytest.raises(ModelLoadError) as info:
        load_model(source, progress=lambda m: None)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"0")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_source(str(f))


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_unreachable_hub_id_is_one_clear_sentence(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time: set the constant too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as info:
        load_model("nobody-here/no-such-model-xyz", progress=lambda m: None)
    assert "nobody-here/no-such-model-xyz" in str(info.value) and "\n" not in str(info.value)


def test_device_falls_back_to_cpu_here():
    expected = (
        "cuda"
        if torch.cuda.is_available()
        else "mps"
        if torch.backends.mps.is_available()
        else "cpu"
    )
    assert pick_device().type == expected


def test_weight_cache_gives_the_same_model(tmp_path, monkeypatch):
    """First load dequantizes a GGUF and writes the cache; the second reads it: same logits,
    same tokenizer. The file: a synthetic tiny Llama in Q8_0 blocks with the embedded model's
    tokenizer cut to 4096 tokens (the loader's path for any GGUF that is dequantized, in seconds;
    the embedded file itself, Q4_1, is not loaded here)."""
    from miniserve.bench import synthetic

    monkeypatch.setenv("MINISERVE_CACHE", str(tmp_path / "cache"))
    shape = synthetic.Shape("llama", 64, 96, 2, 4, 2, 16, 1e4, 1e-5, tied=False)
    path = synthetic.write_shape(tmp_path / "tiny.gguf", shape, "tiny", vocab=4096, quant="q8_0")
    messages = []
    fresh = load_model(str(path), dtype="float32", progress=messages.append)
    assert any("Dequantizing" in m for m in messages)
    messages.clear()
    cached = load_model(str(path), dtype="float32", progress=messages.append)
    assert any("from the cache" in m for m in messages)
    ids = torch.tensor([[1, 969, 198, 2683, 359, 253, 3564, 4095]])
    with torch.inference_mode():
        a, b = fresh.model(ids).logits, cached.model(ids).logits
    assert torch.equal(a, b) and a.abs().max() > 0  # the same tensors: exact by construction
    fresh.model.to(torch.float64)  # a dequantized GGUF is a plain model (no "quantized" flag)
    assert fresh.tokenizer("héllo 🎉")["input_ids"] == cached.tokenizer("héllo 🎉")["input_ids"]
    assert fresh.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False
    ) == cached.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_the_tokenizer_metadata_is_what_transformers_reads():
    """The GGUF tokenizer's inputs read by our GGUF parser (the faster first start) are exactly
    transformers' get_gguf_tokenizer()'s: a BPE vocabulary (the embedded model) and a
    sentencepiece one with scores (Gemma 3 270M, installed by `make models`)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    from miniserve.runners.loader import _tokenizer_metadata, embedded_gguf, known_model_path

    for path in (embedded_gguf(), known_model_path("gemma-3-270m", install=False)):
        assert _tokenizer_metadata(path) == get_gguf_tokenizer(str(path)), path.name


def test_a_cached_tokenizer_reads_back_as_from_pretrained_reads_it(tmp_path):
    """The cache's tokenizer read back by cached_tokenizer (one parse of tokenizer.json) is
    the tokenizer transformers' from_pretrained reads from the same folder: the same class,
    vocabulary, special tokens, chat template, ids (with and without the special tokens, for
    text with spaces, emoji, CJK and the templates' own tokens) and decoded text; for a BPE
    vocabulary (the embedded model) and a sentencepiece one (Gemma 3 270M)."""
    from transformers import PreTrainedTokenizerFast

    from miniserve.runners.loader import (
        _gguf_tokenizer,
        cached_tokenizer,
        embedded_gguf,
        known_model_path,
    )

    texts = [
        "Hello, world!",
        "  two spaces\tand a tab\n\nlines",
        "émoji 🤖, CJK 你好, e\u0301",
        "<|im_start|>user\nhi<|im_end|><bos><start_of_turn>model",
        "def f(x):\n    return x ** 2  # ok",
    ]
    templates = 0
    for path in (embedded_gguf(), known_model_path("gemma-3-270m", install=False)):
        folder = tmp_path / path.stem
        _gguf_tokenizer(path).save_pretrained(str(folder))
        ours, theirs = cached_tokenizer(folder), PreTrainedTokenizerFast.from_pretrained(folder)
        assert type(ours) is type(theirs) and len(ours) == len(theirs), path.name
        assert ours.get_vocab() == theirs.get_vocab() and ours.chat_template == theirs.chat_template
        assert ours.special_tokens_map == theirs.special_tokens_map
        assert ours.get_added_vocab() == theirs.get_added_vocab()
        for text in texts:
            for special in (True, False):
                ids = theirs.encode(text, add_special_tokens=special)
                assert ours.encode(text, add_special_tokens=special) == ids, (path.name, text)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                        ids, skip_special_tokens=skip
                    )
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        if theirs.chat_template:  # (where the file carries one; the engine has its own too)
            templates += 1
            assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
                chat, tokenize=False
            )
    assert templates  # the embedded model's, at least, was compared
