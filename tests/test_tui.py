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
from workbench.tui.app import NARROW, ChatApp
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
    opts = ChatOptions.of(model=model_dir, db=db, block_size=16, checkpoint_every=1, max_new_tokens=6, **kw)
    return ChatApp(RemoteSession(opts) if remote else ChatSession(opts))


async def _say(app: ChatApp, pilot, text: str) -> None:
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await pilot.pause()
    await app.workers.wait_for_complete()
    while app.busy:  # the turn's end reaches the UI thread after the worker finishes
        await pilot.pause(0.02)
    await pilot.pause()


async def _until_answering(app: ChatApp, pilot) -> None:
    """Until the answer of the turn in flight has streamed some text."""
    while app.busy and not (app._stream_text or app._stream_view.source):
        await pilot.pause(0.01)


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


def _logged(app: ChatApp) -> str:
    """The log pane's text, its wrapped lines joined again."""
    return "".join(line.text for line in app.log_view.lines)


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "engine-process"])
def test_turns_update_every_pane(model_dir, tmp_path, remote):
    async def scenario():
        app = _app(model_dir, tmp_path / "a.db", remote)
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)
            views = list(app.query(MessageView))
            assert [v.has_class(r) for v, r in zip(views, ("system", "user", "assistant"))] == [True] * 3
            assert "outcome: miss" in app.validation.text
            assert app.query_one(SegmentTable).row_count == len(app.session.segments()) > 0
            await _say(app, pilot, "What is the code for Mira?")
            panel = app.validation.text
            assert "outcome: hit" in panel and "layer 3 group intersection: pass" in panel
            assert "turns 2 · hit rate 50%" in _text(app.query_one(StatsBar))
            assert len(app.query(MessageView)) == 5
            assert app.query(MessageView)[-1].source == app.session.path()[-1].content

            await _say(app, pilot, "/fault evict-compressed")
            await _say(app, pilot, "And again?")
            panel = app.validation.text
            assert "layer 3 group intersection: FAIL" in panel and "compressed" in panel

            await _say(app, pilot, "/branch side")
            assert app.session.thread.name == "side"
            tree = app.query_one(BranchTree)
            await pilot.pause()
            # both branches' tips are the last message; the cursor follows the current one
            assert "◀ main" in str(tree.tip.label) and "◀ side" in str(tree.tip.label)
            assert tree.cursor_node is tree.tip
    asyncio.run(scenario())


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "engine-process"])
def test_quit_while_generating_cancels_first_and_keeps_the_partial_answer(model_dir, tmp_path, remote):
    db = tmp_path / "q.db"

    async def scenario():
        app = _app(model_dir, db, remote)
        # an answer far longer than the quit takes to arrive (the worker never waits for the screen)
        app.session.opts = ChatOptions.of(model=model_dir, db=db, block_size=16, max_new_tokens=20000, ignore_eos=True)
        async with app.run_test(size=(160, 50)) as pilot:
            app.run_command(FACT)
            await _until_answering(app, pilot)  # (a turn cancelled before its first token keeps no answer)
            await pilot.press("ctrl+q")
            while app.busy:  # the turn ends (cancelled), then the app exits (which cancels the worker object)
                await pilot.pause(0.02)
        return app.session.conversation.id

    conversation = asyncio.run(scenario())
    again = ChatSession(ChatOptions.of(model=model_dir, db=db, block_size=16, session=conversation))
    path = again.path()
    assert [m.role for m in path] == ["system", "user", "assistant"]
    assert json.loads(again.store.db.execute("SELECT meta FROM messages WHERE id = ?",
                                             [path[-1].id]).fetchone()[0])["stop_reason"] == "cancelled"
    again.close()  # (one left open slowed the later tests' generation ~60x)


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
        app.session.opts = ChatOptions.of(model=model_dir, db=db, block_size=16, max_new_tokens=200)
        async with app.run_test(size=(160, 50)) as pilot:
            await _say(app, pilot, FACT)
            app.run_command("Tell me more.")
            await _until_answering(app, pilot)
            app.action_cancel()
            await app.workers.wait_for_complete()
            while app.busy:  # the turn's end reaches the UI thread after the worker finishes
                await pilot.pause(0.02)
            assert app.last.stop_reason == "cancelled" and len(app.last.token_ids) < 200
            assert app.query(MessageView)[-1].border_title.endswith("cancelled")  # labelled where it is shown
            await pilot.press("ctrl+q")
        return app.session.conversation.id

    conversation = asyncio.run(scenario())
    again = ChatSession(ChatOptions.of(model=model_dir, db=db, block_size=16, session=conversation))
    assert [m.role for m in again.path()] == ["system", "user", "assistant", "user", "assistant"]
    again.close()  # (one left open slowed the later tests' generation ~60x)


