"""`python -m miniserve step`: the Step view in a terminal.

Enter takes one token (the draw); a number takes that candidate of the table instead; `t TEXT`
takes the token TEXT is; `b` goes back one token; `/set KEY VALUE`, `/preset NAME`, `/settings`
as in the chat (the table is redrawn on the kept logits, no forward pass); `q` quits. After
each action the text so far and the per-stage table of the top candidates are printed."""

from __future__ import annotations

from miniserve.cli.repl import set_keys, set_setting, settings_line
from miniserve.core.config import ConfigError
from miniserve.core.samplers import STAGES
from miniserve.engine.step import StageView, StepError, StepSession

HELP = """Enter: one token (the draw) · N: take candidate N · t TEXT: take the token TEXT is ·
b: back one token · /set KEY VALUE ({keys}) · /preset NAME · /settings · q: quit"""
SHORT = {"raw": "raw", "greedy": "greedy", "final": "final"}


def short(label: str) -> str:
    """A stage's column title (its declared short name)."""
    stage = next((s for s in STAGES.values() if s.label == label), None)
    return SHORT.get(label) or (stage.short if stage is not None else label)[:7]


def stage_table(view: StageView, top: int) -> str:
    """The candidates as rows, the stages as columns: each token's probability after each
    stage, ✕ where a stage removed it; `above` is the mass ranked above it at top-p (cut at
    p); ▶ marks the draw, ✋ a hand pick."""
    cols = [short(s) for s in view.stages]
    topp = "top-p" in view.stages
    head = (
        f"{'':2}{'#':>3}  {'token':<16}"
        + "".join(f"{c:>9}" for c in cols)
        + (f"{'above':>9}" if topp else "")
    )
    lines = [summary(view), head]
    for n, row in enumerate(view.rows, 1):  # the top ones, then the draw if it is not
        mark = (
            "✋"
            if view.picked and row.token_id == view.taken
            else (
                "▶"
                if row.token_id == (view.taken if view.taken is not None else view.drawn)
                else ""
            )
        )
        cells, gone = [], False
        for stage, p in zip(view.stages, row.probs):
            if gone:
                cells.append(f"{'':>9}")
            elif stage == row.removed_by:
                cells.append(f"{'✕ ' + short(stage)[:6]:>9}")
                gone = True
            else:
                cells.append(f"{100 * p:8.2f}%")
        above = f"{row.mass_above:9.3f}" if topp and row.mass_above is not None else ""
        why = f"  (cannot: {row.why_not})" if row.why_not else ""
        lines.append(f"{mark:<2}{n:>3}  {repr(row.text)[:16]:<16}" + "".join(cells) + above + why)
    return "\n".join(lines)


def summary(view: StageView) -> str:
    if view.drawn is None:
        return f"token {view.position + 1}: {view.note}"
    drawn = next((r.text for r in view.rows if r.token_id == view.drawn), "")
    cut = f" · top-p cut at {view.top_p:g}" if view.top_p is not None else ""
    return (
        f"token {view.position + 1} · entropy {view.entropy_raw:.2f} bits raw → "
        f"{view.entropy_final:.2f} · {'greedy' if view.greedy else 'the draw'} takes "
        f"{drawn!r} (rank {view.rank}, {view.drawn_raw:.1%} raw → {view.drawn_final:.1%}) · "
        f"outside the {len(view.rows)} shown: {view.outside_raw:.1%} raw{cut}"
    )


class StepLoop:
    """One step session read from lines (a terminal or a pipe)."""

    def __init__(self, session: StepSession, presets: dict, top: int, shown_prompt: str, out):
        self.s, self.presets, self.top, self.prompt, self.out = (
            session,
            presets,
            top,
            shown_prompt,
            out,
        )

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def show(self) -> None:
        s = self.s
        text = "".join(
            ("[" + s.text_of(t) + "]") if p.picked else s.text_of(t)
            for t, p in zip(s.tokens, s.positions)
        )
        self.say(f"\n{self.prompt}{text}")
        c = s.positions[-1].cost if s.positions else None
        if c is not None:
            self.say(
                f"[forward {c.forward_s * 1000:.1f} ms · fed {c.new_rows} · KV "
                f"{c.kv_positions} positions, {c.kv_bytes / 1e6:.2f} MB · {c.reused} "
                f"reused from the prefix cache · shared the pass with {c.shared} others]"
            )
        if s.finish:
            self.say(s.finished_note())
        view = s.view(self.top)
        if view is not None:
            self.say(stage_table(view, self.top))

    def command(self, line: str) -> bool:
        """One line; False to quit."""
        s = self.s
        if line in ("q", "quit", "/exit", "/quit"):
            return False
        if line == "":
            s.step()
        elif line.isdigit():
            s.pick_candidate(int(line), self.top)
        elif line == "b":
            s.back()
        elif line.startswith("t "):
            s.step(s.token_for_text(line[2:]))
        elif line.startswith("/set "):
            s.update(set_setting(s.params, line[5:]))
        elif line.startswith("/preset"):
            name = line[7:].strip()
            if name not in self.presets:
                raise ConfigError(f"unknown preset '{name}' (available: {', '.join(self.presets)})")
            s.update(self.presets[name].replace(seed=s.params.seed))
        elif line == "/settings":
            self.say(settings_line(s.params))
            return True
        elif line in ("/help", "?", "h"):
            self.say(HELP.format(keys=set_keys()))
            return True
        else:
            self.say(f"unknown input {line!r}; " + HELP.format(keys=set_keys()))
            return True
        self.show()
        return True

    def run(self, stdin) -> int:
        self.say(HELP.format(keys=set_keys()))
        interactive = stdin.isatty()
        while True:
            if interactive:
                self.out.write("step> ")
                self.out.flush()
            line = stdin.readline()
            if not line:
                return 0
            try:
                if not self.command(line.rstrip("\r\n").strip() if line.strip() else ""):
                    return 0
            except (StepError, ConfigError, ValueError) as e:
                self.say(f"error: {e}")
