"""The token inspector's HTML, as the Chat and Notebook tabs show it; a chat reply's rows as the
Chat tab's Chatbot shows them (its reasoning, its text, its tool calls); the Step tab's text,
chart and costs (a StepSession and its StageView as HTML and SVG)."""

from __future__ import annotations

import bisect
import html
import json
import re

from miniserve.engine.step import TOP, StageView, StepSession

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


# -- A message's text in the Chatbot ----------------------------------------------------------
# The Chatbot renders Markdown and lets standard HTML through its sanitizer: "<div>" or
# "<b>x</b>" typed in prose, or "<<A Title>>" written by a model, would be laid out as markup or
# vanish (custom tags such as "<T>" it already shows as text). So a "<" that opens a standard
# HTML tag (or a comment) outside code is written "&lt;", which the Chatbot shows as "<" (and a
# "&lt;" written before such a tag name as "&amp;lt;", a "&amp;lt;" as "&amp;amp;lt;" and so on,
# so that each shows as written and no two texts are given alike); code spans and fenced blocks
# show their text as it is and are left alone. (Its Copy button and its edit box hold the row's
# text as given: CHATBOT_JS below shows them the text as written.)
HTML_TAGS = frozenset(  # HTML's and SVG's element names (the Chatbot's own list is of both)
    "a abbr acronym address applet area article aside audio b base basefont bdi bdo big "
    "blockquote body br button canvas caption center cite code col colgroup data datalist dd del "
    "details dfn dialog dir div dl dt em embed fieldset figcaption figure filter font footer form "
    "frame frameset g h1 h2 h3 h4 h5 h6 head header hgroup hr html i iframe image img input ins "
    "kbd label legend li line link main map mark marquee mask math menu meta meter nav noframes "
    "noscript object ol optgroup option output p param path picture pre progress q rect rp rt "
    "ruby s samp script search section select set slot small source span strike strong style "
    "sub summary sup svg table tbody td template text textarea tfoot th thead time title tr "
    "track tt u ul use var video view wbr".split()
)
# a tag's name ends where HTML's does (space, tab, newline, form feed, CR, "/" or ">"): spelled
# out, since Python's \s and the page's differ (\x1c-\x1f, \x85, U+FEFF), and CHATBOT_JS uses
# these patterns as they are
TAG_AHEAD = r"(?=!|/?([A-Za-z][A-Za-z0-9]*)(?:[ \t\n\f\r/>]|$))"
OPENS_TAG = re.compile(r"(<|&(?:amp;)*lt;)" + TAG_AHEAD)
WRITTEN_TAG = re.compile(r"(&(?:amp;)*lt;)" + TAG_AHEAD)
# fenced blocks: to their closing fence, or to the end of a text still streaming
FENCE = re.compile(
    r"^ {0,3}(?P<fence>`{3,}|~{3,}).*?(?:\n {0,3}(?P=fence)[`~]*[ \t]*\r?(?=\n|\Z)|\Z)",
    re.M | re.S,
)
TICKS = re.compile(r"`+")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\r?\n")


def code_spans(text: str) -> list[tuple[int, int]]:
    """Where `text`'s code spans are: a run of n backticks to the next run of exactly n in
    the same paragraph (a run with none is text). One pass over the runs, not a regex that
    backtracks (a model repeating backticks would make that take minutes)."""
    runs = [(m.start(), m.end()) for m in TICKS.finditer(text)]
    breaks = [m.start() for m in PARAGRAPH_BREAK.finditer(text)]
    of_length: dict[int, list[int]] = {}
    for k, (start, end) in enumerate(runs):
        of_length.setdefault(end - start, []).append(k)
    spans, k = [], 0
    while k < len(runs):
        start, end = runs[k]
        same = of_length[end - start]
        after = bisect.bisect_right(same, k)
        if after < len(same):
            close = runs[same[after]]
            gap = bisect.bisect_left(breaks, end)
            if gap == len(breaks) or breaks[gap] >= close[0]:
                spans.append((start, close[1]))
                k = same[after] + 1
                continue
        k += 1
    return spans


def _outside(text: str, ranges, edit) -> str:
    out, at = [], 0
    for start, end in ranges:
        out += [edit(text[at:start]), text[start:end]]
        at = end
    return "".join(out + [edit(text[at:])])


def _outside_code(text: str, pattern: re.Pattern, change) -> str:
    def swap(m: re.Match) -> str:
        tag = m.group(2)
        return change(m.group(1)) if tag is None or tag.lower() in HTML_TAGS else m.group()

    def prose(part: str) -> str:
        return _outside(part, code_spans(part), lambda t: pattern.sub(swap, t))

    fences = [m.span() for m in FENCE.finditer(text)]
    return _outside(text, fences, prose)