def test_typing_works_while_an_answer_streams(model_dir, tmp_path):
    """The prompt takes keys while the worker generates, and the answer arrives on screen in
    pieces (the worker hands deltas over without waiting for the screen). The worker is held
    after its 1st and 200th delta until the test has seen them, so that "while" does not depend
    on how fast this machine generates; how fast is benchmarks/tui_responsiveness.py's business."""
    db = tmp_path / "t.db"

    async def scenario():
        app = _app(model_dir, db)
        app.session.opts = ChatOptions.of(model=model_dir, db=db, block_size=16, max_new_tokens=1500, ignore_eos=True)
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
            raise AssertionError(f"the app never got there: busy {app.busy}, {len(deltas)} deltas, {shown()} shown")

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
            app.session.opts = ChatOptions.of(model=model_dir, db=db, block_size=16, max_new_tokens=400,
                                           ignore_eos=True)
            app.query_one("#prompt").value = "Tell me more."
            await pilot.press("enter")
            followed = []
            while app.busy:
                await pilot.pause(0.05)
                followed.append((pane.max_scroll_y, pane.scroll_y))
            await app.workers.wait_for_complete()
            # the answer's final render and the follow-scroll after it land over a refresh or a few
            # (more of them on a loaded machine): a bounded number of pauses, not a single one
            for _ in range(20):
                await pilot.pause(0.05)
                if pane.scroll_y == pane.max_scroll_y:
                    break
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


# an answer streamed in pieces: a list and a quote, which appends that overlap draw twice
MARKDOWN = "1. first\n2. second\n   continued\n3. third\n\n> quote line\n> more\n\nend"
PIECES = ["1", ". first\n2.", " second\n", "   con", "tinu", "ed\n3. third\n", "\n> quo", "te line\n> mo", "re",
          "\n\nen", "d"]


def _blocks(view) -> list:
    from textual.widgets._markdown import MarkdownBlock

    return [w for w in view.walk_children() if isinstance(w, MarkdownBlock)]


def _stored(role: str, text: str):
    from store.conversations import Message

    return Message(role[0], "c", None, role, text, None, "")


def _pane_app():
    from textual.app import App

    class Pane(App):
        def compose(self):
            yield ConversationView()
    return Pane()


def test_a_streamed_answer_is_redrawn_from_the_stored_message_when_its_appends_overlapped():
    """Markdown.append parses from where the append before it stopped, so appends that overlap (the
    last timer flush and the turn's own) can draw a different document than the text: a list and a
    quote drawn twice (found in review). The turn's end re-draws such a view from the stored
    message; views that were not streamed are kept as they are."""
    def shape(view):
        return [type(w).__name__ for w in _blocks(view)]

    async def scenario():
        app = _pane_app()
        async with app.run_test(size=(80, 60)) as pilot:
            pane = app.query_one(ConversationView)
            user = pane.add(0, "user", "hi")
            answer = pane.add(1, "assistant", "", streamed=True)
            reference = pane.add(2, "assistant", MARKDOWN)
            await pilot.pause()
            for i, piece in enumerate(PIECES):
                answer.append(piece)
                if i != len(PIECES) - 2:  # the last two appended without a pause: they overlap
                    await pilot.pause(0.01)
            for _ in range(3):
                await pilot.pause()
            drawn_streamed = shape(answer)
            assert answer.overlapped
            await reference.remove()
            pane.show([_stored("user", "hi"), _stored("assistant", MARKDOWN)])
            for _ in range(3):
                await pilot.pause()
            views = list(pane.query_children(MessageView))
            assert views == [user, answer] and not answer.streamed and answer.source == MARKDOWN
            fresh = MessageView(MARKDOWN, "assistant")
            await pane.mount(fresh)
            await pilot.pause()
            assert shape(answer) == shape(fresh)
            return drawn_streamed, shape(fresh)

    drawn_streamed, wanted = asyncio.run(scenario())
    assert drawn_streamed != wanted  # the overlap did draw something else: the re-draw was needed


