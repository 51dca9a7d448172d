"""`hcw chat` on a terminal: the Textual workbench over one ChatSession, which `hcw chat` runs in a
process of its own (`workbench/remote.py`: drawing never holds the GIL the decode needs).

Generation runs in a worker thread (over a RemoteSession it waits on the child's stream) and
streams into the conversation pane; Esc cancels it (the partial answer is kept). The worker never
waits for the screen: it appends text deltas to a buffer that the UI thread drains into the answer
STREAM_HZ times a second, and posts one message when the turn ends (workbench/tui/messages.py).
Every answered turn is already in the database when the next one starts, so quitting (Ctrl-Q)
never loses one; if the engine's process dies, the app exits saying so (exit code 1).

Layout: wider than NARROW columns, the conversation on the left and the state panes stacked on
the right; narrower, one pane at a time under a tab bar (F2 or a click changes it). `/commands`
typed in the prompt, the command palette (Ctrl-P) and the plain REPL read one table
(workbench/commands.py); a command's listing (/help, /segments, /plan, ...) opens in a scrollable
panel, its other replies go to the log.
"""

from __future__ import annotations

import dataclasses
import gc
import sqlite3
import threading
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Footer, Header, Input, Tab, Tabs

from engine.threads import release_idle_team, threads_beside_ui
from workbench import commands, plain
from workbench.remote import EngineProcessError
from workbench.faults import fault_names
from workbench.options import SETTABLE
from workbench.session import ChatSession
from workbench.turns import TurnResult
from workbench.tui.branches import BranchTree
from workbench.tui.budget import ReplayBudget
from workbench.tui.conversation import ConversationView
from workbench.tui.messages import BranchChosen, CommandChosen, TurnDone, TurnFailed
from workbench.tui.output import OutputScreen
from workbench.tui.segments import SegmentPane, SegmentTable
from workbench.tui.stats import StatsBar, stats_line
from workbench.tui.steady import Log
from workbench.tui.validation import ValidationPanel

# how often streamed text reaches the screen: each append re-lays out the whole screen (~15 ms of
# the UI thread here, which the generating thread then waits on for the GIL), so the cost on
# tokens/s is about linear in this rate (measured on hcw-tiny: 20/s 33%, 10/s 20%, 5/s 7-10%)
STREAM_HZ = 5
NARROW = 110  # below this many columns the panes are tabs
# pane id -> its title (on its border, and on its tab when the panes are tabs)
PANES = {"conversation": "conversation", "branches": "branches", "segments": "segment states",
         "validation": "validation", "budget": "reuse per resume"}


def palette_entries() -> list[tuple[str, str, bool]]:
    """(label, command text, run it now): every command of the table (one that needs arguments is
    put in the prompt to complete), each fault drill and each /set option by name."""
    entries = [(f"{c.usage}  {c.help}", f"/{c.name}" + (" " if c.needs_args else ""), not c.needs_args)
               for c in commands.COMMANDS]
    entries += [(f"/fault {name}  fault drill: damage this state on purpose", f"/fault {name}", True)
                for name in fault_names()]
    entries += [(f"/set {name} VALUE  {meaning}", f"/set {name} ", False)
                for name, meaning in SETTABLE.items()]
    return entries


def _highlight(matcher, label: str) -> Content:
    """The label with the query's letters marked: Matcher.highlight reads it as markup, in which
    "/branch [NAME]" lost its "[NAME]"."""
    content = Content(label)
    _, offsets = matcher.fuzzy_search.match(matcher.query, label)
    for offset in offsets:
        if not label[offset].isspace():
            content = content.stylize(matcher.match_style, offset, offset + 1)
    return content


