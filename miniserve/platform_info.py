"""What this machine's CPU offers and which kernels run on it: the CPU, the instruction sets
that matter for the matrix products, what PyTorch's kernels were capped to, and what the
native forward pass was compiled for. `python -m miniserve --version` shows all of it; the web
app's header and the benchmark name the native kernels (and the benchmark the CPU),
because speed -- and the last bits of every sum -- depend on them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# flags of /proc/cpuinfo worth naming: vector widths, bfloat16 dot products, matrix tiles
FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
            "asimd", "bf16", "sve")
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
    return (info.get("model name") or info.get("Model") or platform.processor()
            or platform.machine())


def cpu_flags() -> str:
    """Every feature flag of the CPU, as the kernel lists them ("" where it does not)."""
    info = _cpuinfo()
    return info.get("flags") or info.get("Features") or ""


def cpu_features() -> list[str]:
    """The flags worth naming (FEATURES) this CPU has."""
    flags = set(cpu_flags().split())
    return [f for f in FEATURES if f in flags]


def kernels() -> dict:
    """Which kernels run here: PyTorch's vector level, the caps in force, the native pass's."""
    from miniserve import native
    caps = {name: os.environ[name] for name in CAPS if name in os.environ}
    return {"aten": torch.backends.cpu.get_cpu_capability(), "caps": caps,
            "native": native.isa() or f"off ({native.unavailable_reason()})",
            "native_target": native.build_target()}


def summary() -> str:
    """Two lines for people: the CPU, then the kernels in use."""
    k = kernels()
    caps = ", ".join(f"{n}={v}" for n, v in k["caps"].items())
    return (f"CPU: {cpu_model()} ({platform.machine()}; {' '.join(cpu_features()) or 'no vector extensions named'})\n"
            f"kernels: PyTorch {torch.__version__} {k['aten']}"
            + (f" (capped: {caps})" if caps else "")
            + f"; native forward pass {k['native']}"
            + (f" (target {k['native_target']})" if not k["native"].startswith("off") else ""))


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
