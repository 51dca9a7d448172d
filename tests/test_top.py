"""`hcw top`: the workbench's panes for a running server, fed by its event stream; readable at
80x24, 120x40 and 200x50; says so when the server is gone."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from serve_helpers import serving
from workbench.serve.top import ServerEvent, TopApp
from workbench.tui.segments import SegmentTable
from workbench.tui.stats import StatsBar
from workbench.tui.validation import ValidationPanel

MIRA = "Remember: the code for Ada is 5512, the code for Bo is 7301. The code for Mira is 4821. What is Mira's code?"


async def until(pilot, check, seconds: float = 60) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        await pilot.pause(0.05)
    raise AssertionError("the app never got there")


def test_top_shows_a_live_servers_requests_plans_and_segments(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db") as (served, base):
        ask = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        ask.chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8,
                                    messages=[{"role": "user", "content": MIRA}])  # before top: replayed to it
        app = TopApp(f"{base}/v1")

        async def run():
            async with app.run_test(size=(120, 40)) as pilot:
                await until(pilot, lambda: len(app.requests) == 1)
                later = threading.Thread(target=lambda: ask.chat.completions.create(
                    model="hcw-tiny", temperature=0, max_tokens=8, messages=[{"role": "user", "content": MIRA}]))
                later.start()
                await until(pilot, lambda: len(app.requests) == 2)
                later.join()
                await until(pilot, lambda: "lookups 2" in app.query_one(StatsBar).shown)
                panel = app.query_one(ValidationPanel)
                assert panel.text.startswith("outcome: hit")  # the newest request is shown: the repeat hit
                assert "layer 3 group intersection: pass" in panel.text
                assert app.query_one(SegmentTable).row_count == 1
                assert app.query_one("#requests").row_count == 2

        asyncio.run(run())


def test_top_says_when_the_server_is_gone():
    app = TopApp("http://127.0.0.1:9")  # nothing listens on the discard port here

    async def run():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.query_one(StatsBar).shown.startswith("disconnected from"))
            line = app.query_one(StatsBar).shown
            assert line.startswith("disconnected from http://127.0.0.1:9: ") and line.endswith("retrying every 2 s")
            assert app.is_running  # a lost server is said, not a crash

    asyncio.run(run())


STATS = {"model": "hcw-tiny", "running": 1, "waiting": 0, "steps": 40, "max_batch": 8, "uptime_s": 12.0,
         "rss_mb": 300.0, "cache": {"lookups": 2, "hit_rate": 0.5, "degraded_hit_rate": 0.0, "usable_hit_tokens": 64,
                                    "logical_hit_tokens": 64, "validation_failures": {}, "lower": {"spills": 0}}}
PLAN = ["outcome: hit", "logical hit 64 tokens · usable 64 · prompt 80", "layer 1 alignment: pass",
        "layer 2 kernel interface: pass", "layer 3 group intersection: pass", "layer 4 byte alignment: pass",
        "  reuse     10 state kinds tokens [0, 64) layers [0, 1, 2, 3, 4, 5, 6, 7]",
        "  recompute all            tokens [64, 80) prefill"]
SEGMENT = {"index": 0, "tokens": [0, 64], "tier": "device", "on_disk": True, "exact": True, "last_access": 2,
           "presence": {c: True for c in ("kv", "compressed", "tail", "window", "indexer", "gdn")}}


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)], ids=["80x24", "120x40", "200x50"])
def test_top_snapshot(snap_compare, size):
    app = TopApp("http://127.0.0.1:8080", feed=False)

    async def feed(pilot):
        app.post_message(ServerEvent("stats", STATS))
        for rid, (cached, outcome) in enumerate([(0, "miss"), (64, "hit")], start=1):
            app.post_message(ServerEvent("request", {
                "id": rid, "endpoint": "chat", "prompt_tokens": 80, "completion_tokens": 5, "cached_tokens": cached,
                "outcome": outcome, "exact": True, "stop_reason": "stop", "ttft_ms": 20.0 - 10 * (rid - 1),
                "tokens_per_s": 300.0, "plan": PLAN if outcome == "hit" else ["outcome: miss"],
                "segments": [SEGMENT]}))
        await pilot.pause()
        assert "hcw-tiny at" in app.query_one(StatsBar).shown

    assert snap_compare(app, terminal_size=size, run_before=feed)


def test_top_shows_a_replayed_request_once_and_a_restarted_servers_anew():
    app = TopApp("http://127.0.0.1:8080", feed=False)
    event = {"id": 1, "endpoint": "chat", "prompt_tokens": 80, "completion_tokens": 5, "cached_tokens": 0,
             "outcome": "miss", "exact": True, "stop_reason": "stop", "ttft_ms": 20.0, "tokens_per_s": 300.0,
             "plan": ["outcome: miss"], "segments": [], "at": 100.0}

    async def run():
        async with app.run_test(size=(120, 40)) as pilot:
            app.post_message(ServerEvent("request", event))
            app.post_message(ServerEvent("request", event))  # a reconnect sends it again
            await pilot.pause()
            table = app.query_one("#requests")
            assert table.row_count == 1
            app.post_message(ServerEvent("request", {**event, "at": 200.0, "outcome": "hit", "plan": PLAN}))
            await pilot.pause()  # the same id from a server started again: the new one replaces it
            assert table.row_count == 1 and app.requests[1]["at"] == 200.0
            assert app.query_one(ValidationPanel).text.startswith("outcome: hit")

    asyncio.run(run())
