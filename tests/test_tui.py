"""The Textual workbench driven through Textual's pilot: a turn streams into the conversation and
updates the segment table, the validation panel, the reuse gauges and the stats; faults, branches
and cancel work from the prompt; quitting keeps every answered turn."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench.remote import RemoteSession
from workbench.session import ChatOptions, ChatSession
from workbench.tui.app import ChatApp
from workbench.tui.branches import BranchTree
from workbench.tui.conversation import ConversationView, MessageView
from workbench.tui.segments import SegmentTable
from workbench.tui.stats import StatsBar
from workbench.tui.validation import ValidationPanel

FACT = "The code for Mira is 4821. " + "Filler words go here and there. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("mixed"), hcw_hybrid_dict(hidden=64), seed=3)


def _app(model_dir, db, remote: bool = False, **kw) -> ChatApp:
    """The app over a session in this process, or (remote, what `hcw chat` runs) in a child process."""
    opts = ChatOptions(model=model_dir, db=db, block_size=16, checkpoint_every=1, max_new_tokens=6, **kw)
    return ChatApp(RemoteSession(opts) if remote else ChatSession(opts))


async def _say(app: ChatApp, pilot, text: str) -> None:
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await pilot.pause()
    await app.workers.wait_for_complete()
    while app.busy:  # the turn's end reaches the UI thread after the worker finishes
        await pilot.pause(0.02)
    await pilot.pause()


def _paced(app: ChatApp, seconds: float) -> None:
    """The worker waits `seconds` after each delta it hands over, so that a test watching an answer
    stream sees it stream however fast this machine generates (a slower one only takes longer)."""
    handover = app._streamed

    def streamed(delta: str) -> None:
        handover(delta)
        time.sleep(seconds)

    app._streamed = streamed


def _text(widget) -> str:
    return str(widget.render())


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "engine-process"])
def test_turns_update_every_pane(model_dir, tmp_path, remote):
    async def scenario():
        app = _app(model_dir, tmp_path / "a.db", remote)
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)
            views = list(app.query(MessageView))
            assert [v.has_class(r) for v, r in zip(views, ("system", "user", "assistant"))] == [True] * 3
            assert "outcome: miss" in _text(app.query_one(ValidationPanel))
            assert app.query_one(SegmentTable).row_count == len(app.session.segments()) > 0
            await _say(app, pilot, "What is the code for Mira?")
            panel = _text(app.query_one(ValidationPanel))
            assert "outcome: hit" in panel and "layer 3: pass" in panel
            assert "turns 2 · hit rate 50%" in _text(app.query_one(StatsBar))
            assert len(app.query(MessageView)) == 5
            assert app.query(MessageView)[-1].source == app.session.path()[-1].content

            await _say(app, pilot, "/fault evict-compressed")
            await _say(app, pilot, "And again?")
            panel = _text(app.query_one(ValidationPanel))
            assert "FAIL" in panel and "compressed" in panel

            await _say(app, pilot, "/branch side")
            assert app.session.thread.name == "side"
            labels = [str(n.label) for n in app.query_one(BranchTree).root.children[0].children]
            assert labels  # the system message has children in the tree
    asyncio.run(scenario())


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "engine-process"])
def test_quit_while_generating_cancels_first_and_keeps_the_partial_answer(model_dir, tmp_path, remote):
    db = tmp_path / "q.db"

    async def scenario():
        app = _app(model_dir, db, remote)
        # an answer far longer than the quit takes to arrive (the worker never waits for the screen)
        app.session.opts = ChatOptions(model=model_dir, db=db, block_size=16, max_new_tokens=20000, ignore_eos=True)
        async with app.run_test(size=(160, 50)) as pilot:
            app.run_command(FACT)
            await pilot.press("ctrl+q")
            while app.busy:  # the turn ends (cancelled), then the app exits (which cancels the worker object)
                await pilot.pause(0.02)
        return app.session.conversation.id

    conversation = asyncio.run(scenario())
    again = ChatSession(ChatOptions(model=model_dir, db=db, block_size=16, session=conversation))
    path = again.path()
    assert [m.role for m in path] == ["system", "user", "assistant"]
    assert json.loads(again.store.db.execute("SELECT meta FROM messages WHERE id = ?",
                                             [path[-1].id]).fetchone()[0])["stop_reason"] == "cancelled"


def test_an_edit_from_the_prompt_shows_the_new_answer(model_dir, tmp_path):
    async def scenario():
        app = _app(model_dir, tmp_path / "e.db")
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)
            await _say(app, pilot, "/edit 1 goodbye")
            views = list(app.query(MessageView))
            path = app.session.path()
            assert [v.source for v in views] == [m.content for m in path]
            assert path[1].content == "goodbye" and path[-1].role == "assistant"
    asyncio.run(scenario())


def test_escape_cancels_and_quit_keeps_answered_turns(model_dir, tmp_path):
    db = tmp_path / "b.db"

    async def scenario():
        app = _app(model_dir, db, )
        app.session.opts = ChatOptions(model=model_dir, db=db, block_size=16, max_new_tokens=200)
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)
            app.run_command("Tell me more.")
            app.action_cancel()
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.last.stop_reason == "cancelled" and len(app.last.token_ids) < 200
            await pilot.press("ctrl+q")
        return app.session.conversation.id

    conversation = asyncio.run(scenario())
    again = ChatSession(ChatOptions(model=model_dir, db=db, block_size=16, session=conversation))
    assert [m.role for m in again.path()] == ["system", "user", "assistant", "user", "assistant"]


def test_typing_works_while_an_answer_streams(model_dir, tmp_path):
    """The prompt takes keys while the worker generates, and the answer arrives on screen in
    pieces (the worker hands deltas over without waiting for the screen). The worker is held
    after its 1st and 200th delta until the test has seen them, so that "while" does not depend
    on how fast this machine generates; how fast is benchmarks/tui_responsiveness.py's business."""
    db = tmp_path / "t.db"

    async def scenario():
        app = _app(model_dir, db)
        app.session.opts = ChatOptions(model=model_dir, db=db, block_size=16, max_new_tokens=1500, ignore_eos=True)
        holds = {1: threading.Event(), 200: threading.Event()}
        deltas = []
        handover = app._streamed

        def streamed(delta: str) -> None:  # runs on the worker thread
            handover(delta)
            deltas.append(delta)
            if len(deltas) in holds:
                holds[len(deltas)].wait(60)

        app._streamed = streamed

        async def until(condition) -> None:
            for _ in range(3000):
                if condition():
                    return
                await pilot.pause(0.02)
            raise AssertionError("the app never got there")

        def shown() -> int:
            return len(app.query(MessageView)[-1].source)

        async with app.run_test(size=(160, 50)) as pilot:
            app.query_one("#prompt").value = FACT
            await pilot.press("enter")
            await until(lambda: shown() > 0)  # the first delta is on screen, the worker held
            for _ in range(8):
                await pilot.press("x")
            assert app.busy and app.query_one("#prompt").value == "x" * 8  # keys landed mid-answer
            first = shown()
            holds[1].set()
            await until(lambda: len(deltas) >= 200 and shown() > first)
            second = shown()
            holds[200].set()
            await until(lambda: not app.busy)
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.query_one("#prompt").value == "x" * 8
            assert len(app.last.token_ids) == 1500 and app.last.stop_reason == "length"
            assert 0 < first < second < len(app.last.text)  # partial answers were on screen before the end
            assert app.query(MessageView)[-1].source == app.last.text
    asyncio.run(scenario())