class ChatCommands(Provider):
    """The palette's commands (Ctrl-P): with nothing typed, every command of the table."""

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for label, text, run in palette_entries():
            score = matcher.match(label)
            if score > 0:
                yield Hit(score, _highlight(matcher, label), partial(self.app.post_message, CommandChosen(text, run)),
                          text=label)

    async def discover(self) -> Hits:
        for label, text, run in palette_entries()[:len(commands.COMMANDS)]:
            yield DiscoveryHit(Content(label), partial(self.app.post_message, CommandChosen(text, run)), text=label)


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "hcw chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW, "-wide")]
    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+q", "quit", "quit"),
                Binding("ctrl+s", "save", "save"), Binding("ctrl+b", "branch", "branch"),
                Binding("f2", "next_pane", "next pane")]

    def __init__(self, session: ChatSession):
        super().__init__()
        if session.opts.decode_threads is None:  # this app draws while the session decodes
            session.opts = dataclasses.replace(session.opts, decode_threads=threads_beside_ui())
        self.session = session
        self.cancel = threading.Event()
        self.busy = False
        self.loading = False  # the engine's process is still building its session
        self._queued: list[str] = []  # what was entered meanwhile, run in order once it is ready
        self.quitting = False
        self.last: TurnResult | None = None
        self._stream_lock = threading.Lock()
        self._stream_text: list[str] = []  # deltas the worker produced, not shown yet
        self._stream_view = None  # the answer they go into
        # the panes, held here: the app sets what they show ("attributes down")
        self.conversation = ConversationView(id="conversation", classes="pane")
        self.log_view = Log(id="log", markup=False, wrap=True, min_width=20)  # (78 by default: cut, not wrapped)
        self.prompt = Input(placeholder="message, or /help for commands", id="prompt")
        self.branches = BranchTree(id="branches", classes="pane")
        self.segments = SegmentPane(id="segments", classes="pane")
        self.validation = ValidationPanel(id="validation", classes="pane")
        self.budget = ReplayBudget(id="budget", classes="pane")
        self.stats_bar = StatsBar(id="stats")

    def compose(self) -> ComposeResult:
        yield Header()
        yield Tabs(*(Tab(title, id=f"tab-{pane}") for pane, title in PANES.items()), id="panes")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield self.conversation
                yield self.log_view
            with Vertical(id="right"):
                yield self.branches
                yield self.segments
                yield self.validation
                yield self.budget
        yield self.prompt
        yield self.stats_bar
        yield Footer()

    def on_mount(self) -> None:
        # what exists by now (the imports' objects, torch's among them) lives as long as the app: a
        # full collection walked all of it, a stall of tens of ms a few times an answer, at a
        # turn's end too. Frozen, collections walk only what the app makes; unfrozen when it ends.
        gc.freeze()
        for pane, title in PANES.items():
            self.query_one(f"#{pane}").border_title = title
        self.validation.show(None)
        self.show_pane("conversation")
        self.prompt.focus()
        if not getattr(self.session, "ready", True):  # a RemoteSession still loading: the screen first
            self.loading = True
            self.sub_title = f"loading {self.session.opts.model}…"
            self.log_line(f"loading {self.session.opts.model} in the engine process…")
            self.wait_for_engine()
            return
        self.engine_ready()

    @work(thread=True, exclusive=True, group="engine")
    def wait_for_engine(self) -> None:
        try:
            self.session.wait_ready()
        except Exception as e:  # the engine could not start: said, and the app ends (exit code 1)
            self.call_from_thread(self.exit, return_code=1, message=f"hcw chat: error: {e.args[0] if e.args else e}")
            return
        self.call_from_thread(self.engine_ready)

    def engine_ready(self) -> None:
        """The session exists: the panes show it, the timers start, the file's warnings are said."""
        if self.loading:  # the log said it was loading: it says when that ended
            self.log_line(f"{self.session.opts.model} loaded: ready")
        self.loading = False
        self.refresh_views(messages=True)
        self.set_interval(1.0, self.refresh_stats)
        self.set_interval(1 / STREAM_HZ, self.flush_stream)
        try:
            for warning in self.session.warnings():
                self.notify(warning, severity="warning", timeout=30)
        except EngineProcessError as e:
            self.engine_lost(e)
            return
        if self._queued:  # the first line entered while loading; the rest wait their turn in the prompt
            first, rest = self._queued[0], self._queued[1:]
            self._queued = []
            if rest:
                self.prompt.value = rest[0]
            self.run_command(first)

    @property
    def narrow(self) -> bool:
        return self.screen.has_class("-narrow")

    def show_pane(self, pane: str) -> None:
        """The pane shown when the panes are tabs (the others are hidden then, not in wide mode)."""
        self.query_one("#left").set_class(pane != "conversation", "-off")
        self.query_one("#right").set_class(pane == "conversation", "-off")
        for other in PANES:
            if other != "conversation":
                self.query_one(f"#{other}").set_class(other != pane, "-off")

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        self.show_pane(event.tab.id.removeprefix("tab-"))

    def action_next_pane(self) -> None:
        self.query_one(Tabs).action_next_tab()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "next_pane":
            return self.narrow  # shown, and working, only when the panes are tabs
        return True

    def on_resize(self, event) -> None:
        self.call_after_refresh(self.refresh_bindings)  # the breakpoint class may have changed

    def refresh_views(self, messages: bool = False) -> None:
        s = self.session
        self.sub_title = f"{s.conversation.id} · branch {s.thread.name} · reuse {s.opts.cache.reuse}"
        try:
            if messages:
                self.conversation.show(s.path())
            self.branches.show(s.store, s.conversation.id, s.thread)
            self.segments.query_one(SegmentTable).update_rows(s.segments())
        except EngineProcessError as e:
            self.engine_lost(e)
            return
        self.refresh_stats()

    def refresh_stats(self) -> None:
        if not self.stats_bar.is_attached:  # the screen is being torn down (the timer may still fire)
            return
        try:
            self.stats_bar.show(stats_line(self.session.stats.as_dict()))
        except EngineProcessError as e:
            self.engine_lost(e)

    def engine_lost(self, error: EngineProcessError) -> None:
        """The engine's process ended under the app: nothing more can be answered. Every answered
        turn is in the database; the app exits saying why (and where the process's output is)."""
        self.exit(return_code=1, message=f"hcw chat: {error}")

    def log_line(self, text: str) -> None:
        self.log_view.write(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if text:
            self.run_command(text)

    def run_command(self, text: str) -> None:
        """A message (answered in a worker) or a /command of the table."""
        if self.loading:  # kept, and run the moment the engine is ready
            self._queued.append(text)
            self.log_line(f"the model is still loading: {text[:40]!r} runs when it is ready")
            return
        if self.busy:
            self.log_line("still generating: Esc cancels")
            return
        try:
            if not text.startswith("/"):
                self.start_turn(lambda on_text, stop: self.session.send(text, on_text, stop), user=text)
                return
            command, args = commands.parse(text)
            if command.quits:
                self.action_quit()
                return
            reply = command.handler(commands.Context(self.session, self._answer, lambda: self.last), args)
        except EngineProcessError as e:
            self.engine_lost(e)
            return
        except (ValueError, KeyError, IndexError) as e:
            self.log_line(f"error: {e.args[0] if e.args else e}")
            return
        except sqlite3.Error as e:  # the workbench file failed under the command: said, not a crash
            self.log_line(f"error: workbench database: {type(e).__name__}: {e}")
            return
        if reply is not None and reply.listing:
            self.push_screen(OutputScreen(text, reply.lines))
        elif reply is not None:
            for line in reply.lines:
                self.log_line(line)
        if not self.busy:  # a command that answers (/edit) redraws when its turn is done
            self.refresh_views(messages=True)

    def on_command_chosen(self, message: CommandChosen) -> None:
        if message.run:
            self.run_command(message.text)
        else:  # it needs arguments: into the prompt, to complete
            self.prompt.value = message.text
            self.prompt.cursor_position = len(message.text)
            self.prompt.focus()

    def on_branch_chosen(self, message: BranchChosen) -> None:
        if not self.busy and message.thread != self.session.thread.id:
            self.run_command(f"/switch {message.thread}")

    def _answer(self, run: commands.Run) -> None:
        """A command that answers (/edit): its turn runs in the worker like a message's."""
        self.start_turn(run, user=None)

    def start_turn(self, run: commands.Run, user: str | None) -> None:
        self._turn_user = user
        view = self.conversation
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
    def generate(self, run: commands.Run) -> None:
        try:
            result = run(self._streamed, self.cancel.is_set)
        except Exception as e:  # shown to the user; the session is unchanged past the last saved turn
            self.post_message(TurnFailed(e))
            return
        self.post_message(TurnDone(result))

    def on_turn_done(self, message: TurnDone) -> None:
        self.turn_done(message.result)

    def on_turn_failed(self, message: TurnFailed) -> None:
        self.turn_failed(message.error)

    def turn_done(self, result: TurnResult) -> None:
        """A turn's end, on the UI thread (benchmarks/tui_responsiveness.py times it here)."""
        self.flush_stream()
        self.busy = False
        self.last = result
        self.validation.show(result)
        self.budget.add(result)
        self.log_line(plain.status_line(result))
        if result.message is None and getattr(self, "_turn_user", None):  # cancelled before the answer began
            self.prompt.value = self._turn_user  # the turn was undone: the message is back to send again
            self.log_line("cancelled before the answer began: the message is back in the prompt")
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

    def on_unmount(self) -> None:
        gc.unfreeze()
        self.session.close()
