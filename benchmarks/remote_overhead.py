"""What the remote path adds per token: the same greedy chat turn on a local engine and
through `python -m miniserve serve` of the same model in another process.

    python -m benchmarks.remote_overhead [--new-tokens N] [--repeat R] [--model SRC]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

from miniserve.core.config import BUILTIN_PRESETS, GREEDY
from miniserve.engine.engine import start_engine
from miniserve.models.registry import parse_spec
from miniserve.models.remote import RemoteEngine


def remote_overhead(
    local,
    remote,
    new_tokens: int = 64,
    repeat: int = 3,
    prompt: str = "Tell me about the history of science.",
) -> dict:
    """What the remote path adds per token: the same greedy chat turn on a local engine and
    through a server of the same model (`remote`), timed at this client. The replies must be
    identical (the same model and arithmetic on both sides), else ValueError."""
    params = BUILTIN_PRESETS[GREEDY].replace(max_new_tokens=new_tokens)
    messages = [{"role": "user", "content": prompt}]
    runs = {"local": [], "remote": []}
    for _ in range(repeat + 1):  # the first round warms up (and fills the prefix caches);
        for side, engine in (("local", local), ("remote", remote)):  # taking turns, so
            chunks = list(engine.chat(messages, params))  # a busy moment costs both alike
            runs[side].append(("".join(c.text for c in chunks), chunks[-1].stats))
    out = {}
    for side in runs:
        texts = {text for text, _ in runs[side]}
        stats = [s for _, s in runs[side][1:]]
        out[side] = {
            "text": runs[side][0][0],
            "new_tokens": stats[0].new_tokens,
            "ms_per_token": round(
                statistics.median(
                    1000 * (s.total_s - s.ttft_s) / max(s.new_tokens - 1, 1) for s in stats
                ),
                3,
            ),
            "ttft_ms": round(statistics.median(1000 * s.ttft_s for s in stats), 2),
            "same_every_run": len(texts) == 1,
        }
    if (out["local"]["text"], out["local"]["new_tokens"]) != (
        out["remote"]["text"],
        out["remote"]["new_tokens"],
    ):
        raise ValueError(
            "the remote reply differs from the local one: not the same model or "
            f"arithmetic\nlocal:  {out['local']['text']!r}\n"
            f"remote: {out['remote']['text']!r}"
        )
    out["added_ms_per_token"] = round(
        out["remote"]["ms_per_token"] - out["local"]["ms_per_token"], 3
    )
    out["added_ttft_ms"] = round(out["remote"]["ttft_ms"] - out["local"]["ttft_ms"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.remote_overhead [--new-tokens N] [--repeat R] [--model SRC]`:
    starts `python -m miniserve serve` of the model in another process, loads the same model
    here, and prints remote_overhead() -- ms per token locally and through the server."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote_overhead")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--model", default=None, help="a local source (default: the embedded model)"
    )
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "miniserve", "serve", "--port", str(port)]
        + (["--model", args.model] if args.model else []),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        local = start_engine(args.model)
        local.warm_up()
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while True:  # the server loads the model meanwhile
            try:
                remote = RemoteEngine(parse_spec(url))
                break
            except Exception:  # noqa: BLE001 -- not up yet
                if server.poll() is not None or time.monotonic() > deadline:
                    print(f"error: the server did not start at {url}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        try:
            result = remote_overhead(local, remote, args.new_tokens, args.repeat)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for side in ("local", "remote"):
            r = result[side]
            print(
                f"{side:>6}: {r['ms_per_token']:.2f} ms/token, first token {r['ttft_ms']:.1f} ms "
                f"({r['new_tokens']} new tokens, same every run: {r['same_every_run']})"
            )
        print(
            f"the remote path adds {result['added_ms_per_token']:.2f} ms/token and "
            f"{result['added_ttft_ms']:.1f} ms to the first token (identical replies)"
        )
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
