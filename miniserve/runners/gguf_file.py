"""A GGUF file read in place: header, metadata and tensor table parsed from a read-only memory
map, each tensor's bytes a zero-copy view of that map (the quantized runner computes on the
weights where they lie; nothing is dequantized or copied).

Everything native code would trust is checked here first, so a truncated, damaged or hostile
file is a GGUFFileError saying what is wrong, never a crash or a hang: counts and lengths
against the bytes left before anything is allocated or read, value and tensor type ids, shapes
against their type's blocks, alignment, every tensor inside the file and none overlapping; the
work is linear in the header's size whatever its bytes (tested by benchmarks/fuzz_gguf.py).
check_scales() goes on to read the blocks' scales (one NaN scale poisons every value it
scales); it is separate because it touches the weights.

The gguf package's GGUFReader is not used: it builds numpy objects for every tensor and every
vocabulary entry (seconds for a 262k-token vocabulary). Here scalars and strings are parsed with
struct, scalar arrays copied out with numpy, and long string arrays (tokens, merges) only
skipped over until their key is read.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 1 had 32-bit counts; 2 and 3 differ only in allowing big-endian
DEFAULT_ALIGNMENT = 32  # when general.alignment is absent
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEYS = 1 << 16  # more metadata keys (real files: ~50) or tensors (thousands) than
MAX_TENSORS = 1 << 18  # these mean a damaged header, not a model: bounds the parse's time
EAGER_STRINGS = 64  # longer string arrays are decoded on first access of their key
SMALL_FLOATS = 1 << 20  # float tensors with fewer elements (norms, biases): every value checked

_V = GGUFValueType
_Q = GGMLQuantizationType
_SCALARS = {
    kind: struct.Struct(fmt)
    for kind, fmt in {
        _V.UINT8: "<B",
        _V.INT8: "<b",
        _V.UINT16: "<H",
        _V.INT16: "<h",
        _V.UINT32: "<I",
        _V.INT32: "<i",
        _V.FLOAT32: "<f",
        _V.BOOL: "<?",
        _V.UINT64: "<Q",
        _V.INT64: "<q",
        _V.FLOAT64: "<d",
    }.items()
}
_ARRAYS = {kind: np.dtype("<u1" if kind == _V.BOOL else s.format) for kind, s in _SCALARS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TENSOR_TAIL = struct.Struct("<IQ")  # type id, offset
_MIN_KV = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR = 8 + 4 + 8 + 4 + 8  # empty name, one dimension, type id, offset

# Where each block keeps its fp16 scales (ggml-common.h's block structs; the same splits as
# gguf.quants' dequantizers): (byte offset in the block, the fields there, 2 bytes each). Not
# checked: Q8_1 (the gguf package's 40-byte size is not ggml's 36-byte block), Q8_K (an f32
# scale, llama.cpp's internal type), MXFP4 / NVFP4 (8-bit scales), Q1_0 (no reference layout in
# the gguf package). IQ1_M's d is the top nibbles of its 4 scale words: _first_iq1m_non_finite.
_SCALES = {
    _Q.Q4_0: (0, ("d",)),
    _Q.Q4_1: (0, ("d", "m")),
    _Q.Q5_0: (0, ("d",)),
    _Q.Q5_1: (0, ("d", "m")),
    _Q.Q8_0: (0, ("d",)),
    _Q.Q2_K: (80, ("d", "dmin")),
    _Q.Q3_K: (108, ("d",)),
    _Q.Q4_K: (0, ("d", "dmin")),
    _Q.Q5_K: (0, ("d", "dmin")),
    _Q.Q6_K: (208, ("d",)),
    _Q.IQ2_XXS: (0, ("d",)),
    _Q.IQ2_XS: (0, ("d",)),
    _Q.IQ2_S: (0, ("d",)),
    _Q.IQ3_XXS: (0, ("d",)),
    _Q.IQ3_S: (0, ("d",)),
    _Q.IQ1_S: (0, ("d",)),
    _Q.IQ4_NL: (0, ("d",)),
    _Q.IQ4_XS: (0, ("d",)),
    _Q.TQ1_0: (52, ("d",)),
    _Q.TQ2_0: (64, ("d",)),
}
# Plain float tensors: the value's bits and +inf's (without the sign, at least that: inf or NaN).
_FLOATS = {
    _Q.F32: (np.dtype("<u4"), 0x7F800000),
    _Q.F16: (np.dtype("<u2"), 0x7C00),
    _Q.BF16: (np.dtype("<u2"), 0x7F80),
}
_F16_INF = 0x7C00
_F16 = np.dtype("<u2")
_VECTOR_STRINGS = 1024  # string arrays at least this long are skipped with numpy
_SHORT_STRING = 1 << 8  # ... whose strings are mostly shorter than this (a tighter bound
# than any length: 8 bytes before a start read as last char + length)
_MAX_STEPS = 256  # ... unless past this many Python steps they skip < 32 strings each
_U64_DTYPE = np.dtype("<u8")
_WINDOW = 1 << 22  # ... looked at this many bytes at a time
_SCAN_ROWS = 1 << 16  # check_scales reads this many blocks at a time (measured fastest)


class GGUFFileError(ValueError):
    """The file cannot be used; the message is one sentence naming the file (and the tensor or
    key) and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. shape is row-major -- GGUF's ne reversed: (rows, cols) for
    a matrix, (n,) for a vector; offset is absolute in the file, nbytes the stored size."""

    name: str
    type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.type)

    def describe(self) -> str:
        """ "tensor 'blk.0.attn_q.weight' (Q4_K, 2048 x 2048)": how messages name it."""
        shape = " x ".join(map(str, self.shape))
        return f"tensor '{_short(self.name)}' ({self.type_name}, {shape})"


@dataclass(frozen=True)
class _Strings:
    """A string array not decoded yet: where its first length prefix is, and how many."""

    offset: int
    count: int


class _Metadata(Mapping):
    """The key/values; a long string array is decoded (and kept) on first access."""

    def __init__(self, values: dict, mm: mmap.mmap, buf: np.ndarray, name: str):
        self._values, self._mm, self._buf, self._name = values, mm, buf, name

    def __getitem__(self, key: str):
        value = self._values[key]
        if isinstance(value, _Strings):
            if self._mm is None:
                raise ValueError(
                    f"{self._name} is closed: the metadata value '{key}' was "
                    "not read before close()"
                )
            value = self._values[key] = _read_strings(
                self._mm, self._buf, value.offset, value.count
            )
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"<GGUF metadata: {', '.join(self._values)}>"


class GGUFFile:
    """One GGUF file, memory-mapped read-only and validated (see the module's docstring); a
    GGUFFileError if it cannot be used. Close it (or use it as a context manager) when done:
    views from data() keep the map alive until they are dropped, addresses from address() do
    not."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._name = self.path.name
        self._mm = None
        self._buf = None
        with open(self.path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            head = f.read(24)
            if head[:4] != MAGIC:
                raise self._error(
                    "is empty, not a GGUF file"
                    if not head
                    else f"is not a GGUF file (it starts with {head[:4]!r}, not "
                    "b'GGUF'); pass a .gguf model file"
                )
            self._check_version(head)
            if len(head) < 24:
                raise self._error(
                    f"is only {self.size:,} bytes, too short for a GGUF header: "
                    "the file is truncated; download it again"
                )
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self._mm)
        try:
            self._buf = np.frombuffer(self._mm, dtype=np.uint8)
            self._parse()
        except BaseException:
            self.close()
            raise

    # ---- what callers use

    @property
    def metadata(self) -> Mapping:
        return self._metadata

    def get(self, key: str, default=None):
        return self._metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        arch = self._metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    @property
    def header_bytes(self) -> int:
        """Where the tensor data starts (the header, metadata and tensor table, aligned)."""
        return self._data_start

    def data(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the map (no copy)."""
        t = self._tensor(name)
        if self._buf is None:
            raise ValueError(f"{self._name} is closed")
        return self._buf[t.offset : t.offset + t.nbytes]

    def address(self, name: str) -> int:
        """The address of the tensor's first byte in this process, for native code; valid
        until close()."""
        return self.data(name).ctypes.data

    def release(self, address: int, nbytes: int) -> None:
        """Hands the whole pages of the map within [address, address + nbytes) back (the
        file's bytes in this process's memory, after a copy of them was made: repacked
        weights). Nothing is lost: the map is the file's, read-only, and a later read faults
        the pages in again."""
        if self._buf is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = address - self._buf.ctypes.data
        if not 0 <= start <= start + nbytes <= self.size:
            raise ValueError(f"{self._name}: bytes {start}..{start + nbytes} are not in the file")
        page = mmap.PAGESIZE
        first, end = -(-start // page) * page, (start + nbytes) // page * page
        if end > first:
            self._mm.madvise(mmap.MADV_DONTNEED, first, end - first)

    def release_header(self) -> None:
        """Hands back the pages of the header (metadata and tensor table: read at open, and
        by a tokenizer built from it), whole pages before the first tensor's."""
        if self._buf is not None:
            self.release(self._buf.ctypes.data, min(self._data_start, self.size))

    def check_scales(
        self, names: Iterable[str] | None = None, release: Collection[str] = ()
    ) -> None:
        """Every quantized block's fp16 scales (d, and m / dmin where the type has them) finite,
        and every value of the small float tensors (fewer than SMALL_FLOATS: norms, biases);
        else GGUFFileError naming the first bad tensor and block. All tensors, or `names`.
        Strided numpy views over the map: one pass over the weights' pages; those of the
        tensors named in `release` are handed back (release()) a chunk at a time as they are
        read, so that the pass does not leave them resident."""
        if self._buf is None:
            raise ValueError(f"{self._name} is closed")
        chosen = self.tensors.values() if names is None else [self._tensor(n) for n in names]
        base = self._buf.ctypes.data
        for t in chosen:
            size = GGML_QUANT_SIZES[t.type][1]

            def done(first: int, n: int, t=t, size=size) -> None:  # a chunk of blocks read
                self.release(base + t.offset + first * size, n * size)

            if t.type in _SCALES:
                start, fields = _SCALES[t.type]
                found = _first_non_finite(
                    self._buf,
                    t.offset + start,
                    t.nbytes // size,
                    size,
                    len(fields),
                    _F16,
                    _F16_INF,
                    done if t.name in release else None,
                )
                if found is not None:
                    index, field = found
                    at = t.offset + index * size + start + 2 * field
                    raise self._error(
                        f"{t.describe()}: block {index:,} has a non-finite scale "
                        f"({fields[field]} = {self._float_text(at, t.type)}) at "
                        f"byte {at:,}: the file is damaged; download it again"
                    )
            elif t.type == _Q.IQ1_M:
                index = _first_iq1m_non_finite(
                    self._buf, t.offset, t.nbytes // size, size, done if t.name in release else None
                )
                if index is not None:
                    at = t.offset + index * size + _IQ1M_WORDS
                    raise self._error(
                        f"{t.describe()}: block {index:,} has a non-finite scale (d, in the top "
                        f"bits of its scale words at byte {at:,}): the file is damaged; "
                        "download it again"
                    )
            elif t.type in _FLOATS and t.nbytes // size < SMALL_FLOATS:
                dtype, inf = _FLOATS[t.type]
                found = _first_non_finite(
                    self._buf, t.offset, t.nbytes // size, size, 1, dtype, inf
                )
                if found is not None:
                    index = found[0]
                    at = t.offset + index * size
                    raise self._error(
                        f"{t.describe()}: element {index:,} is "
                        f"{self._float_text(at, t.type)} (at byte {at:,}): the file "
                        "is damaged; download it again"
                    )
            if t.name in release:  # (the pages between its chunks too)
                self.release(base + t.offset, t.nbytes)

    def close(self) -> None:
        self._buf = None
        if getattr(self, "_metadata", None) is not None:
            self._metadata._mm = self._metadata._buf = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views from data() are alive: the map goes with the last one
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile('{self.path}', {self.architecture}, {len(self.tensors)} tensors"
            f"{', closed' if self._mm is None else ''})"
        )

    # ---- parsing

    def _error(self, message: str) -> GGUFFileError:
        return GGUFFileError(f"{self._name}: {message}.")

    def _past_end(self, what: str) -> GGUFFileError:
        return self._error(
            f"{what}, past the end of the file ({self.size:,} bytes): the file "
            "is truncated or its header damaged; download it again"
        )

    def _check_version(self, head: bytes) -> None:
        if len(head) < 8:
            raise self._error(
                f"is only {self.size:,} bytes, too short for a GGUF header: the "
                "file is truncated; download it again"
            )
        version = _U32.unpack_from(head, 4)[0]
        if version in VERSIONS:
            self.version = version
        elif version & 0xFFFF == 0 and version >> 24 in VERSIONS:
            raise self._error(
                "is a big-endian GGUF, which is not supported: convert the model "
                "again as little-endian"
            )
        elif version == 1:
            raise self._error(
                "is GGUF version 1 (2023's first format), which is not supported: "
                "convert the model again"
            )
        else:
            raise self._error(
                f"has GGUF version {version:,}, which is not supported (only 2 "
                "and 3): the file is damaged or from a newer format"
            )

    def _need(self, pos: int, n: int, what: str) -> int:
        """pos + n, after checking that n bytes are there."""
        if n > self.size - pos:
            raise self._past_end(f"{what} ends at byte {pos + n:,}")
        return pos + n

    def _text(self, pos: int, what: str, strict: bool) -> tuple[str, int]:
        """A length-prefixed string; keys and names must be UTF-8, values are decoded leniently."""
        start = self._need(pos, 8, f"{what}'s length")
        n = _U64.unpack_from(self._mm, pos)[0]
        if n > self.size - start:
            raise self._past_end(f"{what} says it is {n:,} bytes long, running from byte {start:,}")
        raw = self._mm[start : start + n]
        try:
            return raw.decode("utf-8", "strict" if strict else "replace"), start + n
        except UnicodeDecodeError:
            raise self._error(
                f"{what} is not valid UTF-8 ({raw[:40]!r}): the header is "
                "damaged; download it again"
            ) from None

    def _parse(self) -> None:
        mm, size = self._mm, self.size
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        if n_kv > MAX_KEYS or n_tensors > MAX_TENSORS:
            raise self._error(
                f"says it has {n_tensors:,} tensors and {n_kv:,} metadata keys, "
                f"more than any model (at most {MAX_TENSORS:,} and {MAX_KEYS:,} "
                "are read): the header is damaged"
            )
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR > size - 24:
            raise self._error(
                f"says it has {n_tensors:,} tensors and {n_kv:,} metadata keys, "
                f"more than its {size:,} bytes can hold: the header is damaged or "
                "the file truncated; download it again"
            )
        pos = 24
        values: dict = {}
        for i in range(n_kv):
            key, pos = self._text(pos, f"metadata key #{i + 1:,} of {n_kv:,}", strict=True)
            if key in values:
                raise self._error(
                    f"has the metadata key '{_short(key)}' twice: the header is damaged"
                )
            where = f"the metadata value '{_short(key)}'"
            kind = _U32.unpack_from(mm, self._need(pos, 4, f"{where}'s type") - 4)[0]
            values[key], pos = self._value(pos + 4, kind, where)
        self._metadata = _Metadata(values, mm, self._buf, self._name)

        alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self._error(
                f"has general.alignment {alignment!r}, not a power of two: the header is damaged"
            )
        self.alignment = alignment

        table = []
        names = set()
        for i in range(n_tensors):
            name, pos = self._text(
                pos, f"the name of tensor #{i + 1:,} of {n_tensors:,}", strict=True
            )
            where = f"tensor '{_short(name)}'"
            pos = self._need(pos, 4, f"{where}'s dimension count")
            n_dims = _U32.unpack_from(mm, pos - 4)[0]
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._error(
                    f"{where} has {n_dims:,} dimensions (GGUF allows 1 to "
                    f"{MAX_DIMS}): the tensor table is damaged"
                )
            pos = self._need(pos, 8 * n_dims + _TENSOR_TAIL.size, f"{where}'s entry")
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos - 8 * n_dims - _TENSOR_TAIL.size)
            kind, offset = _TENSOR_TAIL.unpack_from(mm, pos - _TENSOR_TAIL.size)
            if kind not in GGML_QUANT_SIZES:
                raise self._error(
                    f"{where} has the unknown type id {kind:,}: the tensor table "
                    "is damaged or the file is from a newer llama.cpp"
                )
            shape = tuple(reversed(ne))
            described = f"{where} ({_type_name(kind)}, {' x '.join(map(str, shape))})"
            if not all(0 < n < 1 << 63 for n in ne):
                raise self._error(
                    f"{described} has a dimension that is not positive: the tensor table is damaged"
                )
            block, type_size = GGML_QUANT_SIZES[kind]
            if ne[0] % block:
                raise self._error(
                    f"{described} has rows of {ne[0]:,} values, not a whole "
                    f"number of its type's {block}-value blocks: the tensor table "
                    "is damaged"
                )
            if name in names:
                raise self._error(
                    f"has two tensors named '{_short(name)}': the tensor table is damaged"
                )
            names.add(name)
            count = 1
            for n in ne:
                count *= n
            table.append((name, kind, shape, offset, count // block * type_size, described))

        self._data_start = -(-pos // alignment) * alignment
        tensors = {}
        for name, kind, shape, offset, nbytes, described in table:
            if offset % alignment:
                raise self._error(
                    f"{described} starts at data offset {offset:,}, not a "
                    f"multiple of the alignment ({alignment}): the tensor table "
                    "is damaged"
                )
            start = self._data_start + offset
            if start + nbytes > size:
                raise self._error(
                    f"{described} ends at byte {start + nbytes:,}, past the end "
                    f"of the file ({size:,} bytes): the file is truncated; "
                    "download it again"
                )
            tensors[name] = TensorInfo(name, kind, shape, start, nbytes)
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if b.offset < a.offset + a.nbytes:
                raise self._error(
                    f"{a.describe()} (bytes {a.offset:,} to "
                    f"{a.offset + a.nbytes:,}) and {b.describe()} (from byte "
                    f"{b.offset:,}) overlap: the tensor table is damaged"
                )
        self.tensors: dict[str, TensorInfo] = tensors

    def _value(self, pos: int, kind: int, where: str):
        """(value, end) of one metadata value of type `kind` at pos."""
        mm = self._mm
        if kind in _SCALARS:
            s = _SCALARS[kind]
            return s.unpack_from(mm, self._need(pos, s.size, where) - s.size)[0], pos + s.size
        if kind == _V.STRING:
            return self._text(pos, where, strict=False)
        if kind != _V.ARRAY:
            raise self._error(
                f"{where} has the unknown value type {kind:,}: the header is "
                "damaged or the file is from a newer format"
            )
        start = self._need(pos, 12, f"{where}'s array header")
        inner, count = struct.unpack_from("<IQ", mm, pos)
        left = self.size - start
        if inner == _V.STRING:
            if count > left // 8:
                raise self._past_end(
                    f"{where} says it holds {count:,} strings, running from byte {start:,}"
                )
            if count <= EAGER_STRINGS:
                values = []
                for i in range(count):
                    text, start = self._text(start, f"{where}'s string #{i + 1:,}", strict=False)
                    values.append(text)
                return values, start
            ok, end = _string_starts(mm, self._buf, start, count, self.size, keep=False)
            if ok is None:
                raise self._past_end(f"{where}'s string #{end + 1:,} of {count:,} runs on")
            return _Strings(start, count), end
        if inner == _V.ARRAY:
            raise self._error(
                f"{where} is an array of arrays, which GGUF readers do not "
                "support: the header is damaged"
            )
        if inner not in _ARRAYS:
            raise self._error(
                f"{where} is an array of the unknown value type {inner:,}: the "
                "header is damaged or the file is from a newer format"
            )
        dtype = _ARRAYS[inner]
        if count > left // dtype.itemsize:
            raise self._past_end(
                f"{where} says it holds {count:,} values of {dtype.itemsize} "
                f"bytes, running from byte {start:,}"
            )
        values = (
            np.frombuffer(mm, dtype=dtype, count=count, offset=start).copy()
            if count
            else np.empty(0, dtype)
        )
        if inner == _V.BOOL:
            values = values != 0
        return values, start + count * dtype.itemsize

    def _tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self._name} has no tensor '{_short(name)}'") from None

    def _float_text(self, at: int, kind: int) -> str:
        """A stored non-finite value as text: NaN, inf or -inf (a scale is fp16)."""
        if kind == _Q.F32:
            value = struct.unpack_from("<f", self._mm, at)[0]
        elif kind == _Q.BF16:
            value = struct.unpack("<f", b"\0\0" + self._mm[at : at + 2])[0]
        else:
            value = struct.unpack_from("<e", self._mm, at)[0]
        return "NaN" if value != value else str(value)


def _short(name: str) -> str:
    """A key or tensor name as messages show it: control characters escaped, a garbage one cut
    to 80 characters (a message stays one line)."""
    if not name.isprintable():
        name = name.encode("unicode_escape").decode("ascii")
    return name if len(name) <= 80 else name[:80] + "..."


def _type_name(kind: int) -> str:
    try:
        return _Q(kind).name
    except ValueError:
        return f"type {kind}"


def _string_starts(
    mm, buf: np.ndarray, pos: int, count: int, size: int, keep: bool = True
) -> tuple[np.ndarray | bool | None, int]:
    """(starts, end) of `count` length-prefixed strings from pos: each one's length prefix's
    position (only True unless `keep`: skipping needs none), and where the last ends; (None,
    index) of the first that runs past the end.

    The positions chain (each follows from the length before it), so instead of a Python step
    a string (~65 ms for 262k) the chain is followed in numpy a window at a time (~15 ms):
    every byte position whose 8 bytes read as a length under 256 is a candidate start -- in
    text only the true starts are -- and a run of candidates each of which ends where the next
    begins is a run of true starts. A long string, or a candidate that is not a start, costs a
    Python step; where those are many (runs of zeros, garbage) the plain loop takes over."""
    if count < _VECTOR_STRINGS:
        return _string_starts_plain(mm, pos, count, size, keep, buf)
    runs, left, steps = [], count, 0

    def worth_it() -> bool:  # after _MAX_STEPS steps, on average 32 strings a step at least
        return steps < _MAX_STEPS or count - left >= 32 * steps

    while left and worth_it():
        span = min(size - pos, left * 32 + 4096, _WINDOW)
        if span < 16:
            break
        zero = buf[pos : pos + span] == 0
        two = zero[:-1] & zero[1:]
        four = two[:-2] & two[2:]
        c = np.flatnonzero(four[1:-3] & four[4:])  # bytes p+1 .. p+7 zero, p < span - 7
        if not len(c) or c[0]:  # a long first string: a plain step
            if keep:
                runs.append(np.array([pos], dtype=np.int64))
            pos += 8 + _U64.unpack_from(mm, pos)[0]
            left -= 1
            steps += 1
            if pos > size:
                return None, count - left - 1
            continue
        heads = np.ndarray((span - 7,), _U64_DTYPE, buf, pos, (1,))
        nxt = c + 8 + heads[c].astype(np.int64)
        breaks = np.flatnonzero(nxt[:-1] != c[1:])  # c[k]'s successor is not c[k + 1]
        k = 0
        while True:
            steps += 1
            j = int(np.searchsorted(breaks, k))
            m = min(int(breaks[j]) if j < len(breaks) else len(c) - 1, k + left - 1)
            if keep:
                runs.append(c[k : m + 1] + pos)
            left -= m - k + 1
            successor = int(nxt[m])
            if not left:  # the array ends in this run
                end = pos + successor
                if end > size:
                    return None, count - 1
                return (np.concatenate(runs) if keep else True), end
            idx = int(np.searchsorted(c, successor))
            if idx < len(c) and c[idx] == successor and worth_it():
                k = idx  # past candidates that were not starts
                continue
            pos += successor  # past the window, or not a candidate
            break
    if pos > size:
        return None, count - left - 1
    rest, end = _string_starts_plain(mm, pos, left, size, keep, buf)
    if rest is None:
        return None, count - left + end
    return (np.concatenate(runs + [rest]) if keep else True), end


def _string_starts_plain(
    mm, pos: int, count: int, size: int, keep: bool = True, buf: np.ndarray | None = None
) -> tuple[np.ndarray | bool | None, int]:
    """_string_starts, a Python step a string -- except over a run of empty strings (zeros, 8
    bytes each: a file of zeros behind a header), counted in numpy when `buf` is given."""
    unpack = _U64.unpack_from
    starts: list = []
    i = 0
    try:
        while i < count:
            n = unpack(mm, pos)[0]
            if n == 0 and buf is not None:
                k = _zero_groups(buf, pos, count - i)
                if keep:
                    starts.extend(range(pos, pos + 8 * k, 8))
                pos += 8 * k
                i += k
                continue
            if keep:
                starts.append(pos)
            pos += 8 + n
            i += 1
    except (struct.error, OverflowError):  # a length prefix cut off, or past the end
        return None, max(i - 1, 0)
    if pos > size:
        return None, count - 1
    return (np.array(starts, dtype=np.int64) if keep else True), pos


def _zero_groups(buf: np.ndarray, pos: int, most: int) -> int:
    """How many of the (up to `most`) 8-byte groups from pos are all zeros (at least one)."""
    done, n = 0, 64
    while done < most:
        n = min(n, most - done)
        window = buf[pos + 8 * done : pos + 8 * (done + n)]
        first = int(np.argmax(window != 0)) if len(window) else 0
        if len(window) and window[first]:  # a nonzero byte: the run ends in this window
            return max(done + first // 8, 1)
        done += len(window) // 8
        if len(window) < 8 * n:  # the end of the file
            return max(done, 1)
        n = min(n * 4, 1 << 20)
    return done


def _read_strings(mm, buf: np.ndarray, pos: int, count: int) -> list[str]:
    """Decode a string array the parse has checked (leniently, as other string values)."""
    starts, end = _string_starts(mm, buf, pos, count, len(mm))
    lasts = np.append(starts[1:], end).tolist()
    return [mm[a:b].decode("utf-8", "replace") for a, b in zip((starts + 8).tolist(), lasts)]


# IQ1_M: {u8 qs[32]; u8 qh[16]; u16 scales[4]}: fp16 d's bits 8-11 are word 2's top nibble, 12-15
# word 3's; its exponent (bits 10-14) is all ones -- inf or NaN -- where words 2 and 3, read as
# one little-endian uint32 at byte 52, have all of 0x7000C000
_IQ1M_WORDS = 48
_IQ1M_EXPONENT = 0x7000C000


def _first_iq1m_non_finite(
    buf: np.ndarray, start: int, rows: int, stride: int, done: Callable[[int, int], None] | None
) -> int | None:
    """The first of `rows` IQ1_M blocks (`stride` bytes apart from byte `start`) whose d is inf
    or NaN; None if none. Chunks of _SCAN_ROWS; done(first row, rows) after each clean one."""
    for first in range(0, rows, _SCAN_ROWS):
        n = min(_SCAN_ROWS, rows - first)
        words = np.ndarray((n,), np.dtype("<u4"), buf, start + first * stride + 52, (stride,))
        bad = (words & _IQ1M_EXPONENT) == _IQ1M_EXPONENT
        if bad.any():
            return first + int(np.argmax(bad))
        if done is not None:
            done(first, n)
    return None


def _first_non_finite(
    buf: np.ndarray,
    start: int,
    rows: int,
    stride: int,
    width: int,
    dtype: np.dtype,
    inf: int,
    done: Callable[[int, int], None] | None = None,
) -> tuple[int, int] | None:
    """(row, column) of the first of `rows` groups of `width` (1, or 2 for fp16 pairs) values,
    `stride` bytes apart from byte `start`, that is inf or NaN: its bits without the sign at
    least `inf`'s; None if none. Chunks of _SCAN_ROWS through one preallocated buffer: a
    pair of fp16 is tested as one uint32 (the exponent's low bit added carries into the sign
    bit only when the exponent is all ones), a single value by the maximum of its bits.
    done(first row, rows) after each chunk found clean."""
    pairs = width == 2
    wide = np.dtype("<u4") if pairs else dtype
    scratch = np.empty(min(rows, _SCAN_ROWS), wide)
    for first in range(0, rows, _SCAN_ROWS):
        n = min(_SCAN_ROWS, rows - first)
        offset = start + first * stride
        x = np.bitwise_and(
            np.ndarray((n,), wide, buf, offset, (stride,)),
            inf << 16 | inf if pairs else inf | (inf - 1),
            out=scratch[:n],
        )
        if pairs:
            low = inf & -inf
            np.add(x, low << 16 | low, out=x)
            found = bool(np.bitwise_and(x, 0x80008000, out=x).any())
        else:
            found = int(x.max()) >= inf
        if found:
            view = np.ndarray((n, width), dtype, buf, offset, (stride, dtype.itemsize))
            flat = int(np.argmax(((view & (inf | (inf - 1))) >= inf).reshape(-1)))
            return first + flat // width, flat % width
        if done is not None:
            done(first, n)
    return None
