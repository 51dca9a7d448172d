"""The validation panel: the last lookup's logical hit, the four validation layers by name
(alignment, kernel interface, group intersection, byte alignment) with pass or FAIL and why, the
plan (reuse / recover via which path / recompute) and the outcome. It scrolls: a long plan is
never cut."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from workbench.plain import describe_plan
from workbench.turns import TurnResult

STYLE = {"hit": "bold green", "degraded": "bold yellow", "recomputed": "bold red", "miss": "dim"}


def render_plan(result: TurnResult | None) -> Text:
    return render_lines(describe_plan(result))


def render_lines(lines: list[str]) -> Text:
    """describe_plan's lines, styled: the outcome by kind, each layer green (pass) or red (FAIL)."""
    text = Text()
    for line in lines:
        if line.startswith("outcome:"):
            style = STYLE.get(line.split()[1], "")
        elif line.startswith("layer"):
            style = "red" if ": FAIL" in line else "green"
        else:
            style = ""
        text.append(line + "\n", style=style)
    text.rstrip()
    return text


class ValidationPanel(VerticalScroll):
    hint = " · /plan explains"  # after the line count on its border (hcw top has no /plan)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.body = Static()
        self.text = ""  # what it shows, as plain text

    def compose(self):
        yield self.body

    def show(self, result: TurnResult | None) -> None:
        self.show_lines(describe_plan(result))

    def show_lines(self, lines: list[str]) -> None:
        """describe_plan's lines, as they came (`hcw top` gets them from a server)."""
        text = render_lines(lines)
        self.text = text.plain
        self.body.update(text)
        n = len(self.text.splitlines())
        self.border_subtitle = f"{n} line{'s' if n != 1 else ''}{self.hint}"
        self.scroll_home(animate=False)
