"""Weights as stored (miniserve/runners/stored.py, kernels/quants.h and kquants.h): each block
type's
kernel against a float64 product over the weights dequantized by an independent decoder (the
gguf package's), with the bound activation rounding explains; a row alone against the same row
in a batch, bit for bit; the real models' teacher-forced logits against float64; bad files."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import gguf
import numpy as np
import product_digests
import pytest
import torch
from test_families import SHAPES as FAMILY_SHAPES

from miniserve.runners import native
from miniserve.runners.native import StoredMatrix
from miniserve.runners.verify import BOUND_STORED_RELATIVE

from conftest import assert_same_whatever_shares_the_pass, needs_native, same_on_every_cpu

Q = gguf.GGMLQuantizationType
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL]  # 32-weight blocks
# 256-weight super-blocks (the K-quants, IQ4_XS and the lattice types)
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS] + product_digests.IQ_LATTICE


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Weights of `qtype` as the file holds them: (rows, bytes per row) uint8. The 32-weight
    types quantized from random floats by gguf's own quantizer; the K-quants and the IQ4 types
    as random block bytes (every byte pattern is a valid block) with finite fp16 scales
    (product_digests.k_quant_blocks)."""
    rng = np.random.default_rng(seed)
    if qtype not in product_digests.SCALES:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        w[:, :32] += 0.3  # a block with an offset: Q4_1 / Q5_1's minimum matters
        return gguf.quants.quantize(w, qtype)
    return product_digests.k_quant_blocks(rng, qtype, rows, cols)


def stored(data: np.ndarray, qtype, cols: int) -> StoredMatrix:
    return StoredMatrix(data.ctypes.data, int(qtype), data.shape[0], cols, data.nbytes)


