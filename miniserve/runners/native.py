"""The native forward pass: miniserve/runners/kernels/decode.cpp, compiled at first use, called by
ctypes.

Why it exists: one decoded token reads every weight once (538 MB in float32), so a step can
not be faster than memory allows; PyTorch gets its matrix-vector products close to that, but
spends another ~10 us on each of ~45 small ops per layer (norms, RoPE, cache writes, SiLU)
on vectors of a few hundred numbers. And many rows at once (several sequences, a prompt's
tokens) turn the same weights into compute-bound products, which decode.cpp runs in its own
fixed order, so that a sequence's results do not depend on what shares its pass. One call
runs a whole pass: every layer, every row.

Build: the system C++ compiler (`$CXX`, else `c++`), `-O3` for the target that
`MINISERVE_NATIVE_ARCH` names (TARGETS below; `native` by default: this CPU, AVX-512 where it
has it), a few seconds, once; the library is kept in the user cache folder, keyed by the
source, the compiler, this CPU and the compiler flags. `isa()` says which inner loops the
library holds (avx512, avx2, avx2+vnni or generic). Where there is no compiler, the lean
PyTorch step runs instead and `unavailable_reason()` says why: nothing else changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from miniserve.core import platform as platform_info
from miniserve.core.config import MATHS
from miniserve.core.paths import cache_root
from miniserve.runners.base import KVCache
from miniserve.runners.lean import LeanRunner, huge_page_memory

SOURCE = Path(__file__).parent / "kernels" / "decode.cpp"
KERNEL_FILES = sorted(SOURCE.parent.glob("*.h")) + [SOURCE]  # the headers decode.cpp includes
# tables keyed by a dtype's name (dtype_name): read when the web app starts, before torch is
# imported (core/deferred.py)
DTYPE_CODES = {"float32": 0, "bfloat16": 1}
# ggml's type ids (a GGUF tensor's type) of the float weights; quantized ones come from the file
TYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 30}
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
MATH_CODES = {"float32": 0, "bfloat16": 1}
# The KV cache's numbers (decode.cpp, ms_kv_type): float32, float16, bfloat16.
KV_TYPES = ("float32", "float16", "bfloat16")  # names: torch is imported when first used
# MINISERVE_KV: the KV cache of weights as stored in block formats (Q4_K, Q8_0, ...): float16,
# the default, as llama.cpp's cache (half the memory, half the bytes attention reads; such a
# product rounds its activations to int8, a coarser step than float16's), or float32. Float
# weights (F16 / BF16 / F32 files, transformers' weights) keep float32 keys and values:
# float32's bound holds there (bfloat16 products apart: decode.cpp's kv_bf16).
KV_CHOICES = ("float16", "float32")
X86_64 = platform.machine().lower() in ("x86_64", "amd64")

# MINISERVE_NATIVE_ARCH: what to compile for, each a list of architecture flags to try in turn
# (the first the compiler takes is used).
#   native:    this CPU. -march=native: AVX-512 where the CPU has it; -mcpu=native: what Apple's
#              clang takes on arm64; none: portable loops the compiler vectorizes as it can.
#   x86-64-v3: AVX2 + FMA, as on most x86 CPUs of the last ten years (the AVX2 loops).
#   x86-64-v3-vnni: the same with AVX-VNNI (Intel's desktops and laptops from Alder Lake: no
#              AVX-512, one instruction for 4 int8 products), as -march=native builds there.
#   generic:   the plain loops, for the architecture's baseline (SSE2 on x86-64).
TARGETS = {
    "native": [["-march=native"], ["-mcpu=native"], []],
    "x86-64-v3": [["-march=x86-64-v3"]],
    "x86-64-v3-vnni": [["-march=x86-64-v3", "-mavxvnni"]],
    "generic": [["-march=x86-64", "-mtune=generic"]] if X86_64 else [[]],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False
_target: str | None = None  # the build target of the load() that ran


def _cpu_id() -> str:
    return platform_info.cpu_flags() or platform.processor() or platform.machine()


def _compiler() -> str | None:
    return (
        shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    )


def build_target() -> str:
    """The build target in use: MINISERVE_NATIVE_ARCH as load() read it (`native` when unset);
    an unknown name is returned as given, and load() then reports it."""
    if _target is not None:
        return _target
    return os.environ.get("MINISERVE_NATIVE_ARCH", "").strip() or "native"


def library_path(compiler: str, target: str = "native") -> Path:
    """Where the library for `target` is kept. The key holds the flags, so that libraries built
    for different targets (or with different flags) are never taken for one another."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    flags = repr((FLAGS, target, TARGETS[target]))
    sources = b"".join(path.read_bytes() for path in KERNEL_FILES)
    key = hashlib.sha256(
        sources
        + version.encode()
        + _cpu_id().encode()
        + platform.machine().encode()
        + flags.encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"decode-{target}-{key}.so"


def _build(compiler: str, path: Path, target: str = "native") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    for arch in TARGETS[target]:
        command = [compiler, *FLAGS, *arch, str(SOURCE), "-o", str(tmp)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            os.replace(tmp, path)
            return
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"{compiler} failed for target {target}: {last}")


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None where it cannot be built."""
    global _lib, _reason, _tried, _target
    with _lock:
        if _tried:
            return _lib
        _tried = True
        _target = build_target()
        if os.environ.get("MINISERVE_NATIVE", "1") == "0":
            _reason = "turned off by MINISERVE_NATIVE=0"
            return None
        if _target not in TARGETS:
            _reason = f"unknown MINISERVE_NATIVE_ARCH={_target!r} (one of: {', '.join(TARGETS)})"
            return None
        compiler = _compiler()
        if compiler is None:
            _reason = "no C++ compiler found (set CXX, or install g++ / clang++)"
            return None
        try:
            path = library_path(compiler, _target)
            if not path.exists():
                print(
                    f"Compiling the native forward pass ({SOURCE.name}, {_target}) ...",
                    file=sys.stderr,
                    flush=True,
                )
                _build(compiler, path, _target)
            lib = ctypes.CDLL(str(path))
            check_layout(lib)
        except Exception as e:  # noqa: BLE001 -- an optimisation: fall back, say why
            _reason = f"could not build or load {SOURCE.name}: {e}"
            return None
        _declare(lib)
        _lib = lib
        return lib


def unavailable_reason() -> str | None:
    load()
    return _reason


def kernels_label() -> str | None:
    """isa(), with "+amx" where Q4_K / Q5_K products of many rows run on AMX tiles."""
    name = isa()
    return name + "+amx" if name is not None and amx() else name


def isa() -> str | None:
    """Which inner loops the library was compiled with: "avx512", "avx2" (with FMA;
    "avx2+vnni" with AVX-VNNI's int8 products) or "generic" (plain loops; "generic+neon" on
    ARM); None where there is no library."""
    lib = load()
    return lib.ms_isa().decode() if lib is not None else None


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")


class StoredMatrix(NamedTuple):
    """A matrix in a GGUF file's own block format, used where it lies (memory-mapped): the
    address of its first row, ggml's type id, its rows and columns, its bytes."""

    address: int
    type: int
    rows: int
    cols: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def numel(self) -> int:
        return self.rows * self.cols


class MsMat(ctypes.Structure):  # decode.cpp's structs, field by field
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_long), ("rows", ctypes.c_long)]


