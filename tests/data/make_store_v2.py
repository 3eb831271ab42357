"""Writes store_v2.sqlite3 and store_v2.json beside this file: a history file as the store at
schema version 2 wrote it, and what that store read back from it (tests/test_store_reasoning.py
opens the file with today's store and compares).

Run against the package as it was at version 2 (the commit before SCHEMA_VERSION 3), e.g.

    git worktree add --detach /tmp/store-v2 <that commit>
    PYTHONPATH=/tmp/store-v2 .venv/bin/python tests/data/make_store_v2.py
    git worktree remove /tmp/store-v2
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import miniserve.store.store as store_module
from miniserve.store.store import Store

assert store_module.SCHEMA_VERSION == 2, f"{store_module.__file__} is not the version 2 store"

HERE = Path(__file__).resolve().parent
A, B = "alice", "bob"
SETTINGS = {"preset": "balanced", "temperature": 0.7, "top_p": 0.95, "seed": 1234}
STATS = {"tokens": 42, "tokens_per_s": 17.25, "ttft_s": 0.031, "finish_reason": "stop"}
QUERIES = ["narwhal", "tusk", "walrus", "whisk", "renamed", "seals", "日本語", "spiral", "nothing"]


def build(s: Store) -> dict:
    t = 1_700_000_000.0
    # alice: a conversation with a system prompt, a regenerated reply (stopped), an edited
    # question, settings and stats; the open branch is not the newest one
    c1 = s.create(A, system="You are terse. Ünïcödé ✓")
    u1 = s.add(A, c1, None, "user", "Tell me about the narwhal 🦄", created=t)
    a1 = s.add(
        A,
        c1,
        u1.id,
        "assistant",
        "It has a spiral tusk.",
        settings=SETTINGS,
        stats=STATS,
        created=t + 1,
    )
    s.add(
        A,
        c1,
        u1.id,
        "assistant",
        "The narwhal is a wh",
        status="stopped",
        settings={**SETTINGS, "temperature": 1.3},
        stats={"tokens": 5},
        created=t + 2,
    )
    u2 = s.add(A, c1, a1.id, "user", "How long is the tusk?", created=t + 3)
    a2 = s.add(
        A,
        c1,
        u2.id,
        "assistant",
        "Up to three metres.\n\n- long\n- spiral",
        settings=SETTINGS,
        stats=STATS,
        created=t + 4,
    )
    u1b = s.add(A, c1, None, "user", "Tell me about the beluga", created=t + 5)
    s.add(A, c1, u1b.id, "assistant", "A white whale.", settings=SETTINGS, created=t + 6)
    s.set_leaf(A, c1, a2.id)
    # renamed, text with tabs and other scripts
    c2 = s.create(A)
    v1 = s.add(A, c2, None, "user", "walrus facts\tplease — 日本語 too", created=t + 10)
    s.add(A, c2, v1.id, "assistant", "Walruses have whiskers.", created=t + 11)
    s.rename(A, c2, "Renamed: walrus notes")
    # titled, no messages
    s.create(A, title="Empty one")
    # deleted (a version 2 store keeps it until it reopens)
    gone = s.create(A)
    s.add(A, gone, None, "user", "narwhal to forget", created=t + 20)
    s.delete(A, gone)
    # bob's
    c3 = s.create(B)
    w1 = s.add(B, c3, None, "user", "Where do seals sleep? narwhal?", created=t + 30)
    s.add(B, c3, w1.id, "assistant", "On ice and in the water.", created=t + 31)
    secret = s.secret()

    seen: dict = {"secret": secret, "deleted": gone, "owners": {}}
    for owner in (A, B):
        conversations = []
        for c in s.conversations(owner):
            path = s.path(owner, c.id)
            conversations.append(
                {
                    "summary": asdict(c),
                    "path": [asdict(m) for m in path],
                    "branches": [asdict(b) for b in s.branches(owner, path)],
                    "markdown": s.export_markdown(owner, c.id),
                    "openai": s.export_openai(owner, c.id),
                }
            )
        seen["owners"][owner] = {
            "conversations": conversations,
            "export_all": s.export_all(owner),
            "search": {q: [c.id for c in s.conversations(owner, q)] for q in QUERIES},
        }
    return seen


def main(out: Path = HERE) -> None:
    db = out / "store_v2.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    s = Store(db)
    seen = build(s)
    s.close()
    assert not Path(f"{db}-wal").exists()
    (out / "store_v2.json").write_text(
        json.dumps(seen, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"wrote {db} ({db.stat().st_size} bytes) with {store_module.__file__}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
