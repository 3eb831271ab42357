"""How fast the saved conversations are with many of them: the store (miniserve/store/store.py) on
its own, and with `--browser` the Chat tab's Conversations sidebar in a real Chromium.

Store figures (no browser): a temporary database with `--conversations` N conversations of one
owner and as many of a second owner (so every query filters by owner). Each conversation is
a made-up chat of `--messages` messages (user and assistant taking turns; users 100-700
characters, replies 300-1500, of a vocabulary of some thousands of words in a Zipf-like
mix), with the settings and stats a reply is saved with; one in five has a regenerated last
reply (a branch). A few words recur across conversations ("python" in ~30%, "garden" and its
relatives "gardening", "gardener" in ~25%), one is rare ("axolotl", in 3). The data is the
same for every run (a fixed seed). Measured, `--repeats` times each (median and p95, ms):

- `open_store`: opening the file (its quick_check, the schema check, the purge of deleted
  conversations), closed between repeats;
- `conversations(owner)`: the full list, limit 1000, as the sidebar asks for it on page load;
- searches, limit 1000: a common word, a rare word, a word prefix ("gard"), two words, and
  a word in nearly every message ("the");
- `path()` of a conversation with a branch (what opening it reads);
- `export_all` of the owner's N conversations (the dict; the JSON's size is reported too);
- `import_` of those N as the app gets them (bytes of JSON, several files when one would
  exceed config.MAX_IMPORT_BYTES), each repeat into a new empty database;
- the database's size on disk (closed, so the WAL is folded in) and as the app's
  `describe()` line shows it while open (the WAL file counted as well).

With `--browser`: the app (`app.py --history-db <new temporary file>`, on a free port) in
headless Chromium (/usr/bin/chromium or $MINISERVE_CHROMIUM). The N conversations are
imported through the sidebar's Import JSON button (the same files as above), then:

- `reload`: `page.reload()` until the sidebar lists all of them (`min(N, the sidebar's
  LIST_LIMIT)` radio inputs in #conversations), `--browser-repeats` times;
- `goto`: the same from a new tab's `page.goto` (same browser profile, so the same owner);
- `search`: filling Search with a word until the list shows exactly the matches (the count
  the store gives, and "K conversations match"), then clearing it until all are listed again;
  each time with Gradio's run history emptied first;
- `run_history_full`: the searches, reload and goto again once Gradio's run history is full.
  Gradio (6.x) keeps every event's inputs and outputs in the browser's localStorage (the
  "runs" page) unless the app turns it off, the sidebar's whole list included, and rewrites
  it on every event; the script searches until it stops growing (the browser's quota, or
  Gradio's 100 runs) and says how large it is.

Browser times are taken inside the page: a MutationObserver notes when the number of entries
changes, and the next animation frame after it (what is reported: the list is drawn then).
`expect(...).to_have_count` is what the script waits with; its own return comes later by up
to its polling interval (100-500 ms) and is kept in the JSON as `wall_ms`. The same timings
for a page whose owner has no conversations (`empty` rows: until the load event's second step
has filled #history-info) say what a page load costs without the list.

    python -m benchmarks.history_bench [--conversations 1000] [--messages 6] [--repeats 20]
                                      [--browser] [--browser-repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from miniserve.bench.streams import percentile
from miniserve.core.config import MAX_IMPORT_BYTES
from miniserve.store.formats import EXPORT_ALL_FORMAT, EXPORT_FORMAT, EXPORT_VERSION
from miniserve.store.store import open_store, title_from

ROOT = Path(__file__).resolve().parent.parent
OWNER, OTHER = "a" * 32, "b" * 32  # owner ids are 32 hex digits
LIST_LIMIT = 1000  # what the store figures ask for (the sidebar's limit)
SEARCHES = {  # label: query
    "common word": "python",
    "rare word": "axolotl",
    "word prefix": "gard",
    "two words": "python garden",
    "word in every message": "the",
}
BROWSER_SEARCHES = ("common word", "rare word", "word prefix", "two words")
CHROMIUM = os.environ.get("MINISERVE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# -- made-up conversations ------------------------------------------------------------------
COMMON = """the of and to a in is it you that for on with as this be are can or your by if
not at from an but will one all use which more when there so also some what about how into
then than other these them only its like just first would could should each time way make
need may get new two most value file data step example code function number list string
line change run first over work result output input case default error test check order
set return call model point start end part user text name type size page question answer
simple better faster because while after before without between again still very well much
here where why does do did has have had were was been""".split()
SYLLABLES = (
    "ka ri to me lo sa vi ne du po ta chi ren mor lin bel dar fen gos hul "
    "jas kel mun nor pel quin ros sel tur val wen yor zan bri cla dro fli"
).split()
TOPICS = [
    "recipe",
    "budget",
    "travel",
    "physics",
    "poetry",
    "history",
    "server",
    "camera",
    "guitar",
    "running",
    "sleep",
    "chess",
    "music",
    "painting",
    "spreadsheet",
    "kubernetes",
    "sourdough",
    "bicycle",
    "telescope",
    "marathon",
    "insurance",
    "vocabulary",
    "algebra",
    "weather",
    "castle",
    "volcano",
    "startup",
    "interview",
]
GARDEN = ["garden", "gardening", "gardener"]


def _vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    words = set()
    while len(words) < size:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))
        if not w.startswith(("gard", "pyth", "axol", "the")):
            words.add(w)
    return sorted(words)


class ChatMaker:
    """Conversations as the app exports them (store.EXPORT_FORMAT), the same for a seed."""

    def __init__(self, seed: int = 1):
        self.rng = random.Random(seed)
        rare = _vocabulary(random.Random(seed + 1000))
        self.words = COMMON + rare
        # Zipf-like: the common words most of the time, the rest with a long tail
        self.weights = [40.0 / (i + 1) ** 0.6 for i in range(len(COMMON))] + [
            2.0 / (i + 1) ** 0.9 for i in range(len(rare))
        ]
        self.cum = []
        total = 0.0
        for w in self.weights:
            total += w
            self.cum.append(total)

    def text(self, chars: int, topics: list[str]) -> str:
        rng = self.rng
        out, size = [], 0
        while size < chars:
            n = rng.randint(6, 18)
            words = rng.choices(self.words, cum_weights=self.cum, k=n)
            for _ in range(rng.randint(0, 2)):
                words[rng.randrange(n)] = rng.choice(topics)
            sentence = " ".join(words)
            sentence = sentence[0].upper() + sentence[1:] + rng.choice(".....?!:")
            if rng.random() < 0.08:
                sentence = "\n\n- " + sentence
            elif rng.random() < 0.04:
                sentence = f"\n\n```\nx = {rng.choice(self.words)}({rng.randint(1, 99)})\n```\n"
            out.append(sentence)
            size += len(sentence) + 1
        return " ".join(out)[:chars].rstrip()

    def conversation(self, i: int, messages: int, now: float, rare: bool) -> dict:
        rng = self.rng
        topics = rng.sample(TOPICS, rng.randint(1, 3))
        if rng.random() < 0.30:
            topics.append("python")
        if rng.random() < 0.25:
            topics.append(rng.choice(GARDEN))
        if rare:
            topics.append("axolotl")
        created = now - rng.uniform(0, 180 * 86400)
        t = created
        out: list[dict] = []
        settings = {
            "preset": "balanced",
            "temperature": 0.7,
            "top_k": 50,
            "top_p": 0.9,
            "min_p": 0.0,
            "repetition_penalty": 1.1,
            "max_new_tokens": 512,
            "system": "",
            "model": "SmolLM2-135M-Instruct",
        }

        def add(parent, role):
            nonlocal t
            t += rng.uniform(5, 120)
            chars = rng.randint(100, 700) if role == "user" else rng.randint(300, 1500)
            m = {
                "id": len(out),
                "parent": parent,
                "role": role,
                "content": self.text(chars, topics),
                "created": t,
                "status": "complete",
                "settings": {},
                "stats": {},
            }
            if role == "assistant":
                tokens = chars // 4
                m["settings"] = {**settings, "seed": rng.randrange(2**31)}
                m["stats"] = {
                    "prompt_tokens": rng.randint(20, 2000),
                    "reused_tokens": 0,
                    "new_tokens": tokens,
                    "ttft_s": rng.uniform(0.05, 0.4),
                    "total_s": tokens / 80,
                    "finish_reason": "eos",
                }
            out.append(m)
            return len(out) - 1

        last = None
        for k in range(messages):
            last = add(last, "user" if k % 2 == 0 else "assistant")
        branched = messages >= 2 and out[-1]["role"] == "assistant" and rng.random() < 0.2
        if branched:  # Regenerate: a second reply to the last user message, now the open one
            add(out[-1]["parent"], "assistant")
        return {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "title": title_from(out[0]["content"]) if out else "",
            "system": "",
            "created": created,
            "updated": t,
            "current": len(out) - 1 if out else None,
            "messages": out,
        }

    def export_all(self, n: int, messages: int) -> dict:
        now = time.time()
        rare = set(self.rng.sample(range(n), min(3, n)))
        return {
            "format": EXPORT_ALL_FORMAT,
            "version": EXPORT_VERSION,
            "conversations": [self.conversation(i, messages, now, i in rare) for i in range(n)],
        }


def import_files(export: dict, limit: int = MAX_IMPORT_BYTES) -> list[bytes]:
    """An export of all as JSON files the app takes: one when it fits under `limit`, else
    as few as fit, each a whole EXPORT_ALL_FORMAT object."""

    def encode(convs):
        return json.dumps({**export, "conversations": convs}, ensure_ascii=False).encode()

    whole = encode(export["conversations"])
    if len(whole) <= limit:
        return [whole]
    files, batch, size = [], [], len(encode([]))
    for c in export["conversations"]:
        one = len(json.dumps(c, ensure_ascii=False).encode()) + 2
        if batch and size + one > limit:
            files.append(encode(batch))
            batch, size = [], len(encode([]))
        batch.append(c)
        size += one
    files.append(encode(batch))
    assert all(len(f) <= limit for f in files)
    return files


# -- timing ---------------------------------------------------------------------------------
def figures(ms: list[float], **extra) -> dict:
    return {
        "median_ms": statistics.median(ms),
        "p95_ms": percentile(ms, 95),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "repeats": len(ms),
        **extra,
    }


def timed(fn, repeats: int, setup=None, teardown=None) -> tuple[list[float], object]:
    out, result = [], None
    for _ in range(repeats):
        arg = setup() if setup else None
        t = time.perf_counter()
        result = fn(arg) if setup else fn()
        out.append((time.perf_counter() - t) * 1000)
        if teardown:
            teardown(arg, result)
    return out, result


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- the store ------------------------------------------------------------------------------
def bench_store(n: int, messages: int, repeats: int, work: Path) -> tuple[dict, dict, list]:
    """The store figures, the data made for them (owner OWNER's export) and its import
    files."""
    maker = ChatMaker(seed=1)
    mine = maker.export_all(n, messages)
    others = ChatMaker(seed=2).export_all(n, messages)
    files = import_files(mine)
    db = work / "history.sqlite3"
    store = open_store(db)
    t = time.perf_counter()
    for data in (mine, others):
        store.import_(OWNER if data is mine else OTHER, data)
    build_s = time.perf_counter() - t
    describe_mb = store.size_bytes() / 1e6
    store.close()
    msgs = [m for c in mine["conversations"] for m in c["messages"]]
    data = {
        "conversations_per_owner": n,
        "owners": 2,
        "messages_per_owner": len(msgs),
        "branched_conversations": sum(len(c["messages"]) > messages for c in mine["conversations"]),
        "message_chars_mean": statistics.mean(len(m["content"]) for m in msgs),
        "message_chars_min": min(len(m["content"]) for m in msgs),
        "message_chars_max": max(len(m["content"]) for m in msgs),
        "export_json_bytes": len(json.dumps(mine, ensure_ascii=False).encode()),
        "import_files": len(files),
        "import_file_bytes": [len(f) for f in files],
        "max_import_bytes": MAX_IMPORT_BYTES,
        "build_s": build_s,
    }
    out: dict = {}

    def close(_, s):
        s.close()

    ms, _ = timed(lambda: open_store(db), repeats, teardown=close)
    out["open_store"] = figures(ms)

    store = open_store(db)
    try:
        ms, rows = timed(lambda: store.conversations(OWNER, limit=LIST_LIMIT), repeats)
        out["conversations(owner)"] = figures(ms, matches=len(rows))
        for label, query in SEARCHES.items():
            ms, rows = timed(lambda: store.conversations(OWNER, query, limit=LIST_LIMIT), repeats)  # noqa: B023
            out[f"search: {label}"] = figures(ms, query=query, matches=len(rows))
        branched = next(c for c in store.conversations(OWNER, limit=-1) if c.messages > messages)
        ms, path = timed(lambda: store.path(OWNER, branched.id), repeats)
        out["path()"] = figures(ms, messages=len(path))
        ms, exported = timed(lambda: store.export_all(OWNER), repeats)
        out["export_all"] = figures(
            ms,
            conversations=len(exported["conversations"]),
            json_bytes=len(json.dumps(exported, ensure_ascii=False).encode()),
        )
    finally:
        store.close()
    db_mb = db.stat().st_size / 1e6  # closed: the WAL is checkpointed into the file

    fresh = iter(range(10**6))

    def new_store():
        s = open_store(work / f"import-{next(fresh)}.sqlite3")
        return s

    def drop(s, _):
        s.close()
        for suffix in ("", "-wal", "-shm"):
            Path(s.file + suffix).unlink(missing_ok=True)

    ms, ids = timed(
        lambda s: [i for f in files for i in s.import_(OWNER, f)],
        repeats,
        setup=new_store,
        teardown=drop,
    )
    out["import_"] = figures(ms, conversations=len(ids), files=len(files))
    out["database"] = {"mb": db_mb, "describe_mb": describe_mb}
    return out, data, files


# -- the browser ----------------------------------------------------------------------------
class App:
    """app.py on a free local port with its own history file (as tests/servers.py)."""

    def __init__(self, history_db: Path, log: Path, timeout: float = 300):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "app.py", "--history-db", str(history_db), "--port", str(self.port)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        while time.perf_counter() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(self.url, timeout=2)
                self.start_s = time.perf_counter() - started
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"app.py did not answer within {timeout} s; see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# Runs in every page before its own scripts: notes (browser clock, ms since 1970) when the
# number of the sidebar's entries changes and the next animation frame after it, when
# #history-info is first filled (the page-load event's last step), and the last input event
# (a keystroke, or Playwright's fill) anywhere in the page.
OBSERVER = """
(() => {
  const now = () => performance.timeOrigin + performance.now();
  window.__bench = {entries: [], info: null, input: null};
  document.addEventListener('input', () => { window.__bench.input = now(); }, true);
  let last = -1;
  new MutationObserver(() => {
    const n = document.querySelectorAll('#conversations input[type=radio]').length;
    if (n !== last) {
      last = n;
      const e = {n: n, t: now(), frame: null};
      window.__bench.entries.push(e);
      requestAnimationFrame(() => { e.frame = now(); });
    }
    if (window.__bench.info === null) {
      const info = document.querySelector('#history-info');
      if (info && info.textContent.includes('history:')) window.__bench.info = now();
    }
  }).observe(document, {childList: true, subtree: true, characterData: true});
})();
"""


def _clock_offset_ms(page) -> float:
    """The browser's clock minus ours, in ms (the middle of a round trip)."""
    best = None
    for _ in range(5):
        before = time.time() * 1000
        theirs = page.evaluate("performance.timeOrigin + performance.now()")
        after = time.time() * 1000
        if best is None or after - before < best[0]:
            best = (after - before, theirs - (before + after) / 2)
    return best[1]


def _shown_ms(page, start_ms: float, count: int) -> tuple[float | None, float | None]:
    """(ms from `start_ms` (our clock) until the list first had `count` entries, and until
    the frame after it), from the page's notes."""
    offset = _clock_offset_ms(page)
    page.wait_for_function("() => window.__bench.entries.every(e => e.frame !== null)")
    for e in page.evaluate("window.__bench.entries"):
        if e["n"] == count and e["t"] - offset >= start_ms:
            return e["t"] - offset - start_ms, e["frame"] - offset - start_ms
    return None, None


def _since_input_ms(page, count: int) -> float:
    """ms from the page's last input event until the frame after the list first had `count`
    entries since then (all in the browser's clock)."""
    page.wait_for_function("() => window.__bench.entries.every(e => e.frame !== null)")
    b = page.evaluate("window.__bench")
    return next(
        e["frame"] - b["input"] for e in b["entries"] if e["n"] == count and e["t"] >= b["input"]
    )


def _info_ms(page, start_ms: float) -> float | None:
    page.wait_for_function("() => window.__bench.info !== null", timeout=120_000)
    offset = _clock_offset_ms(page)
    return page.evaluate("window.__bench.info") - offset - start_ms


RUN_HISTORY = "k => k.startsWith('gradio:run-history')"


def run_history_chars(page) -> int:
    """Characters in Gradio's run history (localStorage) for this page's origin."""
    return page.evaluate(
        f"Object.keys(localStorage).filter({RUN_HISTORY})"
        ".reduce((n, k) => n + localStorage.getItem(k).length, 0)"
    )


def clear_run_history(page) -> None:
    page.evaluate(
        f"Object.keys(localStorage).filter({RUN_HISTORY}).forEach(k => localStorage.removeItem(k))"
    )


def page_loads(context, page, url: str, kind: str, listed: int, repeats: int, timeout: int) -> dict:
    """`kind` "reload": page.reload(); "goto": a new tab's page.goto; until `listed` entries
    are drawn, `repeats` times."""
    from playwright.sync_api import expect

    shown, frame, wall, info, history = [], [], [], [], []
    for _ in range(repeats):
        tab = page if kind == "reload" else context.new_page()
        start = time.time() * 1000
        if kind == "reload":
            tab.reload()
        else:
            tab.goto(url)
        expect(tab.locator("#conversations input[type=radio]")).to_have_count(
            listed, timeout=timeout
        )
        wall.append(time.time() * 1000 - start)
        s, f = _shown_ms(tab, start, listed)
        shown.append(s)
        frame.append(f)
        info.append(_info_ms(tab, start))
        history.append(run_history_chars(tab))
        if kind == "goto":
            tab.close()
    return {
        **figures(frame),
        "list_ms": shown,
        "frame_ms": frame,
        "wall_ms": wall,
        "info_ms": info,
        "run_history_chars": history,
    }


def searching(
    page, box, label: str, matches: int, listed: int, repeats: int, timeout: int, fresh: bool
) -> dict:
    """Fill Search with SEARCHES[label] until the list shows its `matches`, then empty it
    until all `listed` are back; `fresh`: Gradio's run history emptied before each."""
    from playwright.sync_api import expect

    radios = page.locator("#conversations input[type=radio]")
    found = page.locator("#search-status")
    query = SEARCHES[label]
    want = min(matches, listed)  # the sidebar lists at most its LIST_LIMIT
    shown, cleared, history = [], [], []
    for _ in range(repeats):
        if fresh:
            clear_run_history(page)
        history.append(run_history_chars(page))
        box.fill(query)
        expect(radios).to_have_count(want, timeout=timeout)
        expect(found).to_contain_text(f"{matches} conversation", timeout=timeout)
        shown.append(_since_input_ms(page, want))
        box.fill("")
        expect(radios).to_have_count(listed, timeout=timeout)
        cleared.append(_since_input_ms(page, listed))
    return {
        **figures(shown),
        "query": query,
        "matches": matches,
        "shown_ms": shown,
        "cleared": figures(cleared),
        "run_history_chars_before": history,
    }


def bench_browser(
    n: int, files: list[bytes], searches: dict[str, int], repeats: int, work: Path
) -> dict:
    from playwright.sync_api import expect, sync_playwright

    from miniserve.ui.conversation import LIST_LIMIT as sidebar_limit

    if not shutil.which(CHROMIUM):
        raise SystemExit(f"Chromium not found at {CHROMIUM} (`make chromium` installs it)")
    listed = min(n, sidebar_limit)
    paths = []
    for i, data in enumerate(files):
        p = work / f"import-{i}.json"
        p.write_bytes(data)
        paths.append(p)
    out: dict = {"sidebar_limit": sidebar_limit, "listed": listed, "import_files": len(files)}
    app = App(work / "app-history.sqlite3", work / "app.log")
    out["app_start_s"] = app.start_s
    timeout = 180_000
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            out["chromium"] = browser.version
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.add_init_script(OBSERVER)
            page = context.new_page()
            page.goto(app.url)
            expect(page.locator("#history-info")).to_contain_text("history:", timeout=timeout)
            radios = page.locator("#conversations input[type=radio]")
            status = page.locator("#status")

            # the page with nothing saved yet: what a load costs without the list
            empty = {"reload": [], "goto": []}
            for _ in range(repeats):
                start = time.time() * 1000
                page.reload()
                empty["reload"].append(_info_ms(page, start))
            for _ in range(repeats):
                tab = context.new_page()
                start = time.time() * 1000
                tab.goto(app.url)
                empty["goto"].append(_info_ms(tab, start))
                tab.close()
            out["empty"] = {k: figures(v) for k, v in empty.items()}

            # import through the button
            page.get_by_text("This conversation").click()
            imported = 0
            t = time.perf_counter()
            for path, data in zip(paths, files):
                k = len(json.loads(data)["conversations"])
                imported += k
                page.locator("input[type=file]").set_input_files(str(path))
                expect(radios).to_have_count(min(imported, sidebar_limit), timeout=timeout)
                expect(status).to_contain_text(f"imported {k} conversation", timeout=timeout)
            out["import_ms"] = (time.perf_counter() - t) * 1000

            # until the sidebar lists them all: after a reload, and in a new tab
            clear_run_history(page)
            for kind in ("reload", "goto"):
                out[kind] = page_loads(context, page, app.url, kind, listed, repeats, timeout)

            # Search: fill in a word until the list shows the matches, then clear it; each
            # time with Gradio's run history emptied first
            # (resolved once: finding a label among 1000 labelled radios is Playwright's own
            # work, ~100 ms, not the app's)
            box = page.get_by_label("Search").element_handle()
            out["search"] = {}
            for label in BROWSER_SEARCHES:
                out["search"][label] = searching(
                    page, box, label, searches[label], listed, repeats, timeout, fresh=True
                )

            # the same once the run history is as full as the browser lets it be (each event
            # adds its inputs and outputs; the oldest go when localStorage is full)
            query, want = SEARCHES["common word"], searches["common word"]
            sizes = [run_history_chars(page)]
            while len(sizes) < 200 and not (len(sizes) > 3 and sizes[-1] <= sizes[-3]):
                box.fill(query)
                expect(radios).to_have_count(want, timeout=timeout)
                box.fill("")
                expect(radios).to_have_count(listed, timeout=timeout)
                sizes.append(run_history_chars(page))
            full = {
                "filled_with_searches": 2 * (len(sizes) - 1),
                "run_history_chars": sizes[-1],
                "search": {},
            }
            for label in BROWSER_SEARCHES:
                full["search"][label] = searching(
                    page, box, label, searches[label], listed, repeats, timeout, fresh=False
                )
            for kind in ("reload", "goto"):
                full[kind] = page_loads(context, page, app.url, kind, listed, repeats, timeout)
            full["run_history_chars_after"] = run_history_chars(page)
            out["run_history_full"] = full
            browser.close()
    finally:
        app.stop()
    return out


# -- the report -----------------------------------------------------------------------------
def _ms_row(label: str, count: str, f: dict) -> tuple[str, str, str, str]:
    """A browser figure's row: its median and its max, whole milliseconds."""
    return (label, count, f"{f['median_ms']:.0f}", f"{f['max_ms']:.0f} (max)")


def table(result: dict) -> str:
    rows = [("operation", "matches", "median ms", "p95 ms")]
    for name, f in result["store"].items():
        if name == "database":
            continue
        what = f.get("matches", f.get("messages", f.get("conversations", "")))
        label = name + (f' "{f["query"]}"' if "query" in f else "")
        rows.append((label, str(what), f"{f['median_ms']:.2f}", f"{f['p95_ms']:.2f}"))
    db = result["store"]["database"]
    rows.append(
        (
            "database size (MB, closed / open with WAL)",
            "",
            f"{db['mb']:.1f}",
            f"{db['describe_mb']:.1f}",
        )
    )
    b = result.get("browser")
    if b:
        rows.append(("-- browser (in-page, next frame) --", "", "", ""))
        rows.append(
            (
                f"import via the button ({b['import_files']} file(s))",
                str(b["listed"]),
                f"{b['import_ms']:.0f}",
                "",
            )
        )
        for kind in ("reload", "goto"):
            f = b[kind]
            rows.append(_ms_row(f"{kind}: until {b['listed']} listed", str(b["listed"]), f))
            rows.append(
                (
                    f"{kind}: until the page load is done (#history-info)",
                    str(b["listed"]),
                    f"{statistics.median(f['info_ms']):.0f}",
                    f"{max(f['info_ms']):.0f} (max)",
                )
            )
            e = b["empty"][kind]
            rows.append(_ms_row(f"{kind}: the same, no conversations saved", "0", e))
        full = b["run_history_full"]
        for label, f in b["search"].items():
            g = full["search"][label]
            rows.append(_ms_row(f'search box: {label} "{f["query"]}"', str(f["matches"]), f))
            rows.append(_ms_row("  the same, run history full", str(f["matches"]), g))
            rows.append(
                _ms_row("  cleared again, until all listed", str(b["listed"]), f["cleared"])
            )
            rows.append(_ms_row("  the same, run history full", str(b["listed"]), g["cleared"]))
        for kind in ("reload", "goto"):
            g = full[kind]
            rows.append(
                _ms_row(
                    f"{kind}: until {b['listed']} listed, run history full", str(b["listed"]), g
                )
            )
        rows.append(
            (
                f"(run history full: {full['run_history_chars'] / 1e6:.1f} M characters "
                f"in localStorage after {full['filled_with_searches']} searches)",
                "",
                "",
                "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
        for r in rows
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.history_bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--conversations", type=int, default=1000, help="per owner (default 1000)")
    p.add_argument(
        "--messages",
        type=int,
        default=6,
        help="messages on a conversation's main branch (default 6)",
    )
    p.add_argument("--repeats", type=int, default=20, help="of each store figure")
    p.add_argument("--browser", action="store_true", help="also time the sidebar in Chromium")
    p.add_argument("--browser-repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="write the results here")
    args = p.parse_args(argv)
    if args.conversations < 1 or args.messages < 1 or args.repeats < 1 or args.browser_repeats < 1:
        p.error("--conversations, --messages and the repeats must be at least 1")
    from miniserve.core.platform import _cpuinfo, cpu_features, cpu_model

    info = _cpuinfo()
    cpu = cpu_model()
    if info.get("cpu family"):  # a virtual machine's "AMD EPYC" says little on its own
        cpu += f" (family {info['cpu family']} model {info.get('model', '?')})"
    result = {
        "cpu": cpu,
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "conversations": args.conversations,
        "messages": args.messages,
        "repeats": args.repeats,
        "load_before": load(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"CPU: {result['cpu']} ({result['cores']} cores); load {result['load_before']}", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="miniserve-history-bench-") as tmp:
        work = Path(tmp)
        store_figures, data, files = bench_store(
            args.conversations, args.messages, args.repeats, work / "store"
        )
        result["data"], result["store"] = data, store_figures
        if args.browser:
            searches = {
                label: store_figures[f"search: {label}"]["matches"] for label in BROWSER_SEARCHES
            }
            (work / "browser").mkdir()
            result["browser"] = bench_browser(
                args.conversations, files, searches, args.browser_repeats, work / "browser"
            )
            result["browser_repeats"] = args.browser_repeats
    result["load_after"] = load()
    print(
        f"{args.conversations} conversations per owner x 2 owners, "
        f"{data['messages_per_owner']} messages per owner "
        f"({data['branched_conversations']} conversations with a regenerated reply), "
        f"export {data['export_json_bytes'] / 1e6:.1f} MB in {data['import_files']} file(s)"
    )
    print(table(result))
    print(f"load before {result['load_before']}, after {result['load_after']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
