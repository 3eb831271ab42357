"""Fuzz the GGUF reader (miniserve/runners/gguf_file.py) with the embedded model's file, mutated.

    .venv/bin/python benchmarks/fuzz_gguf.py [--cases 20000] [--seconds 300] [--workers N]
        [--seed 0] [--timeout 10] [--out DIR] [--load-path [--load-cases 100]]
    .venv/bin/python benchmarks/fuzz_gguf.py --replay SEED [--out DIR]   (write that case's file)

Each case is a seed; from it a seeded mutator rewrites the header region (header, metadata,
tensor table: everything before the tensor data) -- bit flips, byte and integer overwrites with
interesting values (mostly on the fields that are lengths, counts, type ids, dims and offsets,
read from the gguf package's reader of the original), chunks duplicated or removed, one tensor
entry copied over another -- and sometimes cuts the file short or writes a NaN / inf over a
block's scale in the data. The file goes to GGUFFile, then check_scales, every metadata value
(the lazy string arrays decoded one case in four) and every tensor's view and address.

A GGUFFileError whose message is one sentence naming the file is a clean rejection; a file it
accepts must obey the invariants the reader promises (tensors inside the file, past the header,
aligned, not overlapping, sizes that match their shapes); any other exception, a broken
invariant, a worker that dies (a native crash) or a case past --timeout (a hang) is a bug, and
the case's file is saved to --out. Cases run in worker processes, each rewriting its own
scratch file in /dev/shm (only the header when the tensor data has not moved).

--load-path goes on, for files the reader accepts (up to --load-cases), to
miniserve.runners.loader.load_model(path, dtype="stored") and one forward pass of one token, in a
child
process per batch of cases, so a native crash is a dead child, not a dead fuzzer. It first
checks that the unmutated file loads that way, and says so clearly if it does not (the
quantized runner is another engineer's, and may not exist yet).

Exit status: 0 when no bug was found, 1 otherwise, 2 when --load-path cannot run.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import re
import shutil
import struct
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from miniserve.runners.gguf_file import GGUFFile, GGUFFileError, _Strings  # noqa: E402

# Integers worth writing into a length, count, type id, dimension or offset.
INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    10,
    12,
    13,
    14,
    15,
    16,
    24,
    30,
    31,
    32,
    33,
    34,
    35,
    39,
    41,
    42,
    64,
    127,
    128,
    255,
    256,
    576,
    577,
    1024,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x10000,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 48,
    (1 << 62) + 1,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
]
BYTES = [0x00, 0x01, 0x08, 0x09, 0x0C, 0x1E, 0x20, 0x7C, 0x7E, 0x7F, 0x80, 0xFE, 0xFF]
NON_FINITE_F16 = [0x7E00, 0x7C00, 0xFC00, 0x7C01, 0xFFFF]
SCALE_AT = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0]}  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0: d (m)


class Original:
    """The unmutated file and where its fields are, from the gguf package's reader."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        self.size = path.stat().st_size
        reader = gguf.GGUFReader(path)
        self.header_len = reader.data_offset
        with open(path, "rb") as f:
            self.header = f.read(self.header_len)
        self.fields = [(4, 4), (8, 8), (16, 8)]  # version, tensor count, key count
        self.lengths = []  # each string's length in the big arrays
        self.entries = []  # (start, end) of each tensor's table entry
        self.tensors = []  # (data offset, type, bytes) of each tensor
        for field in reader.fields.values():
            if field.name.startswith("GGUF."):
                continue
            self._parts(field, big=len(field.data) > 64)
        for t in reader.tensors:
            at = self._parts(t.field, big=False)
            self.entries.append((at[0], at[-1] + 8))
            self.tensors.append((t.data_offset, int(t.tensor_type), int(t.n_bytes)))
        self.offsets = [struct.unpack_from("<Q", self.header, e - 8)[0] for _, e in self.entries]

    def _parts(self, field, big: bool) -> list[int]:
        at, pos = [], field.offset
        for part in field.parts:
            at.append(pos)
            if part.dtype.kind in "ui" and part.nbytes in (4, 8) and part.size == 1:
                (self.lengths if big and len(at) > 5 else self.fields).append((pos, part.nbytes))
            elif part.dtype.kind in "ui" and part.itemsize == 8 and part.size <= 4:  # dims
                self.fields.extend((pos + 8 * i, 8) for i in range(part.size))
            pos += part.nbytes
        return at