def _shown_as(written: str) -> str:  # "<" as "&lt;"; "&lt;", "&amp;lt;"…: one "amp;" more
    return "&lt;" if written == "<" else "&amp;" + written[1:]


def _typed_as(shown: str) -> str:  # _shown_as undone
    return "<" if shown == "&lt;" else "&" + shown[len("&amp;") :]


def shown_text(text: str) -> str:
    """A message's text as the Chatbot is given it, so that it shows as written (above)."""
    return _outside_code(text or "", OPENS_TAG, _shown_as)


def typed_text(shown: str) -> str:
    """shown_text undone (a message the Chatbot hands back edited)."""
    return _outside_code(shown or "", WRITTEN_TAG, _typed_as)


# The same two functions in the page, window.msShownText and window.msTypedText (a test
# compares them with shown_text and typed_text), for the two Chatbot buttons that hold a row's
# text as the Chatbot was given it:
# - Copy: a message copied with its Copy button goes to the clipboard as typed ("<div>", not
#   "&lt;div>"); every other copy is left as it is.
# - Edit: the box shows the text as typed while it is open, and gets the Chatbot's form back
#   as its Submit (or Cancel) is pressed: the server is always given the Chatbot's form, which
#   ChatHandlers.edit undoes with typed_text. So a box this script did not convert (opened
#   before the script ran) shows "&lt;div>" as before, and its text still arrives as meant;
#   had the server taken the box's text as typed, such a box would store "&lt;b>" for a "<b>".
#   The round trip is exact: shown_text writes no two texts alike (a typed "&lt;b>" is given
#   as "&amp;lt;b>"), and typed_text undoes it.
JS_NEEDS = {"tags": sorted(HTML_TAGS), "opens": OPENS_TAG.pattern, "written": WRITTEN_TAG.pattern}
CHATBOT_JS = """
() => {
  if (window.msTypedText) return;
  const PY = %(py)s;  // HTML_TAGS, OPENS_TAG and WRITTEN_TAG (the same regex syntax in JS)
  const TAGS = new Set(PY.tags);
  const OPENS = new RegExp(PY.opens, "g");
  const WRITTEN = new RegExp(PY.written, "g");
  const END = "$(?![\\\\s\\\\S])";  // Python's \\Z
  const FENCE = new RegExp(  // Python's "^" with re.M: the start, or after a "\\n" only
    "(?<![^\\\\n]) {0,3}(`{3,}|~{3,})[\\\\s\\\\S]*?(?:\\\\n {0,3}\\\\1[`~]*" +
    "[ \\\\t]*\\\\r?(?=\\\\n|" + END + ")|" + END + ")",
    "g"
  );
  const outside = (text, ranges, edit) => {
    let out = "", at = 0;
    for (const [start, end] of ranges) {
      out += edit(text.slice(at, start)) + text.slice(start, end);
      at = end;
    }
    return out + edit(text.slice(at));
  };
  const above = (sorted, x, strict) => {  // bisect_right (strict) or bisect_left
    let lo = 0, hi = sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (strict ? sorted[mid] <= x : sorted[mid] < x) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  const codeSpans = (text) => {  // render.code_spans
    const runs = [...text.matchAll(/`+/g)].map((m) => [m.index, m.index + m[0].length]);
    const breaks = [...text.matchAll(/\\n[ \\t]*\\r?\\n/g)].map((m) => m.index);
    const ofLength = new Map();
    runs.forEach(([start, end], k) => {
      if (!ofLength.has(end - start)) ofLength.set(end - start, []);
      ofLength.get(end - start).push(k);
    });
    const spans = [];
    for (let k = 0; k < runs.length; ) {
      const [start, end] = runs[k];
      const same = ofLength.get(end - start);
      const after = above(same, k, true);
      if (after < same.length) {
        const close = runs[same[after]];
        const gap = above(breaks, end, false);
        if (gap === breaks.length || breaks[gap] >= close[0]) {
          spans.push([start, close[1]]);
          k = same[after] + 1;
          continue;
        }
      }
      k += 1;
    }
    return spans;
  };
  const outsideCode = (text, pattern, change) => {  // render._outside_code
    const swap = (m, written, tag) =>
      tag === undefined || TAGS.has(tag.toLowerCase()) ? change(written) : m;
    const prose = (part) => outside(part, codeSpans(part), (t) => t.replace(pattern, swap));
    const fences = [...text.matchAll(FENCE)].map((m) => [m.index, m.index + m[0].length]);
    return outside(text, fences, prose);
  };
  window.msShownText = (text) =>
    outsideCode(text, OPENS, (w) => (w === "<" ? "&lt;" : "&amp;" + w.slice(1)));
  window.msTypedText = (shown) =>
    outsideCode(shown, WRITTEN, (w) => (w === "&lt;" ? "<" : "&" + w.slice(5)));
  // an edit box, as it opens: its text as typed, marked so (only a marked box is converted
  // back). Gradio may make an open box again from the text it holds (after a Clear, say): that
  // text is typed already.
  let held = null;  // what the open, marked box holds
  const put = (box, shows, text) => {
    box.dataset.msShows = shows;
    box.value = text;
    box.dispatchEvent(new Event("input", {bubbles: true}));  // the Chatbot's bound value follows
  };
  document.addEventListener("input", (e) => {
    if (e.target.dataset && e.target.dataset.msShows === "typed") held = e.target.value;
  }, true);
  new MutationObserver(() => {
    const opened = "#chatbot textarea.edit-textarea:not([data-ms-shows])";
    for (const box of document.querySelectorAll(opened)) {
      put(box, "typed", box.value === held ? held : window.msTypedText(box.value));
    }
  }).observe(document.body, {childList: true, subtree: true});
  // a message's buttons: Edit opens a box from the Chatbot's text; Submit and Cancel (beside
  // the box's row) give the box the Chatbot's form back before the Chatbot reads it
  document.addEventListener("click", (e) => {
    const buttons = e.target.closest && e.target.closest("#chatbot .message-buttons");
    if (!buttons || !e.target.closest("button")) return;
    held = null;
    const row = buttons.previousElementSibling;
    for (const box of row ? row.querySelectorAll("textarea[data-ms-shows='typed']") : []) {
      put(box, "shown", window.msShownText(box.value));
    }
  }, true);
  if (!navigator.clipboard) return;  // (only in a secure context: https, or this machine)
  // a message's Copy button, pressed just now (not a code block's: its text is as written)
  let pressed = 0;
  document.addEventListener("click", (e) => {
    const button = e.target.closest && e.target.closest("#chatbot button");
    if (button && button.getAttribute("aria-label") === "Copy message") pressed = Date.now();
  }, true);
  const write = navigator.clipboard.writeText.bind(navigator.clipboard);
  navigator.clipboard.writeText = (text) => {
    const mine = Date.now() - pressed < 2000;
    pressed = 0;  // one copy a press
    return write(mine ? window.msTypedText(String(text)) : text);
  };
}
""" % {"py": json.dumps(JS_NEEDS)}  # noqa: UP031 -- JS braces stay plain


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
    return {"role": "assistant", "content": shown_text(reasoning), "metadata": meta}


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
        rows.append({"role": "assistant", "content": shown_text(text)})
    return rows + [call_card(c) for c in calls]


