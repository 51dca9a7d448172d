"""The chat session (shared by the TUI, the plain REPL and replay): turns reuse the cache exactly,
branches keep history, a restart resumes from disk, faults are caught, the REPL's commands work."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench.cli import app
from workbench.plain import run_plain, status_line
from workbench.session import ChatOptions, ChatSession

FACT = "The code for Mira is 4821. " + "Filler words go here and there. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("mixed"), hcw_hybrid_dict(hidden=64), seed=3)


def _session(model_dir, db, **kw) -> ChatSession:
    return ChatSession(ChatOptions.of(model=model_dir, db=db, block_size=16, checkpoint_every=1, max_new_tokens=6, **kw))


def _cold_answers(model_dir, tmp_path, turns):
    ref = _session(model_dir, tmp_path / "ref.db", reuse="off")
    return [ref.send(t).text for t in turns]


def test_second_turn_reuses_the_first_and_answers_exactly_as_without_cache(model_dir, tmp_path):
    turns = [FACT, "What is the code for Mira?"]
    s = _session(model_dir, tmp_path / "a.db")
    results = [s.send(t) for t in turns]
    assert results[0].lookup.outcome == "miss"
    assert results[1].lookup.outcome == "hit" and results[1].cached_tokens >= 16
    assert [r.text for r in results] == _cold_answers(model_dir, tmp_path, turns)
    path = s.path()
    assert [m.role for m in path] == ["system", "user", "assistant", "user", "assistant"]
    assert path[-1].content == results[1].text and results[1].saved_segments > 0
    assert s.stats.as_dict()["hit_rate"] == 0.5


def test_an_edit_branches_keeps_the_old_branch_and_reuses_the_shared_prefix(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "b.db")
    s.send(FACT)
    s.send("What is the code for Mira?")
    main = s.thread
    s.edit(3, "What is the code for Mira? Answer briefly.")
    r = s.regenerate()
    assert s.thread.id != main.id
    assert r.lookup.outcome == "hit" and r.cached_tokens >= 16  # the system turn and the fact are shared
    old = s.store.path(main.id)
    assert old[3].content == "What is the code for Mira?" and len(old) == 5
    assert s.path()[3].content.endswith("Answer briefly.") and s.path()[:3] == old[:3]
    assert r.text == _cold_answers(model_dir, tmp_path, [FACT, "What is the code for Mira? Answer briefly."])[1]
    s.switch("main")
    assert s.thread.id == main.id


def test_a_restart_resumes_the_conversation_from_disk_exactly(model_dir, tmp_path):
    db = tmp_path / "c.db"
    first = _session(model_dir, db)
    first.send(FACT)
    conversation = first.conversation.id
    first.close()
    again = _session(model_dir, db, session=conversation[:6])  # a prefix is enough
    assert [m.role for m in again.path()] == ["system", "user", "assistant"]
    r = again.send("What is the code for Mira?")
    assert r.lookup.outcome == "hit" and again.cache.metrics.lower_fetches > 0
    assert r.text == _cold_answers(model_dir, tmp_path, [FACT, "What is the code for Mira?"])[1]


def test_a_fault_is_caught_by_the_validator_and_the_answer_stays_exact(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "d.db")
    s.send(FACT)
    assert s.fault("evict-compressed") > 0
    r = s.send("What is the code for Mira?")
    assert r.lookup.outcome == "degraded" or any(o.action.value == "recover" for o in r.lookup.plan.objects)
    assert r.text == _cold_answers(model_dir, tmp_path, [FACT, "What is the code for Mira?"])[1]
    with pytest.raises(KeyError, match="unknown fault"):
        s.fault("no-such-fault")


@pytest.mark.parametrize("fault, reason", [("disk-read-error", "io"), ("disk-corrupt-blob", "checksum")])
def test_disk_faults_become_a_counted_miss_and_the_answer_stays_exact(model_dir, tmp_path, fault, reason):
    s = _session(model_dir, tmp_path / "dk.db")
    s.send(FACT)
    assert s.fault(fault) == 1
    r = s.send("What is the code for Mira?")
    assert r.lookup.outcome in ("degraded", "recomputed")
    assert any("lower tier" in x and reason in x for x in r.lookup.reasons), r.lookup.reasons
    assert r.text == _cold_answers(model_dir, tmp_path, [FACT, "What is the code for Mira?"])[1]
    assert s.tier.failures.get(reason) == 1


def test_cancel_keeps_the_partial_answer(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "e.db")
    streamed = []  # should_stop is asked between prefill chunks and after every token
    r = s.send(FACT, on_text=streamed.append, should_stop=lambda: len(streamed) >= 2)
    # stopped at the token that streamed the second piece of text (a byte token may stream none)
    assert r.stop_reason == "cancelled" and len(streamed) == 2 and 2 <= len(r.token_ids) < 16
    assert s.path()[-1].role == "assistant" and s.path()[-1].content == r.text


def test_segments_show_per_state_presence(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "f.db")
    s.send(FACT)
    rows = s.segments()
    assert rows and all(r.presence["kv"] and r.presence["compressed"] for r in rows)
    assert rows[-1].presence["gdn"]  # a checkpoint at the request end (checkpoint_every=1: everywhere)
    assert all(r.on_disk for r in rows)  # saved at the end of the turn


def test_plain_repl_commands_and_json(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "g.db")
    out = io.StringIO()
    lines = [FACT, "/plan", "/segments", "/branch side", "/branches", "/nonsense", "/fork 99",
             "/fault evict-compressed", "What is the code for Mira?", "/stats", "/quit", "never read"]
    assert run_plain(s, lines, out, as_json=True) == 1  # two lines were refused: a script must know
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    types = [r["type"] for r in records]
    assert types == ["turn", "plan", "segments", "branch", "branches", "error", "error", "fault", "turn", "stats"]
    assert records[3]["branch"] == "side" and sum(b["current"] for b in records[4]["items"]) == 1
    assert "unknown command" in records[5]["error"] and "no message 99" in records[6]["error"]
    assert records[8]["outcome"] in ("hit", "degraded") and records[8]["plan"]["usable_tokens"] >= 0
    assert records[9]["turns"] == 2


def test_hcw_chat_plain_through_the_cli(model_dir, tmp_path):
    db = tmp_path / "h.db"
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(db), "--plain",
                                   "--max-new-tokens", "4"], input=f"{FACT}\n/history\n")
    assert res.exit_code == 0, res.output
    assert "[miss" in res.stdout and "0 system" in res.stdout and "2 assistant" in res.stdout
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(db), "--reuse", "sometimes"])
    assert res.exit_code == 2 and "--reuse must be one of" in res.stderr
    res = CliRunner().invoke(app, ["chat", "--model", str(tmp_path / "nope"), "--db", str(db)])
    assert res.exit_code == 2 and "does not exist" in res.stderr
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(db), "--reuse", "approximate",
                                   "--replay-budget", "lots"])
    assert res.exit_code == 2 and "not a fraction" in res.stderr
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(db), "--plain", "--json",
                                   "--reuse", "approximate", "--replay-budget", "adaptive", "--max-new-tokens", "2"],
                             input=f"{FACT}\n")
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[0])["type"] == "turn"


def test_approximate_reuse_is_opt_in_and_labelled_everywhere(tmp_path):
    from engine.model.random_init import qwen3_5_text_dict

    qwen = write_random_model(tmp_path / "qwen", qwen3_5_text_dict(hidden=64, layers=4, attn_every=2), seed=1)
    long_fact = "The code for Mira is 4821. " + "Some filler words that go on and on. " * 8
    edited = long_fact[:-30] + "But this ending differs from the first."
    outcomes = {}
    for reuse in ("exact", "approximate"):
        s = ChatSession(ChatOptions.of(model=qwen, db=tmp_path / f"{reuse}.db", block_size=16, checkpoint_every=100,
                                    checkpoint_tail=0, max_new_tokens=4, reuse=reuse, replay_budget=8))
        s.send(long_fact)
        s.edit(1, edited)
        outcomes[reuse] = (s, s.regenerate())
    s, r = outcomes["exact"]
    # no checkpoint near the edit: the exact policy replays the GDN layers from the start
    assert r.exact and r.replay_tokens == r.cached_tokens > 0 and all(row.exact for row in s.segments())
    s, r = outcomes["approximate"]
    assert not r.exact and 0 < r.replay_tokens <= 8 and r.replay_budget_tokens == 8
    assert r.replay_tokens < outcomes["exact"][1].replay_tokens  # a short replay is what approximate buys
    assert r.as_dict()["exact"] is False and s.path()[-1].content == r.text
    assert "approximate" in status_line(r) and "error bound" in status_line(r)
    assert not s.segments()[-1].exact  # segments written after an approximate resume say so
    assert json.loads(s.store.db.execute("SELECT meta FROM messages WHERE id = ?",
                                         [r.message.id]).fetchone()[0])["exact"] is False


def test_replay_budget_parsing():
    from workbench.session import parse_budget

    assert parse_budget("5%") == pytest.approx(0.05) and parse_budget("0.1") == 0.1 and parse_budget("512") == 512
    assert parse_budget("adaptive") is None
    for bad in ("zero", "0", "-1", "150%"):
        with pytest.raises(ValueError, match="replay-budget"):
            parse_budget(bad)


def test_a_turn_that_cannot_run_leaves_the_thread_as_it_was(tmp_path):
    small = write_random_model(tmp_path / "small", hcw_hybrid_dict(hidden=64, max_positions=160), seed=2)
    s = ChatSession(ChatOptions.of(model=small, db=tmp_path / "s.db", block_size=16, max_new_tokens=4))
    before = [m.id for m in s.path()]
    with pytest.raises(ValueError, match="context limit"):
        s.send("x" * 300)
    assert [m.id for m in s.path()] == before  # nothing half-stored
    r = s.send("hi")
    assert [m.role for m in s.path()] == ["system", "user", "assistant"] and r.message is not None


def test_a_turn_that_fails_mid_generation_is_rolled_back(model_dir, tmp_path, monkeypatch):
    s = _session(model_dir, tmp_path / "r.db")
    s.send(FACT)
    before = [m.id for m in s.path()]

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")
    monkeypatch.setattr(s.engine, "generate", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        s.send("What is the code for Mira?")
    assert [m.id for m in s.path()] == before


def test_hcw_chat_refuses_a_bad_database_and_an_unknown_session(model_dir, tmp_path):
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("this is not SQLite " * 100)
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(not_a_db), "--plain"], input="hi\n")
    assert res.exit_code == 2 and "cannot open the workbench database" in res.stderr
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--db", str(tmp_path / "ok.db"),
                                   "--session", "abcdef", "--plain"], input="hi\n")
    assert res.exit_code == 2 and "abcdef" in res.stderr


def test_hcw_chat_in_a_real_terminal(model_dir, tmp_path):
    """The TUI in tmux: type a message, watch the answer and the panes appear on the screen."""
    import shutil
    import subprocess
    import sys
    import time

    assert shutil.which("tmux"), "the end-to-end test needs tmux"
    name = f"hcw-test-{tmp_path.name}"
    hcw = [sys.executable, "-m", "workbench.cli"]
    cmd = " ".join(hcw + ["chat", "--model", str(model_dir), "--db", str(tmp_path / "t.db"), "--max-new-tokens", "4"])
    # the size in the environment too: a pytest run can hold COLUMNS/LINES, which tmux passes on and
    # Textual trusts over the terminal's own
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "160", "-y", "45", "-e", "COLUMNS=160", "-e",
                    "LINES=45", cmd], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-t", name, "-p"], capture_output=True, text=True).stdout

    def wait_for(*texts: str, limit: float = 60.0) -> str:
        """Wait until every text is on the screen at once (panes repaint independently)."""
        end = time.monotonic() + limit  # a bound on waiting for the screen, not a speed check
        while time.monotonic() < end:
            shown = screen()
            if all(text in shown for text in texts):
                return shown
            time.sleep(0.3)
        raise AssertionError(f"{texts!r} never all appeared:\n{screen()}")

    try:
        wait_for("segment states")
        subprocess.run(["tmux", "send-keys", "-t", name, "The code for Mira is 4821.", "Enter"], check=True)
        wait_for("outcome: miss", "2 · assistant", "turns 1")
        # the model runs in a process of the app's own (workbench/remote.py), not beside the UI thread
        import psutil

        pane = int(subprocess.run(["tmux", "display", "-p", "-t", name, "#{pane_pid}"], capture_output=True,
                                  text=True).stdout.strip())
        assert any("multiprocessing" in " ".join(c.cmdline()) for c in psutil.Process(pane).children(recursive=True))
        subprocess.run(["tmux", "send-keys", "-t", name, "C-q"], check=True)
        end = time.monotonic() + 30
        while time.monotonic() < end and name in subprocess.run(["tmux", "ls"], capture_output=True,
                                                                 text=True).stdout:
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def test_gdn_sketches_are_opt_in_with_approximate_reuse_and_shown(tmp_path):
    from engine.model.random_init import qwen3_5_text_dict

    qwen = write_random_model(tmp_path / "qwen", qwen3_5_text_dict(hidden=64, layers=4, attn_every=2), seed=1)
    with pytest.raises(ValueError, match="--gdn-sketches needs --reuse approximate"):
        ChatOptions.of(model=qwen, sketch_every=2)
    long_fact = "The code for Mira is 4821. " + "Some filler words that go on and on. " * 8
    edited = long_fact[:-30] + "But this ending differs from the first."
    s = ChatSession(ChatOptions.of(model=qwen, db=tmp_path / "s.db", block_size=16, checkpoint_every=100, checkpoint_tail=0,
                                max_new_tokens=4, reuse="approximate", replay_budget=0.5, sketch_every=2))
    s.send(long_fact)
    s.edit(1, edited)
    r = s.regenerate()
    assert not r.exact and r.lookup.plan.replay_seed is not None and r.as_dict()["plan"]["replay_seed"] is not None
    assert "from int8 sketches at" in status_line(r) and "error bound" in status_line(r)
    res = CliRunner().invoke(app, ["chat", "--model", str(qwen), "--db", str(tmp_path / "c.db"), "--gdn-sketches", "2"])
    assert res.exit_code == 2 and "needs --reuse approximate" in res.stderr
