"""A progress display on stderr (rich) for the long commands: `hcw drill`, `hcw replay`, `hcw bench
replay`, `hcw quantise`. Off for --json and when stderr is not a terminal, so scripts and pipes see only the output."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


def wanted(as_json: bool) -> bool:
    return not as_json and sys.stderr.isatty()


class Steps:
    """What a command reports as it goes: `doing(label)` names the step under way, `done(n)` counts
    steps finished. Without a display both do nothing."""

    def __init__(self, display=None, task=None):
        self.display, self.task = display, task

    def doing(self, label: str) -> None:
        if self.display is not None:
            self.display.update(self.task, label=label)

    def done(self, n: int = 1) -> None:
        if self.display is not None:
            self.display.update(self.task, advance=n)

    def total(self, n: int) -> None:
        """The steps' count, where it is known only once the work has begun."""
        if self.display is not None:
            self.display.update(self.task, total=n)


@contextmanager
def bar(total: int | None, what: str, enabled: bool, console=None) -> Iterator[Steps]:
    """A bar of `total` steps on stderr (or `console`) while the block runs (None: not known yet,
    `Steps.total` sets it); it goes when the block ends, and what is printed to stdout or stderr
    meanwhile goes above it."""
    if not enabled:
        yield Steps()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[label]}"), console=console or Console(stderr=True),
                  transient=True) as display:
        yield Steps(display, display.add_task(what, total=total, label=""))
