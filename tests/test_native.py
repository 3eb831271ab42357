"""The native forward pass (miniserve/runners/kernels/decode.cpp) against its definitions: the
matrix
product against float64, whole passes against the PyTorch lean model on tiny models of three
families (Llama, Qwen2, Gemma 3), a sequence alone against the same sequence among others (bit for
bit), and on the
real model against a float64 reference."""

import copy
import mmap
import os
import platform
import subprocess
import threading

import pytest
import torch
from test_decode import GREEDY, PROMPTS, run

from miniserve.engine.decode import generate
from miniserve.runners import native
from miniserve.runners.lean import LeanRunner
from miniserve.runners.native import NativeRunner
from miniserve.runners.verify import runner_bound

from command import process
from conftest import (
    assert_same_whatever_shares_the_pass,
    chat_ids,
    needs_native,
    pinned_runner,
    same_on_every_cpu,
    tiny_shape,
)
from reference import (
    TINY_BOUND,
    assert_greedy,
    float64_twin,
    one_token_at_a_time,
    teacher_forced,
    whole_prompt,
)

# what each ISA's loops need of the CPU (the compiler's -march=native turns them on from it)
ISA_NEEDS = {
    "avx512": {"avx512f"},
    "avx2": {"avx2", "fma"},
    "avx2+vnni": {"avx2", "fma", "avx_vnni"},
    "generic": set(),
    "generic+neon": set(),
}


def native_defines_avx_vnni() -> bool:
    """Whether the compiler's -march=native turns AVX-VNNI on (compilers before GCC 11 and
    clang 12 know no AVX-VNNI, whatever the CPU has): asked of the compiler, not the library."""
    compiler = native._compiler()
    if compiler is None:
        return False
    out = subprocess.run(
        [compiler, "-march=native", "-dM", "-E", "-x", "c++", "-"],
        input="",
        capture_output=True,
        text=True,
        check=False,
    )
    return "__AVXVNNI__" in out.stdout


def expected_isa(target: str, features: set[str], machine: str) -> str:
    """The loops decode.cpp's ms_isa() names for a build target on a CPU with these
    /proc/cpuinfo flags, worked out independently of the library."""
    plain = "generic+neon" if machine.lower() in ("arm64", "aarch64") else "generic"
    if target == "x86-64-v3":
        return "avx2"
    if target == "x86-64-v3-vnni":
        return "avx2+vnni"
    if target == "generic":
        return plain
    assert target == "native", target
    if "avx512f" in features:
        return "avx512"
    if {"avx2", "fma"} <= features:
        return "avx2+vnni" if "avx_vnni" in features and native_defines_avx_vnni() else "avx2"
    return plain


@needs_native
def test_this_leg_runs_the_kernels_it_names():
    """Each leg of `make test` imitates a CPU (Makefile): a leg that silently ran other
    kernels -- a cached -march=native library, a cap that did not take -- would test nothing
    new. In every case the library's loops are the ones the build target and the CPU's own
    flags (/proc/cpuinfo) call for, and loops this CPU can run; a leg's named ISA must be
    that one too."""
    from miniserve.core.platform import cpu_flags

    flags = set(cpu_flags().split())
    machine = platform.machine()
    if not flags and machine.lower() not in ("arm64", "aarch64"):
        pytest.skip("no /proc/cpuinfo flags to say what this CPU runs")
    target = os.environ.get("MINISERVE_NATIVE_ARCH", "").strip() or "native"
    assert native.build_target() == target
    got = native.isa()
    assert got == expected_isa(target, flags, machine), (got, target, native.build_target())
    assert ISA_NEEDS[got] <= flags, (got, sorted(flags))
    want = os.environ.get("MINISERVE_EXPECT_ISA")
    if want is not None:
        assert got == want, native.build_target()
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    if aten:
        assert torch.backends.cpu.get_cpu_capability() == aten.upper()


@needs_native
def test_the_library_builds_here():
    # The test machine has a C++ compiler (Makefile / CI install it): a missing library would
    # otherwise turn every native test below into a test of the fallback.
    assert native.load() is not None, native.unavailable_reason()