def activation_bound(w: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """(B, rows): what rounding each activation block to int8 (a step of amax / 127) can move a
    product by -- half a step per element times the weights' magnitudes -- plus float32 room."""
    B, cols = x.shape
    step = np.abs(x.reshape(B, cols // block, block)).max(-1) / 127  # (B, blocks)
    wsum = np.abs(w.reshape(w.shape[0], cols // block, block)).sum(-1)  # (rows, blocks)
    return (0.5 * step @ wsum.T) * (1 + BOUND_STORED_RELATIVE) + BOUND_STORED_RELATIVE * (
        np.abs(x) @ np.abs(w).T
    )


CASES = [(t, 256 if t in K_QUANTS else 64) for t in LEGACY + K_QUANTS] + [(Q.F16, 48)]


@pytest.mark.parametrize("qtype,cols", CASES, ids=[c[0].name for c in CASES])
@pytest.mark.parametrize("rows,batch", [(6, 1), (13, 5), (9, 21)])
@needs_native
def test_each_kernel_against_float64_over_the_independently_dequantized_weights(
    qtype, cols, rows, batch
):
    """rows: not a multiple of 4 (the threads' shares); batch: 1, 5 (a tile of 4 and one) and
    21 (tiles of 8, 4 and 1; for the K-quants, rows of 17 blocks: on AVX-512 the weight rows
    unpacked once and met in pieces of 8 blocks, the sums carried between pieces). Dequantizing
    (the embedding lookup) equals gguf's decoder bit for bit; the product is within the bound of
    activation rounding of the float64 product over those weights. A nibble order swapped or a
    scale unpacked wrong moves it by far more (test_a_broken_unpacking_is_caught)."""
    cols *= 4 if qtype in LEGACY else 17 if batch > 16 else 2  # several blocks a row
    if qtype == Q.F16:
        data = (
            (np.random.default_rng(rows).standard_normal((rows, cols)) * 0.1)
            .astype(np.float16)
            .view(np.uint8)
        )
        want_w = data.view(np.float16).astype(np.float64)
    else:
        data = random_blocks(qtype, rows, cols, seed=rows * 7 + batch)
        want_w = gguf.quants.dequantize(data, qtype).astype(np.float64)
    w = stored(np.ascontiguousarray(data), qtype, cols)
    assert np.array_equal(native.dequantize(w).numpy(), want_w.astype(np.float32))
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    got = native.matmul(w, x).double().numpy()
    exact = x.double().numpy() @ want_w.T
    block = 256 if qtype in K_QUANTS else 32
    bound = (
        BOUND_STORED_RELATIVE * (np.abs(x.numpy()) @ np.abs(want_w).T)
        if qtype == Q.F16
        else activation_bound(want_w, x.double().numpy(), block)
    )
    assert (np.abs(got - exact) <= bound).all(), float((np.abs(got - exact) / bound).max())


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS + [Q.F16], ids=lambda t: t.name)
@needs_native
def test_each_row_of_a_stored_product_is_computed_as_if_alone(qtype):
    """Batch invariance: 2, 3, 6, 7 and 29 activation rows (groups of 8, 4, 2 and 1) against
    each row alone, bit for bit, over 37 weight rows (the threads' shares and the L2 chunks);
    K-quant rows of 17 blocks (three pieces where the AVX-512 loop lays 16 rows out as a tile,
    and unpacks the rows past the last whole 16, for many activation rows)."""
    cols = 256 * 17 if qtype in K_QUANTS else 512
    if qtype == Q.F16:
        data = (
            (np.random.default_rng(1).standard_normal((37, cols))).astype(np.float16).view(np.uint8)
        )
    else:
        data = random_blocks(qtype, 37, cols, seed=5)
    w = stored(np.ascontiguousarray(data), qtype, cols)
    x = torch.randn(29, cols, generator=torch.Generator().manual_seed(2))
    alone = [native.matmul(w, x[i : i + 1])[0] for i in range(29)]
    for n in (2, 3, 6, 7, 29):  # few rows (4, 2 and 1 a weight row at a time) and many
        together = native.matmul(w, x[:n])
        for i in range(n):
            assert torch.equal(together[i], alone[i]), (n, i)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(300, 65), (40, 8)])
@needs_native
def test_wide_k_quant_rows_against_many_activation_rows(qtype, rows, blocks):
    """Prompt-sized products where the AVX-512 loop lays weight rows out as tiles of 16 rows in
    chunks of an L2's size and meets them a piece of 8 blocks at a time: 300 rows of 65 blocks
    (with 2 threads, two chunks in each of a thread's shares; the last piece of one block; 300
    not a multiple of 16: rows past the tiles, unpacked one by one), 40 rows of 8 (one piece).
    Within the activation rounding's bound of float64, and each of 21 activation rows as if
    alone."""
    cols = 256 * blocks
    data = random_blocks(qtype, rows, cols, seed=rows + blocks)
    want_w = gguf.quants.dequantize(data, qtype).astype(np.float64)
    w = stored(np.ascontiguousarray(data), qtype, cols)
    x = torch.randn(21, cols, generator=torch.Generator().manual_seed(blocks))
    together = native.matmul(w, x)
    exact = x.double().numpy() @ want_w.T
    bound = activation_bound(want_w, x.double().numpy(), 256)
    assert (np.abs(together.double().numpy() - exact) <= bound).all()
    for i in (0, 7, 8, 16, 20):  # the first and last of the groups of 8, 4 and 1
        assert torch.equal(together[i], native.matmul(w, x[i : i + 1])[0]), i


@pytest.mark.parametrize(
    "qtype,packed",
    [(Q.Q4_K, False), (Q.Q5_K, False), (Q.Q4_K, True), (Q.Q5_K, True)],
    ids=["Q4_K", "Q5_K", "Q4_K-packed", "Q5_K-packed"],
)
@pytest.mark.parametrize("rows,blocks,batch", [(37, 17, 29), (16, 1, 8), (53, 8, 64)])
@needs_native
def test_amx_tiles_give_the_bits_of_the_avx512_loops(qtype, packed, rows, blocks, batch):
    """Where the CPU has AMX (kernels/amx.h), Q4_K / Q5_K products of 16 or more activation
    rows run on its tiles: the same bits as the AVX-512 loops (switched in one process), with
    groups of activation rows and chunks of weight rows short of 16 (37 x 29), one super-block,
    and the prompt's shape; a Q4_K or Q5_K matrix packed 16 rows a strip (its rows rounded up to
    whole 16s) unpacked for the tiles from its strips, the same bits as its rows as stored on
    the tiles and in the loops. Without AMX the loops are what runs, and this compares nothing."""
    if not native.amx():
        pytest.skip("no AMX tiles on this CPU (or not granted by the kernel): nothing to compare")
    rows = -(-rows // 16) * 16 if packed else rows
    cols = 256 * blocks
    data = random_blocks(qtype, rows, cols, seed=rows * blocks)
    w = stored(np.ascontiguousarray(data), qtype, cols)
    made = native.pack(w) if packed else None
    assert not packed or made is not None, (
        f"a {qtype.name} matrix of whole 16 rows packs in this build"
    )
    m = made[0] if made else w
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(rows))
    try:
        tiles = native.matmul(m, x)
        native.amx(False)
        loops = native.matmul(m, x)
        stored_loops = native.matmul(w, x)
    finally:
        native.amx(True)
    assert torch.equal(tiles, loops)
    assert torch.equal(tiles, stored_loops)


@pytest.mark.parametrize("name", product_digests.names())
@needs_native
def test_each_types_products_are_the_committed_bits_on_this_build(name):
    """The same bits on every build, checked on whichever CPU runs the leg: products of fixed
    weights of each type with 1, 3, 5, 7, 8, 16 and 64 activation rows (tests/product_digests.py)
    equal the digests in tests/data/product_digests.json, which every build (AVX-512 with or
    without AMX tiles, AVX2, the plain loops) must give. A kernel whose float operations change
    order on one build fails here on that build's leg; a deliberate change of the arithmetic
    rewrites the file (`python tests/product_digests.py --write` in each build)."""
    want = product_digests.committed()
    inputs = product_digests.inputs_digest(name)
    assert inputs == want[f"{name} inputs"], (
        f"the fixed inputs of {name} changed (numpy {np.__version__}, gguf's quantizer): "
        "rewrite the digests with `python tests/product_digests.py --write` in each build"
    )
    got = product_digests.digests_of(name)
    wrong = [k for k, v in got.items() if want.get(k) != v]
    assert not wrong, f"{native.kernels_label()} build: {wrong} differ from the committed digests"


@pytest.mark.parametrize(
    "qtype",
    [Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q6_K, Q.IQ4_XS],
    ids=lambda t: t.name,
)
@needs_native
@same_on_every_cpu
def test_a_broken_unpacking_is_caught(qtype):
    """The bound has teeth: the product over weights whose nibbles are swapped in each byte
    (what a kernel that read them in the wrong order computes) is outside it."""
    cols = 256
    data = random_blocks(qtype, 8, cols, seed=11)
    right = gguf.quants.dequantize(data, qtype).astype(np.float64)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    swapped = data.reshape(8, cols // block, size).copy()
    quants = (
        slice(size - 128, size)
        if qtype in (Q.Q4_K,)
        else slice(0, 128)
        if qtype == Q.Q6_K
        else slice(32, 96)
        if qtype == Q.Q3_K
        else slice(16, 80)
        if qtype == Q.Q2_K
        else slice(8, size)
        if qtype == Q.IQ4_XS
        else slice(size - 16, size)
    )
    q = swapped[:, :, quants]
    swapped[:, :, quants] = (q >> 4) | (q << 4)
    wrong = gguf.quants.dequantize(swapped.reshape(8, -1), qtype).astype(np.float64)
    x = np.random.default_rng(3).standard_normal((4, cols))
    bound = activation_bound(right, x, 256 if qtype in K_QUANTS else 32)
    assert (np.abs(x @ wrong.T - x @ right.T) > bound).any()


@same_on_every_cpu
def test_the_lattice_tables_the_kernels_index_are_ggufs():
    """kernels/iqgrids.h (IQ1/IQ2/IQ3's grids and sign bytes) is what tests/iq_grids.py writes
    from the gguf package's tables today: a table edited by hand, or one gguf changed, fails
    here, before any product over it (the dequantizers equal gguf's decoder besides)."""
    import iq_grids

    assert iq_grids.HEADER.read_text() == iq_grids.text(), "run `python tests/iq_grids.py --write`"


@needs_native
@same_on_every_cpu
def test_the_row_sizes_of_every_type_are_ggmls():
    for qtype in LEGACY + K_QUANTS + [Q.F16, Q.F32, Q.BF16]:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert native.row_bytes(int(qtype), 4 * 256) == 4 * 256 // block * size
    assert native.row_bytes(int(Q.Q4_K), 100) == -1  # not whole blocks
    assert native.row_bytes(int(Q.TQ2_0), 256) == -1  # not run in place


# -- the real model as stored -------------------------------------------------------------------

# Teacher-forced top-1 agreement with float64 over HELD_OUT, measured 94% (float32 attention)
# and 97% (bfloat16) for the embedded Q4_1 file as stored (verify.BOUND_STORED says why).
AGREE_STORED = 0.9


@pytest.mark.parametrize("math", ["float32", "bfloat16"])
@needs_native
def test_the_real_model_as_stored_follows_the_float64_reference(stored, ref32, math):
    """SmolLM2's Q4_1 blocks as stored, prompt path and decode path, against float64 over the
    same weights dequantized (transformers' own decoder): every logit within the bound, the
    top token mostly the reference's; and the two paths give the same bits (one arithmetic
    per row whatever the row count)."""
    from miniserve.runners.stored import StoredRunner
    from miniserve.runners.verify import BOUND_STORED

    from reference import HELD_OUT, teacher_forced

    if math == "bfloat16" and not native.bf16_dot():
        pytest.skip("no bfloat16 dot products on this CPU")
    runner = StoredRunner(stored.model, math, stored.generation_config)
    ids = stored.tokenizer(HELD_OUT)["input_ids"]
    cache = runner.new_cache()
    if math == "float32":  # the default cache: its bound is this test's (float32's: below)
        assert cache.k.dtype == torch.float16
    with torch.inference_mode():
        whole = runner.forward(torch.tensor([ids]), cache, all_logits=True)
    agree, err = teacher_forced(lambda _: whole, ref32, ids)
    assert err <= BOUND_STORED and agree >= AGREE_STORED, (err, agree)
    # One token a pass (the decode path) gives the prompt pass's rows: after its first 136
    # positions (it ran its feed-forward in chunks of decode.cpp's FFN_ROWS, 128: rows 136..
    # were in its second chunk), and from an empty cache.
    for start in (136, 0):
        cache.crop(start)
        with torch.inference_mode():
            steps = [runner.forward(torch.tensor([[t]]), cache) for t in ids[start : start + 24]]
        assert torch.equal(torch.cat(steps), whole[start : start + 24]), start


@needs_native
def test_keys_and_values_as_stored_are_float16_and_follow_the_float64_reference(
    stored, ref32, monkeypatch
):
    """Weights in block formats keep their KV cache in float16 (MINISERVE_KV, the default, as
    llama.cpp's): half float32's bytes, other logits than a float32 cache gives, and the same
    bound against float64 (measured on an AMD EPYC, Zen 3: 1.10 against float32's 1.28; the
    default's bound is test_the_real_model_as_stored_follows_the_float64_reference's, this
    test checks float32's). MINISERVE_KV=float32 keeps float32; anything else is one error
    naming the choices."""
    from miniserve.runners.stored import StoredRunner
    from miniserve.runners.verify import BOUND_STORED

    from reference import HELD_OUT, teacher_forced, whole_prompt

    ids = stored.tokenizer(HELD_OUT)["input_ids"]
    logits, caches = {}, {}
    for kv, dtype in (("float32", torch.float32), ("float16", torch.float16)):
        monkeypatch.setenv("MINISERVE_KV", kv)
        runner = StoredRunner(stored.model, "float32", stored.generation_config)
        if kv == "float32":
            agree, err = teacher_forced(whole_prompt(runner), ref32, ids)
            assert err <= BOUND_STORED and agree >= AGREE_STORED, (kv, err, agree)
        caches[kv] = cache = runner.new_cache(64)
        assert cache.k.dtype == cache.v.dtype == dtype
        with torch.inference_mode():
            logits[kv] = runner.forward(torch.tensor([ids[:48]]), cache, all_logits=True)
    half, full = caches["float16"], caches["float32"]
    assert (half.k.nbytes + half.v.nbytes) * 2 == full.k.nbytes + full.v.nbytes
    assert not torch.equal(logits["float16"], logits["float32"])
    # layer 0's keys and values (the same inputs either way): float32's rounded to nearest
    assert torch.equal(half.k[0, :, :3], full.k[0, :, :3].half())  # tiles of 16 positions
    assert torch.equal(half.v[0, :, :48], full.v[0, :, :48].half())
    monkeypatch.setenv("MINISERVE_KV", "q8_0")
    with pytest.raises(ValueError, match="MINISERVE_KV='q8_0': one of float16, float32"):
        StoredRunner(stored.model, "float32", stored.generation_config)


@needs_native
def test_a_float16_cache_saturates_keys_and_values_past_its_range(tmp_path, monkeypatch):
    """A key or value past float16's largest finite (65,504) is kept as that largest, not as
    infinity (which would make its head's attention NaN): a tiny Q8_0 llama file with weights
    large enough that layer 0's keys and values pass it, its float16 cache equal to the float32
    cache clamped and rounded, every logit finite."""
    from miniserve.bench import synthetic
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    path = tmp_path / "loud.gguf"
    shape = synthetic.Shape("llama", 64, 96, 1, 4, 2, 16, 1e4, 1e-5, tied=False)
    monkeypatch.setattr(synthetic, "STD", 2e4)  # keys and values of ~8 * 2e4
    synthetic.write_shape(path, shape, "loud", vocab=4096, quant="q8_0")
    model = load_model(str(path), dtype="stored", progress=lambda m: None).model
    ids = [(37 * i + 11) % 4096 for i in range(48)]
    logits, caches = {}, {}
    for kv in ("float32", "float16"):
        monkeypatch.setenv("MINISERVE_KV", kv)
        runner = StoredRunner(model, "float32")
        caches[kv] = cache = runner.new_cache(64)
        with torch.inference_mode():
            logits[kv] = runner.forward(torch.tensor([ids]), cache, all_logits=True)
    half, full = caches["float16"], caches["float32"]
    k, v = full.k[0, :, :3], full.v[0, :, :48]  # layer 0: tiles of 16 positions; positions
    assert k.abs().max() > 65520 and v.abs().max() > 65520  # past the range: the case is real
    assert torch.equal(half.k[0, :, :3], k.clamp(-65504, 65504).half())
    assert torch.equal(half.v[0, :, :48], v.clamp(-65504, 65504).half())
    assert torch.isfinite(logits["float16"]).all() and torch.isfinite(logits["float32"]).all()


@needs_native
def test_a_sequence_as_stored_gets_the_same_logits_whatever_shares_its_pass(stored):
    """Batch invariance on the stored weights: a sequence's logits alone, its prompt in chunks
    of 7, and beside two other sequences (one still reading its prompt), bit for bit."""
    runner = stored_runner(stored)
    ids = stored.tokenizer(" The lighthouse keeper climbed the spiral stairs" * 6)["input_ids"]
    whole = runner.step([(ids, runner.new_cache())], all_logits=True)
    assert_same_whatever_shares_the_pass(runner.step, runner.new_cache, ids, whole, chunk=13)


def stored_runner(loaded):
    from miniserve.runners.stored import StoredRunner

    return StoredRunner(loaded.model, "auto", loaded.generation_config)


@needs_native
def test_greedy_tokens_as_stored_follow_the_float64_reference(stored_engine, ref32):
    """The engine's default for a GGUF: its greedy reply, checked step by step against float64
    over the dequantized weights (miniserve/runners/verify.py), with the stored weights' bound."""
    from miniserve.core.config import SamplingParams
    from miniserve.runners.verify import BOUND_STORED, check_tokens

    from conftest import chat_ids

    assert (
        stored_engine.runner_name == "native" and stored_engine.info()["dtype"] == "q4_1 as stored"
    )
    ids = chat_ids(stored_engine.tokenizer, "Name the planets of the solar system.")
    chunks = list(stored_engine.complete(ids, SamplingParams(temperature=0, max_new_tokens=24)))
    tokens = [t for c in chunks for t in c.token_ids]
    result = check_tokens(ref32, ids, tokens, BOUND_STORED)
    assert len(tokens) >= 8 and result.ok, result.wrong


@needs_native
@same_on_every_cpu
def test_loading_as_stored_writes_no_weights_and_maps_the_file(tmp_path, monkeypatch):
    """No dequantized copy: the cache folder gets the tokenizer alone; the matrices point
    into the file's own mapped pages."""
    from miniserve.runners.loader import embedded_gguf, load_model

    monkeypatch.setenv("MINISERVE_CACHE", str(tmp_path))
    loaded = load_model(None, dtype="stored", progress=lambda m: None)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    # the tokenizer (and, where this process had not built it yet, the compiled kernels)
    assert written and all(
        p.relative_to(tmp_path).parts[0] in ("tokenizers", "kernels") for p in written
    )
    assert sum(p.stat().st_size for p in written if "tokenizers" in p.parts) < 10 << 20
    layer = loaded.model.layers[0]
    assert isinstance(layer["wq"], StoredMatrix) and layer["wq"].type == Q.Q4_1
    if os.path.exists("/proc/self/maps"):  # the matrix's address lies in the file's mapping
        with open("/proc/self/maps") as f:
            spans = [
                [int(a, 16) for a in line.split()[0].split("-")]
                for line in f
                if line.rstrip().endswith(str(embedded_gguf()))
            ]
        assert any(lo <= layer["wq"].address < hi for lo, hi in spans), spans


@pytest.mark.parametrize("damage", ["cut", "nan_scale"])
@needs_native
@same_on_every_cpu
def test_a_damaged_file_is_one_clear_error_before_any_kernel_runs(tmp_path, damage):
    from miniserve.runners.gguf_file import GGUFFile
    from miniserve.runners.loader import ModelLoadError, embedded_gguf, load_model

    data = bytearray(embedded_gguf().read_bytes())
    with GGUFFile(embedded_gguf()) as f:
        last = list(f.tensors.values())[-1]
        q = next(t for t in f.tensors.values() if t.type == Q.Q4_1)
    if damage == "cut":
        data = data[: last.offset + last.nbytes // 2]
        want = last.name
    else:  # the first block's d of a Q4_1 matrix: NaN
        data[q.offset : q.offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()
        want = q.name
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(bad), dtype="stored", progress=lambda m: None)
    assert want in str(e.value) and "Traceback" not in str(e.value)


@needs_native
@same_on_every_cpu
def test_the_tokenizer_read_as_stored_is_the_one_transformers_builds(stored, loaded):
    """The stored path builds the GGUF's tokenizer without AutoTokenizer's whole-file read
    (loader._gguf_tokenizer): the same ids, text and chat template as the dequantized path's."""
    text = "Hello there, 1234 numbers  and\n spaces é ümlaut 你好 <|im_end|>"
    messages = [{"role": "user", "content": text}]
    for tok in (stored.tokenizer,):
        assert tok(text)["input_ids"] == loaded.tokenizer(text)["input_ids"]
        assert tok.apply_chat_template(
            messages, tokenize=False
        ) == loaded.tokenizer.apply_chat_template(messages, tokenize=False)
        assert tok.eos_token_id == loaded.tokenizer.eos_token_id
        assert type(tok) is type(loaded.tokenizer)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@needs_native
def test_a_gguf_file_as_stored_computes_what_transformers_computes_from_it(
    tmp_path, arch, monkeypatch
):
    """A small synthetic GGUF (miniserve/bench/synthetic.py: random F16 matrices, the embedded
    vocabulary's first 4096 tokens) read two ways: as stored (our F16 kernel, float32 products)
    and by transformers (dequantized to float32). llama: q and k rows as llama.cpp's converter
    permutes them (decode.cpp's RoPE on pairs); qwen2: q/k/v biases, RoPE on halves. Float32
    arithmetic over the same weights on both sides, so the float32 bound (scaled to these small
    logits)."""
    from transformers import AutoModelForCausalLM

    from miniserve.bench import synthetic
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    shape = synthetic.Shape(
        arch, 64, 128, 2, 4, 2, 16, 10000.0, 1e-5, tied=arch == "llama", qkv_bias=arch == "qwen2"
    )
    monkeypatch.setitem(synthetic.SHAPES, "tiny", shape)
    monkeypatch.setattr(synthetic, "STD", 0.5)  # logits of a useful size
    # the embedded tokenizer cut to 4096 tokens: transformers reads the file in seconds
    path = synthetic.write_gguf(tmp_path / f"tiny-{arch}.gguf", "tiny", vocab=4096, quant="f16")
    stored_model = load_model(str(path), dtype="stored", progress=lambda m: None)
    runner = StoredRunner(stored_model.model, "float32", stored_model.generation_config)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = [(37 * i + 11) % 4096 for i in range(40)]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0].double()
    got = runner.forward(torch.tensor([ids]), None, all_logits=True).double()
    scale = float(want.abs().max())
    assert scale > 0.5
    assert float((got - want).abs().max()) <= 1e-5 * scale * 10


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
@needs_native
def test_a_float_model_quantized_at_load_runs_on_the_same_kernels(bf16, ref16, quant):
    """--quant q8_0 | q4_0: the bfloat16 model's fused matrices as gguf's quantizer makes
    their blocks (each row alone: the fused q|k|v rows are q's, k's and v's), run by the
    stored weights' kernels. Q8_0 keeps the float64 reference's top token almost everywhere
    within the stored bound; Q4_0 (4 bits, every matrix, the output layer too: a small model
    loses much there, measured 53% top-1 agreement over 120 tokens) for agreement far above
    chance only (a broken kernel agrees on next to nothing)."""
    from miniserve.engine.engine import make_runner
    from miniserve.runners.verify import BOUND_STORED

    from reference import HELD_OUT, teacher_forced, whole_prompt

    runner = make_runner(bf16, quant=quant)
    assert runner.name == "native" and runner.quant == quant
    w = runner.layers[0]["wqkv"]
    qtype = Q.Q8_0 if quant == "q8_0" else Q.Q4_0
    assert isinstance(w, StoredMatrix) and w.type == qtype
    q = bf16.model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(q, qtype), qtype)
    assert np.array_equal(native.dequantize(w)[: q.shape[0]].numpy(), want)
    ids = bf16.tokenizer(HELD_OUT)["input_ids"][:120]
    agree, err = teacher_forced(whole_prompt(runner), ref16, ids)
    assert agree >= (AGREE_STORED if quant == "q8_0" else 0.4), agree
    if quant == "q8_0":
        assert err <= BOUND_STORED, err


@same_on_every_cpu
@needs_native
def test_a_gguf_runs_as_stored_by_default_and_dequantized_where_it_cannot():
    """--dtype auto: a GGUF as stored where the native runner runs; the lean or transformers
    runner, or --quant, ask for float weights; a float model's source is never 'stored'."""
    from miniserve.engine.engine import auto_dtype

    assert auto_dtype("auto", None, "auto", None, None) == "stored"
    assert auto_dtype("auto", None, "native", None, "default") == "stored"
    assert auto_dtype("auto", None, "lean", None, None) != "stored"
    assert auto_dtype("auto", None, "auto", "q8_0", None) == "bfloat16"
    assert auto_dtype("float32", None, "auto", None, None) == "float32"


@pytest.mark.parametrize("heads,kv,words", [(4, 3, "do not share"), (2, 4, "head_count_kv")])
@same_on_every_cpu
@needs_native
def test_header_values_the_runner_cannot_run_are_one_error(tmp_path, monkeypatch, heads, kv, words):
    """Head counts whose tensors are consistent but which the pass cannot run (kv heads not
    dividing the heads, more kv heads than heads): one line naming them, before native code
    sees the file (decode.cpp would divide by zero)."""
    from miniserve.bench import synthetic
    from miniserve.runners.loader import ModelLoadError, load_model

    monkeypatch.setitem(
        synthetic.SHAPES, "odd", synthetic.Shape("llama", 64, 128, 1, heads, kv, 16, 10000.0, 1e-5)
    )
    path = synthetic.write_gguf(tmp_path / "odd.gguf", "odd", vocab=4096, quant="f16")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), dtype="stored", progress=lambda m: None)
    assert words in str(e.value) and "odd.gguf" in str(e.value)