def test_a_turn_keeps_the_views_of_earlier_messages_and_the_pane_follows_the_answer(model_dir, tmp_path):
    """After a turn only the new messages are mounted (remounting every message re-parsed and re-laid
    out the whole conversation after each answer: ~1 s for 60 messages); a branch switch keeps the
    views up to the fork. A long answer streaming into a short pane keeps its end in view, unless
    the user has scrolled up to read."""
    db = tmp_path / "f.db"

    async def scenario():
        app = _app(model_dir, db)
        async with app.run_test(size=(160, 30)) as pilot:
            await _say(app, pilot, FACT)
            first = list(app.query(MessageView))
            await _say(app, pilot, "What is the code for Mira?")
            second = list(app.query(MessageView))
            assert len(second) == 5 and all(a is b for a, b in zip(first, second))
            assert [v.source for v in second] == [m.content for m in app.session.path()]

            pane = app.query_one(ConversationView)
            _paced(app, 0.005)  # 400 tokens: >= 2 s of streaming to watch
            app.session.opts = ChatOptions(model=model_dir, db=db, block_size=16, max_new_tokens=400,
                                           ignore_eos=True)
            app.query_one("#prompt").value = "Tell me more."
            await pilot.press("enter")
            followed = []
            while app.busy:
                await pilot.pause(0.05)
                followed.append((pane.max_scroll_y, pane.scroll_y))
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert pane.max_scroll_y > 0 and pane.scroll_y == pane.max_scroll_y
            assert sum(m > 0 and y == m for m, y in followed) >= 2  # at the end while it grew

            app.query_one("#prompt").value = "And more."
            await pilot.press("enter")
            while app.busy and pane.scroll_y < 5:
                await pilot.pause(0.02)
            pane.scroll_home(animate=False, immediate=True)  # the user scrolls up to read
            reading = []
            while app.busy:
                await pilot.pause(0.05)
                reading.append(pane.scroll_y)
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert reading and set(reading) == {0} and pane.scroll_y == 0  # not pulled down while reading
            kept = list(app.query(MessageView))[:5]
            assert all(a is b for a, b in zip(kept, second))

            app.run_command("/branch side")  # a fork at the last message, then a switch back
            await pilot.pause()
            app.run_command("/switch main")
            await pilot.pause()
            await pilot.pause()
            views = list(app.query(MessageView))
            assert all(a is b for a, b in zip(views[:5], second))
            assert [v.source for v in views] == [m.content for m in app.session.path()]
    asyncio.run(scenario())