def test_a_streamed_answer_whose_appends_never_overlapped_is_kept_as_drawn():
    """Each append re-parses from the start of the last block drawn, so appends one after another
    draw what one parse of the whole text draws: the turn's end keeps that view (re-drawing it was
    most of the turn's end, docs/BENCHMARKS.md) and the screen is the one a fresh view draws."""
    async def scenario():
        app = _pane_app()
        async with app.run_test(size=(80, 30)) as pilot:
            pane = app.query_one(ConversationView)
            answer = pane.add(0, "assistant", "", streamed=True)
            await pilot.pause()
            for piece in PIECES:
                await answer.append(piece)
            blocks = _blocks(answer)
            pane.show([_stored("assistant", MARKDOWN)])
            for _ in range(3):
                await pilot.pause()
            assert not answer.streamed and not answer.overlapped
            assert _blocks(answer) == blocks  # the same widgets: nothing was re-drawn
            streamed = app.export_screenshot()
            await answer.remove()
            pane.add(0, "assistant", MARKDOWN)
            for _ in range(3):
                await pilot.pause()
            return streamed, app.export_screenshot()

    streamed, fresh = asyncio.run(scenario())
    assert streamed == fresh


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


async def _assert_every_pane_readable(app: ChatApp, pilot) -> None:
    """From the widgets, not the picture: every pane has its title on screen (its border's, and its
    tab's when the panes are tabs), can be seen at a readable size, and every segment column fits
    without scrolling sideways; the prompt's placeholder and every footer key are whole."""
    from textual.widgets import Tabs
    from textual.widgets._footer import FooterKey

    from workbench.tui.app import PANES
    from workbench.tui.segments import COLUMNS

    width, height = app.size
    narrow = width < NARROW
    assert app.screen.has_class("-narrow") == narrow
    tabs = app.query_one(Tabs)
    assert tabs.display == narrow
    if narrow:
        assert [str(t.label) for t in tabs.query("Tab")] == list(PANES.values())
        assert all(t.region.right <= width and t.region.height for t in tabs.query("Tab"))  # every tab label whole
    for pane, title in PANES.items():
        widget = app.query_one(f"#{pane}")
        if narrow:  # one pane at a time: each shown in turn, across the whole width
            tabs.active = f"tab-{pane}"
            await pilot.pause()
        assert widget.border_title == title and widget.styles.border_top[0]  # a border, so the title is drawn
        region = widget.region
        assert region.width >= (width if narrow else 58) and region.height >= 5, (pane, region)
        assert app.screen.region.contains_region(region), (pane, region)
        if pane == "segments":
            table = app.query_one(SegmentTable)
            assert [c.value for c in table.columns] == list(COLUMNS)
            assert table.virtual_size.width <= table.scrollable_content_region.width, "a column is cut"
            assert table.max_scroll_x == 0 and table.row_count == len(app.session.segments())
        if pane == "validation":
            assert all(name in widget.text for name in ("alignment", "kernel interface", "group intersection",
                                                         "byte alignment"))
            assert widget.max_scroll_y == 0 or widget.show_vertical_scrollbar  # more than fits: a scrollbar says so
        if pane == "branches":
            assert widget.tip is not None and widget.cursor_node is widget.tip
            assert widget.scroll_y <= widget.cursor_line < widget.scroll_y + widget.scrollable_content_region.height
    if narrow:
        tabs.active = "tab-conversation"
        await pilot.pause()
    prompt = app.query_one("#prompt")
    assert prompt.region.width >= len(prompt.placeholder) + 4
    keys = list(app.query(FooterKey))
    assert keys and all(k.region.right <= width for k in keys)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)], ids=["80x24", "120x40", "200x50"])