def packs_here(qtype=Q.Q4_K) -> bool:
    """Whether this build lays matrices of `qtype` out anew (decode.cpp's ms_pack_type): Q4_K in
    the AVX-512 build, with AMX tiles or without (16 rows a strip), and the AVX2 one (8); Q5_K,
    Q6_K, Q3_K, Q2_K, IQ4_XS and the 32-weight types in the AVX-512 build (16) and the AVX2 one
    (8)."""
    if qtype in (Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q3_K, Q.Q2_K):  # the AVX-512 loops need VNNI
        bytes_ = gguf.GGML_QUANT_SIZES[qtype][1]  # a super-block's
        return native.packed_bytes(StoredMatrix(0, int(qtype), 16, 256, 16 * bytes_)) > 0
    return (qtype in LEGACY or qtype == Q.Q4_K) and native.isa() in ("avx512", "avx2", "avx2+vnni")


# (type, rows, blocks): the 32-weight types' rows ending in each kind of last group (576
# columns: 8 + 8 + 2 blocks, SmolLM2's; 13: 8 + 5; 3: one short group; 48: whole groups)
PACKED_CASES = (
    [(Q.Q4_K, 48, 3), (Q.Q4_K, 16, 1), (Q.Q4_K, 80, 8)]
    + [(Q.Q5_K, 48, 3), (Q.Q5_K, 16, 1), (Q.Q5_K, 32, 8)]
    + [(Q.Q6_K, 48, 3), (Q.Q6_K, 16, 1), (Q.Q6_K, 32, 8)]
    + [(Q.Q4_1, 48, 18), (Q.Q4_1, 32, 13), (Q.Q4_1, 16, 3), (Q.Q4_1, 64, 48)]
    + [(t, 48, 18) for t in (Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q8_0)]
    + [(t, 32, 13) for t in (Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q8_0)]
    + [(t, 16, 3) for t in (Q.Q5_0, Q.Q5_1, Q.IQ4_NL)]
    + [(Q.IQ4_NL, 48, 18), (Q.IQ4_NL, 32, 13)]
    + [(Q.IQ4_XS, 48, 3), (Q.IQ4_XS, 16, 1), (Q.IQ4_XS, 32, 8)]
    + [(Q.Q3_K, 48, 3), (Q.Q3_K, 16, 1), (Q.Q3_K, 32, 8)]
    + [(Q.Q2_K, 48, 3), (Q.Q2_K, 16, 1), (Q.Q2_K, 32, 8)]
)