def test_a_growing_answer_does_not_repaint_the_right_column(model_dir, tmp_path, monkeypatch):
    """Each streamed update grows the answer and so reflows the screen. Textual's scroll views
    refreshed their scrollbars on every reflow, and the screen repaints the bounding box of what is
    dirty: the log's and the segment table's scrollbars pulled every right-hand pane into each
    repaint, 5 times a second (workbench/tui/steady.py)."""
    from collections import Counter

    from textual.widget import Widget

    renders = Counter()
    render_lines = Widget.render_lines

    def counted(self, crop):
        if isinstance(self, (SegmentTable, BranchTree, ValidationPanel)):
            renders[type(self).__name__] += 1
        return render_lines(self, crop)

    async def scenario():
        app = _app(model_dir, tmp_path / "g.db")
        # what else repaints on its own: the once-a-second stats line (process memory moves) and,
        # below, the prompt's cursor blink
        monkeypatch.setattr(StatsBar, "show", lambda self, line: None)
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)  # every pane has content, the log a line
            answer = app.query(MessageView)[-1]
            app.query_one("#prompt").cursor_blink = False
            await pilot.pause(0.3)
            monkeypatch.setattr(Widget, "render_lines", counted)
            for i in range(6):
                answer.append(f"\n\nAnother paragraph, number {i}, long enough to wrap. " * 2)
                await pilot.pause()
                await pilot.pause()
            height = answer.size.height
            monkeypatch.undo()
            assert height > 12  # it grew, so the screen reflowed
            assert not renders, renders
    asyncio.run(scenario())


def test_a_streamed_answer_is_redrawn_from_the_stored_message_when_the_turn_ends():
    """Markdown.append parses only the new text, and appends that overlap (the last timer flush and
    the turn's own) can draw a different document than the text: a list and a quote drawn twice
    (found in review). The turn's end re-draws the streamed view from the stored message; views
    that were not streamed are kept as they are."""
    from textual.app import App
    from textual.widgets._markdown import MarkdownBlock

    from store.conversations import Message

    text = "1. first\n2. second\n   continued\n3. third\n\n> quote line\n> more\n\nend"

    def shape(view):
        return [type(w).__name__ for w in view.walk_children() if isinstance(w, MarkdownBlock)]

    class Pane(App):
        def compose(self):
            yield ConversationView()

    async def scenario():
        app = Pane()
        async with app.run_test(size=(80, 60)) as pilot:
            pane = app.query_one(ConversationView)
            user = pane.add(0, "user", "hi")
            answer = pane.add(1, "assistant", "", streamed=True)
            reference = pane.add(2, "assistant", text)
            await pilot.pause()
            pieces = ["1", ". first\n2.", " second\n", "   con", "tinu", "ed\n3. third\n", "\n> quo", "te line\n> mo",
                      "re", "\n\nen", "d"]  # the last two appended without a pause: they overlap
            for i, piece in enumerate(pieces):
                answer.append(piece)
                if i != len(pieces) - 2:
                    await pilot.pause(0.01)
            for _ in range(3):
                await pilot.pause()
            drawn_streamed = shape(answer)
            await reference.remove()
            pane.show([Message("u", "c", None, "user", "hi", None, ""), Message("a", "c", "u", "assistant", text, None, "")])
            for _ in range(3):
                await pilot.pause()
            views = list(pane.query_children(MessageView))
            assert views == [user, answer] and not answer.streamed and answer.source == text
            fresh = MessageView(text, "assistant")
            await pane.mount(fresh)
            await pilot.pause()
            assert shape(answer) == shape(fresh)
            return drawn_streamed, shape(fresh)

    drawn_streamed, wanted = asyncio.run(scenario())
    assert drawn_streamed != wanted  # the overlap did draw something else: the re-draw was needed