def _rows_for_top_k(n: int):
    """Rows a sampler's top-k meets: logits as a model writes them, ones rising all along
    (every value passes the threshold: the candidates are cut down many times), falling, ties
    at and around the k-th, -inf masks, a NaN at either end and in the middle."""
    gen = torch.Generator().manual_seed(n)
    plain = torch.randn(n, generator=gen) * 3
    rising = torch.arange(n, dtype=torch.float32) / 7
    masked = plain.clone()
    masked[torch.randperm(n, generator=gen)[: n - 30]] = float("-inf")
    nan_first, nan_middle, nan_last = plain.clone(), plain.clone(), plain.clone()
    nan_first[0], nan_last[-1] = float("nan"), float("nan")
    nan_middle[n // 2 + 3] = float("nan")  # inside a run of 16 the scan would skip
    return {
        "plain": plain,
        "rising": rising,
        "falling": rising.flip(0),
        "ties": torch.round(plain),
        "coarse": torch.round(plain * 20) / 20,  # a few ties, some at a k-th
        "masked": masked,
        "nan first": nan_first,
        "nan middle": nan_middle,
        "nan last": nan_last,
    }


@pytest.mark.parametrize("n", [64, 49152])
@needs_native
def test_the_top_k_selection_keeps_what_a_full_sort_keeps(n):
    # decode.cpp's one-pass top-k (the sampler's, engine/sampling.py) against the definition:
    # the k largest by a full sort, their positions ascending; refused (None) exactly where
    # the k-th is tied with a value left out, is not finite, or the row has a NaN
    assert native.load() is not None
    checked = refused = 0
    for name, row in _rows_for_top_k(n).items():
        for k in (1, 2, 7, 40, n // 2, n - 1):
            got = native.top_k(row, k)
            order = torch.sort(row, descending=True, stable=True).indices
            kth = row[order[k - 1]]
            ok = not row.isnan().any() and bool(kth.isfinite()) and int((row >= kth).sum()) == k
            assert (got is not None) == ok, (name, k)
            if got is None:
                refused += 1
                continue
            ids = order[:k].sort().values
            assert torch.equal(got[0], ids) and got[0].dtype == torch.int64, (name, k)
            assert torch.equal(got[1], row[ids]), (name, k)
            checked += 1
    assert checked > 20 and refused > 10  # both outcomes were exercised
    assert native.top_k(row, 0) is None and native.top_k(row, n) is None
    # a row that is a strided view is read as its values
    wide = torch.randn(n, 2)[:, 0]
    assert not wide.is_contiguous()
    assert torch.equal(native.top_k(wide, 5)[0], wide.topk(5).indices.sort().values)


def _nucleus(row: torch.Tensor, p: float) -> tuple[list[int], float]:
    """top-p's definition in float64 (the smallest set of the most likely tokens, ties to the
    lower position, whose probability reaches p), positions ascending; and how close the
    mass above any token comes to p (a token on the cut-off: float32's exp may decide it)."""
    probs = row.double().softmax(-1)
    order = torch.sort(row, descending=True, stable=True).indices
    above = probs[order].cumsum(0) - probs[order]
    keep = int((above < p).sum())
    return sorted(order[: max(keep, 1)].tolist()), float((above - p).abs().min())


@pytest.mark.parametrize("n", [61, 49152])  # 61: the vector loops' tails too
@needs_native
def test_the_top_p_selection_keeps_the_nucleus_of_the_definition(n):
    # decode.cpp's top-p (the sampler's, engine/sampling.py top_p_compact) against the float64
    # definition, for rows peaked to flat, masked, tied and rising; None where the whole row
    # must be filtered (a NaN, a +inf, no finite logit, p outside (0, 1))
    assert native.load() is not None
    gen = torch.Generator().manual_seed(n)
    rows = {name: row for name, row in _rows_for_top_k(n).items() if "nan" not in name}
    for scale in (8.0, 1.0, 0.05):
        rows[f"scale {scale}"] = torch.randn(n, generator=gen) * scale
    rows["one"] = torch.full((n,), -30.0)
    rows["one"][n // 3] = 5.0
    checked = 0
    for name, row in rows.items():
        for p in (0.05, 0.5, 0.9, 0.97, 0.999):
            want, margin = _nucleus(row, p)
            got = native.top_p(row, p)
            assert got is not None and got.dtype == torch.int64, (name, p)
            if margin < 1e-6:  # a token on the cut-off
                continue
            assert got.tolist() == want, (name, p)
            checked += 1
    assert checked > 40
    row = torch.randn(n, generator=gen)
    for bad in (float("nan"), float("inf")):
        broken = row.clone()
        broken[n // 2] = bad
        assert native.top_p(broken, 0.9) is None
    assert native.top_p(torch.full((n,), float("-inf")), 0.9) is None
    assert native.top_p(row, 0.0) is None and native.top_p(row, 1.0) is None
    wide = torch.randn(n, 2)[:, 0]  # a strided view is read as its values
    assert native.top_p(wide, 0.5).tolist() == _nucleus(wide.contiguous(), 0.5)[0]


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()  # round to nearest, ties to even, as decode.cpp does


@pytest.mark.parametrize(
    "dtype,math",
    [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.bfloat16, "bfloat16")],
)
@pytest.mark.parametrize(
    "rows,cols", [(4, 32), (7, 13), (64, 576), (130, 96), (9, 1536), (5, 24), (3, 48)]
)
@pytest.mark.parametrize("batch", [1, 6])
@needs_native
def test_matmul_equals_its_definition(dtype, math, rows, cols, batch):
    """Rows not a multiple of 4, batches that leave the 4x4 tiles a remainder, and columns that
    leave the vector loops a tail (24, 48: the AVX2 loops' 8 and 16) or that they skip (13;
    96 for bfloat16 products) take the other paths. bfloat16 products: the activations rounded
    to bfloat16, then float32 sums."""
    torch.manual_seed(rows * cols + batch)
    w = torch.randn(rows, cols).to(dtype)
    x = torch.randn(batch, cols)
    xr = round_bf16(x) if math == "bfloat16" else x
    exact = xr.double() @ w.double().T
    got = native.matmul(w, x, math)
    scale = (xr.double().abs() @ w.double().abs().T).max()
    assert torch.allclose(got.double(), exact, atol=float(scale) * 1e-6, rtol=0)


@pytest.mark.parametrize("math", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [13, 45])
@needs_native
def test_each_row_of_a_matmul_is_computed_as_if_alone(math, rows):
    """Batch invariance of the products: each row of a product equals the product of that row
    alone, bit for bit -- the same sums in the same order whichever tile computed them (13
    rows: one weight row against blocks of 8, 4 and 1 rows; 45: 4x4 tiles and their
    side-by-side reduction, and the remainders)."""
    torch.manual_seed(3)
    w = torch.randn(202, 576).to(torch.bfloat16)
    x = torch.randn(rows, 576)
    together = native.matmul(w, x, math)
    for i in range(rows):
        assert torch.equal(together[i], native.matmul(w, x[i : i + 1], math)[0])


def tiny(family: str, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    if family == "gemma3":
        return tiny_gemma3().to(dtype).eval()
    if family == "llama":  # head_dim 16: the vector paths
        model = LlamaForCausalLM(LlamaConfig(**tiny_shape()))
    else:  # Qwen2: biases on q/k/v; head_dim 12, 40 columns: the scalar paths
        shape = tiny_shape(hidden_size=48, intermediate_size=40, num_key_value_heads=1)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False))
        for layer in model.model.layers:  # random, not zero, biases
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model.to(dtype).eval()


def tiny_gemma3(window: int = 8, hidden: int = 64):
    """Gemma 3 in small: local layers with a window of 8 positions around a global one, each
    kind with its own RoPE base; a query scale (query_pre_attn_scalar 24) that is not
    head_dim's; random norm weights (transformers starts them at 0, where a missing 1 + w would
    show less); intermediate 100: the tails of the vector loops. sqrt(64) = 8 is the same
    factor in bfloat16 and float32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(
        **tiny_shape(hidden_size=hidden, intermediate_size=100, num_hidden_layers=4),
        head_dim=16,
        sliding_window=window,
        query_pre_attn_scalar=24,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@needs_native
def test_step_equals_the_pytorch_forward_pass(family):
    model = tiny(family)
    ids = [(7 * i + 3) % 300 for i in range(70)]  # 70 positions: several attention chunks
    reference = one_token_at_a_time(LeanRunner(model))(ids)
    got = one_token_at_a_time(NativeRunner(model))(ids)
    assert torch.allclose(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@needs_native
def test_bfloat16_weights_compute_like_float32_with_the_same_weights(family):
    model = tiny(family, torch.bfloat16)
    ids = [(5 * i + 1) % 300 for i in range(40)]
    reference = one_token_at_a_time(LeanRunner(copy.deepcopy(model).float()))(ids)
    got = one_token_at_a_time(NativeRunner(model, math="float32"))(ids)
    assert torch.allclose(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("math", ["float32", "bfloat16"])
@needs_native
def test_a_sequence_gets_the_same_logits_whatever_shares_its_pass(family, math):
    """Batch invariance by construction (kernels/decode.cpp): a sequence's logits are the same
    bits alone, one token at a time, its prompt in chunks of 7, and in passes beside two other
    sequences of other lengths (one of them still reading its prompt). Gemma 3: local layers'
    windows of 8 start at every offset within a tile of keys, and straddle the first block's
    end."""
    model = NativeRunner(tiny(family, torch.bfloat16), math=math)
    ids = [(5 * i + 1) % 300 for i in range(300)]  # past one attention block (256 positions)
    whole = model.native([(ids, model.new_cache())], all_logits=True)
    assert torch.equal(one_token_at_a_time(model)(ids), whole)
    assert_same_whatever_shares_the_pass(model.native, model.new_cache, ids, whole, chunk=50)


@needs_native
def test_prompt_and_steps_share_the_cache(tiny_model):
    """A prompt (one pass of many rows) then one-row steps, and the whole sequence again at
    every step (no cache): both held to the float64 twin."""
    reference = float64_twin(tiny_model)
    model = NativeRunner(tiny_model)
    ids = list(range(3, 60))
    for use_cache in (True, False):
        tokens = list(
            generate(
                model, ids, GREEDY.replace(max_new_tokens=20), eos_ids=set(), use_cache=use_cache
            )
        )
        assert len(tokens) == 20
        assert_greedy(reference, ids, tokens, TINY_BOUND)


def test_the_weights_are_moved_not_copied(tiny_model):
    """The matrices a token streams go into one block of memory (lean.WeightArena) that the
    transformers model shares: its modules point into it, nothing is stored twice, and it
    computes what it computed before."""
    model = copy.deepcopy(tiny_model)
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        before = model(ids).logits
    lean = LeanRunner(model)
    attn, layer = model.model.layers[0].self_attn, lean.layers[0]
    assert layer["wo"] is attn.o_proj.weight and lean.lm_head is model.lm_head.weight
    assert attn.q_proj.weight.data_ptr() == layer["wqkv"].data_ptr()
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: one block, with 2 MB pages asked for
        blocks = {
            t.untyped_storage().data_ptr()
            for w in lean.layers
            for t in (w["wqkv"], w["wo"], w["w13"], w["w2"], lean.lm_head)
        }
        assert len(blocks) == 1
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, before, atol=TINY_BOUND, rtol=0)


@needs_native
def test_same_logits_from_another_thread(tiny_model):
    """Exact by construction: the same code with the same pool of threads, from another
    Python thread."""
    model = NativeRunner(tiny_model)
    ids = list(range(3, 30))
    here = one_token_at_a_time(model)(ids)
    box = {}
    worker = threading.Thread(target=lambda: box.update(logits=one_token_at_a_time(model)(ids)))
    worker.start()
    worker.join()
    assert torch.equal(here, box["logits"])


# ---- the real model ----------------------------------------------------------------------


@pytest.mark.parametrize("math", ["float32", "bfloat16"])
@needs_native
def test_real_model_over_bfloat16_weights_follows_the_float64_reference(bf16, ref16, math):
    """bfloat16 weights, float32 arithmetic: what a float32 model holding the rounded weights
    computes, up to the order of the sums -- so held to those weights in float64 within
    float32's bound, with and without the cache. bfloat16 products (activations rounded at
    each product's input): within their own bound. Without the cache a reply's every pass
    runs the prompt path over the whole text and keeps its last row, and a row's logits do
    not depend on the rows beside it (test_a_sequence_gets_the_same_logits_whatever_shares_
    its_pass): so one pass over the short prompt and its reply, every logit of every row
    within the bound, checks what those 40 passes would."""
    model = NativeRunner(bf16.model, math=math)
    bound = runner_bound(model)
    for name in ("short", "long"):
        ids = chat_ids(bf16.tokenizer, PROMPTS[name])
        tokens, end, _ = run(model, ids)
        assert len(tokens) >= 32
        # bfloat16's wider bound leaves near-ties early in a reply: every token is still
        # checked, only the count of decided steps is not required
        assert_greedy(ref16, ids, tokens, bound, end, min_decided=32 if math == "float32" else 0)
        if name == "short":  # without a cache: the prompt path over the whole text
            _, error = teacher_forced(whole_prompt(model), ref16, ids + tokens)
            assert error <= bound, error


@same_on_every_cpu
@pinned_runner  # it switches the native runner off itself: the same in the leg that does
def test_without_the_library_auto_falls_back_and_native_says_why():
    off = {"MINISERVE_NATIVE": "0"}
    r = process(
        "bench",
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "3",
        "--repeat",
        "1",
        "--modes",
        "cache",
        env=off,
    )
    assert r.returncode == 0, r.stderr
    assert "float32, lean runner" in r.stdout  # no native pass: float32 weights, PyTorch lean
    r = process("generate", "--prompt", "Hi", "--runner", "native", env=off)
    assert r.returncode == 2
    assert "native runner" in r.stderr and "MINISERVE_NATIVE=0" in r.stderr
    assert "Traceback" not in r.stderr