@needs_native
def test_a_tied_output_layer_packed_at_load_still_looks_its_tokens_up_in_the_file(
    tmp_path, monkeypatch
):
    """A GGUF whose output layer is its embedding, Q8_0 (as the embedded SmolLM2's): packed at
    load where this build packs Q8_0, the file pages of its stored rows then handed back, and
    every token's row still looked up in them (the pages fault in again): the same logits, bit
    for bit, as with MINISERVE_PACK=0, for a prompt of tokens from across the table."""
    from miniserve.bench import synthetic
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    path = tmp_path / "tied.gguf"
    shape = synthetic.Shape("llama", 64, 96, 1, 4, 2, 16, 1e4, 1e-5, tied=True)
    synthetic.write_shape(path, shape, "tied", vocab=4096, quant="q8_0")
    ids = [(397 * i + 11) % 4096 for i in range(48)]
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("MINISERVE_PACK", setting)
        model = load_model(str(path), dtype="stored", progress=lambda m: None).model
        runner = StoredRunner(model, "float32")
        assert runner.lm_head is runner.embed and runner.lm_head.type == Q.Q8_0
        packed = id(runner.lm_head) in runner.native.as_run
        assert packed == (setting == "1" and packs_here(Q.Q8_0))
        with torch.inference_mode():
            logits[setting] = runner.forward(
                torch.tensor([ids]), runner.new_cache(64), all_logits=True
            )
    assert torch.equal(logits["0"], logits["1"])