# -- The Step tab's view ----------------------------------------------------------------------
# The chart is a small inline SVG made here rather than one of Gradio's plots: it is one string
# of a few kilobytes that the browser draws at once (a redraw after a slider is released is the
# server's few milliseconds plus a DOM swap, where a Vega or Plotly plot would load and lay out a
# charting library each time), and it can draw what a bar chart component cannot: one panel per
# stage side by side, the stage that removed each token, the cumulative mass against the top-p
# cut, and rows that are buttons (miniserve/ui/step_tab.py wires their clicks).
COLORS = {
    "bar": "#8fb3ee",
    "line": "#2f5fb3",
    "cut": "#c0392b",
    "drawn": "#fff1a8",
    "picked": "#d5ecff",
    "mass": "#9aa5b1",
}


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def token_label(text: str, width: int = 14) -> str:
    """A token's text as a label: spaces and line breaks made visible, long ones cut."""
    shown = text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def stage_title(name: str, view: StageView) -> str:
    if name == "top-p" and view.top_p is not None:
        return f"top-p {view.top_p:g}"
    return {
        "final": "greedy: argmax" if view.greedy else "final (draw)",
        "repetition penalty": "rep. penalty",
    }.get(name, name)


def chart_svg(view: StageView, width: int = 940) -> str:
    """The distribution at one position as bars, one panel per stage, one row per candidate.
    Each bar is its token's probability after that stage (scaled to the panel's largest, the
    number beside it exact); ✕ marks the stage that removed a token; in the top-p panel a grey
    line under each row is the mass ranked above it, against the dashed cut at p. The drawn
    row is yellow, a hand-picked one blue; a row is a button that takes its token."""
    label_w, row_h, head = 140, 18, 34
    n = len(view.stages)
    pw = (width - label_w) / n
    bar_w = pw - 8  # the percentage is written over the bar's right end
    rows = view.rows
    height = head + row_h * len(rows) + 6
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="ms-step-chart" width="100%" '
        f'style="max-width:{width}px" viewBox="0 0 {width} {height}" font-family="sans-serif" '
        f'font-size="11" data-position="{view.position}" data-drawn="{view.drawn}" '
        f'data-temperature="{view.temperature:g}">'
        # classes instead of repeated attributes: the chart is redrawn at every change
        f"<style>.b{{fill:{COLORS['bar']}}}.p{{font-size:10px;text-anchor:end}}</style>"
    ]
    for k, name in enumerate(view.stages):
        x = label_w + k * pw
        out.append(
            f'<text x="{x + 2:.1f}" y="14" font-weight="bold">{_esc(stage_title(name, view))}'
            f"</text>"
        )
        if name == "top-p" and view.top_p is not None:
            cx = x + 2 + view.top_p * bar_w
            out.append(
                f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{head - 6}" y2="{height - 4}" '
                f'stroke="{COLORS["cut"]}" stroke-dasharray="3,2"/>'
                f'<text x="{x + 2:.1f}" y="27" font-size="9" fill="#555">grey: mass above'
                f"</text>"
            )
        if k:
            out.append(
                f'<line x1="{x - 2:.1f}" x2="{x - 2:.1f}" y1="4" y2="{height - 4}" stroke="#ddd"/>'
            )
    peaks = [max((r.probs[k] for r in rows), default=0) or 1.0 for k in range(n)]
    for i, row in enumerate(rows):
        y = head + i * row_h
        out.append(f'<g data-token="{row.token_id}">')
        taken = view.taken if view.taken is not None else view.drawn
        if row.token_id == taken:
            fill = COLORS["picked"] if view.picked else COLORS["drawn"]
            out.append(f'<rect x="0" y="{y - 2}" width="{width}" height="{row_h}" fill="{fill}"/>')
        mark = (
            "✋"
            if view.picked and row.token_id == view.taken
            else ("▶" if row.token_id == taken else "")
        )
        out.append(
            f'<text x="2" y="{y + 11}" fill="#666">{i + 1}</text>'
            f'<text x="22" y="{y + 11}" font-family="monospace">{_esc(mark)}'
            f"{_esc(token_label(row.text))}</text>"
        )
        gone = False
        for k, name in enumerate(view.stages):
            x = label_w + k * pw + 2
            p = row.probs[k]
            if gone:
                continue
            if name == row.removed_by:
                out.append(
                    f'<text x="{x:.1f}" y="{y + 11}" fill="{COLORS["cut"]}" '
                    f'data-removed="{_esc(name)}">✕ cut</text>'
                )
                gone = True
                continue
            w = max(p / peaks[k] * bar_w, 0.5 if p > 0 else 0)
            out.append(
                f'<rect class="b" x="{x:.1f}" y="{y}" width="{w:.1f}" height="11" '
                f'data-stage="{_esc(name)}" data-p="{p:.6f}"/>'
                f'<text class="p" x="{x + bar_w:.1f}" y="{y + 10}">{100 * p:.1f}%</text>'
            )
            if name == "top-p" and row.mass_above is not None:
                out.append(
                    f'<rect x="{x:.1f}" y="{y + 12}" width="{row.mass_above * bar_w:.1f}" '
                    f'height="2.5" fill="{COLORS["mass"]}"/>'
                )
        why = row.why_not
        tip = (
            f"cannot be taken: {why}"
            if why
            else f"take {row.text!r} (id {row.token_id}) instead of the draw"
        )
        attrs = (
            f'class="ms-nopick" data-why="{_esc(why)}"'
            if why
            else f'class="ms-pick" data-pick="{row.token_id}" style="cursor:pointer"'
        )
        out.append(
            f'<rect {attrs} x="0" y="{y - 2}" width="{width}" height="{row_h}" '
            f'fill="transparent"><title>{_esc(tip)}</title></rect></g>'
        )
    out.append("</svg>")
    return "".join(out)


