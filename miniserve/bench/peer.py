"""llama.cpp on the same weights, as a peer in the benchmark (optional: llama-cpp-python).

The embedded GGUF is Q4_1 (Gemma 3 270M's Q4_K_M). For a like-for-like comparison the `gguf`
package writes f32 and
bf16 copies of it (dequantized, metadata unchanged) into the cache folder once; llama.cpp then
runs each, fed the same prompt token ids as our engine. For the concurrency benchmark,
`LlamaCppBatch` decodes B sequences together through llama.cpp's own batch API (one sequence
id a stream, all prompts in one batch, then one batch of B tokens a step, greedy).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from miniserve.runners.gguf_file import GGUFFile, GGUFFileError
from miniserve.runners.loader import cache_root, file_key, size_text

# llama.cpp's rows: float32 and bfloat16 copies, and the file as stored ("file": its own
# type, file_type() names it -- q4_1 for the embedded model, q4_k_m for Gemma 3 270M)
PRECISIONS = {"float32": "F32", "bfloat16": "BF16", "file": None}


def file_type(path: Path) -> str | None:
    """The GGUF's weight type as llama.cpp names it (`general.file_type`: q4_1, q4_k_m, ...),
    read from the header alone (GGUFFile: milliseconds, where the gguf package's reader parses
    every tensor and the whole vocabulary); None when the file does not say (or is damaged)."""
    import gguf

    try:
        with GGUFFile(path) as f:
            value = f.get("general.file_type")
    except (GGUFFileError, OSError):
        return None
    if type(value) is not int:
        return None
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").lower()
    except ValueError:
        return None


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_copy(source: Path, precision: str, say=None) -> Path:
    """The source GGUF with every tensor stored as `precision` (F32 or BF16), made once in the
    cache and said then, with its size (through `say`, else on stderr)."""
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
    (say or (lambda m: print(m, file=sys.stderr, flush=True)))(
        f"Wrote a {precision} copy of {source.name} to the cache for llama.cpp: {out} "
        f"({size_text(out.stat().st_size)}; later runs read it, deleting it frees the space)"
    )
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
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=512,
                verbose=False,
            )
        finally:
            llama_module.llama_cpp.llama_model_default_params = default_params

    def run(self, ids: list[int], new_tokens: int, eos_ids) -> tuple[list[int], float, float]:
        self.llm.reset()  # it would otherwise reuse the previous call's KV prefix
        tokens = []
        start = time.perf_counter()
        first = None
        for token in self.llm.generate(
            ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if first is None:
                first = time.perf_counter()
            if token in eos_ids:
                break
            tokens.append(token)
            if len(tokens) >= new_tokens:
                break
        return tokens, first - start, time.perf_counter() - start


class LlamaCppBatch:
    """B greedy sequences decoded together with llama.cpp's low-level API (llama-cpp-python's
    ctypes bindings of llama.h): each stream its own sequence id, all prompts in one batch,
    then one batch holding each unfinished stream's last token a step. Keys and values are
    kept as llama.cpp keeps them by default (float16), or in float32 with `kv_float32`."""

    def __init__(self, path: Path, threads: int, kv_float32: bool = False):

        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load messages
        self.ll = llama_cpp
        self.threads = threads
        self.kv_float32 = kv_float32
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = False  # as in LlamaCppModel: the plain CPU kernels
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def _context(self, streams: int, positions: int):
        """A context for `streams` sequences of up to `positions` each, in caches of their
        own (not unified: the sequences share no prefix)."""
        ll = self.ll
        params = ll.llama_context_default_params()
        per_seq = -(-positions // 256) * 256
        params.n_ctx = per_seq * streams
        params.n_seq_max = streams
        params.kv_unified = False
        params.n_batch = max(512, min(params.n_ctx, 8192))
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        if self.kv_float32:
            params.type_k = params.type_v = ll.GGML_TYPE_F32
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(
                f"llama.cpp could not make a context for {streams} sequences "
                f"of {positions} positions"
            )
        return ctx, params.n_batch

    def run(self, prompts: list[list[int]], new_tokens: int, eos_ids) -> dict:
        """{"streams": [{"tokens", "times", "end"}], "total_s"}: times in seconds from the start,
        when the step that chose each token ended (every stream was submitted at 0)."""
        ll = self.ll
        n = len(prompts)
        ctx, n_batch = self._context(n, max(len(p) for p in prompts) + new_tokens + 1)
        batch = ll.llama_batch_init(max(n_batch, n), 0, 1)
        tokens: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        ends = [0.0] * n
        try:
            start = time.perf_counter()
            # the prompts, in batches of at most n_batch tokens; logits of each last token
            pending = [(s, i, t) for s, p in enumerate(prompts) for i, t in enumerate(p)]
            out_row: dict[int, int] = {}
            for lo in range(0, len(pending), n_batch):
                part = pending[lo : lo + n_batch]
                out_row = {}
                for j, (s, i, t) in enumerate(part):
                    last = i == len(prompts[s]) - 1
                    self._put(batch, j, t, i, s, last)
                    if last:
                        out_row[s] = j
                batch.n_tokens = len(part)
                self._decode(ctx, batch)
                now_rows = self._choose(ctx, out_row)
                for s, token in now_rows.items():
                    self._take(s, token, tokens, times, ends, eos_ids, new_tokens, start)
            live = [s for s in range(n) if not ends[s]]
            while live:
                for j, s in enumerate(live):
                    self._put(
                        batch, j, tokens[s][-1], len(prompts[s]) + len(tokens[s]) - 1, s, True
                    )
                batch.n_tokens = len(live)
                self._decode(ctx, batch)
                for s, token in self._choose(ctx, {s: j for j, s in enumerate(live)}).items():
                    self._take(s, token, tokens, times, ends, eos_ids, new_tokens, start)
                live = [s for s in live if not ends[s]]
            total = time.perf_counter() - start
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)
        return {
            "streams": [{"tokens": tokens[s], "times": times[s], "end": ends[s]} for s in range(n)],
            "total_s": total,
        }

    @staticmethod
    def _put(batch, j: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[j] = token
        batch.pos[j] = pos
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq
        batch.logits[j] = logits

    def _decode(self, ctx, batch) -> None:
        code = self.ll.llama_decode(ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _choose(self, ctx, rows: dict[int, int]) -> dict[int, int]:
        """{stream: its greedy token}, from the logits of each stream's row in the batch."""
        chosen = {}
        for s, j in rows.items():
            logits = np.ctypeslib.as_array(
                self.ll.llama_get_logits_ith(ctx, j), shape=(self.n_vocab,)
            )
            chosen[s] = int(logits.argmax())
        return chosen

    @staticmethod
    def _take(s, token, tokens, times, ends, eos_ids, new_tokens, start) -> None:
        now = time.perf_counter() - start
        if token in eos_ids:  # an end token ends the stream, not counted (as in our engine)
            ends[s] = now
            return
        tokens[s].append(token)
        times[s].append(now)
        if len(tokens[s]) >= new_tokens:
            ends[s] = now

    def close(self) -> None:
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model = None