def _mapped_pages(address: int, nbytes: int) -> int | None:
    """How many pages of [address, address + nbytes) this process has mapped now (the present
    bit of /proc/self/pagemap), where Linux says it."""
    pagemap = Path("/proc/self/pagemap")
    if not pagemap.exists():
        return None
    first, end = address // mmap.PAGESIZE, -(-(address + nbytes) // mmap.PAGESIZE)
    with pagemap.open("rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((end - first) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@same_on_every_cpu
@needs_native
def test_the_rows_a_pass_looks_up_in_a_mapped_embedding_are_handed_back_after_it(tmp_path):
    """A GGUF's embedding is looked up where it lies in the mapped file, and each lookup maps
    the pages around its row (the kernel's fault-around): after every pass the runner hands
    the table's pages back, so that a session's tokens do not pile up as resident memory; the
    next pass reads the same bytes again (the same logits)."""
    from miniserve.bench import synthetic
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    path = tmp_path / "lookups.gguf"
    shape = synthetic.Shape("llama", 64, 96, 1, 4, 2, 16, 1e4, 1e-5, tied=False)
    synthetic.write_shape(path, shape, "lookups", vocab=4096, quant="q8_0")
    runner = StoredRunner(load_model(str(path), dtype="stored", progress=lambda m: None).model)
    embed = runner.embed
    ids = torch.tensor([[(397 * i + 11) % 4096 for i in range(64)]])  # rows across the table
    with torch.inference_mode():
        first = runner.forward(ids, runner.new_cache(80), all_logits=True)
        if _mapped_pages(embed.address, embed.nbytes) is not None:
            assert _mapped_pages(embed.address, embed.nbytes) <= 2  # (the pages at its ends
            # hold its neighbours' bytes too: not handed back)
            int(
                np.frombuffer(runner.weights.file.data("token_embd.weight"), np.uint8)[::4096].sum()
            )
            assert _mapped_pages(embed.address, embed.nbytes) > 8  # (reads do map them)
        again = runner.forward(ids, runner.new_cache(80), all_logits=True)
    assert torch.equal(first, again)


@same_on_every_cpu
@needs_native
def test_norms_and_biases_are_copied_out_of_the_map(tmp_path):
    """A file's small tensors (norms, biases; float32 ones too) are copies in the process's own
    memory: a pass reads them every step, and a read in the map maps the file's pages around
    it (recent kernels' large page-cache folios: up to 2 MB of the next matrix a vector, ~120
    MiB a pass for Qwen3-1.7B's norms, resident beside the packed copies of those matrices)."""
    from miniserve.bench import synthetic
    from miniserve.runners.stored import GGUFWeights

    path = tmp_path / "vectors.gguf"
    shape = synthetic.Shape("qwen2", 64, 96, 2, 4, 2, 16, 1e4, 1e-5, qkv_bias=True)
    synthetic.write_shape(path, shape, "vectors", vocab=4096, quant="q8_0")
    weights = GGUFWeights(path)
    name = "token_embd.weight"
    start = weights.file.address(name) - weights.file.tensors[name].offset  # the map's first byte
    end = start + weights.file.size
    vectors = [weights.final_norm] + [
        t for layer in weights.layers for t in layer.values() if isinstance(t, torch.Tensor)
    ]
    assert len(vectors) == 1 + 3 * shape.layers  # both norms and the q/k/v biases a layer
    for v in vectors:
        assert v.dtype == torch.float32 and not start <= v.data_ptr() < end


def _anon_kib(status: Path) -> int | None:
    """This process's anonymous resident memory (KiB), where Linux says it."""
    if not status.exists():
        return None
    line = next(x for x in status.read_text().splitlines() if x.startswith("RssAnon:"))
    return int(line.split()[1])


@same_on_every_cpu
@needs_native
def test_a_load_reserves_the_packed_arena_ahead_and_hands_it_over_once(tmp_path):
    """The loader's weights reserve the native runner's arena before reading the tokenizer
    (its pages faulted in on another thread meanwhile, native.fault_in: the bytes written
    before stay as they were): the first runner packs into that memory, a second one over
    the same weights gets an arena of its own, and both give the same logits as weights
    loaded without a reservation."""
    from miniserve.bench import synthetic
    from miniserve.runners import lean
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import GGUFWeights, StoredRunner

    memory = lean.huge_page_memory(64 << 20)
    memory = torch.empty(64 << 20, dtype=torch.uint8) if memory is None else memory
    memory[: 1 << 20 : 1 << 12] = torch.arange(256, dtype=torch.uint8)  # the first MB's pages
    status = Path("/proc/self/status")
    before = _anon_kib(status)
    native.fault_in(memory).join()
    assert torch.equal(memory[: 1 << 20 : 1 << 12], torch.arange(256, dtype=torch.uint8))
    if before is not None:  # the 63 MB untouched before are this process's now (not zero pages)
        assert _anon_kib(status) - before > 56 << 10

    path = tmp_path / "reserve.gguf"
    shape = synthetic.Shape("llama", 64, 96, 2, 4, 2, 16, 1e4, 1e-5, tied=True)
    synthetic.write_shape(path, shape, "reserve", vocab=4096, quant="q8_0")
    weights = load_model(str(path), dtype="stored", progress=lambda m: None).model
    reserved = weights._arena
    packs = native.packed_bytes(weights.lm_head) > 0  # (the library's answer, MINISERVE_PACK's)
    assert (reserved is not None) == (packs and hasattr(mmap, "MADV_HUGEPAGE"))
    first, second = StoredRunner(weights, "float32"), StoredRunner(weights, "float32")
    assert weights.take_arena() is None
    if reserved is not None:
        assert first.native._arena.data_ptr() == reserved.data_ptr()
        assert second.native._arena.data_ptr() != reserved.data_ptr()
    plain = StoredRunner(GGUFWeights(path, lambda m: None), "float32")
    ids = torch.tensor([[(397 * i + 11) % 4096 for i in range(24)]])
    with torch.inference_mode():
        logits = [r.forward(ids, r.new_cache(32), all_logits=True) for r in (first, second, plain)]
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])


