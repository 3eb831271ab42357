"""The Conversations sidebar of the Chat tab: New chat, the saved conversations (newest first),
Search, Rename, Delete (with Undo), Export (JSON, Markdown, OpenAI messages) and Import.
`SidebarHandlers` holds what its controls call; each returns `Shown` (conversation.py), plus
a file for the exports. Each takes the browser's owner id from `Conversations.start` (so a
first visit's event that comes before the page's load handler has run works as well) and
says what went wrong in the status line, never as an exception."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import gradio as gr

from miniserve.store.store import StoreError
from miniserve.ui.common import error
from miniserve.ui.conversation import Conversations, Shown, new_view, owner_of

EXPORTS = {
    "JSON (whole tree)": "json",
    "Markdown (this branch)": "md",
    "OpenAI messages (this branch)": "openai",
}


def file_name(title: str, suffix: str) -> str:
    """A download's name from a conversation's title: letters, digits, '.', '-' and '_' only,
    so a title can never name a path."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", title or "").strip("-.")[:40] or "conversation"
    return f"{stem}{suffix}"


class SidebarHandlers:
    def __init__(self, conversations: Conversations):
        self.conversations = conversations
        self.store = conversations.store

    def load(self, browser, query="", view=None, request: gr.Request | None = None):
        """Page load: the browser's owner id (new on a first visit) and what it had open.
        When an event of this page ran first (a message sent while the page was loading: its
        `view` has a conversation), that conversation stays on screen as it is: only the list
        and the browser's state are filled in."""
        browser = self.conversations.start(browser, request)
        if (view or {}).get("cid"):
            cid = view["cid"]
            try:
                listing = self.conversations.listing(owner_of(browser), cid, query)
            except StoreError as e:
                return self.conversations.show_safely(browser, view, error(str(e)), query)
            keep = gr.update()
            return Shown({**browser, "open": cid}, keep, keep, listing, keep, keep, keep, keep)
        cid = browser.get("open")
        if cid:
            try:
                return self.conversations.open(browser, cid, self.info(), query)
            except StoreError:
                pass  # deleted meanwhile, or another browser's: start empty
        return self.conversations.show_safely(browser, new_view(), self.info(), query)

    def info(self) -> str:
        return (f"{self.store.notice} · " if self.store.notice else "") + self.store.describe()

    def _guard(self, browser, query, action) -> Shown:
        """`action()`, or on a StoreError a new chat with the error as its status."""
        try:
            return action()
        except StoreError as e:
            return self.conversations.show_safely(browser, new_view(), error(str(e)), query)

    def new_chat(self, browser, query="", request: gr.Request | None = None):
        browser = self.conversations.start(browser, request)
        return self.conversations.show_safely(browser, new_view(), "new chat", query)

    def open(self, browser, cid, query="", request: gr.Request | None = None):
        browser = self.conversations.start(browser, request)
        if not cid:
            return self.conversations.show_safely(browser, new_view(), "", query)
        return self._guard(browser, query, lambda: self.conversations.open(browser, cid, "", query))

    def search(self, browser, view, query, request: gr.Request | None = None):
        """(the list's update, the line under Search)."""
        browser = self.conversations.start(browser, request)
        try:
            found = self.conversations.listing(owner_of(browser), view.get("cid"), query)
        except StoreError as e:
            return gr.update(), error(str(e))
        n = len(found["choices"])
        return found, (f"{n} conversation{'s' * (n != 1)} match" if (query or "").strip() else "")

    def rename(self, browser, view, title, query="", request: gr.Request | None = None):
        browser = self.conversations.start(browser, request)

        def action():
            if not view.get("cid"):
                raise StoreError("nothing to rename yet: send a message first")
            self.store.rename(owner_of(browser), view["cid"], title)
            return self.conversations.show(browser, view, "renamed", query)

        return self._guard(browser, query, action)

    def delete(self, browser, view, query="", request: gr.Request | None = None):
        browser = self.conversations.start(browser, request)

        def action():
            if not view.get("cid"):
                raise StoreError("no conversation is open")
            title = self.store.get(owner_of(browser), view["cid"]).title
            self.store.delete(owner_of(browser), view["cid"])
            return self.conversations.show(
                browser, new_view(), f"deleted “{title}” · Undo delete brings it back", query
            )

        return self._guard(browser, query, action)

    def undo_delete(self, browser, view, query="", request: gr.Request | None = None):
        browser = self.conversations.start(browser, request)

        def action():
            cid = self.store.restore(owner_of(browser))
            if cid is None:
                return self.conversations.show(browser, view, "nothing to restore", query)
            return self.conversations.open(browser, cid, "restored", query)

        return self._guard(browser, query, action)

    def export(self, browser, view, kind, request: gr.Request | None = None):
        """(a file to download or None, status)."""
        browser = self.conversations.start(browser, request)
        try:
            if not view.get("cid"):
                raise StoreError("nothing to export yet: open or start a conversation")
            owner, cid = owner_of(browser), view["cid"]
            kind = EXPORTS.get(kind, kind)
            title = self.store.get(owner, cid).title
            text, suffix = self.store.export_text(owner, cid, kind, view.get("leaf"))
        except StoreError as e:
            return None, error(str(e))
        path = Path(tempfile.mkdtemp(prefix="miniserve-export-")) / file_name(title, suffix)
        path.write_text(text, encoding="utf-8")
        return str(path), f"exported “{title}” ({path.name})"

    def import_file(self, browser, view, upload, query="", request: gr.Request | None = None):
        """Import an uploaded file; opens the (first) imported conversation."""
        browser = self.conversations.start(browser, request)
        try:
            if not upload:
                raise StoreError("no file was uploaded")
            path = upload if isinstance(upload, str) else getattr(upload, "name", upload)
            ids = self.store.import_file(owner_of(browser), path)
        except (StoreError, OSError) as e:
            return self.conversations.show_safely(
                browser, view, error(f"import failed, nothing was imported: {e}"), query
            )
        n = len(ids)
        return self._guard(
            browser,
            query,
            lambda: self.conversations.open(
                browser, ids[0], f"imported {n} conversation{'s' * (n != 1)}", query
            ),
        )