def test_the_workbench_after_turns_snapshot(model_dir, tmp_path, monkeypatch, snap_compare, size):
    """The main screen after real turns at three terminal sizes: a miss, a hit, a fault drill that
    fails validation layer 3 (group intersection) on the next turn, then a branch (two tips). Below
    NARROW columns the panes are tabs; the picture shows the conversation's."""
    _pin_screen(monkeypatch)
    app = _app(model_dir, tmp_path / "turns.db")
    checked = []

    async def turns(pilot):
        app.query_one("#prompt").cursor_blink = False  # a blinking cursor would make the picture racy
        await _say(app, pilot, FACT)
        await _say(app, pilot, "What is the code for Mira?")
        await _say(app, pilot, "/fault evict-compressed")
        await _say(app, pilot, "And again?")
        assert "layer 3 group intersection: FAIL" in app.validation.text
        await _say(app, pilot, "/branch side")
        await _assert_every_pane_readable(app, pilot)
        checked.append(True)
        tree = app.query_one(BranchTree)
        for _ in range(200):  # the tree's cursor follows the tip after a refresh: in the picture, always
            await pilot.pause()
            if tree.tip is not None and tree.cursor_node is tree.tip:
                break
        assert tree.cursor_node is tree.tip
        settled, last = 0, None
        for _ in range(400):  # and its scroll to it: the same offset over several refreshes
            await pilot.wait_for_scheduled_animations()
            await pilot.pause(0.01)
            settled = settled + 1 if tree.scroll_offset == last else 0
            last = tree.scroll_offset
            if settled >= 5:
                break
    assert snap_compare(app, terminal_size=size, run_before=turns)
    assert checked


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
            assert table.get_cell("5", "tokens") == "80–96" and table.summary == "4 segment(s)"
    asyncio.run(scenario())


def test_the_app_decodes_with_a_core_left_to_its_own_thread(model_dir, tmp_path):
    from engine.threads import threads_beside_ui

    app = _app(model_dir, tmp_path / "c.db")
    assert app.session.opts.decode_threads == threads_beside_ui()
    app.session.close()
    chosen = ChatApp(ChatSession(ChatOptions.of(model=model_dir, db=tmp_path / "d.db", decode_threads=3)))
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


def test_command_output_opens_in_a_panel_that_scrolls_to_its_end(model_dir, tmp_path):
    """A command's listing (/help, /segments, ...) is read in full in a scrollable panel at 80x24
    (it was the last 2 lines of a 2-line box); a one-line reply goes to the log; Esc closes the
    panel and the prompt has the keys again."""
    from textual.containers import VerticalScroll

    from workbench.commands import COMMANDS
    from workbench.tui.output import OutputScreen

    async def scenario():
        app = _app(model_dir, tmp_path / "o.db")
        async with app.run_test(size=(80, 24)) as pilot:
            await _say(app, pilot, "/help")
            assert isinstance(app.screen, OutputScreen)
            text = "\n".join(app.screen.lines)
            assert all(c.usage in text for c in COMMANDS)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, OutputScreen) and app.focused is app.prompt

            await _say(app, pilot, FACT * 2)
            await _say(app, pilot, "/segments")
            rows = app.session.segments()
            panel = app.screen.query_one(VerticalScroll)
            assert len(app.screen.lines) == len(rows) + 1 > panel.size.height  # taller than the terminal
            assert panel.max_scroll_y > 0
            await pilot.press("end")
            await pilot.pause()
            assert panel.scroll_y == panel.max_scroll_y  # scrolled to the last row
            await pilot.press("escape")
            await _say(app, pilot, "/save")
            assert not isinstance(app.screen, OutputScreen)
            assert "saved" in _logged(app)
    asyncio.run(scenario())


