"""The native decode step: miniserve/kernels/decode.cpp, compiled at first use, called by ctypes.

Why it exists: one decoded token reads every weight once (538 MB in float32), so a step can
not be faster than memory allows; PyTorch gets its matrix-vector products close to that, but
spends another ~10 us on each of ~45 small ops per layer (norms, RoPE, cache writes, SiLU)
on vectors of a few hundred numbers. The C++ file does a layer's two halves in two calls.

Build: the system C++ compiler (`$CXX`, else `c++`), `-O3` for the target that
`MINISERVE_NATIVE_ARCH` names (TARGETS below; `native` by default: this CPU, AVX-512 where it
has it), a few seconds, once; the library is kept in the user cache folder, keyed by the
source, the compiler, this CPU and the compiler flags. `isa()` says which inner loops the
library holds (avx512, avx2 or generic). Where there is no compiler, the lean PyTorch step runs
instead and `unavailable_reason()` says why: nothing else changes.
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
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "kernels" / "decode.cpp"
ABI_VERSION = 5
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"]
X86_64 = platform.machine().lower() in ("x86_64", "amd64")

# MINISERVE_NATIVE_ARCH: what to compile for, each a list of architecture flags to try in turn
# (the first the compiler takes is used).
#   native:    this CPU. -march=native: AVX-512 where the CPU has it; -mcpu=native: what Apple's
#              clang takes on arm64; none: portable loops the compiler vectorizes as it can.
#   x86-64-v3: AVX2 + FMA, as on most x86 CPUs of the last ten years (the AVX2 loops).
#   generic:   the plain loops, for the architecture's baseline (SSE2 on x86-64).
TARGETS = {
    "native": [["-march=native"], ["-mcpu=native"], []],
    "x86-64-v3": [["-march=x86-64-v3"]],
    "generic": [["-march=x86-64", "-mtune=generic"]] if X86_64 else [[]],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False
_target: str | None = None  # the build target of the load() that ran


def _cpu_id() -> str:
    from miniserve.platform_info import cpu_flags
    return cpu_flags() or platform.processor() or platform.machine()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or \
        shutil.which("clang++")


def build_target() -> str:
    """The build target in use: MINISERVE_NATIVE_ARCH as load() read it (`native` when unset);
    an unknown name is returned as given, and load() then reports it."""
    if _target is not None:
        return _target
    return os.environ.get("MINISERVE_NATIVE_ARCH", "").strip() or "native"


def library_path(compiler: str, target: str = "native") -> Path:
    """Where the library for `target` is kept. The key holds the flags, so that libraries built
    for different targets (or with different flags) are never taken for one another."""
    from miniserve.loader import cache_root
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    flags = repr((FLAGS, target, TARGETS[target]))
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_id().encode()
                         + platform.machine().encode() + flags.encode()).hexdigest()[:16]
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
            _reason = (f"unknown MINISERVE_NATIVE_ARCH={_target!r} "
                       f"(one of: {', '.join(TARGETS)})")
            return None
        compiler = _compiler()
        if compiler is None:
            _reason = "no C++ compiler found (set CXX, or install g++ / clang++)"
            return None
        try:
            path = library_path(compiler, _target)
            if not path.exists():
                print(f"Compiling the native decode step ({SOURCE.name}, {_target}) ...",
                      file=sys.stderr, flush=True)
                _build(compiler, path, _target)
            lib = ctypes.CDLL(str(path))
            if lib.ms_abi_version() != ABI_VERSION:
                raise RuntimeError("stale library (ABI version differs)")
        except Exception as e:  # noqa: BLE001 -- an optimisation: fall back, say why
            _reason = f"could not build or load {SOURCE.name}: {e}"
            return None
        _declare(lib)
        _lib = lib
        return lib


def unavailable_reason() -> str | None:
    load()
    return _reason


def isa() -> str | None:
    """Which inner loops the library was compiled with: "avx512", "avx2" (with FMA) or
    "generic" (plain loops; "generic+neon" on ARM); None where there is no library."""
    lib = load()
    return lib.ms_isa().decode() if lib is not None else None


def _declare(lib: ctypes.CDLL) -> None:
    P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.ms_attn_block.argtypes = [I, P, P, F, P, P, P, P, P, P, P, L, L, L, L, L, L, P, I]
    lib.ms_mlp_block.argtypes = [I, P, P, F, P, P, L, L, P, I]
    lib.ms_lm_head.argtypes = [I, P, P, F, P, P, L, L, P, I]
    lib.ms_matvec.argtypes = [I, P, P, P, L, L, I]
    lib.ms_threads.argtypes = [I]
    lib.ms_threads.restype = I
    lib.ms_isa.argtypes = []
    lib.ms_isa.restype = ctypes.c_char_p
    for f in (lib.ms_attn_block, lib.ms_mlp_block, lib.ms_lm_head, lib.ms_matvec):
        f.restype = None


def supports(device: torch.device, dtype: torch.dtype, quant: str | None = None) -> bool:
    """The native step runs a lean model on the CPU with float32 or bfloat16 weights, no
    quantization, where the library could be built."""
    return (device.type == "cpu" and dtype in DTYPE_CODES and quant is None
            and load() is not None)


def matvec(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w @ x with the native kernel (float32 result); for tests and measurements."""
    lib = load()
    assert lib is not None and w.is_contiguous() and x.dtype == torch.float32
    y = torch.empty(w.shape[0], dtype=torch.float32)
    lib.ms_matvec(DTYPE_CODES[w.dtype], w.data_ptr(), x.contiguous().data_ptr(), y.data_ptr(),
                  w.shape[0], w.shape[1], torch.get_num_threads())
    return y