class MsLayer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("qkv", MsMat * 3),
        ("bqkv", ctypes.c_void_p),
        ("wo", MsMat),
        ("mlp_norm", ctypes.c_void_p),
        ("gate_up", MsMat * 2),
        ("w2", MsMat),
        *(
            (name, ctypes.c_void_p)
            for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "cos", "sin")
        ),
        ("window", ctypes.c_long),
        ("router", MsMat),
        ("experts", MsMat * 3),
    ]


class MsModel(ctypes.Structure):
    _fields_ = [
        *(
            (name, ctypes.c_long)
            for name in ("layers", "D", "H", "KV", "hd", "I", "V", "rot", "E", "K", "F")
        ),
        ("embed", MsMat),
        ("lm_head", MsMat),
        ("final_norm", ctypes.c_void_p),
        ("layer", ctypes.POINTER(MsLayer)),
        *((name, ctypes.c_float) for name in ("eps", "embed_scale", "attn_scale")),
        *(
            (name, ctypes.c_int)
            for name in ("gelu", "rope_pairs", "math", "threads", "kv_half", "embed_mapped")
        ),
    ]


def kv_choice() -> str:
    """MINISERVE_KV as set (float16 when unset); ValueError naming the choices otherwise."""
    choice = os.environ.get("MINISERVE_KV", "").strip() or "float16"
    if choice not in KV_CHOICES:
        raise ValueError(f"MINISERVE_KV={choice!r}: one of {', '.join(KV_CHOICES)}")
    return choice


def kv_half(model) -> bool:
    """Whether this model's KV cache holds float16: weights as stored whose attention
    projections are in block formats, unless MINISERVE_KV=float32."""
    qkv = [w for name in ("wqkv", "wq") if (w := model.layers[0].get(name)) is not None]
    blocks = bool(qkv) and all(
        isinstance(w, StoredMatrix) and w.type not in TYPE_IDS.values() for w in qkv
    )
    return kv_choice() == "float16" and blocks  # a bad MINISERVE_KV is an error everywhere


