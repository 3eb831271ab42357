"""What this machine's CPU offers and which kernels run on it: the CPU, the instruction sets
that matter for the matrix products, what PyTorch's kernels were capped to, and what the
native forward pass was compiled for. `python -m miniserve --version` shows all of it; the web
app's header and the benchmark name the native kernels (and the benchmark the CPU),
because speed -- and the last bits of every sum -- depend on them."""

from __future__ import annotations

import platform
from pathlib import Path

# flags of /proc/cpuinfo worth naming: vector widths, bfloat16 dot products, matrix tiles
FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "bf16",
    "sve",
)
# the switches that cap the libraries' kernels (README, "Other CPUs")
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def _cpuinfo() -> dict[str, str]:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """Every feature flag of the CPU, as the kernel lists them ("" where it does not)."""
    info = _cpuinfo()
    return info.get("flags") or info.get("Features") or ""


def cpu_features() -> list[str]:
    """The flags worth naming (FEATURES) this CPU has."""
    flags = set(cpu_flags().split())
    return [f for f in FEATURES if f in flags]


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MiB; where /proc is missing, the most
    it has held."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    scale = 1024 * 1024 if platform.system() == "Darwin" else 1024  # bytes there, KiB here
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def return_freed_memory() -> None:
    """Hand the C heap's freed pages back to the system (glibc's malloc_trim; nothing
    elsewhere). Reading a large tokenizer.json leaves ~100 MiB of parse garbage freed but held
    by the allocator -- measured with Qwen3's 151,936-token vocabulary -- which otherwise stays
    in the process's resident memory for its whole life."""
    import ctypes

    if platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