class NativeStep:
    """Feeds one token through a LeanModel's weights with the compiled kernels.

    Holds the raw pointers of the weights (they never move) and float32 work buffers; the KV
    cache is the model's own (float32) KVCache, so prefill (PyTorch, many tokens at once) and
    these steps write to the same cache and can alternate freely."""

    def __init__(self, model):
        self.lib = load()
        self.model = model
        cfg = model.config
        self.D = cfg.hidden_size
        self.I = cfg.intermediate_size
        self.V = model.lm_head.shape[0]
        self.H, self.KV, self.hd = model.n_heads, model.n_kv, model.head_dim
        self.eps = float(model.eps)
        self.wcode = DTYPE_CODES[model.dtype]
        assert model.act_dtype == torch.float32
        self.x = torch.empty(self.D, dtype=torch.float32)
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.layers = [(w["attn_norm"].data_ptr(), w["wqkv"].data_ptr(),
                        w["bqkv"].data_ptr() if w["bqkv"] is not None else None,
                        w["wo"].data_ptr(), w["mlp_norm"].data_ptr(), w["w13"].data_ptr(),
                        w["w2"].data_ptr()) for w in model.layers]
        assert self.hd <= 1024 and all(t is None or t.is_contiguous()
                                       for w in model.layers for t in w.values())

    def _scratch(self, positions: int, threads: int) -> int:
        n = self.lib.ms_threads(threads)  # the pool's size (set by its first use)
        need = (2 * self.D + (2 * self.H + 2 * self.KV) * self.hd + self.H * (positions + 2 * n)
                + n * self.H * (self.hd + 2) + 4 * self.I + self.D)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need * 2, dtype=torch.float32)
        return self.scratch.data_ptr()

    def __call__(self, token_id: int, cache) -> torch.Tensor:
        """Float32 logits (1, vocab) for `token_id` at position cache.length."""
        m, lib = self.model, self.lib
        pos = cache.length
        cache.reserve(pos + 1)
        threads = torch.get_num_threads()
        scratch = self._scratch(pos + 1, threads)
        self.x.copy_(m.embed[token_id])
        x = self.x.data_ptr()
        cos, sin = m.cos[pos].data_ptr(), m.sin[pos].data_ptr()
        k0, v0 = cache.k.data_ptr(), cache.v.data_ptr()
        cap = cache.k.shape[2]
        layer_bytes = cache.k[0].numel() * cache.k.element_size()
        for i, (attn_norm, wqkv, bqkv, wo, mlp_norm, w13, w2) in enumerate(self.layers):
            lib.ms_attn_block(self.wcode, x, attn_norm, self.eps, wqkv, bqkv, wo, cos, sin,
                              k0 + i * layer_bytes, v0 + i * layer_bytes, cap, pos,
                              self.D, self.H, self.KV, self.hd, scratch, threads)
            lib.ms_mlp_block(self.wcode, x, mlp_norm, self.eps, w13, w2, self.D, self.I,
                             scratch, threads)
        cache.length = pos + 1
        logits = torch.empty(1, self.V, dtype=torch.float32)  # fresh: callers may keep it
        lib.ms_lm_head(self.wcode, x, m.final_norm.data_ptr(), self.eps, m.lm_head.data_ptr(),
                       logits.data_ptr(), self.D, self.V, scratch, threads)
        return logits
