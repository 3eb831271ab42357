"""The token inspector's HTML, as the Chat and Notebook tabs show it."""

from __future__ import annotations

import html

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