def test_the_palette_holds_every_command_and_finds_help_and_segments(model_dir, tmp_path):
    """Ctrl-P lists every command of the table; typing "help" or "segments" finds it; picking a
    command runs it, and one that needs arguments is put in the prompt to complete."""
    from textual.command import CommandList, CommandPalette

    from workbench.commands import COMMANDS
    from workbench.tui.output import OutputScreen

    async def options(app, pilot, query: str, first: str | None = None) -> list[str]:
        """What the palette lists for `query`, once it lists `first` first (or every command)."""
        palette = app.screen
        assert isinstance(palette, CommandPalette)
        await pilot.press("ctrl+u", *query)  # typed, as a person would
        listed: list[str] = []
        for _ in range(250):  # the providers answer asynchronously
            await pilot.pause(0.02)
            found = palette.query_one(CommandList)
            listed = [str(found.get_option_at_index(i).prompt) for i in range(found.option_count)]
            if listed and listed[0].startswith(first) if first else \
                    all(any(line.startswith(c.usage) for line in listed) for c in COMMANDS):
                break
        return listed

    async def scenario():
        app = _app(model_dir, tmp_path / "p.db")
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("ctrl+p")
            await pilot.pause()
            shown = await options(app, pilot, "")
            assert all(any(line.startswith(c.usage) for line in shown) for c in COMMANDS), "\n".join(shown)
            for query, first in (("help", "/help"), ("segments", "/segments"), ("fault evict", "/fault evict")):
                assert (await options(app, pilot, query, first))[0].startswith(first)
            await pilot.press("enter")  # the fault drill on an empty cache: refused, in the log
            await pilot.pause()
            assert "nothing of this conversation is cached" in _logged(app)

            await pilot.press("ctrl+p")
            await options(app, pilot, "segments", "/segments")
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, OutputScreen) and app.screen.title == "/segments"
            await pilot.press("escape")

            await pilot.press("ctrl+p")
            assert (await options(app, pilot, "fork", "/fork N"))[0].startswith("/fork N")
            await pilot.press("enter")
            await pilot.pause()
            assert app.prompt.value == "/fork " and app.focused is app.prompt
    asyncio.run(scenario())


def test_the_branch_tree_nests_forks_and_follows_the_tip(model_dir, tmp_path):
    """A run of messages is one level; a fork nests its branches under the message they leave
    from; the cursor follows the current branch's tip; choosing a tip switches to its branch."""
    from workbench.tui.messages import BranchChosen

    async def scenario():
        app = _app(model_dir, tmp_path / "b.db")
        async with app.run_test(size=(120, 40)) as pilot:
            await _say(app, pilot, FACT)
            await _say(app, pilot, "/fork 0 other")  # a branch from the system message
            await _say(app, pilot, "Something else.")
            tree = app.query_one(BranchTree)
            roots = tree.root.children
            assert [str(n.label) for n in roots] == [str(roots[0].label)] and roots[0].allow_expand
            main, other = roots[0].children  # the fork: each branch's first message, the rest under it
            assert str(main.label).startswith("1 U The code for Mira") and len(main.children) == 1
            assert str(other.label).startswith("1 U Something else.") and len(other.children) == 1
            assert tree.tip is other.children[0] and "◀ other" in str(tree.tip.label)
            await pilot.pause()
            assert tree.cursor_node is tree.tip and str(tree.tip.label).startswith("2 A")
            await _say(app, pilot, "/switch main")
            await pilot.pause()
            assert "◀ main" in str(tree.tip.label) and tree.cursor_node is tree.tip
            tips = [n for n in _nodes(tree.root) if n.data and n is not tree.tip]
            assert len(tips) == 1 and "◀ other" in str(tips[0].label)
            tree.post_message(BranchChosen(tips[0].data))
            await pilot.pause()
            await pilot.pause()
            assert app.session.thread.name == "other"
    asyncio.run(scenario())


