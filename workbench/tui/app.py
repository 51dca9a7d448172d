"""`hcw chat` on a terminal: the Textual workbench over one ChatSession, which `hcw chat` runs in a
process of its own (`workbench/remote.py`: drawing never holds the GIL the decode needs).

Generation runs in a worker thread (over a RemoteSession it waits on the child's stream) and
streams into the conversation pane; Esc cancels it (the partial answer is kept). The worker never
waits for the screen: it appends text deltas to a buffer that the UI thread drains into the answer
STREAM_HZ times a second. Every answered turn is already in the database when the next one starts,
so quitting (Ctrl-Q) never loses one; if the engine's process dies, the app exits saying so (exit
code 1). `/commands` typed in the prompt and the command palette (Ctrl-P) share the plain REPL's
commands.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, RichLog

from engine.threads import release_idle_team, threads_beside_ui
from workbench import plain
from workbench.remote import EngineProcessError
from workbench.session import ChatSession, TurnResult, fault_names
from workbench.tui.branches import BranchTree
from workbench.tui.budget import ReplayBudget
from workbench.tui.conversation import ConversationView
from workbench.tui.segments import SegmentTable
from workbench.tui.stats import StatsBar, stats_line
from workbench.tui.steady import Log
from workbench.tui.validation import ValidationPanel

# how often streamed text reaches the screen: each append re-lays out the whole screen (~15 ms of
# the UI thread here, which the generating thread then waits on for the GIL), so the cost on
# tokens/s is about linear in this rate (measured on hcw-tiny: 20/s 33%, 10/s 20%, 5/s 7-10%)
STREAM_HZ = 5

PALETTE = [("branch from the last message", "/branch"), ("save cached segments now", "/save"),
           ("show stats in the log", "/stats"), ("list branches in the log", "/branches")] + \
          [(f"fault drill: {name}", f"/fault {name}") for name in fault_names()]


class ChatCommands(Provider):
    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for label, command in PALETTE:
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, matcher.highlight(label), partial(self.app.run_command, command), help=command)


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "hcw chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [Binding("escape", "cancel", "cancel generation"), Binding("ctrl+q", "quit", "quit"),
                Binding("ctrl+s", "save", "save"), Binding("ctrl+b", "branch", "branch")]

    def __init__(self, session: ChatSession):
        super().__init__()
        if session.opts.decode_threads is None:  # this app draws while the session decodes
            session.opts = dataclasses.replace(session.opts, decode_threads=threads_beside_ui())
        self.session = session
        self.cancel = threading.Event()
        self.busy = False
        self.quitting = False
        self.last: TurnResult | None = None
        self._stream_lock = threading.Lock()
        self._stream_text: list[str] = []  # deltas the worker produced, not shown yet
        self._stream_view = None  # the answer they go into

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield ConversationView(id="conversation")
                yield Log(id="log", markup=False, wrap=True)
                yield Input(placeholder="message, or /help for commands", id="prompt")
            with Vertical(id="right"):
                yield BranchTree(id="branches")
                yield SegmentTable(id="segments")
                yield ValidationPanel(id="validation")
                yield ReplayBudget(id="budget")
        yield StatsBar(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#conversation").border_title = "conversation"
        self.query_one("#branches").border_title = "branches"
        self.query_one("#segments").border_title = "segment states"
        self.query_one("#validation").border_title = "validation"
        self.query_one("#budget").border_title = "reuse per resume"
        self.query_one(ValidationPanel).show(None)
        self.refresh_views(messages=True)
        self.set_interval(1.0, self.refresh_stats)
        self.set_interval(1 / STREAM_HZ, self.flush_stream)
        self.query_one(Input).focus()
        try:
            for warning in self.session.warnings():
                self.notify(warning, severity="warning", timeout=30)
        except EngineProcessError as e:
            self.engine_lost(e)

    # ---- views -------------------------------------------------------------------------
    def refresh_views(self, messages: bool = False) -> None:
        s = self.session
        self.sub_title = f"{s.conversation.id} · branch {s.thread.name} · reuse {s.opts.reuse}"
        try:
            if messages:
                self.query_one(ConversationView).show(s.path())
            self.query_one(BranchTree).show(s.store, s.conversation.id, s.thread)
            self.query_one(SegmentTable).update_rows(s.segments())
        except EngineProcessError as e:
            self.engine_lost(e)
            return
        self.refresh_stats()

    def refresh_stats(self) -> None:
        for bar in self.query(StatsBar):  # none while the screen is being torn down (the timer may still fire)
            try:
                bar.show(stats_line(self.session.stats.as_dict()))
            except EngineProcessError as e:
                self.engine_lost(e)

    def engine_lost(self, error: EngineProcessError) -> None:
        """The engine's process ended under the app: nothing more can be answered. Every answered
        turn is in the database; the app exits saying why (and where the process's output is)."""
        self.exit(return_code=1, message=f"hcw chat: {error}")

    def log_line(self, text: str) -> None:
        self.query_one(RichLog).write(text)

    # ---- input -------------------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if text:
            self.run_command(text)

    def run_command(self, text: str) -> None:
        if self.busy:
            self.log_line("still generating: Esc cancels")
            return
        try:
            if not text.startswith("/"):
                self.start_turn(lambda on_text, stop: self.session.send(text, on_text, stop), user=text)
                return
            quit_now = plain._command(self.session, text, self.log_line, self._answer_command, lambda: self.last,
                                      as_json=False)
        except EngineProcessError as e:
            self.engine_lost(e)
            return
        except (ValueError, KeyError, IndexError) as e:
            self.log_line(f"error: {e.args[0] if e.args else e}")
            return
        except sqlite3.Error as e:  # the workbench file failed under the command: said, not a crash
            self.log_line(f"error: workbench database: {type(e).__name__}: {e}")
            return
        if quit_now:
            self.action_quit()
            return
        if not self.busy:  # a command that answers (/edit) redraws when its turn is done
            self.refresh_views(messages=True)

    def _answer_command(self, run) -> None:
        """plain's commands that answer (/edit) hand over a run(on_text) callable."""
        self.start_turn(lambda on_text, stop: self.session.regenerate(on_text, stop), user=None)

    def start_turn(self, run, user: str | None) -> None:
        view = self.query_one(ConversationView)
        n = len(self.session.path())
        if user is not None:
            view.add(n, "user", user)
            n += 1
        else:
            view.show(self.session.path())
        answer = view.add(n, "assistant", "", streamed=True)
        self.busy = True
        self.cancel.clear()
        with self._stream_lock:
            self._stream_text, self._stream_view = [], answer
        # the worker computes; this thread's idle OpenMP team would halve its speed (engine/threads.py)
        release_idle_team()
        self.generate(run)

    def _streamed(self, delta: str) -> None:
        """Worker side: keep the delta for the next flush; never blocks on the screen."""
        with self._stream_lock:
            self._stream_text.append(delta)

    def flush_stream(self) -> None:
        """UI side: everything streamed since the last flush, appended to the answer at once."""
        with self._stream_lock:
            text, self._stream_text = "".join(self._stream_text), []
            view = self._stream_view
        if text and view is not None and view.is_attached:
            view.append(text)

    @work(thread=True, exclusive=True)
    def generate(self, run) -> None:
        try:
            result = run(self._streamed, self.cancel.is_set)
        except Exception as e:  # shown to the user; the session is unchanged past the last saved turn
            self.call_from_thread(self.turn_failed, e)
            return
        self.call_from_thread(self.turn_done, result)

    def turn_done(self, result: TurnResult) -> None:
        self.flush_stream()
        self.busy = False
        self.last = result
        self.query_one(ValidationPanel).show(result)
        self.query_one(ReplayBudget).add(result)
        self.log_line(plain.status_line(result))
        self._after_turn()

    def turn_failed(self, error: Exception) -> None:
        self.flush_stream()
        self.busy = False
        if isinstance(error, EngineProcessError):
            self.engine_lost(error)
            return
        self.log_line(f"error: {error}")
        self._after_turn()

    def _after_turn(self) -> None:
        if self.quitting:
            self.exit()
            return
        self.refresh_views(messages=True)

    # ---- actions -----------------------------------------------------------------------
    def action_quit(self) -> None:
        """Quit; a generation in flight is cancelled first and its partial answer kept."""
        if self.busy:
            self.quitting = True
            self.cancel.set()
            self.log_line("cancelling, then quitting…")
            return
        self.exit()

    def action_cancel(self) -> None:
        if self.busy:
            self.cancel.set()
            self.log_line("cancelling…")

    def action_save(self) -> None:
        self.run_command("/save")

    def action_branch(self) -> None:
        self.run_command("/branch")

    def on_tree_node_selected(self, event: BranchTree.NodeSelected) -> None:
        if event.node.data and not self.busy and event.node.data != self.session.thread.id:
            self.run_command(f"/switch {event.node.data}")

    def on_unmount(self) -> None:
        self.session.close()