# The architecture table's kinds of matrices (test_families.py's tiny shapes, here as Q8_0):
# per-head norms (qwen3), fused q|k|v and gate|up (phi3), q/k/v biases (qwen2), Gemma's, and
# 3-D expert tensors (qwen3moe)
RESERVED_SHAPES = {
    name: FAMILY_SHAPES[name] for name in ("qwen3", "phi3", "qwen2", "gemma3-4b", "qwen3moe")
}


@same_on_every_cpu
@needs_native
@pytest.mark.parametrize("name", sorted(RESERVED_SHAPES))
def test_the_arena_reserved_from_the_tensor_table_is_the_one_the_runner_packs_into(tmp_path, name):
    """The arena a load reserves before its layers are made (sized from the tensor table
    alone) is the size the native runner's packed matrices need, for every kind of matrix the
    architecture table declares: the runner packs into it rather than into one of its own."""
    from miniserve.bench import synthetic
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner

    path = tmp_path / f"{name}.gguf"
    synthetic.write_shape(path, RESERVED_SHAPES[name], name, vocab=4096, quant="q8_0")
    weights = load_model(str(path), dtype="stored", progress=lambda m: None).model
    reserved = weights._arena
    runner = StoredRunner(weights, "float32")
    assert (reserved is not None) == (bool(runner.native.packed) and hasattr(mmap, "MADV_HUGEPAGE"))
    assert reserved is None or runner.native._arena.data_ptr() == reserved.data_ptr()


