"""The benchmark's token check on a GGUF run as stored: a float64 pass over the file's blocks
(miniserve/runners/float64.py), not a float32 transformers copy of the model. It agrees with the
embedded model's greedy tokens, sees a runner that chose one wrong token, writes nothing to the
cache, and says in one line when the pass would not fit in memory. Copies that the engine does
write to the cache are said once, with their size."""

from __future__ import annotations

import numpy as np
import pytest

from miniserve.bench import check
from miniserve.bench.check import TokenCheck
from miniserve.bench.options import BenchConfig
from miniserve.bench.report import verdict
from miniserve.bench.runs import clear_prefix_cache, run_bench
from miniserve.runners.float64 import Float64Reference

from conftest import needs_native

CONFIG = dict(prompt_tokens=[10, 24], new_tokens=8, repeat=1, modes=("no_cache", "cache"))


def listing(folder):
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file()
    )


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """The cache folder, empty, for the length of a test: anything written there is seen."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("MINISERVE_CACHE", str(folder))
    return folder


@needs_native
def test_the_check_follows_the_embedded_model_and_writes_nothing(
    stored_engine, empty_cache, monkeypatch
):
    def no_copy(self):
        raise AssertionError("the check asked for the transformers copy of the model")

    monkeypatch.setattr(type(stored_engine.loaded), "reference", no_copy)
    result = run_bench(stored_engine, BenchConfig(**CONFIG))
    assert result.tokens_verified and all(r.verified is True for r in result.rows)
    assert result.check == "float64 reference over the file's blocks"
    line = verdict(result)
    assert "follow the float64 reference over the file's blocks: yes (teacher-forced" in line
    assert "2 x the row's error bound" in line and "nothing written" in line
    assert "at bound 3 (as stored)" in line and "the reference's top token at" in line
    assert listing(empty_cache) == []  # no copy of the model, nor anything else


@needs_native
def test_a_runner_that_chooses_one_wrong_token_fails_the_check(stored_engine, monkeypatch):
    """The runner's logits at one decode step of the measured run lifted at its own worst
    token: the reply takes it there, and the check must say so."""
    runner = stored_engine.runner
    real = runner.step
    state = {"armed": False, "decodes": 0}

    def wrong(entries, all_logits=False):
        logits = real(entries, all_logits)
        if state["armed"] and len(entries) == 1 and len(entries[0][0]) == 1:
            state["decodes"] += 1
            if state["decodes"] == 3:
                logits = logits.clone()
                logits[-1, int(logits[-1].argmin())] = float(logits[-1].max()) + 50
        return logits

    def progress(fraction, message):  # the measured run, after the warm-up
        state["armed"] = state["armed"] or message.startswith("10 prompt tokens, cache")

    monkeypatch.setattr(runner, "step", wrong)
    config = BenchConfig(**{**CONFIG, "prompt_tokens": [10], "modes": ("cache",)})
    try:
        result = run_bench(stored_engine, config, progress)
    finally:
        clear_prefix_cache(stored_engine)
    assert state["decodes"] >= 3
    assert not result.tokens_verified and result.rows[0].verified is False
    assert "follow the float64 reference over the file's blocks: NO" in verdict(result)


@needs_native
def test_the_check_says_in_one_line_when_the_reference_would_not_fit(
    stored_engine, monkeypatch, empty_cache
):
    monkeypatch.setattr(check, "available_memory", lambda: 10**6)
    config = BenchConfig(**{**CONFIG, "prompt_tokens": [10]})
    result = run_bench(stored_engine, config)
    assert all(r.verified is None for r in result.rows)  # not checked, not "checked"
    line = verdict(result)
    assert line.startswith(
        "greedy tokens not checked: the float64 reference over the file's blocks would hold about "
    )
    assert "at once and 0.0 GB is available" in line and "\n" not in line
    assert listing(empty_cache) == []


@needs_native
def test_one_pass_over_many_sequences_gives_each_its_own_logits(stored):
    """logits_many: sequences of one pass see only themselves; the last rows asked for are the
    full pass's last rows."""
    reference = Float64Reference(stored.model)
    a, b = [1, 5, 9, 200, 7, 31], [42, 3, 3, 17]
    alone = reference.logits(a)
    many = reference.logits_many([b, a], [None, 2])
    assert many[0].shape == (4, alone.shape[1]) and many[1].shape == (2, alone.shape[1])
    assert np.allclose(many[1], alone[-2:], rtol=0, atol=1e-9)
    assert not np.allclose(many[0][:2], alone[:2], rtol=0, atol=1e-3)  # b is not a
    assert reference.peak_bytes([6, 4], [2, 4]) > 0


@needs_native
def test_a_perturbed_reference_disagrees(stored_engine, monkeypatch):
    """The same replies against a reference whose output matrix was scaled: what the check
    holds our tokens to is the file's weights."""
    check = TokenCheck(stored_engine, 8)
    ids = stored_engine.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    tokens = [c for chunk in stored_engine.complete(ids, greedy(8)) for c in chunk.token_ids]
    check.add(ids, tokens)
    check.run()
    assert check.verdict([(ids, tokens)], 3.0) is True
    real = Float64Reference.part

    def perturbed(self, name, start, stop):
        values = real(self, name, start, stop)
        return values if name not in ("output.weight", "token_embd.weight") else -values

    monkeypatch.setattr(Float64Reference, "part", perturbed)
    wrong = TokenCheck(stored_engine, 8)
    wrong.add(ids, tokens)
    wrong.run()
    assert wrong.verdict([(ids, tokens)], 3.0) is False


def greedy(n):
    from miniserve.core.config import BUILTIN_PRESETS, GREEDY

    return BUILTIN_PRESETS[GREEDY].replace(max_new_tokens=n)


def test_a_copy_written_to_the_cache_is_said_once_with_its_size(
    stored, tiny_model, tokenizer, empty_cache, monkeypatch, capsys
):
    """A GGUF loaded by transformers is dequantized and written to the cache once: that load
    says where and how big, and the next reads it and says nothing of a copy. The copy the
    benchmark's generate() modes load for weights as stored (LoadedModel.reference, whose
    progress nobody watches) says it too. (transformers' own dequantizing stood in for by a
    tiny model: what is written and said is the loader's.)"""
    import copy
    import shutil

    from miniserve.runners import loader

    monkeypatch.setattr(
        loader, "_load_pretrained", lambda *a, **k: (copy.deepcopy(tiny_model), tokenizer)
    )
    said: list[str] = []
    loader.load_model(None, device="cpu", dtype="float32", progress=said.append)
    wrote = [m for m in said if m.startswith("Wrote a float32 copy of")]
    assert len(wrote) == 1 and " MB; later starts read it" in wrote[0], said
    (folder,) = [p for p in empty_cache.iterdir() if p.name.endswith("-float32")]
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert f"{folder} ({size / 1e6:.1f} MB;" in wrote[0]
    again: list[str] = []
    loader.load_model(None, device="cpu", dtype="float32", progress=again.append)
    assert not [m for m in again if m.startswith("Wrote")], again
    assert any("from the cache" in m for m in again)

    shutil.rmtree(folder)  # as stored: the copy the first generate() row loads
    capsys.readouterr()
    fresh = copy.copy(stored)
    fresh._reference = None
    fresh.reference()
    err = capsys.readouterr().err
    assert err.count("Wrote a float32 copy of SmolLM2-135M-Instruct.Q4_1.gguf") == 1, err
