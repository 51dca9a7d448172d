"""The workbench's ChatSession in a child process: the TUI's process only draws.

In one process, the UI thread's Python (laying out and drawing the streamed answer) holds the GIL
that the generating thread needs between torch ops, and every time it does the decode waits. In
two processes they share nothing but the machine (docs/BENCHMARKS.md, workbench responsiveness).
The child does no IPC per token: it batches an answer's text deltas into one message per
DELTA_INTERVAL_S (the app draws 5 times a second, workbench/tui/app.py STREAM_HZ), flushed before
the turn's reply, cancelled or not, so the text arrives whole and in order.

`RemoteSession` has the interface the app and the /commands use: every public ChatSession method
(forwarded, with its exceptions re-raised here; `EngineProcessError` when the child is gone), `conversation`, `thread` and `opts` (refreshed from every reply;
setting `opts` sets the child's), `store` and `stats` (their methods forwarded). Two pipes: turns
(send / regenerate, whose text deltas stream back and whose cancel is a shared event) go over one,
served by a thread of their own in the child, and everything else over the other, so the stats
line can be read while an answer streams, as it is in one process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

from engine.threads import release_idle_team
from store.db import default_home
from workbench.options import ChatOptions
from workbench.session import ChatSession

DELTA_INTERVAL_S = 0.05  # the child batches an answer's text deltas: at most one message per this long
START_TIMEOUT_S = 600.0  # loading a model in the child


class EngineProcessError(RuntimeError):
    """The child process ended, or could not start."""


def log_path(opts: ChatOptions) -> Path:
    """Where the child's stdout and stderr go (beside the workbench file): nothing it prints may
    draw over the app's screen, and a crash's last words stay readable."""
    return (Path(opts.db).parent if opts.db is not None else default_home()) / "hcw-engine.log"


class RemoteSession:
    """A ChatSession built from `opts` in a child process, used through the same interface. The
    constructor returns once the child's session exists (its model loaded), or raises what building
    it raised; with `wait=False` it returns at once and `wait_ready()` does that wait (the app draws
    its screen meanwhile). `close()` ends the child after its session is closed."""

    def __init__(self, opts: ChatOptions, start_timeout_s: float = START_TIMEOUT_S, wait: bool = True):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
        self._turns, turns_child = ctx.Pipe()
        self._control, control_child = ctx.Pipe()
        self._cancel = ctx.Event()
        self._process = ctx.Process(target=_serve, args=(opts, turns_child, control_child, self._cancel),
                                    name="hcw-engine", daemon=True)
        self._process.start()
        turns_child.close()
        control_child.close()
        self._control_lock = threading.Lock()
        self._turn_lock = threading.Lock()
        self.conversation = self.thread = None
        self._opts = opts
        self._seen = -1  # the newest snapshot of the child's session applied here
        self.store = _Forward(self, "store")
        self.stats = _Forward(self, "stats")
        self.ready = False
        self._pending_opts: ChatOptions | None = None
        self._start_timeout_s = start_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the child's session is built, or raise what building it raised (the child
        is then ended)."""
        if self.ready:
            return
        try:
            self._reply(self._control, self._start_timeout_s)  # the session is built, or its error raised here
        except BaseException:
            self._end()
            raise
        self.ready = True
        if self._pending_opts is not None:
            self.opts, self._pending_opts = self._pending_opts, None

    @property
    def opts(self) -> ChatOptions:
        return self._opts

    @opts.setter
    def opts(self, opts: ChatOptions) -> None:
        if not self.ready:  # sent once the child's session exists
            self._opts, self._pending_opts = opts, opts
            return
        self._request("set_opts", opts)

    @property
    def pid(self) -> int:
        return self._process.pid

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in _METHODS:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._request("call", name, args, kwargs)

    def send(self, text: str, on_text=None, should_stop=None):
        return self._turn("send", (text,), on_text, should_stop)

    def regenerate(self, on_text=None, should_stop=None):
        return self._turn("regenerate", (), on_text, should_stop)

    def close(self) -> None:
        """Closes the session in the child (its last writes flushed) and waits for it to end."""
        if self._process.is_alive() and self.ready:
            try:
                self._request("close")
            except EngineProcessError:
                pass  # it ended meanwhile: nothing left to close
            self._process.join(30)
        self._end()

    def _end(self) -> None:
        """The child gone (killed if it is still there) and reaped, the pipes closed (once)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        if not self._turns.closed:
            self._turns.close()
            self._control.close()

    def _ended(self) -> EngineProcessError:
        self._process.join(1.0)  # its exit code, once it is reaped
        return EngineProcessError(f"the engine process ended (exit code {self._process.exitcode}; "
                                  f"its output is in {log_path(self._opts)})")

    def _request(self, op: str, *payload) -> Any:
        with self._control_lock:
            self._put(self._control, (op, *payload))
            return self._reply(self._control, None)

    def _turn(self, name: str, args: tuple, on_text, should_stop):
        with self._turn_lock:
            self._cancel.clear()
            self._put(self._turns, (name, args))
            while True:
                # asked on every pass, deltas or not: a steady stream must not starve a cancel
                if should_stop is not None and should_stop():
                    self._cancel.set()  # the child stops at its next token and answers as usual
                if self._turns.poll(0.02):
                    message = self._get(self._turns)
                    if message[0] != "delta":
                        return self._result(message)
                    if on_text is not None:
                        on_text(message[1])
                elif not self._process.is_alive():
                    raise self._ended()

    def _reply(self, conn, timeout_s: float | None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(0.05):
            if not self._process.is_alive():
                raise self._ended()
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineProcessError(f"the engine process did not start within {timeout_s:.0f} s")
        return self._result(self._get(conn))

    def _result(self, message):
        kind, value, snapshot = message
        # replies on the two pipes can cross (the stats line read during a turn): only a newer
        # snapshot of the child's session replaces what is mirrored here
        if snapshot is not None and snapshot[0] > self._seen:
            self._seen, self.conversation, self.thread, self._opts = snapshot
        if kind == "error":
            raise value
        return value

    def _put(self, conn, message) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise self._ended() from e

    def _get(self, conn):
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            raise self._ended() from e


class _Forward:
    """`session.store` / `session.stats` of the child: each method call forwarded."""

    def __init__(self, owner: RemoteSession, name: str):
        self._owner, self._name = owner, name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: self._owner._request("call", f"{self._name}.{attr}", args, kwargs)


# every public method of a ChatSession; send and regenerate are turns, close ends the child
_METHODS = {name for name, value in vars(ChatSession).items()
            if not name.startswith("_") and callable(value)} - {"send", "regenerate", "close"}


def _serve(opts: ChatOptions, turns, control, cancel) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the app; it closes us
    log = log_path(opts)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:  # file descriptors 1 and 2: what C libraries print goes there too
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} hcw engine process {os.getpid()}: {opts.model}", flush=True)
    try:
        session = ChatSession(opts)
    except BaseException as e:
        control.send(("error", _portable(e), None))
        return
    control.send(("ok", None, _snapshot(session)))
    # turns compute on their own thread: this one's idle OpenMP team (it loaded the model) cost a
    # 2K-token prompt's prefill 2.4x its time (965 -> 409 ms on hcw-tiny-qwen3.5; engine/threads.py)
    print(f"serving turns; this thread's idle OpenMP team released: {release_idle_team()}", flush=True)
    threading.Thread(target=_serve_turns, args=(session, turns, cancel), name="turns", daemon=True).start()
    while True:
        try:
            op, *payload = control.recv()
        except EOFError:  # the app's process is gone
            session.close()
            return
        try:
            if op == "close":
                session.close()
                control.send(("ok", None, None))
                return
            if op == "set_opts":
                session.opts = payload[0]
                value = None
            else:
                name, args, kwargs = payload
                target = session
                for part in name.split("."):
                    target = getattr(target, part)
                value = target(*args, **kwargs)
            control.send(("ok", value, _snapshot(session)))
        except Exception as e:
            control.send(("error", _portable(e), _snapshot(session)))


def _serve_turns(session: ChatSession, turns, cancel, clock=time.monotonic) -> None:
    """Answers each turn asked on `turns`, its text sent back batched (one message per
    DELTA_INTERVAL_S of `clock` at most), then the turn's reply."""
    while True:
        try:
            name, args = turns.recv()
        except EOFError:
            return
        pending: list[str] = []
        last = clock()

        def on_text(delta: str) -> None:
            nonlocal last
            pending.append(delta)
            now = clock()
            if now - last >= DELTA_INTERVAL_S:
                turns.send(("delta", "".join(pending)))
                pending.clear()
                last = now

        try:
            result = getattr(session, name)(*args, on_text, cancel.is_set)
            reply = ("ok", result, _snapshot(session))
        except Exception as e:
            reply = ("error", _portable(e), _snapshot(session))
        if pending:
            turns.send(("delta", "".join(pending)))
        try:
            turns.send(reply)
        except Exception as e:  # a result that does not pickle: the app must still hear the turn end
            turns.send(("error", RuntimeError(f"the turn's result could not be sent back: {e}"), _snapshot(session)))


_SNAPSHOTS = itertools.count()


def _snapshot(session: ChatSession) -> tuple:
    """(a number that grows with every snapshot, the conversation, the thread, the options)."""
    return next(_SNAPSHOTS), session.conversation, session.thread, session.opts


def _portable(error: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
