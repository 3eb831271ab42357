"""llama.cpp on the same weights, as a peer in the benchmark (optional: llama-cpp-python).

The embedded GGUF is Q4_1. For a like-for-like comparison the `gguf` package writes f32 and
bf16 copies of it (dequantized, metadata unchanged) into the cache folder once; llama.cpp then
runs each, fed the same prompt token ids as our engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from miniserve.loader import cache_root, file_key

PRECISIONS = {"float32": "F32", "bfloat16": "BF16", "q4_1": None}


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_copy(source: Path, precision: str) -> Path:
    """The source GGUF with every tensor stored as `precision` (F32 or BF16), made once."""
    import gguf
    from gguf.quants import dequantize, quantize
    kind = PRECISIONS[precision]
    if kind is None:
        return source
    out = cache_root() / f"{source.stem}-{file_key(source)}.{kind.lower()}.gguf"
    if out.is_file():
        return out
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if len(values.shape) == 1 or kind == "F32":  # norms stay f32, as converters do
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out


class LlamaCppModel:
    """One llama.cpp model in this process; `run(ids, n)` -> (tokens, ttft_s, total_s)."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        import llama_cpp
        from llama_cpp import llama as llama_module
        # llama.cpp's extra weight layouts (AMX / repacked) crashed here in the first batched
        # decode (a segfault in ggml_backend_amx_mul_mat with llama-cpp-python 0.3.36 on this
        # CPU); the plain CPU kernels are used instead, as `--no-extra-bufts` would.
        default_params = llama_module.llama_cpp.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_module.llama_cpp.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, n_batch=512, verbose=False)
        finally:
            llama_module.llama_cpp.llama_model_default_params = default_params

    def run(self, ids: list[int], new_tokens: int, eos_ids) -> tuple[list[int], float, float]:
        self.llm.reset()  # it would otherwise reuse the previous call's KV prefix
        tokens = []
        start = time.perf_counter()
        first = None
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                       repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if token in eos_ids:
                break
            tokens.append(token)
            if len(tokens) >= new_tokens:
                break
        return tokens, first - start, time.perf_counter() - start


class LlamaCppPeer:
    """llama.cpp in a process of its own, so that neither engine's idle worker threads
    (both use OpenMP, whose workers spin between calls) take CPU from the other: in one
    process llama.cpp measured 32 instead of 90 tokens/s here."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        self.path = Path(path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "miniserve.peer", str(path), str(n_ctx), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def run(self, ids: list[int], new_tokens: int, eos_ids) -> tuple[list[int], float, float]:
        self.proc.stdin.write(json.dumps({"ids": list(ids), "new_tokens": new_tokens,
                                          "eos": sorted(eos_ids)}) + "\n")
        reply = json.loads(self.proc.stdout.readline())
        return reply["tokens"], reply["ttft_s"], reply["total_s"]

    def weight_bytes(self) -> int:
        return self.path.stat().st_size

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _serve(path: str, n_ctx: str, threads: str) -> None:
    """The peer process: one JSON request a line in, one JSON result a line out."""
    model = LlamaCppModel(Path(path), int(n_ctx), int(threads))
    for line in sys.stdin:
        request = json.loads(line)
        tokens, ttft, total = model.run(request["ids"], request["new_tokens"], set(request["eos"]))
        print(json.dumps({"tokens": tokens, "ttft_s": ttft, "total_s": total}), flush=True)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