def ms_mat(w) -> MsMat:
    """A tensor (float32, float16 or bfloat16, contiguous) or a StoredMatrix as an MsMat; None
    as an absent one."""
    if w is None:
        return MsMat(None, 0, 0)
    if isinstance(w, StoredMatrix):
        return MsMat(w.address, w.type, w.rows)
    assert w.is_contiguous() and dtype_name(w.dtype) in TYPE_IDS, (w.dtype, w.shape)
    return MsMat(w.data_ptr(), TYPE_IDS[dtype_name(w.dtype)], w.shape[0])


class MsRows(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_long),
        ("n_out", ctypes.c_long),
        *((name, ctypes.c_void_p) for name in ("token", "pos", "cap", "out", "k", "v", "logits")),
    ]


def layout() -> dict[str, int]:
    """The mirrored structs' sizes and field offsets as ctypes lays them out, in decode.cpp's
    ms_layout() names ("MsModel" = its size, "MsModel.rot" = a field's offset)."""
    out = {}
    for struct in (MsMat, MsLayer, MsModel, MsRows):
        out[struct.__name__] = ctypes.sizeof(struct)
        for name, *_ in struct._fields_:
            out[f"{struct.__name__}.{name}"] = getattr(struct, name).offset
    return out


def check_layout(lib: ctypes.CDLL) -> None:
    """RuntimeError naming the first field where the library's structs and their ctypes mirrors
    disagree (a field added on one side only): the one definition is decode.cpp's."""
    lib.ms_layout.restype = ctypes.c_char_p
    theirs = dict(item.split("=") for item in lib.ms_layout().decode().split())
    ours = layout()
    for name in sorted(set(theirs) | set(ours)):
        if str(ours.get(name)) != theirs.get(name):
            raise RuntimeError(
                f"the library's {name} is {theirs.get(name, 'absent')}, its mirror's "
                f"{ours.get(name, 'absent')} (miniserve/runners/native.py)"
            )