def summary_line(view: StageView) -> str:
    """Beside the chart: entropy, the drawn token's rank and probability, the mass outside."""
    if view.drawn is None:
        return view.note
    drawn = next((r.text for r in view.rows if r.token_id == view.drawn), "")
    parts = [
        f"entropy {view.entropy_raw:.2f} bits raw → {view.entropy_final:.2f} after the stages",
        f"{'greedy takes' if view.greedy else 'the draw takes'} {drawn!r} (rank "
        f"{view.rank}, p {view.drawn_raw:.1%} raw → {view.drawn_final:.1%})",
        f"outside the {len(view.rows)} shown: {view.outside_raw:.1%} raw, "
        f"{view.outside_final:.1%} after",
    ]
    if view.taken is not None and view.picked:
        taken = next((r.text for r in view.rows if r.token_id == view.taken), "")
        parts.append(f"taken by hand: {taken!r}")
    return " · ".join(parts)


def chart_html(session: StepSession | None, top: int = TOP) -> str:
    if session is None or not session.positions:
        return (
            '<div class="ms-step-empty">Step reads the prompt and shows the distribution '
            "of the next token through every sampling stage.</div>"
        )
    view = session.view(top)
    title = (
        f"token {view.position + 1}: the distribution through every stage "
        "(click a row to take that token)"
    )
    return (
        f'<div class="ms-step-view"><div><b>{_esc(title)}</b></div>'
        f'<div class="ms-step-summary">{_esc(summary_line(view))}</div>'
        f"{chart_svg(view)}</div>"
    )