def build_sidebar(side: SidebarHandlers) -> dict:
    """The sidebar's components (call inside a Column); `wire_sidebar` connects them once the
    Chat tab's components exist."""
    c = {}
    c["new"] = gr.Button("New chat", variant="primary", size="sm")
    c["search"] = gr.Textbox(
        label="Search", placeholder="words in titles and messages", max_lines=1
    )
    c["found"] = gr.Markdown("", elem_id="search-status")
    c["conversations"] = gr.Radio(label="Conversations", choices=[], elem_id="conversations")
    with gr.Accordion("This conversation", open=False):
        c["title"] = gr.Textbox(label="Title", max_lines=1)
        with gr.Row():
            c["rename"] = gr.Button("Rename", size="sm")
            c["delete"] = gr.Button("Delete", variant="stop", size="sm")
            c["undo_delete"] = gr.Button("Undo delete", size="sm")
        c["export_kind"] = gr.Dropdown(list(EXPORTS), value=next(iter(EXPORTS)), label="Export as")
        c["export"] = gr.Button("Export", size="sm")
        c["file"] = gr.File(label="Exported file", interactive=False, elem_id="export-file")
        c["import"] = gr.UploadButton("Import JSON", file_types=[".json"], size="sm")
    c["info"] = gr.Markdown("", elem_id="history-info")
    return c


def wire_sidebar(
    side: SidebarHandlers, c: dict, shown: list, browser, view, after_reply=lambda fn, n: fn
) -> list:
    """Connect the sidebar's events; `shown` are the components of SHOWN, in order;
    `after_reply` turns a handler that changes the conversation shown into one that first
    stops a streaming reply (ChatHandlers.after_reply). Returns the events that open a saved
    conversation (a click in the list, Undo delete, Import)."""
    q = c["search"]
    n = len(shown)
    c["new"].click(after_reply(side.new_chat, n), [browser, q], shown)
    opened = [
        c["conversations"].input(after_reply(side.open, n), [browser, c["conversations"], q], shown)
    ]
    q.change(side.search, [browser, view, q], [c["conversations"], c["found"]])
    c["rename"].click(side.rename, [browser, view, c["title"], q], shown)
    c["title"].submit(side.rename, [browser, view, c["title"], q], shown)
    c["delete"].click(after_reply(side.delete, n), [browser, view, q], shown)
    opened.append(
        c["undo_delete"].click(after_reply(side.undo_delete, n), [browser, view, q], shown)
    )
    status = shown[-1]
    c["export"].click(side.export, [browser, view, c["export_kind"]], [c["file"], status])
    opened.append(
        c["import"].upload(after_reply(side.import_file, n), [browser, view, c["import"], q], shown)
    )
    return opened
