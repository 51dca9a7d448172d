"""A command's output to read (/help, /segments, /plan, /faults, /stats, ...): a modal panel over
the workbench holding all of it, scrollable with the arrow keys, PgUp / PgDn, Home / End or the
mouse; Esc (or q, or Enter) closes it."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


class OutputScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    OutputScreen { align: center middle; }
    #output { width: 100%; max-width: 120; height: auto; max-height: 100%; border: round $accent; background: $surface;
              padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q,enter", "dismiss", "close")]

    def __init__(self, title: str, lines: list[str]):
        super().__init__()
        self.title = title
        self.lines = lines

    def compose(self):
        with VerticalScroll(id="output") as pane:
            pane.border_title = self.title
            pane.border_subtitle = "↑↓ PgUp PgDn scroll · Esc closes"
            yield Static(Text("\n".join(self.lines)), id="output-text")

    def on_mount(self) -> None:
        self.query_one("#output").focus()
