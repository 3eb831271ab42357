"""What the Chat tab and its Conversations sidebar share: which conversation a browser tab
shows, and how a saved conversation (miniserve/store/store.py) is drawn.

Two values say where a browser is:
- `browser` (kept in the browser's local storage, so it outlives a reload and a restart):
  {"owner": the browser's random id, "open": the conversation it had open}. The store only
  answers for that owner.
- `view` (one per browser tab): {"cid": conversation, "leaf": the last message this tab shows,
  "focus": the message whose versions ‹ › step through}. A turn sent from a tab is added
  under *its* leaf: when another tab has moved on meanwhile, the turn becomes a branch where
  the two views diverged, and nothing is overwritten.

A first visit has no owner id until one of its page's events gives it one (`start`): the
page's load handler normally, but a message sent while the page is still loading reaches the
server first. Every handler that takes `browser` starts with `start`; the id it gives is kept
for the page's session, so whichever event runs first creates it and the others get the same.

A reply may be several rows of the Chatbot (its reasoning folded, its text, a card per tool
call: render.reply_rows); `Conversations.rows` draws a branch and says which message each row
shows, so a click or an edit on a row finds its message.

Every handler that shows a conversation returns `Shown`, the same eight values in the order
of `SHOWN` (the components they go to, named in build_chat_tab). `show_safely` is what an
error path shows: it never raises.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import OrderedDict
from typing import NamedTuple

import gradio as gr

from miniserve.store.store import Message, NotFound, Store, StoreError
from miniserve.ui.common import error, is_error
from miniserve.ui.render import reply_rows, shown_text

SHOWN = ("browser", "view", "chatbot", "conversations", "title", "system", "branches", "status")
BRANCH_MARK = re.compile(r"\s*‹ \d+/\d+ ›\s*$")
LIST_LIMIT = 1000  # the sidebar lists the newest this many; Search finds any
# The owner ids given to first visits, by Gradio session (one page), kept for the newest this
# many: only needed until the page has stored its id, a moment after its first event ends.
FIRST_VISITS = 4096


class Shown(NamedTuple):
    browser: dict
    view: dict
    chatbot: list
    conversations: dict  # a gr.update of the sidebar's list
    title: str
    system: str
    branches: str
    status: str


def new_view(cid: str | None = None, leaf: str | None = None, focus: str | None = None) -> dict:
    return {"cid": cid, "leaf": leaf, "focus": focus}


def owner_of(browser) -> str:
    """The browser's owner id. Raises NotFound for a browser without one (its first visit):
    handlers give it one first (`Conversations.start`)."""
    owner = (browser or {}).get("owner")
    if not isinstance(owner, str) or not re.fullmatch(r"[0-9a-f]{32}", owner):
        raise NotFound("this browser has no history id yet; reload the page")
    return owner


def strip_marks(text: str) -> str:
    """A message as the user wrote it, without the ‹ 1/2 › the view adds."""
    return BRANCH_MARK.sub("", text or "")


def when(seconds: float) -> str:
    """A date for the list: the time today, else the day."""
    t = time.localtime(seconds)
    today = time.localtime()
    return time.strftime("%H:%M" if t[:3] == today[:3] else "%Y-%m-%d", t)


class Conversations:
    """Draws conversations of one store for the handlers of the Chat tab and the sidebar."""

    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()  # handlers of many sessions run on Gradio's threads
        self._first_visits: OrderedDict[str, str] = OrderedDict()  # session -> owner id

    def start(self, browser, request=None) -> dict:
        """The browser's state with an owner id: its own, or on its first visit a new random
        one. `request` (Gradio's) names the page: every event of one page that comes without
        an id gets the same new one, whichever runs first (the load handler, or a message
        sent before it ran), so what the first event saves is the browser's. Without a
        request (a handler called directly), a new one each time."""
        browser = dict(browser or {})
        try:
            owner_of(browser)
            return browser
        except NotFound:
            pass
        session = getattr(request, "session_hash", None)
        with self._lock:
            owner = self._first_visits.get(session) if session else None
            if owner is None:
                owner = uuid.uuid4().hex
                if session:
                    self._first_visits[session] = owner
                    while len(self._first_visits) > FIRST_VISITS:
                        self._first_visits.popitem(last=False)
        return {"owner": owner, "open": None}

    def choices(self, owner: str, query: str = "") -> list[tuple[str, str]]:
        return [
            (f"{c.title or 'New chat'} · {when(c.updated)}", c.id)
            for c in self.store.conversations(owner, query or "", LIST_LIMIT)
        ]

    def listing(self, owner: str, cid: str | None, query: str = "") -> dict:
        choices = self.choices(owner, query)
        return gr.update(choices=choices, value=cid if cid in {c for _, c in choices} else None)

    def path(self, owner: str, view: dict) -> list[Message]:
        return (
            self.store.path(owner, view["cid"], view["leaf"])
            if view.get("cid") and view.get("leaf")
            else []
        )

    def show(self, browser: dict, view: dict, status: str = "", query: str = "") -> Shown:
        """The browser tab showing `view`'s conversation up to its leaf."""
        owner = owner_of(browser)
        cid = view.get("cid")
        if cid is None:
            return Shown(
                {**browser, "open": None},
                new_view(),
                [],
                self.listing(owner, None, query),
                "",
                gr.update(),
                "",
                status,
            )
        conv = self.store.get(owner, cid)
        path = self.path(owner, view)
        branches = self.store.branches(owner, path)
        shown = [row for _, row in self.rows(path, branches)]
        focus = self.focus(path, branches, view.get("focus"))
        view = new_view(cid, view.get("leaf"), focus)
        return Shown(
            {**browser, "open": cid},
            view,
            shown,
            self.listing(owner, cid, query),
            conv.title,
            conv.system,
            self.branch_line(path, branches, focus),
            status,
        )

    def show_safely(self, browser, view, status: str = "", query: str = "") -> Shown:
        """What an error path shows: `show`, or a new chat when the view's conversation is
        gone (deleted in another tab), or, when even that cannot be read, the status alone
        (the rest of the page as it is). Never raises: a handler's error stays a message."""
        try:
            return self.show(browser, view, status, query)
        except StoreError as e:
            status = status if is_error(status) else error(str(e))
        except Exception as e:  # noqa: BLE001 -- the database failing: said, not raised
            status = status if is_error(status) else error(f"{type(e).__name__}: {e}")
        try:
            return self.show(browser, new_view(), status, query)
        except Exception:  # noqa: BLE001 -- as above; the status says the first failure
            keep = gr.update()
            return Shown(keep, keep, keep, keep, keep, keep, keep, status)

    @staticmethod
    def rows(path: list[Message], branches) -> list[tuple[int, dict]]:
        """The Chatbot's rows of a branch, each with the index in `path` of the message it
        shows: a user message is one row; a reply its reasoning (folded), its text (marked
        when stopped and with its ‹ i/n › when it has versions) and a card per tool call."""
        out = []
        for i, (m, b) in enumerate(zip(path, branches)):
            text = m.content
            if m.status == "stopped":
                text += " *(stopped)*"
            if b.count > 1:
                text += f"\n\n‹ {b.index}/{b.count} ›"
            if m.role != "assistant":
                out.append((i, {"role": m.role, "content": shown_text(text)}))
                continue
            stats = m.stats or {}
            rows = reply_rows(
                text,
                m.reasoning,
                m.tool_calls,
                tokens=stats.get("reasoning_tokens"),
                seconds=stats.get("reasoning_s"),
            )
            out += [(i, row) for row in rows]
        return out

    def message_at(self, owner: str, view: dict, row) -> tuple[list[Message], int | None]:
        """The branch `view` shows and the index in it of the message of the Chatbot's row
        `row` (None when there is no such row)."""
        path = self.path(owner, view)
        if not isinstance(row, int) or row < 0:
            return path, None
        rows = self.rows(path, self.store.branches(owner, path))
        return path, rows[row][0] if row < len(rows) else None

    @staticmethod
    def focus(path, branches, wanted: str | None) -> str | None:
        """The message ‹ › act on: the one chosen (clicked) if it has versions, else the last
        message of the branch that has."""
        with_versions = [m.id for m, b in zip(path, branches) if b.count > 1]
        if wanted in with_versions:
            return wanted
        return with_versions[-1] if with_versions else None

    @staticmethod
    def branch_line(path, branches, focus: str | None) -> str:
        if focus is None:
            return ""
        i = next(i for i, m in enumerate(path) if m.id == focus)
        b = branches[i]
        who = "your message" if path[i].role == "user" else "the reply"
        return (
            f"‹ › step through the versions of {who} #{i + 1} (now {b.index} of {b.count}); "
            f"click another message marked ‹ › to choose it"
        )

    def open(
        self, browser, cid: str, status: str = "", query: str = "", focus: str | None = None
    ) -> Shown:
        """Open a conversation at its open leaf."""
        conv = self.store.get(owner_of(browser), cid)
        return self.show(browser, new_view(cid, conv.leaf, focus), status, query)
