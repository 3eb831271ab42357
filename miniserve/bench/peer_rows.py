"""llama.cpp as a peer in the benchmarks: its processes (peer.py) on the engine's GGUF as
copies, and what its rows need -- a runner per precision for run_bench, the batched peer for
run_concurrency and its reply as stream timelines."""

from __future__ import annotations

import torch

from miniserve.bench import peer
from miniserve.bench.options import BenchConfig, ConcurrencyConfig, Progress
from miniserve.bench.streams import StreamTimeline
from miniserve.engine.engine import Engine
from miniserve.runners.loader import resolve_source


def peer_runners(engine: Engine, config: BenchConfig, progress: Progress):
    """llama.cpp rows, keyed by mode, with their dtype and weight bytes; and the peer
    processes, for the caller to close."""
    kind, path, _ = resolve_source(engine.loaded.source)
    if not peer.available():
        raise ValueError("--peer needs llama-cpp-python (`make bench-peer` installs it)")
    if kind != "gguf":
        raise ValueError("--peer needs a .gguf model source")
    n_ctx = max(config.prompt_tokens) + config.new_tokens + 16
    runners, dtypes, nbytes, peers = {}, {}, {}, []
    for precision in peer.PRECISIONS:
        progress(0.0, f"preparing llama.cpp {precision}")
        model = peer.LlamaCppPeer(peer.gguf_copy(path, precision), n_ctx, torch.get_num_threads())
        peers.append(model)
        label = (peer.file_type(path) or "file") if precision == "file" else precision
        mode = f"llamacpp_{label}"
        runners[mode] = (lambda m: lambda ids: m.run(ids, config.new_tokens, engine.eos_ids))(model)
        dtypes[mode] = label if label != "file" else "as stored"
        nbytes[mode] = model.weight_bytes()  # the file: weights as stored, read once a token
    return runners, dtypes, nbytes, peers


def peer_streams(reply: dict) -> list[StreamTimeline]:
    """llama.cpp's batch reply (seconds from its start) as stream timelines: every stream
    was submitted at 0, and each token arrives when the step that chose it ends."""
    return [StreamTimeline(0.0, [(t, 1) for t in s["times"]], s["end"]) for s in reply["streams"]]


def concurrency_peer(engine: Engine, config: ConcurrencyConfig, progress: Progress):
    """llama.cpp in its own process on the engine's weights as a GGUF copy (bfloat16, or
    float32 when the engine runs float32 weights); (peer, dtype, weight bytes)."""
    if not peer.available():
        raise ValueError("--peer needs llama-cpp-python (`make bench-peer` installs it)")
    kind, path, _ = resolve_source(engine.loaded.source)
    if kind != "gguf":
        raise ValueError("--peer needs a .gguf model source")
    precision = "float32" if engine.loaded.dtype == torch.float32 else "bfloat16"
    progress(0.0, f"preparing llama.cpp {precision}")
    model = peer.LlamaCppPeer(peer.gguf_copy(path, precision), 0, torch.get_num_threads())
    return model, precision, model.weight_bytes()
