"""Scrollable widgets that leave their scrollbars alone when nothing about them changed.

Textual's ScrollView (the base of DataTable, Tree and RichLog) keeps its own virtual size, so the
one each screen reflow passes in never matches and every reflow refreshes its scrollbars. A
reflow happens at each streamed update (the answer grows), and the screen repaints the bounding
box of everything dirty: the log's and the segment table's scrollbars pulled the whole right
column into every repaint (SegmentTable, BranchTree, ValidationPanel, ReplayBudget re-rendered 5
times a second while nothing in them changed; docs/BENCHMARKS.md, workbench responsiveness).
"""

from __future__ import annotations

from textual.geometry import Size
from textual.widgets import RichLog


class SteadyScrollbars:
    """Mixin for a ScrollView: a reflow that changes neither the widget's size, its container's,
    nor its own virtual size leaves it as it is (no scrollbar refresh, no Resize event)."""

    _steady: tuple[Size, Size, Size] | None = None

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        key = (size, container_size, self.virtual_size)
        if key == self._steady:
            return False
        self._steady = key
        return super()._size_updated(size, virtual_size, container_size, layout)


class Log(SteadyScrollbars, RichLog):
    """The workbench's log pane."""
