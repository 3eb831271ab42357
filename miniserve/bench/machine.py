"""What this machine can give: the memory available now (whether the token check's reference
fits), and the ceiling of a decoding step -- memory bandwidth and GFLOPS measured on the
engine's largest weight matrix with the kernel that would run it, and the tokens/s they allow."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from miniserve.engine.engine import Engine
from miniserve.runners import native


def available_memory() -> int | None:
    """Bytes this machine can give a process now without swapping (MemAvailable; psutil's
    estimate where /proc is missing); None where neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


# -- the ceiling ------------------------------------------------------------------------------

CEILING_BATCH = 64  # rows for the GFLOPS measurement: enough that arithmetic, not memory, limits


def largest_weight(runner) -> tuple[str, torch.Tensor] | None:
    """(name, tensor) of the runner's largest 2-D float weight matrix; None if it has none
    (int8 weights)."""
    if hasattr(runner, "layers") and hasattr(runner, "lm_head"):
        named = [("lm_head", runner.lm_head)] + [
            (f"layers[0].{k}", t) for k, t in (runner.layers[0].items() if runner.layers else ())
        ]
    else:
        named = list(getattr(runner, "model", runner).named_parameters())
    named = [
        (n, t)
        for n, t in named
        if isinstance(t, native.StoredMatrix)
        or (
            isinstance(t, torch.Tensor)
            and t.dim() == 2
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
    ]
    return max(named, key=lambda nt: nt[1].numel(), default=None)


def weight_elements(runner) -> int:
    """Weight elements read per decoded token: the tensors runner.weight_bytes() counts (a
    runner over a file's weights says so itself: of an MoE's experts, the K a token uses)."""
    if hasattr(runner, "weight_elements"):
        return runner.weight_elements()
    if hasattr(runner, "layers") and hasattr(runner, "lm_head"):
        tensors = [
            *(x for layer in runner.layers for x in layer.values()),
            runner.lm_head,
            getattr(runner, "final_norm", None),
        ]
        return sum((w.q if hasattr(w, "q") else w).numel() for w in tensors if w is not None)
    m = runner.model
    total = sum(p.numel() for p in m.parameters())
    embed = m.get_input_embeddings().weight
    out = m.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel()


def as_run(runner, w):
    """The matrix as the runner's passes read it: the form the native runner packed it into at
    load where it did (its stored rows' pages were handed back), else itself."""
    forward = getattr(runner, "native", None)
    return getattr(forward, "as_run", {}).get(id(w), w)


def _bytes(w) -> int:
    return w.nbytes if isinstance(w, native.StoredMatrix) else w.numel() * w.element_size()


def _type_name(type_id: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(type_id).name


def product_kernel(
    w: torch.Tensor, math: str, use_native: bool
) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """(x (B, C) float32 -> w @ x.T as (B, R) float32, what computes it): the native matmul
    (the native runner's kernel) with `use_native`, else torch.matmul in the math dtype."""
    if use_native:
        if native.load() is None:
            raise RuntimeError(
                f"the native kernels are not available: {native.unavailable_reason()}"
            )
        return (lambda x: native.matmul(w, x, math)), "native.matmul"
    dtype = w.dtype if math != "float32" else torch.float32
    wt = w.to(dtype)
    label = f"torch.matmul ({str(dtype).removeprefix('torch.')})"
    return (lambda x: torch.matmul(x.to(dtype), wt.t()).float()), label


def _best_time(
    fn, budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 200, before=None
) -> float:
    """The best time of fn() over several runs; `before()`, untimed, ahead of each."""
    fn()  # first call: page faults, thread pool start
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, reps = min(best, took), spent + took, reps + 1
    return best


def time_from_memory(fn) -> float:
    """The best time of fn() over up to 20 runs, twice the largest cache written over before
    each, so that what it reads (a weight matrix that would fit there) comes from memory."""
    evict = torch.empty(2 * last_cache_bytes(), dtype=torch.uint8)
    return _best_time(fn, max_reps=20, before=lambda: evict.fill_(1))


def last_cache_bytes() -> int:
    """The CPU's largest cache (Linux: sysfs; elsewhere, or unreadable: 64 MiB)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError):
            pass
    return max(sizes, default=64 << 20)


def measure_ceiling(engine: Engine, math: str = "") -> dict:
    """Memory bandwidth (one row through the largest weight matrix, as the passes read it,
    from memory: twice the largest cache written over before each run, so that a matrix that
    fits in it is not read from there) and GFLOPS (CEILING_BATCH rows through it, warm),
    measured on the engine thread with the kernel that would run them; the best of several
    runs. Empty when the runner has no float weight matrix."""
    runner = engine.runner
    found = largest_weight(runner)
    if found is None:
        return {}
    name, stored = found
    w = as_run(runner, stored)
    math = math or engine.info().get("compute_dtype", "float32")

    def measure():
        product, label = product_kernel(w, math, engine.runner_name == "native")
        rows, cols = w.shape
        x1 = torch.randn(1, cols, dtype=torch.float32)
        xb = torch.randn(CEILING_BATCH, cols, dtype=torch.float32)
        with torch.inference_mode():
            t1 = time_from_memory(lambda: product(x1))
            tb = _best_time(lambda: product(xb))
        kind = (
            _type_name(stored.type) + (", packed" if w is not stored else "")
            if isinstance(w, native.StoredMatrix)
            else str(w.dtype).removeprefix("torch.")
        )
        return {
            "matrix": f"{name} ({rows}x{cols}, {kind})",
            "bandwidth_gb_s": round(_bytes(w) / t1 / 1e9, 2),
            "gflops": round(2 * rows * cols * CEILING_BATCH / tb / 1e9, 2),
            "gflops_rows": CEILING_BATCH,
            "method": f"{label} for the bandwidth (from memory) and GFLOPS",
            "weight_bytes": runner.weight_bytes(),
            "weight_elements": weight_elements(runner),
            "math": math,
        }

    run = getattr(engine, "run_on_worker", None)
    return run(measure) if run else measure()


def ceiling_tokens_per_s(ceiling: dict, level: int) -> float | None:
    """min(B x bandwidth / weight bytes, GFLOPS / (2 x weight elements)): a step of B rows
    reads every weight once and does two flops per weight element and row."""
    if not ceiling:
        return None
    memory = level * ceiling["bandwidth_gb_s"] * 1e9 / ceiling["weight_bytes"]
    compute = ceiling["gflops"] * 1e9 / (2 * ceiling["weight_elements"])
    return min(memory, compute)
