"""The token inspector's HTML, as the Chat and Notebook tabs show it; a chat reply's rows as the
Chat tab's Chatbot shows them (its reasoning, its text, its tool calls)."""

from __future__ import annotations

import html
import json
import re

# -- Token inspector --------------------------------------------------------------------------
BENT = 0.01  # a step the grammar bent: its mask took at least this share of the probability


def grammar_line(steps) -> str:
    """The inspector's summary of an output format's grammar: at how many of the reply's steps
    its mask took probability away, and the most it took ("" without a grammar)."""
    masses = [s.masked_mass for s in steps if s.masked_mass is not None]
    if not masses:
        return ""
    bent = sum(m >= BENT for m in masses)
    return (
        f"grammar bent {bent} of {len(masses)} steps, up to {max(masses):.0%} of the "
        f"probability (a step counts when its mask removed ≥ {BENT:.0%}; hover an "
        f"underlined token for what it removed)"
    )


def inspector_html(inspector) -> str:
    """What the Token inspector box shows for a finished generation ("" when it was off)."""
    if inspector is None:
        return ""
    line = grammar_line(inspector.steps)
    return (
        f'<div class="ms-grammar">{html.escape(line)}</div>' if line else ""
    ) + inspector.as_html()


# -- A chat reply's rows ----------------------------------------------------------------------
# A reply is one to three kinds of Chatbot rows: its reasoning as a folded "thought" (Gradio's
# message metadata: an accordion above the text, with a spinner and open while its status is
# "pending", folded once it is "done" unless the user opened or closed it meanwhile), its text,
# and a card per tool call (open: the function's name and its arguments). Gradio draws the
# rows of one reply as one bubble.
THINKING = "Thinking…"
CALL_LOG = "not run: the chat runs no tools"


def thought_title(tokens: int | None, seconds: float | None) -> str:
    """A folded reasoning's summary line: "Thought for 8 tokens, 0.4 s"."""
    parts = ([f"{tokens} token{'s' * (tokens != 1)}"] if tokens else []) + (
        [f"{seconds:.1f} s"] if seconds is not None else []
    )
    return "Thought for " + ", ".join(parts) if parts else "Thought"


def thought_row(
    reasoning: str, pending: bool = False, tokens: int | None = None, seconds: float | None = None
) -> dict:
    """The reasoning's row: open with a spinner while it streams (`pending`), else folded
    under its summary line."""
    if pending:
        meta = {"title": THINKING, "status": "pending"}
        if tokens:
            meta["log"] = f"{tokens} token{'s' * (tokens != 1)}"
    else:
        meta = {"title": thought_title(tokens, seconds), "status": "done"}
    return {"role": "assistant", "content": reasoning, "metadata": meta}


def pretty_arguments(arguments: str) -> str:
    """A call's arguments JSON indented (as written when it does not parse: a reply cut off
    mid-call)."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except (TypeError, ValueError):
        return arguments


def call_card(call: dict) -> dict:
    """A tool call's card: its function's name over its arguments in a JSON code block."""
    body = pretty_arguments(call.get("arguments") or "")
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return {
        "role": "assistant",
        "content": f"{fence}json\n{body}\n{fence}",
        "metadata": {"title": f"Tool call: {call.get('name') or '…'}", "log": CALL_LOG},
    }


def reply_rows(
    text: str,
    reasoning: str = "",
    calls=(),
    *,
    pending: bool = False,
    tokens: int | None = None,
    seconds: float | None = None,
) -> list[dict]:
    """A reply's rows: its reasoning (when it has some), its text (always, unless it is
    empty beside a reasoning or calls), a card per tool call."""
    rows = [thought_row(reasoning, pending, tokens, seconds)] if reasoning else []
    if text or not (reasoning or calls):
        rows.append({"role": "assistant", "content": text})
    return rows + [call_card(c) for c in calls]
