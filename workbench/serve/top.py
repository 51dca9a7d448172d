"""`hcw top URL`: a running server's workbench panes, live — its stats line, the requests it has
answered (newest first), and for the one selected (the newest until you pick another) the
validation panel (the four layers, the plan) and the segment state table of its prompt. The
widgets are the chat workbench's; they are fed by the server's event stream (`GET /hcw/events`,
workbench/serve/events.py), read in a worker thread that posts one message per event and
reconnects, saying so, when the server goes away.

Wider than NARROW columns the requests are on the left and the panes on the right; narrower, the
three are stacked.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.coordinate import Coordinate
from textual.message import Message
from textual.widgets import DataTable, Footer, Header
from textual.worker import get_current_worker

from workbench.turns import SegmentRow
from workbench.tui.segments import SegmentPane, SegmentTable
from workbench.tui.stats import StatsBar
from workbench.tui.validation import ValidationPanel

NARROW = 110
KEEP = 200  # requests the table keeps
RETRY_S = 2.0
API = {"chat": "chat", "completions": "text"}  # the endpoint, in the requests table


@dataclass
class ServerEvent(Message):
    kind: str  # stats | request
    data: dict


@dataclass
class FeedLost(Message):
    reason: str


class TopValidation(ValidationPanel):
    hint = ""


def stats_text(s: dict, url: str) -> str:
    c = s.get("cache") or {}
    looked = c.get("lookups", 0)
    hit = f"hit rate {c.get('hit_rate', 0):.0%} · degraded {c.get('degraded_hit_rate', 0):.0%} · " if looked else ""
    failures = sum((c.get("validation_failures") or {}).values())
    return (f"{s['model']} at {url} · running {s['running']}/{s['max_batch']} · waiting {s['waiting']} · "
            f"steps {s['steps']} · lookups {looked} · {hit}usable {c.get('usable_hit_tokens', 0)} of "
            f"{c.get('logical_hit_tokens', 0)} matched tokens · validation failures {failures} · "
            f"spills {(c.get('lower') or {}).get('spills', 0)} · RSS {s['rss_mb']:.0f} MiB")


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:120]


def parse(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    """Server-sent events: (event, JSON data) pairs."""
    kind = "message"
    for line in lines:
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            yield kind, json.loads(line[5:].strip())
        elif not line:
            kind = "message"


class TopApp(App):
    CSS_PATH = "top.tcss"
    TITLE = "hcw top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW, "-wide")]
    BINDINGS = [Binding("q", "quit", "quit"), Binding("ctrl+q", "quit", "quit", show=False)]

    def __init__(self, url: str, api_key: str | None = None, feed: bool = True):
        super().__init__()
        self.url = url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.feed = feed  # False: events come from the caller (tests post them)
        self.requests: dict[int, dict] = {}
        self.selected: int | None = None
        self.sub_title = self.url

    def compose(self) -> ComposeResult:
        yield Header()
        yield StatsBar("connecting…", id="stats")
        with Horizontal(id="main"):
            table = DataTable(id="requests", cursor_type="row", zebra_stripes=True)
            table.border_title = "requests"
            yield table
            with Vertical(id="right"):
                panel = TopValidation(id="validation")
                panel.border_title = "validation"
                yield panel
                pane = SegmentPane(id="segments")
                pane.border_title = "segment states"
                yield pane
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#requests", DataTable)
        for key, label in (("id", "id"), ("api", "api"), ("prompt", "prompt"), ("cached", "cached"),
                           ("outcome", "outcome"), ("ttft", "ttft ms"), ("tps", "tok/s"), ("stop", "stop")):
            table.add_column(label, key=key)
        self.query_one(TopValidation).show_lines(["no request yet"])
        if self.feed:
            self.watch_feed()

    @work(thread=True, exclusive=True)
    def watch_feed(self) -> None:
        worker = get_current_worker()
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while not worker.is_cancelled:
            try:
                # the server sends its stats every second: a read that waits 5 s means it is gone
                with httpx.stream("GET", f"{self.url}/hcw/events", headers=headers,
                                  timeout=httpx.Timeout(5.0)) as r:
                    if r.status_code != 200:
                        reason = r.read().decode(errors="replace")
                        raise httpx.HTTPError(f"HTTP {r.status_code}: {_error_message(reason)}")
                    for kind, data in parse(r.iter_lines()):
                        if worker.is_cancelled:
                            return
                        self.post_message(ServerEvent(kind, data))
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                self.post_message(FeedLost(str(e) or type(e).__name__))
            time.sleep(RETRY_S)

    def on_server_event(self, event: ServerEvent) -> None:
        if event.kind == "stats":
            self.query_one(StatsBar).show(stats_text(event.data, self.url))
        elif event.kind == "request":
            self.add_request(event.data)

    def on_feed_lost(self, event: FeedLost) -> None:
        self.query_one(StatsBar).show(f"disconnected from {self.url}: {event.reason}; retrying every "
                                      f"{RETRY_S:.0f} s")

    def add_request(self, r: dict) -> None:
        table = self.query_one("#requests", DataTable)
        key = str(r["id"])
        known = self.requests.get(r["id"])
        if known is not None:
            if known.get("at") == r.get("at"):
                return  # shown already (a reconnect is sent the last requests again)
            del self.requests[r["id"]]  # a restarted server numbers its requests from 1 again
            table.remove_row(key)
            if self.selected == r["id"]:
                self.selected = None
        if "error" in r:
            cells = (key, API[r["endpoint"]], str(r["prompt_tokens"]), "-", "error", "-", "-", r["error"][:40])
        else:
            cells = (key, API[r["endpoint"]], str(r["prompt_tokens"]), str(r["cached_tokens"]),
                     r["outcome"] + ("" if r["exact"] else " ≈"), f"{r['ttft_ms']:.0f}", f"{r['tokens_per_s']:.0f}",
                     r["stop_reason"])
        follow = self.selected is None or self.selected == max(self.requests, default=r["id"])  # on the newest
        self.requests[r["id"]] = r
        table.add_row(*cells, key=key)
        table.sort("id", key=lambda v: -int(v))  # newest first
        while len(self.requests) > KEEP:
            oldest = min(self.requests)
            del self.requests[oldest]
            table.remove_row(str(oldest))
        if follow:
            table.move_cursor(row=0)
            self.select(r["id"])

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """The row under the cursor now (an event can arrive after rows moved: its own key is stale)."""
        table = self.query_one("#requests", DataTable)
        if table.row_count:
            self.select(int(table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value))

    def select(self, rid: int) -> None:
        r = self.requests.get(rid)
        if r is None or rid == self.selected:
            return
        self.selected = rid
        panel = self.query_one(TopValidation)
        panel.show_lines(r.get("plan") or [f"request {rid} failed: {r.get('error', '')}"])
        panel.border_title = f"validation · request {rid}"
        rows = [SegmentRow(s["index"], tuple(s["tokens"]), s["tier"], s["presence"], s["on_disk"], s["exact"],
                           s["last_access"]) for s in r.get("segments", [])]
        self.query_one(SegmentTable).update_rows(rows)
        self.query_one(SegmentPane).border_title = f"segment states · request {rid}"