def _declare(lib: ctypes.CDLL) -> None:
    P, L, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.ms_forward.argtypes = [ctypes.POINTER(MsModel), ctypes.POINTER(MsRows), P]
    lib.ms_forward.restype = None
    lib.ms_scratch_floats.argtypes = [ctypes.POINTER(MsModel), L, L]
    lib.ms_scratch_floats.restype = L
    lib.ms_matmul.argtypes = [ctypes.POINTER(MsMat), P, P, L, L, I, I]
    lib.ms_matmul.restype = None
    lib.ms_dequant.argtypes = [ctypes.POINTER(MsMat), L, P]
    lib.ms_dequant.restype = None
    lib.ms_row_bytes.argtypes = [L, L]
    lib.ms_row_bytes.restype = L
    lib.ms_top_k.argtypes = [P, L, L, P, P]
    lib.ms_top_k.restype = L
    lib.ms_top_p.argtypes = [P, L, ctypes.c_double, P]
    lib.ms_top_p.restype = L
    lib.ms_kv_type.argtypes = [ctypes.POINTER(MsModel)]
    lib.ms_kv_type.restype = I
    lib.ms_bf16_dot.argtypes = []
    lib.ms_bf16_dot.restype = I
    lib.ms_isa.argtypes = []
    lib.ms_isa.restype = ctypes.c_char_p
    lib.ms_amx.argtypes = [I]
    lib.ms_amx.restype = I
    lib.ms_pack_type.argtypes = [L, L, L]
    lib.ms_pack_type.restype = L
    lib.ms_pack.argtypes = [ctypes.POINTER(MsMat), L, P, I]
    lib.ms_pack.restype = L
    lib.ms_fault_in.argtypes = [P, L, L]
    lib.ms_fault_in.restype = None


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the key of the tables above)."""
    return str(dtype).removeprefix("torch.")


def supports(device: torch.device, dtype: torch.dtype, quant: str | None = None) -> bool:
    """The native runner runs a lean model on the CPU with float32 or bfloat16 weights, no
    quantization, where the library could be built."""
    return (
        device.type == "cpu"
        and dtype_name(dtype) in DTYPE_CODES
        and quant is None
        and load() is not None
    )


def amx(on: bool | None = None) -> bool:
    """Whether Q4_K / Q5_K products of many rows run on AMX tiles (kernels/amx.h): where the
    library was built with them and the CPU and kernel grant them. on=False / True switches
    them (the same bits either way: tests compare), None asks."""
    lib = load()
    return bool(lib is not None and lib.ms_amx(-1 if on is None else int(on)))


# decode.cpp's packed types (T_Q4_K_P16, T_Q4_K_P8, T_Q5_K_P16, T_Q5_K_P8, T_Q6_K_P16, T_Q6_K_P8,
# ..., T_PACKED_32 + a 32-weight type's id) are numbered from here on, past ggml's
PACKED_TYPES = 1000


def packed_bytes(w) -> int:
    """The bytes pack() makes of a matrix (decode.cpp's ms_pack_type: Q4_K with rows in whole
    16s in the AVX-512 build (AMX tiles unpack the strips), in whole 8s in the AVX2 build; Q5_K,
    Q6_K, Q3_K, Q2_K and IQ4_XS with rows in whole 16s in the AVX-512 build, in whole 8s in the
    AVX2 one; the 32-weight types (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, IQ4_NL) with rows in whole 16s in the AVX-512 build, 8s in the AVX2 one); 0
    where it stays as stored, and for all with MINISERVE_PACK=0."""
    lib = load()
    off = os.environ.get("MINISERVE_PACK", "1") == "0"
    if lib is None or off or not isinstance(w, StoredMatrix):
        return 0
    packed = lib.ms_pack_type(w.type, w.rows, w.cols)
    return 0 if packed < 0 else w.rows * lib.ms_row_bytes(packed, w.cols)


def _line_multiple(nbytes: int) -> int:
    """nbytes rounded up to whole 64-byte lines (where the next packed matrix may start)."""
    return -(-nbytes // 64) * 64


def arena_bytes(layers: list[dict], lm_head) -> int:
    """The bytes of NativeForward's arena for these matrices: each one's packed_bytes, whole
    64-byte lines."""
    total = sum(_line_multiple(packed_bytes(m)) for w in layers for m in w.values())
    return total + _line_multiple(packed_bytes(lm_head))


def fault_in(memory: torch.Tensor) -> threading.Thread | None:
    """Starts a thread that maps every page of `memory` (decode.cpp's ms_fault_in, a touch
    every 4 KB, outside the GIL, at the lowest priority): the kernel clears each 2 MB page as
    it maps it (~1 GB/s on some VMs), and this lets that run on a core the caller leaves idle
    (a load reads its tokenizer meanwhile). It changes no byte, so writers may use the memory
    at once: a page it has not reached yet faults in at their write, as without it. None
    where the library is not there or the memory is empty."""
    lib = load()
    nbytes = memory.numel() * memory.element_size()
    if lib is None or nbytes == 0:
        return None

    def run(memory=memory):  # holds the memory until done
        try:  # (Linux: this thread alone) below the caller's work
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        lib.ms_fault_in(memory.data_ptr(), nbytes, 4096)  # (a 2 MB page at its first)

    thread = threading.Thread(target=run, name="fault-in", daemon=True)
    thread.start()
    return thread


def reserve_arena(layers: list[dict], lm_head) -> torch.Tensor | None:
    """NativeForward's arena for these matrices, made now, with its pages being faulted in on
    another thread (fault_in), so that a load can do other work (read its tokenizer)
    while the kernel clears them; None where nothing packs or 2 MB pages cannot be asked."""
    total = arena_bytes(layers, lm_head)
    arena = huge_page_memory(total) if total else None
    if arena is not None:
        fault_in(arena)
    return arena


PACK_BYTES = 16 << 20  # stored bytes a call of ms_pack where pack() hands them back as it goes


def pack(
    w: StoredMatrix,
    out: torch.Tensor | None = None,
    release: Callable[[StoredMatrix], None] | None = None,
) -> tuple[StoredMatrix, torch.Tensor] | None:
    """The matrix laid out anew for this build's products, where it has such a form
    (packed_bytes): 16 (AVX2: 8) rows' blocks side by side, so that a product of few activation
    rows needs no sums across lanes. Returns a StoredMatrix of the packed type and the uint8
    tensor holding its bytes (`out`, 64-byte aligned, where given; keep it alive), or None. The
    products are the same bits as over the rows as stored; Q4_K takes 2.8% more bytes, Q5_K
    2.3%, Q6_K 1%; in the AVX2 build Q3_K 5.5%, IQ4_XS 2.9%, Q2_K none.

    release(rows as stored), where given, gets the stored rows ~PACK_BYTES at a time once they
    are laid out (a strip's rows are laid out together, each strip where its first row's
    share of `out` starts), so that a large matrix (a 255 MB output layer) is never resident
    twice."""
    nbytes = packed_bytes(w)
    if nbytes == 0:
        return None
    lib = load()
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
    assert out.numel() == nbytes and out.data_ptr() % 64 == 0  # (PyTorch's CPU allocations are)
    wrow, prow = w.nbytes // w.rows, nbytes // w.rows
    step = w.rows if release is None else max(16, PACK_BYTES // wrow // 16 * 16)  # whole strips
    for first in range(0, w.rows, step):
        rows = min(step, w.rows - first)
        part = StoredMatrix(w.address + first * wrow, w.type, rows, w.cols, rows * wrow)
        packed = lib.ms_pack(
            ctypes.byref(ms_mat(part)),
            w.cols,
            out.data_ptr() + first * prow,
            torch.get_num_threads(),
        )
        assert packed >= 0  # (the type of every whole-strip share of the rows)
        if release is not None:
            release(part)
    return StoredMatrix(out.data_ptr(), packed, w.rows, w.cols, nbytes), out


def bf16_dot() -> bool:
    """Whether bfloat16 products run on the CPU's bfloat16 dot instruction (AVX512_BF16)."""
    lib = load()
    return bool(lib is not None and lib.ms_bf16_dot())