def mutate(original: Original, seed: int) -> tuple[bytes, list[tuple[int, bytes]], int | None]:
    """(header region, pokes into the tensor data at original offsets, cut) for one case."""
    rng = random.Random(seed)
    head = bytearray(original.header)
    pokes, cut = [], None

    def field() -> tuple[int, int]:
        pool = original.lengths if original.lengths and rng.random() < 0.1 else original.fields
        return rng.choice(pool)

    def number(old: int, width: int) -> int:
        choice = rng.random()
        if choice < 0.5:
            value = rng.choice(INTERESTING)
        elif choice < 0.7:
            value = old + rng.choice([-1, 1]) * rng.choice([1, 2, 4, 8, 16, 31, 32, 64, 4096])
        elif choice < 0.8:
            value = old ^ (1 << rng.randrange(8 * width))
        elif choice < 0.9:
            value = rng.choice(
                [
                    original.size,
                    original.size - original.header_len,
                    original.header_len,
                    len(head),
                    old * 2,
                    old + (1 << 32),
                ]
            )
        else:
            value = rng.choice(original.offsets)  # another tensor's offset: overlaps
        return value % (1 << (8 * width))

    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4])):
        op = rng.random()
        if op < 0.35:  # an integer field overwritten
            pos, width = field()
            if pos + width <= len(head):
                old = int.from_bytes(head[pos : pos + width], "little")
                head[pos : pos + width] = number(old, width).to_bytes(width, "little")
        elif op < 0.50:  # a bit flipped
            pos = field()[0] + rng.randrange(8) if rng.random() < 0.6 else rng.randrange(len(head))
            if pos < len(head):
                head[pos] ^= 1 << rng.randrange(8)
        elif op < 0.60:  # a byte overwritten
            head[rng.randrange(len(head))] = rng.choice(BYTES)
        elif op < 0.74:  # a chunk duplicated or removed
            a = rng.randrange(len(head))
            n = rng.choice([1, 2, 4, 8, 12, 16, 32, 64, 200])
            if op < 0.67:
                b = rng.randrange(len(head))
                head[b:b] = head[a : a + n]
            else:
                del head[a : a + n]
            if rng.random() < 0.6:  # the header region keeps its length: the data stays put
                head = head[: original.header_len].ljust(original.header_len, b"\0")
        elif op < 0.80 and len(head) == original.header_len:  # one tensor entry over another
            (a0, a1), (b0, b1) = rng.sample(original.entries, 2)
            head[b0:b1] = original.header[a0:a1]
        elif op < 0.89:  # cut short
            where = rng.random()
            total = len(head) + original.size - original.header_len
            cut = (
                rng.randrange(len(head))
                if where < 0.5
                else total - rng.randrange(1, 200)
                if where < 0.7
                else rng.randrange(total)
            )
        else:  # a non-finite scale or float value
            offset, kind, nbytes = rng.choice(original.tensors)
            if kind in SCALE_AT:
                size = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34}[kind]
                at = offset + rng.randrange(nbytes // size) * size + rng.choice(SCALE_AT[kind])
            else:
                at = offset + rng.randrange(nbytes // 4) * 4 + 2  # f32: the high half
            pokes.append((at, struct.pack("<H", rng.choice(NON_FINITE_F16))))
    return bytes(head), pokes, cut


class Scratch:
    """One worker's files: the mutated header region, then the original tensor data (from a
    copy of the original in the scratch folder: copy_file_range copies in the kernel only
    within one file system). Where the header keeps its length and the file is not cut, one
    file is rewritten in place -- the header and the last case's pokes; otherwise a second file
    is written whole (or only up to the cut)."""

    def __init__(self, original: Original, folder: Path, name: str):
        self.original = original
        self.source = folder / "original.gguf"
        if not self.source.exists():
            shutil.copyfile(original.path, self.source)
        self.inplace, self.whole = folder / f"{name}.gguf", folder / f"{name}-moved.gguf"
        self.ready = False  # the in-place file holds the original data after the header
        self.undo = []

    def write(self, head: bytes, pokes, cut) -> Path:
        o = self.original
        shift = len(head) - o.header_len
        if cut is None and not shift:
            if not self.ready:
                shutil.copyfile(self.source, self.inplace)
                self.ready, self.undo = True, []
            path = self.inplace
            with open(path, "r+b") as f:
                for at, raw in self.undo:
                    f.seek(at)
                    f.write(raw)
                f.seek(0)
                f.write(head)
        else:
            path = self.whole
            total = len(head) + o.size - o.header_len if cut is None else cut
            with open(path, "wb") as f:
                f.write(head[:total])
                if total > len(head):
                    with open(self.source, "rb") as src:
                        _copy(
                            src,
                            f,
                            o.header_len,
                            min(total, len(head) + o.size - o.header_len) - len(head),
                            len(head),
                        )
                f.truncate(total)
        undo = []
        with open(path, "r+b") as f, open(self.source, "rb") as src:
            for at, raw in pokes:
                if at + shift + len(raw) <= (cut if cut is not None else 1 << 62):
                    src.seek(at)
                    undo.append((at + shift, src.read(len(raw))))
                    f.seek(at + shift)
                    f.write(raw)
        if path == self.inplace:
            self.undo = undo
        return path


def _copy(src, dst, offset: int, count: int, to: int) -> None:
    """count bytes of src from offset into dst at `to` (in the kernel where it can)."""
    try:
        done = 0
        while done < count:
            n = os.copy_file_range(
                src.fileno(), dst.fileno(), count - done, offset + done, to + done
            )
            if n <= 0:
                raise OSError("copy_file_range copied nothing")
            done += n
    except (AttributeError, OSError):
        src.seek(offset)
        dst.seek(to)
        left = count
        while left:
            chunk = src.read(min(left, 1 << 22))
            if not chunk:
                break
            dst.write(chunk)
            left -= len(chunk)


def check(path: Path, decode: bool) -> tuple[str, str]:
    """('rejected', message) | ('loaded', '') | ('bug', what) for one file."""
    try:
        with GGUFFile(path) as f:
            f.check_scales()
            broken = invariants(f, decode)
        return ("bug", "invariant: " + broken) if broken else ("loaded", "")
    except GGUFFileError as e:
        message = str(e)
        if not message.startswith(path.name + ": ") or "\n" in message or not message.endswith("."):
            return "bug", f"message format: {message!r}"
        return "rejected", message
    except Exception:  # noqa: BLE001 -- anything but GGUFFileError is what we look for
        return "bug", traceback.format_exc(limit=6).strip()


def invariants(f: GGUFFile, decode: bool) -> str | None:
    """What the reader promises about a file it accepted; the first broken promise, or None."""
    from gguf import GGML_QUANT_SIZES

    for key in f.metadata:
        if decode or not isinstance(f.metadata._values[key], _Strings):  # lazy: decoded 1 in 4
            value = f.metadata[key]
            if not isinstance(value, (int, float, str, list, np.ndarray)):
                return f"metadata {key!r} is a {type(value).__name__}"
    base = (
        f.address(next(iter(f.tensors))) - next(iter(f.tensors.values())).offset if f.tensors else 0
    )
    end = 0
    for t in sorted(f.tensors.values(), key=lambda t: t.offset):
        block, size = GGML_QUANT_SIZES[t.type]
        count = 1
        for n in t.shape:
            count *= n
        if not (
            1 <= len(t.shape) <= 4
            and all(n > 0 for n in t.shape)
            and t.shape[-1] % block == 0
            and t.nbytes == count // block * size
        ):
            return f"{t.name}: shape {t.shape} and {t.nbytes} bytes disagree"
        if t.offset < max(end, f.header_bytes) or t.offset + t.nbytes > f.size:
            return f"{t.name}: bytes {t.offset}..{t.offset + t.nbytes} overlap or leave the file"
        if (t.offset - f.header_bytes) % f.alignment or f.header_bytes % f.alignment:
            return f"{t.name}: offset {t.offset} not aligned"
        view = f.data(t.name)
        if view.nbytes != t.nbytes or f.address(t.name) != base + t.offset:
            return f"{t.name}: view of {view.nbytes} bytes at the wrong address"
        end = t.offset + t.nbytes
    return None


def worker(original: Original, scratch_dir: Path, index: int, conn) -> None:
    scratch = Scratch(original, scratch_dir, f"case-{index}")
    while True:
        seed = conn.recv()
        if seed is None:
            return
        start = time.perf_counter()
        path = scratch.write(*mutate(original, seed))
        outcome, detail = check(path, decode=seed % 4 == 0)
        conn.send((seed, outcome, detail, time.perf_counter() - start))


def category(message: str) -> str:
    """A rejection's kind: its message with the file, names, numbers and quotes taken out."""
    text = message.split(": ", 1)[-1].rsplit(": ", 1)[0]  # not the file, not the advice
    text = re.sub(r"b'(?:[^'\\]|\\.)*'|(?<!\w)'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\([^)]*\)", "(…)", text)
    text = re.sub(r"-?\d[\d,.]*", "N", text)
    return text[:100]


def save(original: Original, seed: int, out: Path, what: str, detail: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{what}-{seed}.gguf"
    with tempfile.TemporaryDirectory(dir=out) as folder:
        shutil.move(Scratch(original, Path(folder), "case").write(*mutate(original, seed)), path)
    (out / f"{what}-{seed}.txt").write_text(f"seed {seed}: {what}\n{detail}\n")
    return path


def fuzz(original: Original, args, scratch_dir: Path) -> tuple[collections.Counter, list, list]:
    """Run the reader-only cases; (outcome counts, bugs, accepted seeds)."""
    ctx = mp.get_context("fork")
    counts, bugs, accepted, kinds = collections.Counter(), [], [], collections.Counter()
    seeds = iter(range(args.seed, args.seed + args.cases))
    deadline = time.monotonic() + args.seconds
    busy: dict = {}  # conn -> (process, seed, started)
    idle: list = []
    procs = {}

    def spawn(i):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(original, scratch_dir, i, child), daemon=True)
        p.start()
        child.close()
        procs[parent] = (p, i)
        idle.append(parent)

    def replace(conn):
        p, i = procs.pop(conn)
        if p.is_alive():
            p.kill()
        p.join()
        spawn(i)

    for i in range(args.workers):
        spawn(i)
    started, last_report = time.monotonic(), time.monotonic()
    exhausted = False
    while busy or not exhausted:
        while idle and not exhausted and time.monotonic() < deadline:
            seed = next(seeds, None)
            if seed is None:
                exhausted = True
                break
            conn = idle.pop()
            conn.send(seed)
            busy[conn] = (seed, time.monotonic())
        if time.monotonic() >= deadline:
            exhausted = True
        if not busy:
            break
        for conn in wait(list(busy), timeout=0.2):
            seed, _ = busy.pop(conn)
            try:
                seed, outcome, detail, _ = conn.recv()
            except (EOFError, OSError):
                p, _ = procs[conn]
                p.join(1)
                outcome, detail = "crash", f"the worker died (exit code {p.exitcode})"
                replace(conn)
            else:
                idle.append(conn)
            counts[outcome] += 1
            if outcome == "rejected":
                kinds[category(detail)] += 1
            elif outcome == "loaded":
                accepted.append(seed)
            else:
                bugs.append((seed, outcome, detail))
        for conn, (seed, since) in list(busy.items()):
            if time.monotonic() - since > args.timeout:
                busy.pop(conn)
                replace(conn)
                counts["hang"] += 1
                bugs.append((seed, "hang", f"no answer in {args.timeout} s"))
        if time.monotonic() - last_report > 15:
            last_report = time.monotonic()
            done = sum(counts.values())
            print(
                f"  {done:,} cases, {done / (last_report - started):.1f}/s: {dict(counts)}",
                flush=True,
            )
    for conn in list(procs):
        try:
            conn.send(None)
        except OSError:
            pass
    for p, _ in procs.values():
        p.join(2)
        if p.is_alive():
            p.kill()
    if kinds:
        print("rejections, by kind:")
        for kind, n in kinds.most_common(25):
            print(f"  {n:6,}  {kind}")
    return counts, bugs, accepted


# ---- --load-path: the loader and one forward pass, in child processes


def load_child(original: Original, scratch_dir: Path, seeds: list, conn) -> None:
    """Load each case's file with dtype="stored" and run one token through it; say 'start'
    before each (so a dead child names its case) and the outcome after. The cache folder is the
    run's own (the native library compiled into it once); each case's tokenizer is dropped."""
    import torch

    from miniserve.runners.loader import ModelLoadError, load_model

    os.environ["MINISERVE_CACHE"] = str(scratch_dir / "cache")
    for seed in seeds:
        path = (
            original.path
            if seed is None
            else Scratch(original, scratch_dir, f"load-{os.getpid()}").write(
                *mutate(original, seed)
            )
        )
        conn.send(("start", seed))
        try:
            loaded = load_model(str(path), dtype="stored", device="cpu", progress=lambda m: None)
            token = loaded.generation_config.bos_token_id or 1
            ids = torch.tensor([[int(token)]])
            with torch.inference_mode():
                if getattr(loaded, "stored", False):
                    from miniserve.engine.engine import make_runner

                    logits = make_runner(loaded).forward(ids)
                else:
                    logits = loaded.model(ids).logits
            finite = bool(torch.isfinite(logits).all())
            result = ("ok", "" if finite else "non-finite logits")
            del loaded, logits
        except (ModelLoadError, GGUFFileError) as e:
            result = ("refused", str(e).splitlines()[0] if str(e) else type(e).__name__)
        except ValueError as e:  # the runner's refusals name the file
            kind = "refused" if str(e).startswith(path.name) else "error"
            result = (kind, f"{type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001
            result = ("error", f"{type(e).__name__}: {e}"[:300])
        shutil.rmtree(scratch_dir / "cache" / "tokenizers", ignore_errors=True)
        conn.send(("done", seed) + result)
    conn.send(("exit", None))


def died_before_first(todo: list, exitcode) -> list:
    """[(seed, "crash", detail)] for the seeds a child left when it died before its first case:
    nothing more will run."""
    return [
        (s, "crash", f"the child died before its first case (exit code {exitcode})") for s in todo
    ]


def run_load_batch(original: Original, scratch_dir: Path, seeds: list, timeout: float):
    """[(seed, outcome, detail)] for the seeds, a child process at a time: a child that dies
    (or takes longer than `timeout` on a case) is recorded against its case and replaced by a
    new child for the rest."""
    ctx = mp.get_context("spawn")  # torch in a forked child of a numpy process: start clean
    results, todo = [], list(seeds)
    while todo:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=load_child, args=(original, scratch_dir, todo, child))
        p.start()
        child.close()
        current, since = None, time.monotonic()
        while True:
            if not parent.poll(1):
                if not p.is_alive() and not parent.poll(0):
                    if current is None:  # before its first case: nothing more will run
                        return results + died_before_first(todo, p.exitcode)
                    results.append((current, "crash", f"the child died (exit code {p.exitcode})"))
                    break
                if current is not None and time.monotonic() - since > timeout:
                    p.kill()
                    results.append((current, "hang", f"no answer in {timeout} s"))
                    break
                continue
            try:
                message = parent.recv()
            except EOFError:
                p.join(5)
                if current is None:
                    return results + died_before_first(todo, p.exitcode)
                results.append((current, "crash", f"the child died (exit code {p.exitcode})"))
                break
            if message[0] == "start":
                current, since = message[1], time.monotonic()
            elif message[0] == "done":
                results.append(message[1:])
                current = None
            else:
                break
        p.join(5)
        finished = {r[0] for r in results}
        todo = [s for s in todo if s not in finished]
    return results


def load_path(original: Original, args, scratch_dir: Path, accepted: list):
    try:
        from miniserve.runners.loader import load_model  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(
            f"--load-path: cannot import miniserve.runners.loader.load_model ({type(e).__name__}: "
            f"{e}); the quantized loading path is not there yet."
        )
        sys.exit(2)
    print("--load-path: the unmutated file first ...", flush=True)
    base = run_load_batch(original, scratch_dir, [None], args.load_timeout)
    if base[0][1] != "ok":
        print(
            f"--load-path: load_model({original.path.name!r}, dtype='stored') and one token "
            f"fail on the unmutated file ({base[0][1]}: {base[0][2]}); the quantized "
            "loading path is not there yet (or is broken): fix that first, or fuzz the "
            "reader alone (without --load-path)."
        )
        sys.exit(2)
    chosen = accepted[: args.load_cases]
    print(
        f"--load-path: {len(chosen)} accepted files, {args.load_batch} to a child ...", flush=True
    )
    results = []
    for i in range(0, len(chosen), args.load_batch):
        results += run_load_batch(
            original, scratch_dir, chosen[i : i + args.load_batch], args.load_timeout
        )
    counts = collections.Counter(r[1] for r in results)
    print(f"--load-path: {dict(counts)}")
    for (outcome, kind), n in collections.Counter(
        (r[1], category(r[2])) for r in results if r[1] != "ok"
    ).most_common(15):
        print(f"  {n:5,} {outcome:8} {kind}")
    return [r for r in results if r[1] in ("crash", "hang", "error")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed")
    parser.add_argument("--timeout", type=float, default=10, help="seconds a case may take")
    parser.add_argument(
        "--out", type=Path, default=Path(tempfile.gettempdir()) / "fuzz_gguf-failures"
    )
    parser.add_argument("--replay", type=int, help="write this seed's file to --out and stop")
    parser.add_argument("--load-path", action="store_true")
    parser.add_argument("--load-cases", type=int, default=100)
    parser.add_argument("--load-batch", type=int, default=8)
    parser.add_argument("--load-timeout", type=float, default=300)
    args = parser.parse_args(argv)

    from miniserve.runners.loader import embedded_gguf

    source = embedded_gguf()
    original = Original(source)
    if args.replay is not None:
        path = save(original, args.replay, args.out, "replay", "")
        print(path, check(path, decode=True))
        return 0
    scratch_dir = Path(
        tempfile.mkdtemp(prefix="fuzz_gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        print(
            f"{source.name}: {original.size:,} bytes, header region {original.header_len:,}, "
            f"{len(original.fields):,} fields and {len(original.lengths):,} string lengths "
            f"to aim at; {args.workers} workers, up to {args.cases:,} cases or "
            f"{args.seconds:g} s",
            flush=True,
        )
        start = time.monotonic()
        counts, bugs, accepted = fuzz(original, args, scratch_dir)
        tried = sum(counts.values())
        print(
            f"tried {tried:,} files in {time.monotonic() - start:.0f} s: "
            f"{counts['rejected']:,} rejected cleanly, {counts['loaded']:,} loaded, "
            f"{counts['crash']:,} crashes, {counts['hang']:,} hangs, "
            f"{counts['bug']:,} other exceptions or broken invariants"
        )
        if args.load_path:
            bugs += load_path(original, args, scratch_dir, accepted)
        for seed, what, detail in bugs[:20]:
            path = save(original, seed, args.out, what, detail)
            print(f"{what}: seed {seed} -> {path}\n  " + detail.replace("\n", "\n  "))
        return 1 if bugs else 0
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
