"""The GGUF reader the quantized runner maps its weights with: it reads what the gguf package
reads (faster, in place), and each way a file can be bad is a GGUFFileError naming the tensor or
key, before anything reads the bytes. The bad files are the embedded model's bytes, patched."""

import shutil
import struct

import gguf
import numpy as np
import pytest

from miniserve.runners.gguf_file import (
    _SCALES,
    GGUFFile,
    GGUFFileError,
    _first_non_finite,
    _string_starts,
    _string_starts_plain,
)
from miniserve.runners.loader import embedded_gguf


@pytest.fixture(scope="module")
def path():
    return embedded_gguf()


@pytest.fixture(scope="module")
def reader(path):
    return gguf.GGUFReader(path)


@pytest.fixture(scope="module")
def original(path):
    return path.read_bytes()


def parts_at(field) -> list[int]:
    """The byte position of each part of a gguf.ReaderField (key or tensor entry)."""
    at, pos = [], field.offset
    for part in field.parts:
        at.append(pos)
        pos += part.nbytes
    return at


def entry(reader, name) -> dict:
    """Where a tensor's entry keeps its fields: name_len, name, n_dims, dims, type, offset."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return dict(
        zip(["name_len", "name", "n_dims", "dims", "type", "offset"], parts_at(tensor.field))
    )


def patched(tmp_path, *patches, cut=None, name="bad.gguf"):
    """The file with (position, bytes) patches written over it, cut to `cut` bytes."""
    out = tmp_path / name
    shutil.copyfile(embedded_gguf(), out)  # a copy in the kernel: faster than writing `original`
    with open(out, "r+b") as f:
        for at, raw in patches:
            f.seek(at)
            f.write(raw)
        if cut is not None:
            f.truncate(cut)
    return out


def refused(path, *words, scales=False):
    """The GGUFFileError the file gives (from the constructor, or from check_scales), checked
    to be one sentence naming the file and holding `words`."""
    with pytest.raises(GGUFFileError) as info:
        with GGUFFile(path) as f:
            if scales:
                f.check_scales()
    message = str(info.value)
    assert message.startswith(path.name + ": ") and message.endswith(".") and "\n" not in message
    for word in words:
        assert word in message, (word, message)
    return message


def test_reads_what_the_gguf_package_reads(path, reader):
    """Every tensor's name, type, shape (ne reversed), offset and bytes; every metadata value,
    the vocabulary and merges included -- and the bytes are views of one map, not copies."""
    with GGUFFile(path) as f:
        assert f.header_bytes == reader.data_offset and f.size == path.stat().st_size
        assert list(f.tensors) == [t.name for t in reader.tensors]  # file order
        for t in reader.tensors:
            mine = f.tensors[t.name]
            assert mine.type == t.tensor_type and mine.type_name == t.tensor_type.name
            assert mine.shape == tuple(int(n) for n in reversed(t.shape))
            assert mine.offset == t.data_offset and mine.nbytes == t.n_bytes
            view = f.data(t.name)
            assert view.dtype == np.uint8 and not view.flags.writeable
            assert np.array_equal(view, np.asarray(t.data).view(np.uint8).reshape(-1))
            assert (
                f.address(t.name) - f.address("token_embd.weight")
                == mine.offset - f.tensors["token_embd.weight"].offset
            )
        fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(fields)
        for key, field in fields.items():
            value = f.metadata[key]
            value = value.tolist() if isinstance(value, np.ndarray) else value
            assert value == field.contents(), key
        assert f.architecture == "llama" and f.get("general.file_type") == 3
        assert f.get("no.such.key", 7) == 7
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152


def test_real_file_passes_check_scales(path):
    with GGUFFile(path) as f:
        f.check_scales()
        f.check_scales(["blk.0.attn_q.weight", "output_norm.weight"])
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            f.check_scales(["nope"])


def test_views_outlive_close_and_closed_file_refuses(path):
    f = GGUFFile(path)
    view = f.data("output_norm.weight")
    f.close()
    assert view.view(np.float32).sum() > 0  # the map stays while a view does
    with pytest.raises(ValueError, match="closed"):
        f.data("output_norm.weight")
    with pytest.raises(ValueError, match="closed"):
        f.metadata["tokenizer.ggml.merges"]  # never read: decoded lazily, too late now
    f.close()  # twice is fine


@pytest.mark.parametrize(
    "where", ["magic", "version", "header", "key", "tokens", "table", "first tensor", "last tensor"]
)
def test_cut_short_anywhere(tmp_path, path, reader, original, where):
    tokens = reader.fields["tokenizer.ggml.tokens"]
    first = reader.tensors[0]
    cut, words = {
        "magic": (3, ["not a GGUF"]),
        "version": (6, ["too short"]),
        "header": (20, ["too short"]),
        "key": (
            parts_at(reader.fields["tokenizer.chat_template"])[4] + 2,
            ["'tokenizer.chat_template'"],
        ),
        "tokens": (parts_at(tokens)[5 + 2 * 20000], ["'tokenizer.ggml.tokens'"]),
        "table": (parts_at(reader.tensors[5].field)[3] + 3, [reader.tensors[5].name]),
        "first tensor": (first.data_offset + 100, [f"'{first.name}'", "past the end"]),
        "last tensor": (len(original) - 1, [f"'{reader.tensors[-1].name}'", "truncated"]),
    }[where]
    refused(patched(tmp_path, cut=cut), *words)


def test_offset_past_the_end(tmp_path, reader, original):
    at = entry(reader, "blk.3.attn_q.weight")["offset"]
    message = refused(
        patched(tmp_path, (at, struct.pack("<Q", 1 << 40))),
        "tensor 'blk.3.attn_q.weight' (Q4_1, 576 x 576)",
        "past the end",
        f"({len(original):,} bytes)",
    )
    assert "truncated" in message


def test_offset_misaligned_or_overlapping(tmp_path, reader, original):
    e = entry(reader, "blk.3.attn_q.weight")
    offset = struct.unpack_from("<Q", original, e["offset"])[0]
    refused(
        patched(tmp_path, (e["offset"], struct.pack("<Q", offset + 4))),
        "'blk.3.attn_q.weight'",
        "alignment",
    )
    other = struct.unpack_from("<Q", original, entry(reader, "blk.3.attn_k.weight")["offset"])[0]
    refused(
        patched(tmp_path, (e["offset"], struct.pack("<Q", other))),
        "'blk.3.attn_q.weight'",
        "'blk.3.attn_k.weight'",
        "overlap",
    )


def test_rows_that_do_not_fill_blocks(tmp_path, reader, original):
    dims = entry(reader, "blk.3.attn_q.weight")["dims"]
    refused(
        patched(tmp_path, (dims, struct.pack("<Q", 577))),
        "tensor 'blk.3.attn_q.weight' (Q4_1, 576 x 577)",
        "577",
        "32-value blocks",
    )
    refused(
        patched(tmp_path, (dims + 8, struct.pack("<Q", 0))), "'blk.3.attn_q.weight'", "not positive"
    )


def test_unknown_type_and_too_many_dims(tmp_path, reader, original):
    e = entry(reader, "blk.7.ffn_up.weight")
    refused(
        patched(tmp_path, (e["type"], struct.pack("<I", 4))),
        "'blk.7.ffn_up.weight'",
        "unknown type id 4",
    )
    refused(
        patched(tmp_path, (e["n_dims"], struct.pack("<I", 9))),
        "'blk.7.ffn_up.weight'",
        "9 dimensions",
    )


def test_duplicate_tensor_name(tmp_path, reader, original):
    at = entry(reader, "blk.3.attn_q.weight")["name"]
    refused(
        patched(tmp_path, (at, b"blk.3.attn_k.weight")), "two tensors named 'blk.3.attn_k.weight'"
    )


def test_nan_and_inf_scales(tmp_path, reader, original):
    """A non-finite d or m in one block of a Q4_1 matrix, d in the Q8_0 embeddings (in its
    first and a later chunk of blocks), a NaN in a norm: check_scales names the tensor, the
    block and the field, also when it hands each chunk's pages back as it goes; the largest
    finite scales pass."""
    q41 = next(t for t in reader.tensors if t.name == "blk.3.attn_q.weight")
    q80 = next(t for t in reader.tensors if t.name == "token_embd.weight")
    norm = next(t for t in reader.tensors if t.name == "blk.2.ffn_norm.weight")
    nan, inf, ninf, big = (struct.pack("<H", v) for v in (0x7E00, 0x7C00, 0xFC00, 0x7BFF))
    ok = patched(
        tmp_path, (q41.data_offset, big), (q41.data_offset + 2, b"\xff\xfb"), name="ok.gguf"
    )
    with GGUFFile(ok) as f:
        f.check_scales()
    for patch, words in [
        ((q41.data_offset + 5 * 20, nan), ["'blk.3.attn_q.weight' (Q4_1", "block 5 ", "d = NaN"]),
        ((q41.data_offset + 7 * 20 + 2, ninf), ["'blk.3.attn_q.weight'", "block 7 ", "m = -inf"]),
        ((q41.data_offset + (q41.n_bytes - 20) + 2, inf), ["block 10,367 ", "m = inf"]),
        (
            (q80.data_offset + 9 * 34, nan),
            ["'token_embd.weight' (Q8_0, 49152 x 576)", "block 9 ", "d = NaN"],
        ),
        ((q80.data_offset + 700_000 * 34, inf), ["'token_embd.weight'", "block 700,000 "]),
        (
            (norm.data_offset + 4 * 3, struct.pack("<f", float("nan"))),
            ["'blk.2.ffn_norm.weight' (F32, 576)", "element 3 is NaN"],
        ),
    ]:
        message = refused(patched(tmp_path, patch), *words, scales=True)
        assert f"byte {patch[0]:,}" in message
        with pytest.raises(GGUFFileError) as again:  # pages handed back as read: the same find
            with GGUFFile(patched(tmp_path, patch)) as f:
                f.check_scales(release={t.name for t in reader.tensors})
        assert str(again.value) == message
        with GGUFFile(patched(tmp_path, patch)) as f:  # the table itself is fine
            f.check_scales(["blk.0.attn_q.weight"])


@pytest.mark.parametrize("qtype", sorted(_SCALES))
def test_scale_positions_are_the_dequantizers(qtype):
    """Where check_scales looks is where the gguf package's dequantizer takes each block's
    scales: with them 1.0 a block of random bytes is finite; a NaN at each field poisons it."""
    from gguf.quants import dequantize

    _, size = gguf.GGML_QUANT_SIZES[qtype]
    start, fields = _SCALES[qtype]
    block = np.random.default_rng(int(qtype)).integers(0, 256, (1, size), dtype=np.uint8)
    block[0, start : start + 2 * len(fields)] = np.full(len(fields), 1.0, np.float16).view(np.uint8)
    assert np.isfinite(dequantize(block, qtype)).all()
    buf = np.tile(block.reshape(-1), 3)
    assert _first_non_finite(buf, start, 3, size, len(fields), np.dtype("<u2"), 0x7C00) is None
    for i in range(len(fields)):
        bad = block.copy()
        bad[0, start + 2 * i : start + 2 * i + 2] = np.array([np.nan], np.float16).view(np.uint8)
        assert not np.isfinite(dequantize(bad, qtype)).all(), fields[i]
        buf = np.concatenate([block.reshape(-1), bad.reshape(-1), bad.reshape(-1)])
        assert _first_non_finite(buf, start, 3, size, len(fields), np.dtype("<u2"), 0x7C00) == (
            1,
            i,
        )


def test_an_iq1m_scale_is_found_where_the_dequantizer_takes_it():
    """IQ1_M's d lies in the top nibbles of its 4 scale words: with it 1.0, a block of random
    bytes is finite and passes; with it NaN or inf the gguf package's dequantizer gives
    non-finite weights, and the check names that block."""
    from gguf.quants import dequantize

    from miniserve.runners.gguf_file import _first_iq1m_non_finite

    q = gguf.GGMLQuantizationType.IQ1_M
    _, size = gguf.GGML_QUANT_SIZES[q]

    def with_d(bits: int) -> np.ndarray:
        block = np.random.default_rng(bits).integers(0, 256, size, dtype=np.uint8)
        words = block[48:56].copy().view("<u2")
        for t in range(4):
            words[t] = (words[t] & 0x0FFF) | (((bits >> (4 * t)) & 15) << 12)
        block[48:56] = words.view(np.uint8)
        return block

    good = with_d(0x3C00)  # 1.0
    assert np.isfinite(dequantize(good.reshape(1, -1), q)).all()
    assert _first_iq1m_non_finite(np.tile(good, 3), 0, 3, size, None) is None
    for bits in (0x7E00, 0x7C00, 0xFC00):  # NaN, inf, -inf
        bad = with_d(bits)
        assert not np.isfinite(dequantize(bad.reshape(1, -1), q)).all()
        buf = np.concatenate([good, good, bad, good])
        assert _first_iq1m_non_finite(buf, 0, 4, size, None) == 2
    big = with_d(0x7BFF)  # the largest finite
    assert _first_iq1m_non_finite(big, 0, 1, size, None) is None


def test_bad_magic_and_versions(tmp_path, original):
    refused(patched(tmp_path, (0, b"GGML")), "not a GGUF file", "b'GGML'")
    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", "empty")
    refused(patched(tmp_path, (4, struct.pack("<I", 1))), "version 1")
    refused(patched(tmp_path, (4, struct.pack("<I", 77))), "version 77")
    refused(patched(tmp_path, (4, struct.pack(">I", 3))), "big-endian")


def test_garbage_lengths_and_counts(tmp_path, reader, original):
    name = parts_at(reader.fields["general.name"])
    tokens = parts_at(reader.fields["tokenizer.ggml.tokens"])
    types = parts_at(reader.fields["tokenizer.ggml.token_type"])
    for at, count, *words in [  # a length or a count at `at` made `count`
        (name[0], 1 << 62, "metadata key #", "past the end"),
        (name[3], 1 << 40, "'general.name'", "1,099,511,627,776 bytes long"),
        (tokens[4], 1 << 61, "'tokenizer.ggml.tokens'", "2,305,843,009,213,693,952 strings"),
        (tokens[5 + 2 * 1000], 1 << 50, "'tokenizer.ggml.tokens'", "string #1,001 of 49,152"),
        (types[4], 1 << 60, "'tokenizer.ggml.token_type'", "values of 4 bytes"),
        (8, 1 << 62, "tensors", "damaged"),
        (16, 1 << 62, "metadata keys"),
    ]:
        refused(patched(tmp_path, (at, struct.pack("<Q", count))), *words)
    for seed in range(20):  # random bytes behind a good header: a clean refusal each time
        rng = np.random.default_rng(seed)
        junk = original[:24] + rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
        (tmp_path / "junk.gguf").write_bytes(junk)
        refused(tmp_path / "junk.gguf")


def test_bad_value_types_and_keys(tmp_path, reader, original):
    name = parts_at(reader.fields["general.name"])
    refused(
        patched(tmp_path, (name[2], struct.pack("<I", 13))),
        "'general.name'",
        "unknown value type 13",
    )
    languages = parts_at(reader.fields["general.languages"])
    refused(
        patched(tmp_path, (languages[3], struct.pack("<I", 9))),
        "'general.languages'",
        "array of arrays",
    )
    refused(patched(tmp_path, (name[1], b"general.type")), "key 'general.type' twice")
    refused(patched(tmp_path, (name[1], b"\xff")), "not valid UTF-8")
    at = parts_at(reader.fields["general.quantization_version"])  # a u32 key, renamed
    data = (
        original[: at[0]]
        + struct.pack("<Q", 17)
        + b"general.alignment"
        + struct.pack("<II", 4, 48)
        + original[at[3] + 4 :]
    )
    (tmp_path / "align.gguf").write_bytes(data)
    refused(tmp_path / "align.gguf", "general.alignment 48", "not a power of two")


def test_string_arrays_skipped_in_numpy_as_in_python():
    """The numpy chain-following skip gives the plain loop's starts and end, on strings with
    zero bytes, empty ones, long ones (a Python step each) -- and the same refusal when cut."""
    rng = np.random.default_rng(0)
    for trial in range(12):
        count = int(rng.integers(1024, 3000))
        kind = rng.random(count)
        lengths = np.where(
            kind < 0.05,
            0,
            np.where(kind < 0.08, rng.integers(256, 3000, count), rng.integers(1, 20, count)),
        )
        text = rng.integers(0 if trial % 3 == 0 else 1, 256, int(lengths.sum()), dtype=np.uint8)
        ends = np.cumsum(lengths).tolist()
        pieces = [
            struct.pack("<Q", b - a) + text[a:b].tobytes() for a, b in zip([0] + ends[:-1], ends)
        ]
        raw = b"\x07" * 5 + b"".join(pieces) + bytes(rng.integers(0, 256, 64, dtype=np.uint8))
        for cut in (len(raw), len(raw) - 70, len(raw) // 2):
            data = np.frombuffer(raw[:cut], np.uint8)
            plain = _string_starts_plain(data, 5, count, cut)
            fast = _string_starts(data, data, 5, count, cut)
            assert (fast[0] is None) == (plain[0] is None), (trial, cut)
            skipped = _string_starts(data, data, 5, count, cut, keep=False)
            if plain[0] is None:
                assert cut < len(raw) - 64 and skipped[0] is None
            else:
                assert fast[1] == plain[1] and np.array_equal(fast[0], plain[0]), trial
                assert skipped == (True, plain[1])


def test_peer_file_type_reads_the_header(tmp_path, path, original):
    from miniserve.bench import peer

    assert peer.file_type(path) == "q4_1"
    assert peer.file_type(patched(tmp_path, cut=5000)) is None
    assert peer.file_type(patched(tmp_path, (0, b"GGML"))) is None