def resolve_math(math: str, dtype: torch.dtype) -> str:
    """The arithmetic for `--math` over weights of `dtype`: auto is bfloat16 products where the
    weights are bfloat16 and the CPU has bfloat16 dot products, else float32."""
    if math not in MATHS:
        raise ValueError(f"unknown --math '{math}': use {', '.join(MATHS)}")
    if math == "auto":
        return "bfloat16" if dtype == torch.bfloat16 and bf16_dot() else "float32"
    if math == "bfloat16" and dtype != torch.bfloat16:
        raise ValueError("--math bfloat16 needs bfloat16 weights (--dtype bfloat16)")
    return math


def matmul(w, x: torch.Tensor, math: str = "float32") -> torch.Tensor:
    """x @ w.T with the native kernel (float32 result; x float32 of shape (B, cols)); w a
    float tensor (in the given arithmetic) or a StoredMatrix (its type's kernel, on x quantized
    per block); for tests and measurements."""
    lib = load()
    assert lib is not None and x.dtype == torch.float32
    rows, cols = (w.rows, w.cols) if isinstance(w, StoredMatrix) else w.shape
    if not isinstance(w, StoredMatrix):
        math = resolve_math(math, w.dtype)
    x = x.reshape(-1, cols).contiguous()
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    lib.ms_matmul(
        ctypes.byref(ms_mat(w)),
        x.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        cols,
        MATH_CODES[math],
        torch.get_num_threads(),
    )
    return y


def dequantize(w: StoredMatrix) -> torch.Tensor:
    """The matrix's rows as float32, as the kernels read its blocks (rows, cols)."""
    assert w.type < PACKED_TYPES, "a packed matrix has no row decoder: decode the stored one"
    lib = load()
    assert lib is not None
    y = torch.empty(w.rows, w.cols, dtype=torch.float32)
    lib.ms_dequant(ctypes.byref(ms_mat(w)), w.cols, y.data_ptr())
    return y


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes of a row of `cols` weights of a ggml type in this library; -1 where it does not
    run that type in place (or the width does not divide into its blocks)."""
    lib = load()
    return lib.ms_row_bytes(type_id, cols) if lib is not None else -1


def top_k(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The k largest of a contiguous float32 CPU row (1-D): (their positions ascending, their
    values), as int64 / float32 tensors of k; None where the whole row must be filtered (k not
    in (0, n), a NaN, a k-th value that is not finite or tied). Runs only in a library already
    loaded (a sampler never waits for a build): NotImplemented where there is none."""
    lib = _lib
    if lib is None:
        return NotImplemented
    row = row.contiguous()
    ids = torch.empty(max(k, 0), dtype=torch.int64)
    values = torch.empty(max(k, 0), dtype=torch.float32)
    if not lib.ms_top_k(row.data_ptr(), row.shape[0], k, ids.data_ptr(), values.data_ptr()):
        return None
    return ids, values


def top_p(row: torch.Tensor, p: float) -> torch.Tensor | None:
    """The positions top-p keeps of a contiguous float32 CPU row (1-D), ascending, as int64
    (at least the most likely); None where the whole row must be filtered (p not in (0, 1), a
    NaN, a +inf, no finite logit). Runs only in a library already loaded: NotImplemented where
    there is none."""
    lib = _lib
    if lib is None:
        return NotImplemented
    row = row.contiguous()
    room = getattr(_TOP_P, "room", None)  # the thread's own, kept: fresh memory a call costs
    if room is None or room.shape[0] < row.shape[0]:  # its page faults (~0.1 ms over 49,152)
        room = _TOP_P.room = torch.empty(row.shape[0], dtype=torch.int64)
    count = lib.ms_top_p(row.data_ptr(), row.shape[0], p, room.data_ptr())
    # numpy's copy, on this thread (torch's, of many ids, wakes its thread pool)
    return torch.from_numpy(room.numpy()[:count].copy()) if count > 0 else None


