"""Ours vs llama.cpp on GGUF files, each engine in its own process, one process at a time.

    .venv/bin/python benchmarks/vs_llamacpp.py FILE.gguf [FILE.gguf ...]
        [--engines llamacpp,ours] [--repeat 3] [--threads 2] [--json OUT.json]
        [--ours-cmd '...{model}...{json}...'] [--ours-batch-cmd '...'] [--ours-ready REGEX]
    .venv/bin/python benchmarks/vs_llamacpp.py --from-json A.json [B.json ...]   (table only)

What is measured, per file and engine (median over --repeat rounds; each round starts a fresh
process per measurement, the engines taking turns -- A B, then B A -- so that a slow moment of
the machine costs both alike):

  * one stream: decode tokens/s of 64 new tokens after a 64-token prompt (greedy; tokens after
    the first over their time), time to first token at 64 and at 512 prompt tokens;
  * load: process start to model ready (llama.cpp: Llama() constructed; ours: the first line on
    stderr matching --ours-ready, by default the bench's "warming up"), file pages warm in the
    page cache (every file is read once before the first round);
  * memory: peak RSS of the process (VmHWM of /proc/PID/status, sampled every 50 ms until it
    exits), and RssAnon / RssFile at the sampled moment of highest VmRSS and at the end --
    anonymous memory is what the engine made (repacked / dequantized weights, KV cache), file
    memory the mapped GGUF (llama.cpp keeps the whole file mapped, the repacked tensors' pages
    too, so its RSS counts those weights twice; file pages can be reclaimed, anonymous ones
    cannot);
  * B streams (--streams, 8) batched: aggregate tokens/s, every stream's new tokens over the
    wall time from the submit to the last token, prefill of all prompts included (llama.cpp:
    its batch API through miniserve/bench/peer.py's LlamaCppBatch, one sequence id a stream; ours:
    the
    --ours-batch-cmd, by default `bench --concurrency B --presets greedy`). A separate process
    from the one-stream one, so that the one-stream memory figures are one context's.

llama.cpp (llama-cpp-python) runs with n_threads = n_threads_batch = --threads and otherwise
its defaults -- the extra (repacked) CPU weight buffers on, as its users run it -- except its AMX
buffer: llama-cpp-python 0.3.36's AMX kernels die on this CPU (SIGILL in
ggml_backend_amx_mul_mat at the first prompt, a ggml bug), so by default each llama.cpp process
is started with AMX refused (miniserve.bench.synthetic.block_amx: the weights then go to CPU_REPACK,
as on a CPU without AMX). --llamacpp-amx tries AMX anyway; --no-extra-bufts turns all the extra
buffers off (peer.py's setting). A llama.cpp process that crashes is rerun once with the extra
buffers off, and the JSON says so. End tokens do not stop llama.cpp (every run makes exactly the
asked tokens).

The AVX2 row with both engines built for AVX2 (what a CPU without AVX-512 runs), on an AVX-512
machine: llama-cpp-python built from source into a folder of its own, put first on PYTHONPATH
(the llama.cpp children import it from there; ours has nothing of that name), and our
x86-64-v3 build:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
        .venv/bin/python -m pip install --no-cache-dir --no-deps --no-binary llama-cpp-python \
        --target DIR llama-cpp-python==0.3.36
    PYTHONPATH=DIR MINISERVE_NATIVE_ARCH=x86-64-v3 .venv/bin/python benchmarks/vs_llamacpp.py ...

(the JSON's llama.cpp system_info then reads AVX2 without AVX512).

Before a file's first round, our one-stream command runs once unmeasured (--no-prime: not),
so that a first start's one-off work (the loader's dequantized-weights cache) is not in the
load times. The default commands are `python -m miniserve bench --no-check`: the bench's own
check of its greedy tokens (a float64 pass over the file's blocks) would put its reference's
memory and time in our process, where llama.cpp has none; `miniserve bench` alone checks.

"Ours" is a command: a list of words with {model}, {json}, {prompt_tokens}, {new_tokens},
{threads}, {streams} filled in (--ours-cmd / --ours-batch-cmd, a shell-like string). Its result is
read from the {json} file (or, if the command has no {json}, the last JSON line on stdout), in
one of three forms: `miniserve bench --json` (rows with mode, prompt_tokens, ttft_s,
decode_tokens_per_s; the row of --ours-mode, "cache" by default), `miniserve bench
--concurrency --json` (rows with engine "miniserve" and aggregate_tokens_per_s), or a flat
object with this script's own names (decode_tok_s, ttft_s: {"64": s, "512": s}, batch_tok_s,
and ready_s when the command knows better when it was ready).

Nothing else should run meanwhile: --wait-idle S waits (up to S seconds) before each process
until the machine is idle; the JSON records, per run, the CPU time that other processes took
during it (/proc/stat busy time less the child's and this script's), and the table flags runs
where that was over 5% of the machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OURS = (
    "{python} -m miniserve bench --model {model} --prompt-tokens {prompt_tokens} "
    "--new-tokens {new_tokens} --repeat 1 --modes cache --no-check --json {json}"
)
DEFAULT_OURS_BATCH = (
    "{python} -m miniserve bench --model {model} --concurrency {streams} "
    "--presets greedy --prompt-tokens {batch_prompt} --new-tokens {new_tokens} "
    "--repeat 1 --no-check --json {json}"
)
DEFAULT_READY = r"warming up"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BUSY_OTHERS_FLAG = 0.05


# -- the machine ------------------------------------------------------------------------------


def cpu_description() -> dict:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    named = [
        f
        for f in (
            "avx2",
            "avx512f",
            "avx512_vnni",
            "avx_vnni",
            "avx512_bf16",
            "amx_tile",
            "amx_int8",
            "amx_bf16",
        )
        if f in flags
    ]
    return {"model": info.get("model name", "?"), "cores": os.cpu_count(), "flags": named}


def busy_jiffies() -> int:
    """All CPUs' busy time so far (/proc/stat: user, nice, system, irq, softirq -- not idle,
    iowait, or steal, the hypervisor's), in ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6]


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process, in MiB ({} once it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    except (OSError, ValueError):
        pass
    return out


class Sampler(threading.Thread):
    """Samples the child's /proc status every `interval` s: the sample of highest VmRSS, and
    the last one."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak: dict = {}
        self.last: dict = {}
        self.hwm = 0.0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            status = proc_status(self.pid)
            if status.get("VmRSS") is not None:
                self.last = status
                self.hwm = max(self.hwm, status.get("VmHWM", 0.0))
                if status["VmRSS"] >= self.peak.get("VmRSS", -1):
                    self.peak = status
            self.stop.wait(self.interval)


def run_child(
    cmd: list[str], ready: str | None = None, env: dict | None = None, timeout: float = 3600
) -> dict:
    """Run one measurement process alone: {rc, out, err, ready_s (spawn -> the ready line),
    wall_s, peak_rss_mb (VmHWM), peak / end samples, cpu_s, others_cpu_share}."""
    ready_re = re.compile(ready) if ready else None
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    busy_before = busy_jiffies()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    box: dict = {"ready_s": None, "out": [], "err": []}

    def read(stream, lines, is_err):
        """Collect the stream; note when a line first says the model is ready. A progress
        bar's line ends with the \r of the next update, written only when that step is done:
        the unfinished line counts too (else "warming up" would be seen after the warm-up).
        Reads whatever is there at once, not a byte a call: this process must not take CPU
        from the one it measures."""
        pending = ""
        while True:
            data = os.read(stream.fileno(), 1 << 16)
            if not data:
                break
            text = data.decode(errors="replace")
            lines.append(text)
            if box["ready_s"] is None:
                pending += text
                *done, pending = re.split(r"[\r\n]", pending)
                for line in done + [pending]:
                    if (ready_re is None and not is_err and line.strip() == "READY") or (
                        ready_re is not None and ready_re.search(line)
                    ):
                        box["ready_s"] = time.perf_counter() - start
                        break

    readers = [
        threading.Thread(target=read, args=(proc.stdout, box["out"], False), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, box["err"], True), daemon=True),
    ]
    for r in readers:
        r.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop.set()
    sampler.join()
    for r in readers:
        r.join()
    busy = (busy_jiffies() - busy_before) / CLK_TCK
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    mine = self_after.ru_utime + self_after.ru_stime - self_before.ru_utime - self_before.ru_stime
    child_cpu = usage.ru_utime + usage.ru_stime
    others = max(0.0, busy - child_cpu - mine)
    return {
        "rc": proc.returncode,
        "out": "".join(box["out"]),
        "err": "".join(box["err"]),
        "ready_s": box["ready_s"],
        "wall_s": round(wall, 3),
        # VmHWM as last sampled (ru_maxrss would count the forked copy of this process
        # before its exec)
        "peak_rss_mb": sampler.hwm or None,
        "peak_sample": sampler.peak,
        "end_sample": sampler.last,
        "cpu_s": round(child_cpu, 2),
        "others_cpu_s": round(others, 2),
        "others_cpu_share": round(others / (wall * (os.cpu_count() or 1)), 3),
    }


# -- llama.cpp, in a child process ------------------------------------------------------------


def filler_text() -> str:
    """miniserve.bench.prompts.FILLER, read from its source (importing it would import torch)."""
    tree = ast.parse((ROOT / "miniserve" / "bench" / "prompts.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "FILLER" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise RuntimeError("no FILLER in miniserve/bench/prompts.py")


def filler_ids(tokenize, n: int, lead: str = "") -> list[int]:
    """n tokens: `lead` then the filler repeated (as bench's prompt_of_length/stream_prompt)."""
    ids = tokenize(filler_text())
    body = (ids * (n // len(ids) + 1))[:n]
    return ((tokenize(lead) if lead else []) + body)[:n]


def own_status() -> dict:
    return proc_status(os.getpid())


def llamacpp_params(extra_bufts: bool):
    """llama_model_default_params with the repacked buffers as asked (the default: on)."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    if not extra_bufts:
        params.use_extra_bufts = False
    return params


def llamacpp_greedy(llm, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """n greedy tokens after `ids` from an empty context (end tokens too: exactly n): (the
    tokens, seconds to the first, seconds in all)."""
    llm.reset()  # else generate() reuses the previous call's KV prefix
    tokens, first = [], None
    start = time.perf_counter()
    for token in llm.generate(
        ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
    ):
        if first is None:
            first = time.perf_counter() - start
        tokens.append(token)
        if len(tokens) >= n:
            break
    return tokens, first, time.perf_counter() - start


def child_llamacpp_single(
    path: str, threads: int, prompts: list[int], new_tokens: int, extra_bufts: bool
) -> dict:
    t0 = time.perf_counter()
    import llama_cpp
    from llama_cpp import llama as llama_module

    imported = time.perf_counter() - t0
    n_ctx = max(prompts) + new_tokens + 16
    original = llama_module.llama_cpp.llama_model_default_params
    if not extra_bufts:
        llama_module.llama_cpp.llama_model_default_params = lambda: llamacpp_params(False)
    try:
        llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=max(n_ctx, 1024),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=True,
        )  # its buffer sizes
    finally:
        llama_module.llama_cpp.llama_model_default_params = original
    constructed = time.perf_counter() - t0
    print("READY", flush=True)
    after_load = own_status()

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=False)

    def run(ids: list[int], n: int):
        tokens, first, total = llamacpp_greedy(llm, ids, n)
        decode = (len(tokens) - 1) / (total - first) if len(tokens) > 1 else 0.0
        return {
            "prompt_tokens": len(ids),
            "new_tokens": len(tokens),
            "ttft_s": round(first, 4),
            "total_s": round(total, 4),
            "decode_tok_s": round(decode, 2),
            "tokens_head": tokens[:8],
        }

    run(filler_ids(tokenize, 8), 4)  # one-off costs (first graph, buffers) out of the numbers
    runs = [run(filler_ids(tokenize, n), new_tokens) for n in prompts]
    cparams = llm.context_params
    return {
        "engine": "llama.cpp",
        "kind": "single",
        "import_s": round(imported, 3),
        "construct_s": round(constructed, 3),
        "runs": runs,
        "settings": {
            "n_threads": threads,
            "n_ctx": llm.n_ctx(),
            "n_batch": llm.n_batch,
            "n_ubatch": cparams.n_ubatch,
            "flash_attn": getattr(cparams, "flash_attn_type", getattr(cparams, "flash_attn", None)),
            "type_k": cparams.type_k,
            "load_mode": getattr(llm.model_params, "load_mode", None),
            "extra_bufts": bool(llm.model_params.use_extra_bufts),
            "system_info": llama_cpp.llama_print_system_info().decode(),
        },
        "status_after_load": after_load,
        "status_end": own_status(),
    }


def child_llamacpp_batch(
    path: str, threads: int, streams: int, prompt: int, new_tokens: int, extra_bufts: bool
) -> dict:
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    # miniserve.bench.peer imports miniserve.runners.loader (for its GGUF copies), which imports
    # torch:
    # ~150 MB and a second OpenMP runtime in a process that measures llama.cpp. The batch
    # class needs none of it, so the loader is stubbed for this process.
    import types

    import llama_cpp

    if "miniserve.runners.loader" not in sys.modules:
        stub = types.ModuleType("miniserve.runners.loader")
        stub.cache_root = stub.file_key = stub.size_text = None
        sys.modules["miniserve.runners.loader"] = stub
    from miniserve.bench.peer import LlamaCppBatch

    class Batch(LlamaCppBatch):
        """LlamaCppBatch with the model loaded with llama.cpp's default parameters (its own
        __init__ turns the repacked buffers off)."""

        def __init__(self, path: Path, threads: int):
            import logging

            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
            self.ll = llama_cpp
            self.threads = threads
            self.kv_float32 = False
            llama_cpp.llama_backend_init()
            self.model = llama_cpp.llama_model_load_from_file(
                str(path).encode(), llamacpp_params(extra_bufts)
            )
            if not self.model:
                raise RuntimeError(f"llama.cpp could not load {path}")
            self.n_vocab = llama_cpp.llama_vocab_n_tokens(
                llama_cpp.llama_model_get_vocab(self.model)
            )

    model = Batch(Path(path), threads)
    constructed = time.perf_counter() - t0
    print("READY", flush=True)
    vocab = llama_cpp.llama_model_get_vocab(model.model)

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        return list(buf[:n])

    warm = [filler_ids(tokenize, 8, f"{i + 1}. ") for i in range(streams)]
    model.run(warm, 4, set())
    prompts = [filler_ids(tokenize, prompt, f"{i + 1}. ") for i in range(streams)]
    reply = model.run(prompts, new_tokens, set())
    produced = sum(len(s["tokens"]) for s in reply["streams"])
    firsts = [s["times"][0] for s in reply["streams"] if s["times"]]
    last = max(s["times"][-1] for s in reply["streams"] if s["times"])
    after_first = produced - len(firsts)
    model.close()
    return {
        "engine": "llama.cpp",
        "kind": "batch",
        "construct_s": round(constructed, 3),
        "streams": streams,
        "prompt_tokens": prompt,
        "new_tokens": new_tokens,
        "produced_tokens": produced,
        "wall_s": round(reply["total_s"], 4),
        "batch_tok_s": round(produced / reply["total_s"], 2),
        "batch_decode_tok_s": round(after_first / (last - max(firsts)), 2)
        if last > max(firsts)
        else None,
        "ttft_p50_s": round(statistics.median(firsts), 4),
        "extra_bufts": extra_bufts,
        "status_end": own_status(),
    }


def child_main(args) -> int:
    if not args.llamacpp_amx and not args.no_extra_bufts:
        sys.path.insert(0, str(ROOT))
        from miniserve.bench.synthetic import block_amx

        block_amx()
    if args.child == "llamacpp-batch":
        result = child_llamacpp_batch(
            args.files[0],
            args.threads,
            args.streams,
            args.batch_prompt_tokens,
            args.new_tokens,
            not args.no_extra_bufts,
        )
    else:
        result = child_llamacpp_single(
            args.files[0], args.threads, args.prompt_list, args.new_tokens, not args.no_extra_bufts
        )
    print(json.dumps(result), flush=True)
    return 0


# -- the runs ---------------------------------------------------------------------------------


def last_json_line(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def parse_ours(data: dict, mode: str, prompts: list[int]) -> dict:
    """Our command's JSON (the three forms of the module docstring) in this script's names."""
    rows = data.get("rows")
    if rows and "aggregate_tokens_per_s" in rows[0]:  # bench --concurrency
        mine = [r for r in rows if r.get("engine") == "miniserve"]
        row = next((r for r in mine if r.get("preset") == "greedy"), mine[0] if mine else None)
        if row is None:
            return {"error": "no miniserve row in the concurrency JSON"}
        return {
            "batch_tok_s": row["aggregate_tokens_per_s"],
            "streams": row["concurrency"],
            "produced_tokens": row["produced_tokens"],
            "ttft_p50_s": row.get("ttft_p50_s"),
            "batch_stream_decode_tok_s": row.get("stream_decode_tokens_per_s"),
            "dtype": row.get("dtype"),
            "runner": data.get("runner"),
        }
    if rows is not None:  # bench
        runs = []
        for r in rows:
            if r.get("mode") == mode:
                runs.append(
                    {
                        "prompt_tokens": r["prompt_tokens"],
                        "new_tokens": r["new_tokens"],
                        "ttft_s": r["ttft_s"],
                        "decode_tok_s": r["decode_tokens_per_s"],
                    }
                )
        if not runs:
            return {"error": f"no rows of mode {mode!r} in the bench JSON"}
        return {
            "runs": runs,
            "dtype": data.get("dtype"),
            "runner": data.get("runner"),
            "tokens_verified": data.get("tokens_verified"),
        }
    out = dict(data)  # a flat object in our own names
    if "ttft_s" in out and isinstance(out["ttft_s"], dict):
        out["runs"] = [
            {
                "prompt_tokens": int(n),
                "ttft_s": s,
                "decode_tok_s": out.get("decode_tok_s") if int(n) == prompts[0] else None,
            }
            for n, s in out.pop("ttft_s").items()
        ]
    return out


def fill(template: str, **values) -> list[str]:
    return [word.format(**values) for word in shlex.split(template)]


def measure(engine: str, kind: str, path: Path, args, round_no: int) -> dict:
    """One process: one engine, one kind (single / batch), one round."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    prompts = ",".join(str(n) for n in args.prompt_list)
    if engine == "llamacpp":
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "llamacpp-batch" if kind == "batch" else "llamacpp-single",
            str(path),
            "--threads",
            str(args.threads),
            "--prompt-tokens",
            prompts,
            "--new-tokens",
            str(args.new_tokens),
            "--streams",
            str(args.streams),
            "--batch-prompt-tokens",
            str(args.batch_prompt_tokens),
        ]
        extra = not args.no_extra_bufts
        flags = ([] if extra else ["--no-extra-bufts"]) + (
            ["--llamacpp-amx"] if args.llamacpp_amx else []
        )
        done = run_child(cmd + flags, None, env, args.timeout)
        result = last_json_line(done["out"])
        if result is None and extra and done["rc"] < 0:
            # a crash in an extra buffer's kernels (the AMX ones die here): once more with
            # the plain buffers, said in the record
            crashed = done
            done = run_child(cmd + ["--no-extra-bufts"], None, env, args.timeout)
            result = last_json_line(done["out"])
            if result is not None:
                result["note"] = (
                    f"crashed with the extra buffers (exit {crashed['rc']}: "
                    + " | ".join(crashed["err"].strip().splitlines()[-2:])[:300]
                    + "); this run used the plain CPU buffers"
                )
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out_json = Path(tmp) / "ours.json"
            template = args.ours_batch_cmd if kind == "batch" else args.ours_cmd
            cmd = fill(
                template,
                python=sys.executable,
                model=str(path),
                json=str(out_json),
                prompt_tokens=prompts,
                new_tokens=args.new_tokens,
                threads=args.threads,
                streams=args.streams,
                batch_prompt=args.batch_prompt_tokens,
            )
            done = run_child(cmd, args.ours_ready, env, args.timeout)
            data = (
                json.loads(out_json.read_text())
                if out_json.is_file()
                else last_json_line(done["out"])
            )
        result = parse_ours(data, args.ours_mode, args.prompt_list) if data else None
        if result and result.get("ready_s") is not None:
            done["ready_s"] = result["ready_s"]
    record = {
        "engine": engine,
        "kind": kind,
        "round": round_no,
        "cmd": cmd,
        **done,
        "result": result,
    }
    if result is None or done["rc"] not in (0, 3):  # bench exits 3 on unverified tokens
        record["error"] = (
            f"exit {done['rc']}: " + " | ".join(done["err"].strip().splitlines()[-3:])
        )[:600]
    record["buffers_mib"] = buffer_sizes(done["err"])
    if not args.keep_output:
        record["out"] = record["out"][-2000:] if record.get("error") else ""
        record["err"] = record["err"][-2000:] if record.get("error") else ""
    return record


def buffer_sizes(log: str) -> dict[str, float]:
    """llama.cpp's buffer sizes from its load log: {"model CPU_REPACK": MiB, "KV CPU": ...}."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = re.search(
            r"^\w+:\s+(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB", line.strip()
        )
        if m:
            key = f"{m.group(2)} {m.group(1)}"
            out[key] = round(out.get(key, 0.0) + float(m.group(3)), 1)
    return out


def others_busy(window: float = 3.0) -> float:
    """Share of the machine's CPU busy over `window` seconds (this script sleeps meanwhile)."""
    before = busy_jiffies()
    time.sleep(window)
    return (busy_jiffies() - before) / CLK_TCK / (window * (os.cpu_count() or 1))


def wait_idle(max_wait: float, threshold: float = BUSY_OTHERS_FLAG) -> dict:
    """Wait (at most max_wait s) until the machine is idle: under `threshold` of its CPU busy
    over 3 s. {waited_s, busy_before}: what it found."""
    start = time.perf_counter()
    busy = others_busy()
    while busy > threshold and time.perf_counter() - start < max_wait:
        busy = others_busy(10.0)
    return {"waited_s": round(time.perf_counter() - start, 1), "busy_before": round(busy, 3)}


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def gguf_summary(path: Path) -> dict:
    """File size and its tensor types ({type: count}) from its header, without numpy arrays."""
    sys.path.insert(0, str(ROOT))
    out: dict = {"size_mib": round(path.stat().st_size / 2**20, 1)}
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        types: dict[str, int] = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        out["tensor_types"] = types
        field = reader.fields.get("general.file_type")
        if field is not None:
            out["file_type"] = (
                gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").lower()
            )
        arch = reader.fields["general.architecture"].contents()
        out["arch"] = arch
        for key in ("block_count", "embedding_length", "vocab_size"):
            f = reader.fields.get(f"{arch}.{key}")
            if f is not None:
                out[key] = int(f.contents())
        out["params_b"] = round(sum(int(t.n_elements) for t in reader.tensors) / 1e9, 3)
    except Exception as e:  # noqa: BLE001 -- the summary is a courtesy
        out["error"] = str(e)
    return out


def summarize(records: list[dict], prompts: list[int]) -> dict:
    """Medians per engine over the rounds."""
    out: dict = {}
    for engine in sorted({r["engine"] for r in records}):
        mine = [
            r for r in records if r["engine"] == engine and r.get("result") and not r.get("error")
        ]
        single = [r for r in mine if r["kind"] == "single"]
        batch = [r for r in mine if r["kind"] == "batch"]
        s: dict = {"rounds": len(single), "batch_rounds": len(batch)}

        def med(values):
            values = [v for v in values if v is not None]
            return round(statistics.median(values), 4) if values else None

        for n in prompts:
            runs = [
                next((x for x in r["result"].get("runs", []) if x["prompt_tokens"] == n), None)
                for r in single
            ]
            runs = [x for x in runs if x]
            s[f"ttft_{n}_s"] = med(x["ttft_s"] for x in runs)
            if n == prompts[0]:
                s["decode_tok_s"] = med(x.get("decode_tok_s") for x in runs)
        s["load_s"] = med(r["ready_s"] for r in single)
        s["peak_rss_mib"] = med(r["peak_rss_mb"] for r in single)
        s["rss_anon_at_peak_mib"] = med(r["peak_sample"].get("RssAnon") for r in single)
        s["rss_file_at_peak_mib"] = med(r["peak_sample"].get("RssFile") for r in single)
        s["batch_tok_s"] = med(r["result"].get("batch_tok_s") for r in batch)
        s["batch_peak_rss_mib"] = med(r["peak_rss_mb"] for r in batch)
        s["others_cpu_share_max"] = max((r["others_cpu_share"] for r in mine), default=None)
        notes = sorted({r["result"].get("note") for r in mine if r["result"].get("note")})
        errors = [r["error"] for r in records if r["engine"] == engine and r.get("error")]
        if notes:
            s["notes"] = notes
        if errors:
            s["errors"] = errors
        out[engine] = s
    return out


# -- the table --------------------------------------------------------------------------------

COLUMNS = (
    ("decode_tok_s", "decode tok/s", "{:.1f}"),
    ("ttft_64_s", "TTFT 64 (s)", "{:.3f}"),
    ("ttft_512_s", "TTFT 512 (s)", "{:.3f}"),
    ("batch_tok_s", "B=8 tok/s", "{:.1f}"),
    ("load_s", "load (s)", "{:.2f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
    ("rss_anon_at_peak_mib", "anon MiB", "{:.0f}"),
    ("rss_file_at_peak_mib", "file MiB", "{:.0f}"),
)


def markdown(results: list[dict]) -> str:
    lines = []
    cpus = {json.dumps(r["cpu"], sort_keys=True) for r in results}
    for c in cpus:
        c = json.loads(c)
        lines.append(f"CPU: {c['model']}, {c['cores']} cores ({' '.join(c['flags']) or '-'})")
    for r in results:
        st = r.get("settings", {})
        lines.append(
            f"threads {st.get('threads')}, median of {st.get('repeat')} rounds, "
            f"{st.get('new_tokens')} new tokens, B={st.get('streams')} streams of "
            f"{st.get('batch_prompt_tokens')}-token prompts; each engine alone in its "
            "own process, rounds interleaved"
        )
        break
    head = ["model", "engine"] + [c[1] for c in COLUMNS]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        for f in r["files"]:
            info = f["info"]
            label = f"{Path(f['path']).name} ({info.get('size_mib', 0):.0f} MiB)"
            summary = f["summary"]
            for engine in ("llamacpp", "ours"):
                if engine not in summary:
                    continue
                s = summary[engine]
                cells = [label, "llama.cpp" if engine == "llamacpp" else "ours"]
                for key, _, fmt in COLUMNS:
                    cells.append(fmt.format(s[key]) if s.get(key) is not None else "-")
                if s.get("others_cpu_share_max") and s["others_cpu_share_max"] > BUSY_OTHERS_FLAG:
                    cells[1] += f" (busy: others {s['others_cpu_share_max']:.0%})"
                lines.append("| " + " | ".join(cells) + " |")
            if "llamacpp" in summary and "ours" in summary:
                cells = [label, "ours / llama.cpp"]
                for key, _, _ in COLUMNS:
                    a, b = summary["ours"].get(key), summary["llamacpp"].get(key)
                    cells.append(f"{a / b:.2f}x" if a is not None and b else "-")
                lines.append("| " + " | ".join(cells) + " |")
    notes = [
        (Path(f["path"]).name, e, n)
        for r in results
        for f in r["files"]
        for e, s in f["summary"].items()
        for n in s.get("notes", []) + s.get("errors", [])
    ]
    for name, engine, note in notes:
        lines.append(f"- {name}, {engine}: {note}")
    return "\n".join(lines)


def merge(results: list[dict]) -> list[dict]:
    """Several JSON results (e.g. llama.cpp's and ours' of the same files, run apart) as one:
    files matched by name and size, their summaries joined."""
    if len(results) < 2:
        return results
    base = json.loads(json.dumps(results[0]))
    index = {(Path(f["path"]).name, f["info"].get("size_mib")): f for f in base["files"]}
    for other in results[1:]:
        for f in other["files"]:
            key = (Path(f["path"]).name, f["info"].get("size_mib"))
            if key in index:
                index[key]["summary"].update(f["summary"])
                index[key]["records"] += f["records"]
            else:
                base["files"].append(f)
                index[key] = f
    return [base]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="GGUF files")
    p.add_argument(
        "--engines", default="llamacpp,ours", help="comma-separated: llamacpp, ours (default both)"
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds (median reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--prompt-tokens",
        default="64,512",
        help="prompt lengths; decode tok/s is read from the first",
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=8, help="B for the batched run (0: none)")
    p.add_argument("--batch-prompt-tokens", type=int, default=64)
    p.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="llama.cpp without its extra CPU buffers (AMX, CPU_REPACK; default: "
        "on, its default, less AMX)",
    )
    p.add_argument(
        "--llamacpp-amx",
        action="store_true",
        help="let llama.cpp use its AMX buffer (it crashes on this CPU with "
        "llama-cpp-python 0.3.36)",
    )
    p.add_argument(
        "--ours-cmd",
        default=DEFAULT_OURS,
        help="our one-stream command ({model} {json} {prompt_tokens} {new_tokens} "
        "{threads} {python}); default: %(default)s",
    )
    p.add_argument(
        "--ours-batch-cmd",
        default=DEFAULT_OURS_BATCH,
        help="our B-stream command ({streams} {batch_prompt} too); default: %(default)s",
    )
    p.add_argument(
        "--ours-ready",
        default=DEFAULT_READY,
        help="regex of the output line that marks our model as loaded",
    )
    p.add_argument("--ours-mode", default="cache", help="the bench JSON's mode to read")
    p.add_argument(
        "--no-prime",
        action="store_true",
        help="no unmeasured run of ours before a file's first round",
    )
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        help="print the table of saved results (several: merged by file)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="S",
        help="before each process, wait up to S seconds for the machine to be idle "
        f"(under {BUSY_OTHERS_FLAG * 100:.0f} percent of its CPU busy over 3 s)",
    )
    p.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        metavar="N",
        help="run a measurement again (up to N times) when other processes took "
        f"over {BUSY_OTHERS_FLAG * 100:.0f} percent of the CPU during it; the least "
        "disturbed run is kept",
    )
    p.add_argument("--keep-output", action="store_true", help="keep every child's output")
    p.add_argument("--timeout", type=float, default=3600, help="per process, seconds")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.prompt_list = [int(x) for x in args.prompt_tokens.split(",")]
    if args.child:
        return child_main(args)
    if args.from_json:
        results = [json.loads(Path(f).read_text()) for f in args.from_json]
        print(markdown(merge(results)))
        return 0
    if not args.files:
        p.error("name at least one GGUF file (or --from-json)")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"llamacpp", "ours"}
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}")
    load = os.getloadavg()[0]
    if load > 0.5:
        print(
            f"warning: load average {load:.2f} before the start -- other work is running; "
            "the figures will show it",
            file=sys.stderr,
        )
    result = {
        "cpu": cpu_description(),
        "load_average_before": round(load, 2),
        "settings": {
            "threads": args.threads,
            "repeat": args.repeat,
            "prompt_tokens": args.prompt_list,
            "new_tokens": args.new_tokens,
            "streams": args.streams,
            "batch_prompt_tokens": args.batch_prompt_tokens,
            "engines": engines,
            "extra_bufts": not args.no_extra_bufts,
            "llamacpp_amx": args.llamacpp_amx and not args.no_extra_bufts,
            "ours_cmd": args.ours_cmd,
            "ours_batch_cmd": args.ours_batch_cmd,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "files": [],
    }
    kinds = ["single"] + (["batch"] if args.streams else [])
    for name in args.files:
        path = Path(name).resolve()
        warm_page_cache(path)
        entry = {"path": str(path), "info": gguf_summary(path), "records": []}
        if "ours" in engines and not args.no_prime:
            print(
                f"{path.name}: ours once, unmeasured (caches, page cache) ...",
                file=sys.stderr,
                flush=True,
            )
            prime = measure("ours", "single", path, args, 0)
            entry["prime"] = {k: prime.get(k) for k in ("rc", "ready_s", "wall_s", "error")}
        for r in range(args.repeat):
            order = engines if r % 2 == 0 else engines[::-1]  # A B, B A, A B ...
            for kind in kinds:
                for engine in order:
                    print(
                        f"{path.name}: round {r + 1}/{args.repeat}, {engine} {kind} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    record, tries = None, 0
                    while tries <= args.retry_busy:  # a run that others disturbed: again
                        idle = wait_idle(args.wait_idle) if args.wait_idle else None
                        attempt = measure(engine, kind, path, args, r + 1)
                        attempt["idle_wait"] = idle
                        tries += 1
                        if record is None or (
                            attempt["others_cpu_share"] < record["others_cpu_share"]
                        ):
                            record = attempt
                        if record["others_cpu_share"] <= BUSY_OTHERS_FLAG:
                            break
                        print(
                            f"  others took {attempt['others_cpu_share']:.0%} of the CPU meanwhile",
                            file=sys.stderr,
                        )
                    record["attempts"] = tries
                    if record.get("error"):
                        print(f"  error: {record['error']}", file=sys.stderr)
                    entry["records"].append(record)
        entry["summary"] = summarize(entry["records"], args.prompt_list)
        result["files"].append(entry)
        if args.json:  # after every file: a long run keeps what it has
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    print(markdown([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
