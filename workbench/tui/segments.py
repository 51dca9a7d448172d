"""The segment state table, live: one row per segment of the current branch, updated in place."""

from __future__ import annotations

from textual.widgets import DataTable

from workbench.session import PRESENCE, SegmentRow
from workbench.tui.steady import SteadyScrollbars

COLUMNS = ("seg", "tokens", "tier", *PRESENCE, "disk", "reuse", "access")


def cells(row: SegmentRow) -> tuple[str, ...]:
    flags = tuple("●" if row.presence[c] else "·" for c in PRESENCE)
    return (str(row.index), f"{row.tokens[0]}–{row.tokens[1]}", row.tier, *flags, "●" if row.on_disk else "·",
            "exact" if row.exact else "approx", str(row.last_access) if row.last_access >= 0 else "-")


class SegmentTable(SteadyScrollbars, DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for name in COLUMNS:
            self.add_column(name, key=name)

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
        self.border_subtitle = f"{len(rows)} segment(s)"