def text_html(session: StepSession | None, prompt_shown: str = "") -> str:
    """The text so far: the prompt, then each generated token a chip (a click goes back to just
    before it); hand-picked tokens outlined."""
    if session is None:
        return '<div class="ms-step-text"></div>'
    chips = []
    for i, token in enumerate(session.tokens):
        pos = session.positions[i]
        tip = (
            f"token {i + 1}: id {token}, p {pos.prob:.1%}"
            + (" · taken by hand" if pos.picked else "")
            + " · click: go back to just before it"
        )
        cls = "ms-chip ms-picked" if pos.picked else "ms-chip"
        chips.append(
            f'<span class="{cls}" data-back="{i}" title="{_esc(tip)}">'
            f"{_esc(session.text_of(token).replace(chr(10), '↵' + chr(10)))}</span>"
        )
    return (
        f'<div class="ms-step-text"><span class="ms-step-prompt">{_esc(prompt_shown)}</span>'
        + "".join(chips)
        + "</div>"
    )


def _spark(values: list[float], label: str, fmt: str, x0: float, w: float, h: float) -> str:
    """One small line plot of `values` over the tokens, with its range written."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    step = w / max(len(values) - 1, 1)
    pts = " ".join(
        f"{x0 + i * step:.1f},{18 + (h - 24) * (1 - (v - lo) / span):.1f}"
        for i, v in enumerate(values)
    )
    return (
        f'<text x="{x0}" y="11" font-weight="bold">{_esc(label)}</text>'
        f'<text x="{x0 + w}" y="11" text-anchor="end" fill="#666">{format(lo, fmt)} – '
        f"{format(hi, fmt)}</text>"
        f'<rect x="{x0}" y="16" width="{w}" height="{h - 20}" fill="none" stroke="#ddd"/>'
        f'<polyline points="{pts}" fill="none" stroke="{COLORS["line"]}" stroke-width="1.5"/>'
    )


def costs_html(session: StepSession | None) -> str:
    """What the last pass cost, and a small plot over the tokens so far: step time, entropy
    and the taken token's probability."""
    if session is None or not session.positions:
        return ""
    c = session.positions[-1].cost
    line = (
        f"last pass: forward {c.forward_s * 1000:.1f} ms (asked → logits "
        f"{c.wall_s * 1000:.1f} ms) · fed {c.new_rows} position{'s' * (c.new_rows != 1)} · "
        f"KV {c.kv_positions} positions, {c.kv_bytes / 1e6:.2f} MB · {c.reused} reused "
        f"from the prefix cache · shared the pass with {c.shared} other "
        f"sequence{'s' * (c.shared != 1)}"
    )
    taken = session.positions[: len(session.tokens)]
    times = [p.cost.forward_s * 1000 for p in session.positions[1:]]  # after the prompt's
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" class="ms-step-costs" width="100%" '
        'style="max-width:940px" viewBox="0 0 940 90" font-family="sans-serif" '
        'font-size="11">'
        + _spark(times, "step forward (ms)", ".1f", 4, 290, 90)
        + _spark([p.entropy for p in taken], "entropy (bits)", ".2f", 322, 290, 90)
        + _spark([p.prob for p in taken], "taken token's p", ".2f", 640, 290, 90)
        + "</svg>"
    )
    return f'<div class="ms-step-cost">{_esc(line)}</div>{svg}'