@pytest.mark.parametrize(
    "qtype,rows,blocks", PACKED_CASES, ids=lambda v: getattr(v, "name", str(v))
)
@needs_native
def test_rows_packed_16_at_a_time_give_the_bits_of_the_rows_as_stored(
    qtype, rows, blocks, monkeypatch
):
    """Where the build repacks a type's matrices at load (16 rows' blocks side by side, 8 in the
    AVX2 build; the quants as stored), every product -- 1 to 7 activation rows (the strips' own
    loops), 8 to 15 (groups of 8 on the strips, then the rest), 16 and more (the K-quants on
    AVX-512: widened to tiles, or Q4_K / Q5_K unpacked for AMX where the CPU has it; AVX2: on
    the strips) -- is the same bits as over the rows as
    stored, with the weight rows dealt to the threads in whole strips (48 rows: 32 and 16).
    Laid out a share of the
    rows at a time, each share's stored rows handed back once done (as a load does), the bytes
    are the same as laid out at once. Elsewhere (the plain loops) no matrix is repacked."""
    cols = (256 if qtype in K_QUANTS else 32) * blocks
    data = random_blocks(qtype, rows, cols, seed=rows + blocks)
    w = stored(np.ascontiguousarray(data), qtype, cols)
    packed = native.pack(w)
    if not packs_here(qtype):
        assert packed is None
        return
    assert packed is not None and packed[0].type != w.type
    monkeypatch.setattr(native, "PACK_BYTES", 1)  # the smallest share: 16 rows a call
    shares = []
    again = native.pack(w, release=shares.append)
    assert torch.equal(again[1], packed[1]) and again[0].type == packed[0].type
    row = w.nbytes // rows
    assert [(s.address, s.rows, s.nbytes) for s in shares] == [
        (w.address + r * row, 16, 16 * row) for r in range(0, rows, 16)
    ]
    short = np.ascontiguousarray(data[: rows - 4])  # rows not in whole strips stay as stored
    assert native.pack(stored(short, qtype, cols)) is None
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(rows))
    for batch in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 64):
        assert torch.equal(native.matmul(packed[0], x[:batch]), native.matmul(w, x[:batch])), batch
    # activations of one sign and near their block's largest: every integer sum near its
    # largest (one kept in 16 bits that overflows fails here: tried with 5-bit quants in the
    # AVX2 strips), also against float64
    ax = 1 + 0.05 * x[:9]
    got = native.matmul(packed[0], ax)
    assert torch.equal(got, native.matmul(w, ax))
    want_w = gguf.quants.dequantize(data, qtype).astype(np.float64)
    exact = ax.double().numpy() @ want_w.T
    bound = activation_bound(want_w, ax.double().numpy(), 256 if qtype in K_QUANTS else 32)
    assert (np.abs(got.double().numpy() - exact) <= bound).all()


