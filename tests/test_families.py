"""The model families of the architecture table (miniserve/core/architectures.py) as stored: tiny
synthetic GGUFs of each (written from the table by miniserve/bench/synthetic.py) through the
native runner, teacher-forced against a float64 pass over the same weights dequantized by the
gguf package (miniserve/runners/float64.py); a sequence alone against the same sequence in a
batch; and the mistakes each new operation invites, which must fail that comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from miniserve.bench import synthetic
from miniserve.runners.float64 import Float64Reference
from miniserve.runners.verify import BOUND_STORED_F16_RELATIVE

from conftest import needs_native, pinned_runner, same_on_every_cpu, tiny_shape

pytestmark = pinned_runner  # the stored and native runners, named: the no-native leg leaves them

S = synthetic.Shape
# head_dim 32 where hidden / heads is 16: the key_length path; every size tiny
SHAPES = {
    "qwen3": S("qwen3", 64, 96, 2, 4, 2, 32, 1e6, 1e-6),
    # Phi-4-mini's kind: q|k|v and gate|up fused, 24 of 32 dimensions turned, LongRoPE; the
    # file's context (8192) past the original 2048: the long factors
    "phi3": S("phi3", 64, 96, 2, 4, 2, 32, 1e4, 1e-5, tied=False, rotary=24, longrope=2048),
    # ... and within it: the short ones; and partial rotary alone
    "phi3-short": S("phi3", 64, 96, 2, 4, 2, 32, 1e4, 1e-5, rotary=24, longrope=16384),
    "phi3-plain": S("phi3", 64, 96, 2, 4, 2, 32, 1e4, 1e-5, rotary=24),
    # Gemma 3 1B's attention (4 heads, 1 kv head, local layers of 512 positions, every 6th
    # global), narrow: a prompt of 600 positions goes past the window
    "gemma3-1b": S("gemma3", 64, 96, 6, 4, 1, 32, 1e6, 1e-6, window=512),
    # Gemma 3 4B's global RoPE, linear-scaled by 8
    "gemma3-4b": S("gemma3", 64, 96, 6, 4, 2, 32, 1e6, 1e-6, window=8, rope_linear=8.0),
    # Qwen3 MoE in small: 16 experts, 4 a token, each 32 wide
    "qwen3moe": S(
        "qwen3moe",
        64,
        96,
        2,
        4,
        2,
        32,
        1e6,
        1e-6,
        tied=False,
        experts=16,
        experts_used=4,
        expert_ffn=32,
    ),
    # 10 heads over 2 kv heads: groups of 5 (the AVX2 build's attention takes 4 heads at once,
    # then one alone), 16 dimensions (its sums then go 8 at a time)
    "llama": S("llama", 64, 96, 2, 10, 2, 16, 1e4, 1e-5, tied=False),
    # groups of 3 (SmolLM2's), 24 dimensions: the AVX2 attention's 3 heads at once, its sums
    # 16 and then 8 columns at a time
    "qwen2": S("qwen2", 64, 96, 2, 12, 4, 24, 1e6, 1e-6, qkv_bias=True),
}
LENGTH = {"gemma3-1b": 600}
# the embedded tokenizer's first 4096 tokens and the merges among them (synthetic.py): a whole
# tokenizer that transformers' GGUF reader parses in a second, not ten
VOCAB = 4096


def write(tmp_path_factory, name: str, shape: synthetic.Shape):
    path = tmp_path_factory.mktemp("families") / f"{name}.gguf"
    synthetic.SHAPES[name] = shape
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(synthetic, "STD", 0.25)  # logits of a useful size
            synthetic.write_gguf(path, name, vocab=VOCAB, quant="f16")
    finally:
        del synthetic.SHAPES[name]
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return {name: write(tmp_path_factory, name, shape) for name, shape in SHAPES.items()}


def stored_runner(path):
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    loaded = load_model(str(path), dtype="stored", progress=lambda m: None)
    return StoredRunner(loaded.model, "float32")


def ids_for(name: str) -> list[int]:
    return [(37 * i + 11) % VOCAB for i in range(LENGTH.get(name, 40))]


def compare(runner, ids) -> tuple[float, float]:
    """(largest |error| over the largest |logit|, that largest |logit|) of the runner's
    teacher-forced logits against the float64 reference over the same file. With experts:
    no row's K-th expert nearly tied with the next (where it is, float32 may choose the other,
    as check_greedy allows near-tied tokens; these files have none, so every choice counts)."""
    reference = Float64Reference(runner.weights)
    want = reference.logits(ids)
    if runner.arch.moe:
        assert min(reference.margins) > 1e-4, min(reference.margins)
    got = runner.forward(torch.tensor([ids]), None, all_logits=True).double().numpy()
    scale = float(np.abs(want).max())
    return float(np.abs(got - want).max()) / scale, scale


@pytest.mark.parametrize("name", list(SHAPES))
@needs_native
def test_each_family_as_stored_follows_the_float64_reference(files, name):
    """Float16 weights (the activations stay float32: no rounding to blocks), float32
    arithmetic: the float32 bound, relative to the logits' size."""
    runner = stored_runner(files[name])
    assert runner.arch.name == SHAPES[name].arch
    error, scale = compare(runner, ids_for(name))
    assert scale > 0.5
    assert error <= BOUND_STORED_F16_RELATIVE, error


