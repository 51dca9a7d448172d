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
    text = Text()
    for line in describe_plan(result):
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
    def __init__(self, **kw):
        super().__init__(**kw)
        self.body = Static()
        self.text = ""  # what it shows, as plain text

    def compose(self):
        yield self.body

    def show(self, result: TurnResult | None) -> None:
        text = render_plan(result)
        self.text = text.plain
        self.body.update(text)
        n = len(self.text.splitlines())
        self.border_subtitle = f"{n} line{'s' if n != 1 else ''} · /plan explains"
        self.scroll_home(animate=False)