@needs_native
def test_a_model_with_packed_matrices_gets_the_logits_of_its_rows_as_stored(monkeypatch):
    """The packing at load, through the runner: a model whose matrices are Q4_K blocks gets the
    same logits, bit for bit, with its matrices repacked (the default) and as stored
    (MINISERVE_PACK=0), for a prompt and for decode steps of 1 to 9 sequences at once; and the
    packed model's rows are the same whatever shares their pass. Its output layer is tied to
    the embedding, as SmolLM2's and Qwen3's are: packed, while the tokens' rows are still
    looked up in the stored blocks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    config = Qwen3Config(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    model = native.NativeRunner(Qwen3ForCausalLM(config).eval(), math="float32")
    kept = []
    for i, layer in enumerate(model.layers):  # the fused matrices as random Q4_K rows
        for name in ("wqkv", "wo", "w13", "w2"):
            rows, cols = layer[name].shape
            blocks = random_blocks(Q.Q4_K, rows, cols, seed=10 * i + len(kept))
            kept.append(np.ascontiguousarray(blocks))
            layer[name] = stored(kept[-1], Q.Q4_K, cols)
    kept.append(np.ascontiguousarray(random_blocks(Q.Q4_K, 320, 256, seed=99)))
    model.embed = model.lm_head = stored(kept[-1], Q.Q4_K, 256)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("MINISERVE_PACK", setting)
        forward = native.NativeForward(model, "float32")
        assert len(forward.packed) == (9 if setting == "1" and packs_here() else 0)
        if forward.packed and hasattr(mmap, "MADV_HUGEPAGE"):  # one block, 2 MB pages asked for
            base = forward._arena.data_ptr()
            assert base % (2 << 20) == 0
            assert all(0 <= m.address - base < len(forward._arena) for m in forward.packed)
        ids = [(13 * i + 5) % 320 for i in range(40)]
        caches = [forward.new_cache(64) for _ in range(9)]
        logits = [forward([(ids, caches[0])], all_logits=True)]
        for c, cache in enumerate(caches[1:]):
            forward([(ids[: 3 + c], cache)])
        for n in (1, 4, 9):
            logits.append(forward([([7 + n], cache) for cache in caches[:n]]))
        runs[setting] = logits
        if setting == "1":
            assert_same_whatever_shares_the_pass(forward, forward.new_cache, ids, logits[0], 11)
    for a, b in zip(runs["0"], runs["1"]):
        assert torch.equal(a, b)


# -- the lattice types' files --------------------------------------------------------------------

# one layer of 256 wide (whole 256-weight super-blocks), 4096 tokens
LATTICE_SHAPE = dict(arch="llama", hidden=256, ffn=512, layers=1, heads=4, kv_heads=2, head_dim=64)


@pytest.mark.parametrize("quant", ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq1_s", "iq1_m"])
@needs_native
def test_a_lattice_file_runs_as_stored_and_its_prompt_rows_are_its_decode_rows(
    tmp_path, monkeypatch, quant
):
    """A file of a lattice type (IQ1/IQ2/IQ3, every matrix of it: synthetic.py's random blocks)
    runs as stored -- no dequantized copy -- with weights of the writer's deviation; its
    teacher-forced logits follow float64 over gguf's dequantized weights (activation rounding
    only), and a prompt's rows (16+ rows: each weight row built once, qmatmul_unpacked) are the
    bits of the same positions decoded one at a time (the rows as stored)."""
    from miniserve.bench import synthetic
    from miniserve.runners.float64 import Float64Reference
    from miniserve.runners.loader import load_model
    from miniserve.runners.stored import StoredRunner, runs_as_stored

    s = LATTICE_SHAPE
    shape = synthetic.Shape(
        s["arch"], s["hidden"], s["ffn"], s["layers"], s["heads"], s["kv_heads"], s["head_dim"],
        1e4, 1e-5,
    )  # fmt: skip
    monkeypatch.setitem(synthetic.SHAPES, "lattice", shape)
    # logits of a useful size (4-5); the activations' rounding then moves them by 2-3% of the
    # largest, as it does Q4_0's and Q8_0's in this shape (1.4%; 10% at a deviation of 0.25)
    monkeypatch.setattr(synthetic, "STD", 0.05)
    path = synthetic.write_gguf(tmp_path / f"{quant}.gguf", "lattice", vocab=4096, quant=quant)
    qtype = Q[quant.upper()]
    reader = gguf.GGUFReader(str(path))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert {t.tensor_type for t in matrices} == {qtype}
    w = gguf.quants.dequantize(np.asarray(matrices[-1].data), qtype)
    assert 0.04 < float(w.std()) < 0.06, float(w.std())
    assert runs_as_stored(path)
    loaded = load_model(str(path), dtype="stored", progress=lambda m: None)
    runner = StoredRunner(loaded.model, "float32")
    ids = [(37 * i + 11) % 4096 for i in range(40)]
    want = Float64Reference(runner.weights).logits(ids)
    cache = runner.new_cache()
    with torch.inference_mode():
        whole = runner.forward(torch.tensor([ids]), cache, all_logits=True)
    scale = float(np.abs(want).max())
    error = float(np.abs(whole.double().numpy() - want).max()) / scale
    assert scale > 0.5 and error < 0.05, (scale, error)
    cache.crop(0)
    with torch.inference_mode():
        steps = [runner.forward(torch.tensor([[t]]), cache) for t in ids[:20]]
    assert torch.equal(torch.cat(steps), whole[:20])