@same_on_every_cpu
@needs_native
def test_the_table_decides_what_each_family_runs(files):
    """What the comparison above rests on, read off the runners: partial rotary, the LongRoPE
    factors chosen by the context, windows and global layers, the attention scale."""
    phi, short = stored_runner(files["phi3"]), stored_runner(files["phi3-short"])
    assert phi.rot == 24 and phi.head_dim == 32 and phi.cos.shape[1] == 12  # an angle each
    assert phi.native.struct.rot == 24 and phi.native.struct.gelu == 0
    assert not torch.equal(phi.cos, short.cos)  # long factors against short ones
    gemma = stored_runner(files["gemma3-1b"])
    assert gemma.windows == [512] * 5 + [None] and gemma.native.struct.gelu == 1
    assert stored_runner(files["qwen3"]).windows == [None, None]


@needs_native
def test_an_moe_token_reads_the_experts_it_uses_not_all_of_them(files):
    """What the bench's ceiling rests on: per token, of each experts' tensor the K of E
    experts a token uses, in bytes and in weights; every other matrix whole. Counted here from
    the file's tensor table, apart from the runner's own sum."""
    from miniserve.bench.machine import weight_elements

    runner, shape = stored_runner(files["qwen3moe"]), SHAPES["qwen3moe"]
    tensors = runner.weights.file.tensors
    share = shape.experts_used / shape.experts
    want_bytes = want_elements = 0
    for name, t in tensors.items():
        if name == "token_embd.weight":  # looked up; the file has its own output matrix
            continue
        part = share if "_exps." in name else 1
        want_bytes += t.nbytes * part
        want_elements += int(np.prod(t.shape)) * part
    assert any("_exps." in name for name in tensors) and "output.weight" in tensors
    assert runner.weight_bytes() == want_bytes
    assert weight_elements(runner) == want_elements
    dense = stored_runner(files["qwen3"])  # the same rule leaves a dense file's tensors whole
    assert weight_elements(dense) == sum(
        int(np.prod(t.shape))
        for name, t in dense.weights.file.tensors.items()
        if name != "token_embd.weight" or "output.weight" not in dense.weights.file.tensors
    )