class LlamaCppPeer:
    """llama.cpp in a process of its own, so that neither engine's idle worker threads
    (both use OpenMP, whose workers spin between calls) take CPU from the other: in one
    process llama.cpp measured 32 instead of 90 tokens/s here."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        self.path = Path(path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "miniserve.bench.peer", str(path), str(n_ctx), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def run(self, ids: list[int], new_tokens: int, eos_ids) -> tuple[list[int], float, float]:
        self.proc.stdin.write(
            json.dumps({"ids": list(ids), "new_tokens": new_tokens, "eos": sorted(eos_ids)}) + "\n"
        )
        reply = json.loads(self.proc.stdout.readline())
        return reply["tokens"], reply["ttft_s"], reply["total_s"]

    def run_batch(self, prompts: list[list[int]], new_tokens: int, eos_ids) -> dict:
        """The prompts decoded together (LlamaCppBatch.run), in the peer process."""
        self.proc.stdin.write(
            json.dumps(
                {
                    "batch": [list(p) for p in prompts],
                    "new_tokens": new_tokens,
                    "eos": sorted(eos_ids),
                }
            )
            + "\n"
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp process ended without a reply (see above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp: {reply['error']}")
        return reply

    def weight_bytes(self) -> int:
        return self.path.stat().st_size

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _serve(path: str, n_ctx: str, threads: str) -> None:
    """The peer process: one JSON request a line in, one JSON result a line out. A request
    with "ids" runs one sequence (LlamaCppModel, n_ctx positions); one with "batch" runs
    several together (LlamaCppBatch). Each model is loaded at its first request."""
    single: LlamaCppModel | None = None
    batched: LlamaCppBatch | None = None
    for line in sys.stdin:
        request = json.loads(line)
        eos = set(request["eos"])
        if "batch" in request:
            batched = batched or LlamaCppBatch(Path(path), int(threads))
            try:
                reply = batched.run(request["batch"], request["new_tokens"], eos)
            except RuntimeError as e:
                reply = {"error": str(e)}
            print(json.dumps(reply), flush=True)
            continue
        single = single or LlamaCppModel(Path(path), int(n_ctx), int(threads))
        tokens, ttft, total = single.run(request["ids"], request["new_tokens"], eos)
        print(json.dumps({"tokens": tokens, "ttft_s": ttft, "total_s": total}), flush=True)
    if batched is not None:
        batched.close()


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
