"""The one command table (workbench/commands.py) and the plain REPL that reads it: every command is
in /help (text and JSON) and runs from a pipe; /set changes and lists options; a piped chat exits 1
when any turn or command failed, saying how many did."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench import commands
from workbench.cli import app
from workbench.plain import run_plain
from workbench.session import SETTABLE, ChatOptions, ChatSession

FACT = "The code for Mira is 4821. " + "Filler words go here and there. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a short context, so that one message can be past its limit
    return write_random_model(tmp_path_factory.mktemp("short"), hcw_hybrid_dict(hidden=64, max_positions=512), seed=3)


def _session(model_dir, db) -> ChatSession:
    return ChatSession(ChatOptions.of(model=model_dir, db=db, block_size=16, checkpoint_every=1, max_new_tokens=4))


def test_the_table_names_every_command_once_and_parses_what_it_lists():
    names = [n for c in commands.COMMANDS for n in (c.name, *c.aliases)]
    assert len(names) == len(set(names))
    assert {"help", "history", "branches", "branch", "fork", "edit", "switch", "resume", "segments", "plan",
            "fault", "faults", "save", "stats", "set", "quit"} <= set(names)
    help_text = "\n".join(commands.help_lines())
    for c in commands.COMMANDS:
        assert c.usage in help_text and c.help in help_text
        assert commands.parse(f"/{c.name} {c.args}")[0] is c
    assert commands.parse("/fork 3 'a side'") == (commands.BY_NAME["fork"], ["3", "a side"])
    assert commands.parse("/EXIT")[0].quits and commands.parse("/")[0].name == "help"
    assert [c.name for c in commands.COMMANDS if c.needs_args] == ["fork", "edit", "switch", "resume", "fault"]
    with pytest.raises(ValueError, match="unknown command /bogus"):
        commands.parse("/bogus")
    with pytest.raises(ValueError, match="cannot parse"):
        commands.parse("/edit 1 'unclosed")


def test_every_command_runs_from_a_pipe_and_help_lists_the_table(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "a.db")
    out = io.StringIO()
    lines = ["/help", FACT, "/history", "/branches", "/branch side", "/switch main", "/fork 1 other", "/segments",
             "/plan", "/faults", "/fault evict-compressed", "/save", "/stats", "/set", "/set temperature 0.5",
             f"/resume {s.conversation.id}", "/edit 1 goodbye", "/history", "/quit", "never read"]
    assert run_plain(s, lines, out, as_json=True) == 0
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["type"] for r in records] == ["help", "turn", "history", "branches", "branch", "branch", "branch",
                                            "segments", "plan", "faults", "fault", "save", "stats", "settings", "set",
                                            "resume", "turn", "history"]
    assert [i["command"] for i in records[0]["items"]] == [f"/{c.name}" for c in commands.COMMANDS]
    assert [i["name"] for i in records[13]["items"]] == list(SETTABLE)
    assert records[14]["name"] == "temperature" and "0.5" in records[14]["result"]
    assert s.opts.temperature == 0.5 and not s.opts.greedy
    assert records[-2]["stop_reason"] in ("stop", "length") and records[-1]["items"][1]["content"] == "goodbye"

    text = io.StringIO()
    assert run_plain(_session(model_dir, tmp_path / "b.db"), ["/help", "/set"], text) == 0
    for c in commands.COMMANDS:
        assert c.usage in text.getvalue()
    assert all(name in text.getvalue() for name in SETTABLE)


def test_a_piped_chat_exits_1_when_a_turn_or_a_command_failed_and_says_how_many(model_dir, tmp_path):
    db = tmp_path / "c.db"
    chat = ["chat", "--model", str(model_dir), "--db", str(db), "--plain", "--max-new-tokens", "3"]
    past_limit = "word " * 200  # well past the 512-token context
    res = CliRunner().invoke(app, chat, input=f"/bogus\n/switch nosuch\n{past_limit}\n{FACT}\n/set temperature hot\n")
    assert res.exit_code == 1, res.output
    assert "error: unknown command /bogus" in res.stdout and "error: no branch 'nosuch'" in res.stdout
    assert "past the context limit" in res.stdout and "[miss" in res.stdout  # the good turn was answered
    assert "hcw chat: 4 of 5 line(s) failed" in res.stderr
    assert "Traceback" not in res.output

    res = CliRunner().invoke(app, chat + ["--json"], input="/bogus\n")
    assert res.exit_code == 1 and json.loads(res.stdout.splitlines()[-1])["type"] == "error"
    assert "hcw chat: 1 of 1 line(s) failed" in res.stderr  # stdout stays one JSON object a line

    res = CliRunner().invoke(app, chat, input=f"{FACT}\n/stats\n")
    assert res.exit_code == 0 and "failed" not in res.stderr
