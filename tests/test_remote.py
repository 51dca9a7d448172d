"""`hcw chat`'s session in a child process (`workbench.remote.RemoteSession`): the same answers as
a session in this process, its text streamed back, its errors raised here with their types,
cancel and close reaching the child, and a child that died reported, never waited on."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from engine.config import ConfigError
from engine.threads import _libgomp
from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench.remote import EngineProcessError, RemoteSession, log_path
from workbench.session import ChatOptions, ChatSession

FACT = "The code for Mira is 4821. " + "Filler words go here and there. " * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("remote-model"), hcw_hybrid_dict(hidden=64), seed=3)


def _opts(model_dir, db, **kw) -> ChatOptions:
    return ChatOptions.of(**{"model": model_dir, "db": db, "block_size": 16, "checkpoint_every": 1, "max_new_tokens": 8,
                          **kw})


@pytest.fixture(scope="module")
def remote(model_dir, tmp_path_factory):
    session = RemoteSession(_opts(model_dir, tmp_path_factory.mktemp("remote") / "r.db"))
    yield session
    session.close()


def test_turns_stream_and_answer_as_in_this_process(remote, model_dir, tmp_path):
    local = ChatSession(_opts(model_dir, tmp_path / "l.db"))
    assert remote.pid != os.getpid()
    for text in (FACT, "What is the code for Mira?"):
        deltas: list[str] = []
        got = remote.send(text, deltas.append)
        want = local.send(text)
        assert got.text == want.text and got.token_ids == want.token_ids
        assert "".join(deltas) == got.text
        assert got.cached_tokens == want.cached_tokens and got.lookup.outcome == want.lookup.outcome
    assert [m.content for m in remote.path()] == [m.content for m in local.path()]
    assert remote.stats.as_dict()["turns"] == 2
    assert [r.index for r in remote.segments()] == [r.index for r in local.segments()]
    local.close()


def test_branches_update_the_mirrored_conversation_and_thread(remote):
    before = remote.thread
    side = remote.fork(None, "side")
    assert side.name == "side" and remote.thread == side and remote.conversation.id == side.conversation
    assert {t.name for t in remote.store.threads(remote.conversation.id)} >= {"main", "side"}
    assert remote.switch(before.name).id == before.id and remote.thread.id == before.id


def test_errors_come_back_with_their_types(remote, model_dir, tmp_path):
    with pytest.raises(ValueError, match="empty message"):
        remote.send("   ")
    with pytest.raises(KeyError):
        remote.switch("no-such-branch")
    with pytest.raises(AttributeError):
        remote.no_such_method  # noqa: B018
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):
        RemoteSession(_opts(tmp_path / "empty", tmp_path / "e.db"))


def test_the_child_prints_to_its_log_not_over_the_app(model_dir, tmp_path, capfd):
    session = RemoteSession(_opts(model_dir, tmp_path / "o.db"))
    try:
        session.send(FACT)
    finally:
        session.close()
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # the child's own line went to the log, not to this terminal
    assert log_path(session.opts) == tmp_path / "hcw-engine.log"
    log = log_path(session.opts).read_text()
    assert f"hcw engine process {session.pid}:" in log
    # the thread that loaded the model gave up its idle OpenMP team before turns ran on another
    assert f"idle OpenMP team released: {_libgomp() is not None}" in log


def test_options_set_here_reach_the_child(remote):
    remote.opts = dataclasses.replace(remote.opts, decode_threads=1, max_new_tokens=3)
    assert remote.opts.decode_threads == 1  # read back from the child's session
    assert len(remote.send("Count to ten.").token_ids) <= 3


def test_cancel_stops_the_child_and_keeps_the_partial_answer(model_dir, tmp_path):
    session = RemoteSession(_opts(model_dir, tmp_path / "c.db", max_new_tokens=20000, ignore_eos=True))
    try:
        seen: list[str] = []
        result = session.send(FACT, seen.append, lambda: bool(seen))  # stop once text has arrived
        assert result.stop_reason == "cancelled" and 0 < len(result.token_ids) < 20000
        assert result.text.startswith("".join(seen))  # what streamed before the cancel, in order
        assert session.path()[-1].role == "assistant" and session.path()[-1].content == result.text
    finally:
        session.close()
    assert session._process.exitcode == 0


def test_a_child_that_died_is_reported(model_dir, tmp_path):
    session = RemoteSession(_opts(model_dir, tmp_path / "k.db"))
    os.kill(session.pid, signal.SIGKILL)
    session._process.join(10)
    with pytest.raises(EngineProcessError, match="ended") as died:
        session.send(FACT)
    assert str(log_path(session.opts)) in str(died.value)  # where the child's last words are
    with pytest.raises(EngineProcessError, match="ended"):
        session.path()
    session.close()  # nothing left to close: returns


def test_a_child_that_dies_mid_turn_ends_the_turn_with_an_error(model_dir, tmp_path):
    session = RemoteSession(_opts(model_dir, tmp_path / "m.db", max_new_tokens=20000, ignore_eos=True))
    seen: list[str] = []

    def on_text(delta: str) -> None:
        if not seen:
            os.kill(session.pid, signal.SIGKILL)
        seen.append(delta)

    with pytest.raises(EngineProcessError, match="ended"):
        session.send(FACT, on_text)
    session.close()
    assert not session._process.is_alive() and session._process.exitcode == -signal.SIGKILL


def test_a_turn_result_that_cannot_be_sent_back_still_ends_the_turn():
    """The child's turn thread, over a real pipe, with a session whose answer does not pickle."""
    import multiprocessing
    import threading

    from workbench.remote import _serve_turns

    class Stub:
        conversation = thread = opts = None

        def send(self, text, on_text, should_stop):
            on_text("partial")
            return lambda: None  # functions do not pickle

    here, child = multiprocessing.Pipe()
    threading.Thread(target=_serve_turns, args=(Stub(), child, threading.Event()), daemon=True).start()
    here.send(("send", ("hi",)))
    assert here.recv()[:2] == ("delta", "partial")
    kind, error, _ = here.recv()
    assert kind == "error" and "could not be sent back" in str(error)
    here.close()


@pytest.mark.parametrize("cancel_at", [None, 13])
def test_the_child_batches_an_answers_text_and_sends_all_of_it_in_order(cancel_at):
    """The child's turn thread sends one message per DELTA_INTERVAL_S, not one per token, and the
    text still arrives whole and in order, the last batch before the reply, cancelled or not."""
    import multiprocessing
    import threading

    from workbench.remote import DELTA_INTERVAL_S, _serve_turns

    tokens, step = 60, DELTA_INTERVAL_S / 4.2  # about four tokens to a message
    now = [0.0]
    cancel = threading.Event()

    class Stub:
        conversation = thread = opts = None

        def send(self, text, on_text, should_stop):
            out = []
            for i in range(tokens):
                now[0] += step
                out.append(f"w{i} ")
                on_text(out[-1])
                if i == cancel_at:
                    cancel.set()  # as the app's Esc arrives
                if should_stop():
                    break
            return "".join(out)

    here, child = multiprocessing.Pipe()
    threading.Thread(target=_serve_turns, args=(Stub(), child, cancel, lambda: now[0]), daemon=True).start()
    here.send(("send", ("hi",)))
    deltas = []
    while (message := here.recv())[0] == "delta":
        deltas.append(message[1])
    kind, text, _ = message
    assert kind == "ok" and "".join(deltas) == text
    sent = tokens if cancel_at is None else cancel_at + 1
    assert text.split() == [f"w{i}" for i in range(sent)]
    assert 1 < len(deltas) <= sent // 4 + 1
    here.close()