_TOP_P = threading.local()


def _rows(w) -> int:
    return w.rows if isinstance(w, StoredMatrix) else w.shape[0]


def _embed_scale(model) -> float:
    """The factor of the embeddings: Gemma's sqrt(hidden) as transformers rounds it (to the
    weights' dtype), else 1 (no change)."""
    return float(model.embed_scale) if model.embed_scale is not None else 1.0


def _attn_scale(model) -> float:
    """The scores' factor: Gemma's query_pre_attn_scalar^-0.5, else head_dim^-0.5 computed as
    1 / sqrt in float32 (both correctly rounded, so as decode.cpp computed it before)."""
    if model.attn_scale is not None:
        return float(model.attn_scale)
    hd = torch.tensor(float(model.head_dim), dtype=torch.float32)
    return float(1.0 / torch.sqrt(hd))


class NativeCache(KVCache):
    """One sequence's keys and values in decode.cpp's layout. float32: K as (layers, kv_heads,
    capacity / 16, head_dim, 16) -- tiles of 16 positions, transposed -- and V as (layers,
    kv_heads, capacity, head_dim); float16 (weights as stored in block formats: kv_half) in
    the same layout; bfloat16 (bfloat16 products on the dot instruction): the same sizes, with
    pairs side by side (decode.cpp, kv_bf16). The rest is lean.KVCache's."""

    TILE = 16

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        dtype: torch.dtype | None = None,  # float32
    ):
        dtype = dtype or torch.float32
        capacity = -(-max(capacity, 16) // 16) * 16
        self.k = torch.zeros(layers, kv_heads, capacity // 16, head_dim, 16, dtype=dtype)
        self.v = torch.zeros(layers, kv_heads, capacity, head_dim, dtype=dtype)
        self.length = 0

    def _grow(self, capacity: int) -> None:
        k = self.k.new_zeros((*self.k.shape[:2], capacity // 16, *self.k.shape[3:]))
        v = self.v.new_zeros((*self.v.shape[:2], capacity, self.v.shape[3]))
        k[:, :, : self.k.shape[2]] = self.k
        v[:, :, : self.capacity] = self.v
        self.k, self.v = k, v


class NativeForward:
    """A model's weights behind decode.cpp's forward pass: any number of rows from any number
    of sequences in one call. The model is a LeanRunner (float32 / bfloat16 tensors, q|k|v and
    gate|up fused) or a stored GGUF model (miniserve/runners/stored.py: StoredMatrix tensors in the
    file's block formats, q, k, v, gate and up apart).

    Holds the model struct (raw pointers of the weights, which never move), float32 copies of
    norm weights and biases (decode.cpp takes them in float32: Gemma's 1 + w is float32
    whatever the weights' dtype), the layers' and the output layer's matrices that pack() lays
    out anew for this build (their stored rows' pages then handed to `release`, which a model
    over a mapped file gives, so that those weights are not resident twice) and a scratch
    buffer sized by the C side."""

    def __init__(
        self,
        model,
        math: str,
        release: Callable[[StoredMatrix], None] | None = None,
        arena: torch.Tensor | None = None,
    ):
        """`arena`: reserve_arena's memory for this model's packed matrices, where the caller
        reserved it ahead (used only if it is arena_bytes long)."""
        self.lib = load()
        self._release = release
        self.as_run: dict[int, StoredMatrix] = {}  # id(a model's matrix) -> its packed form
        self.model = model
        self.math = math
        cfg = model.config
        self.V = _rows(model.lm_head)
        assert model.head_dim <= 1024
        self._kept = []  # the float32 norm weights the structs point to
        # an embedding looked up where it lies in a mapped file (a model over one gives
        # `release`): its pages handed back by the pass once it has looked its rows up
        # (decode.cpp's embed_hand_back), so that the tokens' rows do not pile up as resident
        # memory (each lookup maps the ~64 KB around its row, the kernel's fault-around: 38 MiB
        # after 700 lookups in Qwen3-1.7B's 255 MB table). ~10 us a pass.
        embed_mapped = release is not None and isinstance(model.embed, StoredMatrix)
        # the matrices pack() lays out anew, in one allocation (one per matrix would round each
        # up to whole 2 MiB pages: +117 MB for Qwen3-1.7B), backed by 2 MB pages where the
        # system gives them (lean.huge_page_memory: a decoded token streams every matrix once,
        # and with 4 KB pages its address translations cost much of that stream)
        total = arena_bytes(model.layers, model.lm_head)
        if arena is None or arena.numel() != total:
            arena = huge_page_memory(total)
        self._arena = arena if arena is not None else torch.empty(total, dtype=torch.uint8)
        self._arena_used = 0
        self._layers = (MsLayer * len(model.layers))(
            *[
                self._layer(w, *model.layer_tables(i), model.windows[i])
                for i, w in enumerate(model.layers)
            ]
        )
        self.struct = MsModel(
            layers=len(model.layers),
            D=cfg.hidden_size,
            H=model.n_heads,
            KV=model.n_kv,
            hd=model.head_dim,
            I=cfg.intermediate_size,
            V=self.V,
            embed=ms_mat(model.embed),
            # packed too where its type packs (the output layer meets every row of a pass); a
            # tied embedding keeps looking its rows up in the stored ones, whose pages handed
            # back by `release` fault in again as tokens are looked up
            lm_head=self._mat(model.lm_head),
            final_norm=self._float32(model.final_norm),
            layer=self._layers,
            eps=float(model.eps),
            embed_scale=_embed_scale(model),
            attn_scale=_attn_scale(model),
            rot=model.rot,
            E=getattr(cfg, "num_experts", 0),
            K=getattr(cfg, "num_experts_per_tok", 0),
            F=getattr(cfg, "moe_intermediate_size", 0),
            gelu=int(model.arch.activation == "gelu_tanh"),
            rope_pairs=int(model.rope_pairs),
            math=MATH_CODES[math],
            threads=torch.get_num_threads(),
            kv_half=int(kv_half(model)),
            embed_mapped=int(embed_mapped),
        )
        self.max_positions = model.cos.shape[0]
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.kv_dtype = getattr(torch, KV_TYPES[self.lib.ms_kv_type(ctypes.byref(self.struct))])

    def _float32(self, t: torch.Tensor | None) -> int | None:
        """The address of `t` as float32 (a copy, kept, where it is not), or None."""
        if t is None:
            return None
        t = t.float().contiguous()
        self._kept.append(t)
        return t.data_ptr()

    def _layer(self, w: dict, cos: torch.Tensor, sin: torch.Tensor, window: int | None) -> MsLayer:
        qkv = [w["wqkv"]] if "wqkv" in w else [w["wq"], w["wk"], w["wv"]]
        gate_up = [w["w13"]] if "w13" in w else [w.get("w1"), w.get("w3")]
        assert cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert cos.shape[1] == self.model.rot // 2, (cos.shape, self.model.rot)  # an angle each
        return MsLayer(
            attn_norm=self._float32(w["attn_norm"]),
            qkv=(MsMat * 3)(*(self._mat(m) for m in qkv + [None] * (3 - len(qkv)))),
            bqkv=self._float32(w.get("bqkv")),
            wo=self._mat(w["wo"]),
            mlp_norm=self._float32(w["mlp_norm"]),
            gate_up=(MsMat * 2)(*(self._mat(m) for m in gate_up + [None] * (2 - len(gate_up)))),
            w2=self._mat(w.get("w2")),
            **{name: self._float32(w.get(name)) for name in NORMS[2:]},
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            window=window or 0,
            router=ms_mat(w.get("router")),
            experts=(MsMat * 3)(*(self._mat(w.get(n)) for n in ("w1_exps", "w3_exps", "w2_exps"))),
        )

    def _mat(self, w) -> MsMat:
        """A matrix for the structs (a layer's, the output layer): packed into the arena where
        pack() has a form for it (the stored rows' pages then handed back through `release`,
        so that the weights are not resident twice), else as ms_mat."""
        nbytes = _line_multiple(packed_bytes(w))
        if nbytes == 0:
            return ms_mat(w)
        packed = pack(w, self._arena[self._arena_used : self._arena_used + nbytes], self._release)
        self._arena_used += nbytes
        self.as_run[id(w)] = packed[0]
        if self._release is not None:  # (the pages across two shares' rows too)
            self._release(w)
        return ms_mat(packed[0])

    @property
    def packed(self) -> list[StoredMatrix]:
        """The matrices pack() laid out anew."""
        return list(self.as_run.values())

    def new_cache(self, capacity: int = 256) -> NativeCache:
        m = self.model
        return NativeCache(len(m.layers), m.n_kv, m.head_dim, capacity, self.kv_dtype)

    def __call__(self, entries, all_logits: bool | list[bool] = False) -> torch.Tensor:
        """entries: (new token ids, NativeCache) per sequence. Appends each sequence's ids to
        its cache and returns float32 logits of each one's last new token (len(entries),
        vocab), or of every new token (total rows, vocab) with `all_logits` -- or, with a list
        of flags, one per entry, of every new token of the entries flagged (speculation's
        verify rows) and the last of the others, in entry order."""
        every = all_logits if isinstance(all_logits, list) else [all_logits] * len(entries)
        tokens, pos, caps, ks, vs, out = [], [], [], [], [], []
        for (ids, cache), all_rows in zip(entries, every):
            start, n = cache.length, len(ids)
            if n == 0:
                raise ValueError("each sequence in a pass needs at least one new token")
            if start + n > self.max_positions:
                raise ValueError(
                    f"position {start + n - 1} is past the model's {self.max_positions} positions"
                )
            cache.reserve(start + n)
            if all_rows:
                out.extend(range(len(tokens), len(tokens) + n))
            else:
                out.append(len(tokens) + n - 1)
            tokens.extend(int(t) for t in ids)
            pos.extend(range(start, start + n))
            caps += [cache.capacity] * n
            ks += [cache.k.data_ptr()] * n
            vs += [cache.v.data_ptr()] * n
        arrays = [torch.tensor(a, dtype=torch.int64) for a in (tokens, pos, caps, out, ks, vs)]
        logits = torch.empty(len(out), self.V, dtype=torch.float32)  # fresh: callers keep it
        rows = MsRows(len(tokens), len(out), *(a.data_ptr() for a in arrays), logits.data_ptr())
        need = self.lib.ms_scratch_floats(ctypes.byref(self.struct), len(tokens), max(pos) + 1)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)
        self.lib.ms_forward(ctypes.byref(self.struct), ctypes.byref(rows), self.scratch.data_ptr())
        for ids, cache in entries:
            cache.length += len(ids)
        return logits


class CompiledPass:
    """The runner methods of a model whose every pass runs in decode.cpp (`self.native`, a
    NativeForward): NativeRunner's and stored.StoredRunner's."""

    name = "native"
    native: NativeForward

    def new_cache(self, capacity: int = 256) -> NativeCache:
        return self.native.new_cache(capacity)

    def step(self, entries, all_logits: bool = False) -> torch.Tensor:
        """Any number of sequences' new rows in one pass."""
        return self.native(entries, all_logits)

    def forward(self, input_ids: torch.Tensor, cache=None, all_logits: bool = False):
        ids = input_ids[0].tolist()
        logits = self.native(
            [(ids, cache if cache is not None else self.new_cache(len(ids)))], all_logits
        )
        return logits if all_logits else logits.view(1, -1)

    __call__ = forward


class NativeRunner(CompiledPass, LeanRunner):
    """The lean runner's weights (float32 or bfloat16, q|k|v and gate|up fused), every pass in
    compiled code: activations, RoPE tables and the KV cache in float32 whatever the products'
    arithmetic (`--math`)."""

    def __init__(self, hf_model, math: str = "auto"):
        if not supports(hf_model.device, hf_model.dtype):
            reason = unavailable_reason()
            raise ValueError(
                "the native runner needs a CPU model with float32 or bfloat16 "
                "weights and no --quant" + (f"; {reason}" if reason else "")
            )
        super().__init__(hf_model, math=math)
        self.native = NativeForward(self, self.math)

    def _math(self, math: str) -> str:
        return resolve_math(math, self.dtype)

    def _table_dtype(self) -> torch.dtype:
        return torch.float32


def kernels() -> dict:
    """Which kernels run here: PyTorch's vector level, the caps in force, the native pass's."""
    caps = {name: os.environ[name] for name in platform_info.CAPS if name in os.environ}
    return {
        "aten": torch.backends.cpu.get_cpu_capability(),
        "caps": caps,
        "native": kernels_label() or f"off ({unavailable_reason()})",
        "native_target": build_target(),
    }


def summary() -> str:
    """Two lines for people: the CPU, then the kernels in use."""
    k = kernels()
    caps = ", ".join(f"{n}={v}" for n, v in k["caps"].items())
    features = " ".join(platform_info.cpu_features()) or "no vector extensions named"
    return (
        f"CPU: {platform_info.cpu_model()} ({platform.machine()}; {features})\n"
        f"kernels: PyTorch {torch.__version__} {k['aten']}"
        + (f" (capped: {caps})" if caps else "")
        + f"; native forward pass {k['native']}"
        + (f" (target {k['native_target']})" if not k["native"].startswith("off") else "")
    )