@pytest.mark.parametrize(
    "name,mistake",
    [
        ("phi3-plain", "full rotary"),
        ("qwen3", "no q/k norms"),
        ("phi3-short", "long factors"),
        ("gemma3-1b", "no window"),
        ("gemma3-4b", "unscaled global RoPE"),
    ],
)
@needs_native
def test_each_mistake_a_family_invites_fails_the_comparison(files, name, mistake, monkeypatch):
    """The runner built with one thing wrong (as a bug would build it) moves the logits far past
    the bound: the comparison can see each of these. (q/k norms after RoPE instead of before,
    tried by moving them in decode.cpp, fails the test above the same way.)"""
    from miniserve.runners import stored

    path = files[name]
    reference = Float64Reference(stored_runner(path).weights)
    if mistake == "full rotary":
        config = stored.GGUFWeights._config
        monkeypatch.setattr(
            stored.GGUFWeights,
            "_config",
            lambda self: dataclasses.replace(
                config(self), rotary_dim=self.file.get("phi3.attention.key_length")
            ),
        )
    runner = stored_runner(path)
    if mistake == "no q/k norms":
        for layer in runner.layers:
            layer.pop("q_norm"), layer.pop("k_norm")
    elif mistake == "long factors":
        divisors = runner.weights.vector("rope_factors_long.weight", runner.rot // 2)
        runner.cos, runner.sin = stored.rope_tables(
            runner.rot,
            runner.config.rope_theta,
            runner.cos.shape[0],
            1.0,
            divisors,
            float(runner.weights._meta("rope.scaling.attn_factor")),
        )
        runner.local_cos, runner.local_sin = runner.cos, runner.sin
    elif mistake == "no window":
        runner.windows = [None] * len(runner.layers)
    elif mistake == "unscaled global RoPE":
        runner.cos, runner.sin = stored.rope_tables(
            runner.rot, runner.config.rope_theta, runner.cos.shape[0]
        )
    runner.native = type(runner.native)(runner, runner.math)
    ids = ids_for(name)
    want = reference.logits(ids)
    got = runner.forward(torch.tensor([ids]), None, all_logits=True).double().numpy()
    error = float(np.abs(got - want).max()) / float(np.abs(want).max())
    assert error > 100 * BOUND_STORED_F16_RELATIVE, (mistake, error)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma3-4b", "qwen3moe"])
@needs_native
def test_a_sequence_of_each_family_gets_the_same_logits_in_a_batch(files, name):
    """Batch invariance: a prompt alone, then its rows beside two other sequences' (decode rows
    and another prompt's chunk), bit for bit."""
    runner = stored_runner(files[name])
    ids = ids_for(name)[:30]
    alone = runner.step([(ids, runner.new_cache())], all_logits=True)
    others = [([5, 6, 7], runner.new_cache()), ([9] * 20, runner.new_cache())]
    together = runner.step([others[0], (ids, runner.new_cache()), others[1]], all_logits=True)
    assert torch.equal(together[3 : 3 + len(ids)], alone)


@needs_native
def test_an_moe_sequence_decoding_alone_gets_the_logits_of_its_rows_in_a_prompt(files):
    """A pass of one row (a sequence decoding alone: its K experts' products in two parallel
    regions) against the same rows read as one prompt (the rows grouped by expert), bit for
    bit, at every position."""
    runner = stored_runner(files["qwen3moe"])
    ids = ids_for("qwen3moe")[:12]
    prompt = runner.step([(ids, runner.new_cache())], all_logits=True)
    cache = runner.new_cache()
    decoded = torch.cat([runner.step([([token], cache)]) for token in ids])
    assert decoded.shape == prompt.shape
    assert torch.equal(decoded, prompt)


@same_on_every_cpu
def test_an_architecture_outside_the_table_is_one_sentence_naming_what_runs(tmp_path):
    """A file of another architecture: the error (transformers cannot load it either) or the
    notice before the transformers fallback dequantizes it names the architecture, every one
    that runs natively, and (the notice) roughly what the fallback costs."""
    from test_models import write_gguf

    from miniserve.core.architectures import ARCHITECTURES
    from miniserve.runners.loader import ModelLoadError, fallback_notice, load_model

    path, odd = tmp_path / "other.gguf", tmp_path / "odd.gguf"
    write_gguf(path, "stablelm")  # an architecture transformers loads
    notice = fallback_notice(path, "stablelm", torch.bfloat16)
    assert "architecture 'stablelm' does not run natively" in notice
    assert all(name in notice for name in ARCHITECTURES)
    assert "0.00 B weights to bfloat16" in notice and "5 s and 0.0 GB" in notice
    write_gguf(odd, "mamba9")  # one it does not
    with pytest.raises(ModelLoadError) as e:
        load_model(str(odd))
    assert "'mamba9' runs neither natively" in str(e.value)
    assert all(name in str(e.value) for name in ARCHITECTURES)


def tiny_transformers(family: str):
    """A tiny transformers model of the family, random norm weights (they start at 1)."""
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    common = tiny_shape()
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    else:  # Phi-4-mini's partial rotary: 12 of 16 dimensions turn
        model = Phi3ForCausalLM(Phi3Config(**common, partial_rotary_factor=0.75, pad_token_id=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
@needs_native
def test_the_lean_and_native_runners_compute_what_transformers_computes(family):
    """The same table read over transformers' weights: Qwen3's q/k norms, Phi-3's fused
    matrices and partial rotary, in the lean PyTorch pass and the native one."""
    from miniserve.runners.lean import LeanRunner, supports
    from miniserve.runners.native import NativeRunner

    model = tiny_transformers(family)
    ids = [(7 * i + 3) % 300 for i in range(40)]
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]
    assert supports(model)
    for runner in (LeanRunner(model), NativeRunner(model, math="float32")):
        got = runner.forward(torch.tensor([ids]), None, all_logits=True)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (runner.name, family)


@same_on_every_cpu
@needs_native
def test_expert_tensors_that_disagree_with_the_header_are_one_error(tmp_path):
    """A file whose header makes each expert 16 wide while its expert tensors hold 32 rows an
    expert: refused before any kernel reads the tensors, naming the tensor and both sizes."""
    import gguf

    from miniserve.runners.loader import ModelLoadError, load_model

    width = gguf.GGUFWriter.add_expert_feed_forward_length
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_expert_feed_forward_length", lambda w, n: width(w, n // 2))
        path = write(tmp_path_factory_for(tmp_path), "qwen3moe", SHAPES["qwen3moe"])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), dtype="stored", progress=lambda m: None)
    assert "'blk.0.ffn_gate_exps.weight' is (16, 32, 64)" in str(e.value)
    assert "make it (16, 16, 64)" in str(e.value)


def tmp_path_factory_for(path):
    class Factory:
        def mktemp(self, name):
            folder = path / name
            folder.mkdir()
            return folder

    return Factory()


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
@needs_native
def test_transformers_reading_the_same_file_computes_what_the_stored_runner_does(
    tmp_path_factory, name
):
    """A second reference, where transformers' GGUF mapping reads the shape right: its qwen3
    assumes head_dim 128 (it ignores key_length) and its qwen3moe an expert width of 768
    (it ignores expert_feed_forward_length), so those sizes here."""
    from transformers import AutoModelForCausalLM

    shape = dataclasses.replace(
        SHAPES[name], head_dim=128, **({"expert_ffn": 768} if name == "qwen3moe" else {})
    )
    path = write(tmp_path_factory, f"{name}-hf", shape)
    runner = stored_runner(path)
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = ids_for(name)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0].double()
    got = runner.forward(torch.tensor([ids]), None, all_logits=True).double()
    scale = float(want.abs().max())
    assert scale > 0.5
    assert float((got - want).abs().max()) / scale <= BOUND_STORED_F16_RELATIVE
