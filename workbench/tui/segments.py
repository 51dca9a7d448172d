"""The segment state table, live: one row per segment of the current branch, updated in place.

Its twelve columns have short labels, explained by a legend under the table, so that all of them
fit in the right-hand pane at 120 columns (and in the pane's tab at 80)."""

from __future__ import annotations

from textual.containers import Vertical
from textual.widgets import DataTable, Static

from workbench.session import PRESENCE
from workbench.turns import SegmentRow
from workbench.tui.steady import SteadyScrollbars

# column key -> (its label, what the legend says it is); the keys are the row's fields
COLUMNS: dict[str, tuple[str, str]] = {
    "seg": ("seg", "segment"), "tokens": ("tokens", "its token range"), "tier": ("tier", "where its states are"),
    "kv": ("K", "kv"), "compressed": ("C", "compressed"), "tail": ("T", "tail"),
    "window": ("W", "window"), "indexer": ("I", "indexer"), "gdn": ("G", "GDN ckpt"),
    "disk": ("D", "on disk"), "reuse": ("R", "= exact ≈ approx"), "access": ("acc", "last use")}
assert list(COLUMNS)[3:9] == list(PRESENCE)  # a presence column the table lacks would be a silent gap
LEGEND = " · ".join(f"{label} {meaning}" for label, meaning in list(COLUMNS.values())[3:])


def cells(row: SegmentRow) -> tuple[str, ...]:
    flags = tuple("●" if row.presence[c] else "·" for c in PRESENCE)
    return (str(row.index), f"{row.tokens[0]}–{row.tokens[1]}", row.tier, *flags, "●" if row.on_disk else "·",
            "=" if row.exact else "≈", str(row.last_access) if row.last_access >= 0 else "-")


class SegmentTable(SteadyScrollbars, DataTable):
    summary = ""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for key, (label, _) in COLUMNS.items():
            self.add_column(label, key=key)

    def update_rows(self, rows: list[SegmentRow]) -> None:
        """Rows keyed by segment index: changed cells are updated in place, new rows added, rows
        of segments no longer on this branch removed."""
        wanted = {str(r.index): cells(r) for r in rows}
        present = {k.value for k in self.rows}  # (once: per row it made an update quadratic in the segments)
        for key in present - wanted.keys():
            self.remove_row(key)
        for key, values in wanted.items():
            if key in present:
                for column, value in zip(COLUMNS, values):
                    if self.get_cell(key, column) != value:
                        self.update_cell(key, column, value)
            else:
                self.add_row(*values, key=key)
        self.summary = f"{len(rows)} segment(s)"
        if isinstance(self.parent, SegmentPane):
            self.parent.border_subtitle = self.summary


class SegmentPane(Vertical):
    """The table and its legend, under one border and title."""

    def compose(self):
        yield SegmentTable(id="segment-table")
        yield Static(LEGEND, id="segment-legend", markup=False)