def test_the_workbench_layout_snapshot(model_dir, tmp_path, monkeypatch, snap_compare):
    """The layout a user sees on start (ids and memory pinned so the picture is reproducible)."""
    import itertools

    import psutil

    counter = itertools.count()
    # ids only: sqlite-utils draws its savepoint names from the same function
    monkeypatch.setattr("store.conversations.secrets", SimpleNamespace(token_hex=lambda n: f"{next(counter):0{2 * n}x}"))

    class Memory:
        rss = 512 << 20
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: Memory())
    app = _app(model_dir, tmp_path / "snap.db")
    assert snap_compare(app, terminal_size=(150, 40))


def _pin_screen(monkeypatch):
    """Ids, memory and timings pinned so a picture after real turns is reproducible."""
    import itertools
    import re

    import psutil

    from workbench import plain
    from workbench.tui import app as app_module

    counter = itertools.count()
    # ids only: sqlite-utils draws its savepoint names from the same function
    monkeypatch.setattr("store.conversations.secrets", SimpleNamespace(token_hex=lambda n: f"{next(counter):0{2 * n}x}"))

    class Memory:
        rss = 512 << 20
    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: Memory())

    def timeless(fn):
        return lambda *a: re.sub(r"[\d.]+ tok/s", "# tok/s", re.sub(r"TTFT \d+ ms", "TTFT # ms", fn(*a)))
    monkeypatch.setattr(plain, "status_line", timeless(plain.status_line))
    monkeypatch.setattr(app_module, "stats_line", timeless(app_module.stats_line))


@pytest.mark.parametrize("screen", ["hit", "fault-and-branch"])
def test_the_workbench_after_turns_snapshot(model_dir, tmp_path, monkeypatch, snap_compare, screen):
    """The main screens after real turns: a miss then a hit (every pane filled in); a fault drill
    that fails validation layer 3, then a branch (two tips in the tree)."""
    _pin_screen(monkeypatch)
    app = _app(model_dir, tmp_path / "turns.db")

    async def turns(pilot):
        app.query_one("#prompt").cursor_blink = False  # a blinking cursor would make the picture racy
        await _say(app, pilot, FACT)
        await _say(app, pilot, "What is the code for Mira?")
        if screen == "fault-and-branch":
            await _say(app, pilot, "/fault evict-compressed")
            await _say(app, pilot, "And again?")
            await _say(app, pilot, "/branch side")
            await _say(app, pilot, "Another question.")
        await pilot.pause()
    assert snap_compare(app, terminal_size=(150, 45), run_before=turns)


def test_the_segment_table_updates_rows_in_place_adds_and_removes():
    """Rows keyed by segment: a changed cell is rewritten, a new segment added, one no longer on
    the branch removed (one pass over the rows: the lookup per row was quadratic, ~190 ms per
    update at 2,000 segments)."""
    from textual.app import App

    from workbench.session import PRESENCE, SegmentRow

    def rows(indices, tier):
        return [SegmentRow(i, (16 * i, 16 * i + 16), tier, {p: i % 2 == 0 for p in PRESENCE}, False, True, i)
                for i in indices]

    class Pane(App):
        def compose(self):
            yield SegmentTable()

    async def scenario():
        async with Pane().run_test() as pilot:
            table = pilot.app.query_one(SegmentTable)
            table.update_rows(rows(range(5), "device"))
            table.update_rows(rows([0, 2, 3, 5], "host"))
            await pilot.pause()
            assert sorted(k.value for k in table.rows) == ["0", "2", "3", "5"]
            assert [table.get_cell(k, "tier") for k in ("0", "2", "3", "5")] == ["host"] * 4
            assert table.get_cell("5", "tokens") == "80–96" and table.border_subtitle == "4 segment(s)"
    asyncio.run(scenario())


def test_the_app_decodes_with_a_core_left_to_its_own_thread(model_dir, tmp_path):
    from engine.threads import threads_beside_ui

    app = _app(model_dir, tmp_path / "c.db")
    assert app.session.opts.decode_threads == threads_beside_ui()
    app.session.close()
    chosen = ChatApp(ChatSession(ChatOptions(model=model_dir, db=tmp_path / "d.db", decode_threads=3)))
    assert chosen.session.opts.decode_threads == 3  # a choice the user made is kept
    chosen.session.close()


def test_the_app_exits_saying_so_when_the_engine_process_dies(model_dir, tmp_path):
    import dataclasses
    import os
    import signal

    async def scenario():
        app = _app(model_dir, tmp_path / "x.db", remote=True)
        app.session.opts = dataclasses.replace(app.session.opts, max_new_tokens=20000, ignore_eos=True)
        async with app.run_test(size=(160, 50)) as pilot:
            app.run_command(FACT)
            while app.busy and not app.query(MessageView)[-1].source:  # the answer has started
                await pilot.pause(0.02)
            os.kill(app.session.pid, signal.SIGKILL)
            while app.return_code is None:
                await pilot.pause(0.02)
        return app.return_code

    assert asyncio.run(scenario()) == 1
