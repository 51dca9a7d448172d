"""The stats bar: turns (and cancelled ones), hit rate, degraded-hit rate, TTFT, tokens/s, process and
device memory."""

from __future__ import annotations

from textual.widgets import Static


def stats_line(stats: dict) -> str:
    cancelled = f" (+{stats['cancelled']} cancelled)" if stats.get("cancelled") else ""
    return (f"turns {stats['turns']}{cancelled} · hit rate {stats['hit_rate']:.0%} · "
            f"degraded {stats['degraded_rate']:.0%} · "
            f"TTFT {stats['ttft_ms']:.0f} ms · {stats['tokens_per_s']:.1f} tok/s · "
            f"RSS {stats['rss_mb']:.0f} MiB · device {stats['device_mb']:.0f} MiB")


class StatsBar(Static):
    """One line of fixed height: a new text is repainted without a layout of the screen (which
    re-arranges every pane and, while an answer streams, costs the generating thread the GIL),
    and an unchanged one not even repainted."""

    shown = ""

    def show(self, line: str) -> None:
        if line != self.shown:
            self.shown = line
            self.update(line, layout=False)