def _nodes(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def test_set_from_the_prompt_changes_the_next_turn_and_lists_the_options(model_dir, tmp_path):
    from workbench.session import SETTABLE
    from workbench.tui.output import OutputScreen

    async def scenario():
        app = _app(model_dir, tmp_path / "s.db", remote=True)  # the option reaches the engine's process
        async with app.run_test(size=(120, 40)) as pilot:
            await _say(app, pilot, "/set")
            assert isinstance(app.screen, OutputScreen) and all(n in "\n".join(app.screen.lines) for n in SETTABLE)
            await pilot.press("escape")
            await _say(app, pilot, "/set max_new_tokens 2")
            assert app.session.opts.max_new_tokens == 2
            await _say(app, pilot, "/set temperature hot")
            assert "error: /set temperature: 'hot' is not a value" in _logged(app)
            await _say(app, pilot, FACT)
            assert len(app.last.token_ids) <= 2
    asyncio.run(scenario())


def test_a_long_plan_scrolls_in_the_validation_panel_and_is_never_cut(model_dir, tmp_path):
    """The panel holds every line of the plan (it cut them at 14 lines); when they are more than
    its height it scrolls, and a scrollbar says there is more."""
    from workbench.plain import describe_plan

    async def scenario():
        app = _app(model_dir, tmp_path / "v.db")
        async with app.run_test(size=(120, 30)) as pilot:
            await _say(app, pilot, FACT)
            await _say(app, pilot, "/fault evict-compressed")
            await _say(app, pilot, "And again?")
            panel = app.validation
            assert panel.text == "\n".join(describe_plan(app.last))
            assert panel.max_scroll_y > 0 and panel.show_vertical_scrollbar
            panel.scroll_end(animate=False)
            await pilot.pause()
            assert panel.scroll_y == panel.max_scroll_y
    asyncio.run(scenario())


def test_the_screen_is_up_before_the_engine_has_loaded_the_model(model_dir, tmp_path):
    """`hcw chat` starts the engine's process and draws at once: the app says the model is
    loading, keeps a message entered meanwhile and answers it once the engine is ready; an engine
    that cannot start ends the app with its error (exit code 1)."""
    async def scenario():
        opts = ChatOptions.of(model=model_dir, db=tmp_path / "l.db", block_size=16, max_new_tokens=4)
        app = ChatApp(RemoteSession(opts, wait=False))
        async with app.run_test(size=(120, 40)) as pilot:
            assert app.loading and not app.session.ready  # drawn while the child imports and loads
            app.run_command("hello")  # entered while loading: kept, and answered once the engine is ready
            await pilot.pause()
            assert not app.busy and "loading" in _logged(app) and "still loading" in _logged(app)
            while app.loading or app.busy or app.last is None:
                await pilot.pause(0.05)
            assert app.last.message is not None and [m.content for m in app.session.path()][-2] == "hello"
            assert "loaded: ready" in _logged(app)  # the log's "loading" line is not the last word
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "config.json").write_text((model_dir / "config.json").read_text())
        (bad / "model.safetensors").write_bytes(b"\x00" * 4)  # weights the child cannot read
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (model_dir / name).exists():
                (bad / name).write_text((model_dir / name).read_text())
        broken = ChatApp(RemoteSession(ChatOptions.of(model=bad, db=tmp_path / "b.db"), wait=False))
        async with broken.run_test(size=(120, 40)) as pilot:
            while broken.return_code is None:
                await pilot.pause(0.05)
        return broken.return_code

    assert asyncio.run(scenario()) == 1


def test_the_app_keeps_what_existed_at_its_start_out_of_garbage_collections_while_it_runs(model_dir, tmp_path):
    """A full collection walked every object of the imports (torch's among them): a UI stall of
    tens of ms a few times an answer. The app freezes them while it runs, and hands them back."""
    import gc

    async def scenario():
        app = _app(model_dir, tmp_path / "gc.db")
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            return gc.get_freeze_count()

    assert asyncio.run(scenario()) > 10_000 and gc.get_freeze_count() == 0
