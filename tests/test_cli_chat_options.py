"""`hcw chat`'s options reach ChatOptions: --system, --temperature, --top-p, --seed, -c/--continue;
flags read as flags in --help; the default file's location is written there; `hcw --version`."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from store.conversations import Conversations
from store.db import open_db
from workbench import cli, session
from workbench.cli import app

runner = CliRunner()


class _Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """ChatSession replaced by one that keeps the options it was given and refuses to start."""
    seen = []

    def fake(opts, *args, **kwargs):
        seen.append(opts)
        raise ValueError("not started (test)")

    monkeypatch.setattr(session, "ChatSession", fake)
    return seen


def _opts(captured, *args) -> session.ChatOptions:
    res = runner.invoke(app, ["chat", "--plain", *args])
    assert res.exit_code == 2 and res.stderr == "error: not started (test)\n", res.output
    return captured[-1]


def test_sampling_options_reach_chat_options(captured):
    opts = _opts(captured, "--temperature", "0.5", "--top-p", "0.9", "--seed", "7")
    assert (opts.temperature, opts.top_p, opts.seed, opts.greedy) == (0.5, 0.9, 7, False)
    assert _opts(captured, "--top-p", "0.5").greedy is False  # either one turns sampling on
    plain = _opts(captured)
    defaults = session.ChatOptions.of()
    assert (plain.temperature, plain.top_p, plain.seed, plain.greedy, plain.system) == (
        defaults.temperature, defaults.top_p, defaults.seed, True, defaults.system)
    assert _opts(captured, "--seed", "3").greedy is True  # a seed alone keeps greedy decoding


def test_system_and_continue_reach_chat_options(captured):
    assert _opts(captured, "--system", "be brief").system == "be brief"
    assert _opts(captured, "--system", "").system is None  # '': no system message
    assert _opts(captured, "-c").continue_last is True and _opts(captured, "--continue").continue_last is True
    assert _opts(captured).continue_last is False


@pytest.mark.parametrize("args, message", [
    (["--temperature", "0"], "temperature must be > 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--seed", "x"], "valid integer"),
    (["-c", "--session", "ab"], "not both"),
    (["-c", "--system", "be brief"], "--system starts a new conversation"),
    (["--session", "ab", "--system", ""], "--system starts a new conversation"),
])
def test_bad_chat_options_exit_2_with_one_line(args, message):
    res = runner.invoke(app, ["chat", "--plain", *args])
    assert res.exit_code == 2 and message in res.stderr, res.output
    assert "Traceback" not in res.output


def test_help_defaults_are_chat_options_defaults():
    defaults = session.ChatOptions.of()
    assert cli.CHAT_DEFAULTS == {k: getattr(defaults, k) for k in cli.CHAT_DEFAULTS}


def test_chat_system_is_stored_and_continue_resumes_the_latest(tmp_path):
    db = tmp_path / "hcw.db"
    base = ["chat", "--plain", "--db", str(db), "--max-new-tokens", "2"]
    res = runner.invoke(app, [*base, "--system", "You answer in one word."], input="hello\n/quit\n")
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*base, "-c"], input="again\n/quit\n")
    assert res.exit_code == 0, res.output
    convs = Conversations(open_db(db))
    used = [c for c in convs.recent() if c["messages"]]
    assert len(used) == 1  # -c answered in the same conversation
    (main,) = convs.threads(used[0]["id"])
    path = convs.path(main.id)
    assert (path[0].role, path[0].content) == ("system", "You answer in one word.")
    assert [m.content for m in path if m.role == "user"] == ["hello", "again"]
    assert used[0]["model"] == "hcw-tiny"  # the name, not the layout's fingerprint


def test_continue_without_a_conversation_exits_2(tmp_path):
    res = runner.invoke(app, ["chat", "--plain", "--db", str(tmp_path / "hcw.db"), "-c"], input="/quit\n")
    assert res.exit_code == 2 and "no stored conversation to continue" in res.stderr


def test_flags_read_as_flags_and_the_default_file_is_named():
    for command in (["chat"], ["inspect"], ["generate"], ["drill"]):
        res = runner.invoke(app, [*command, "--help"], terminal_width=100)
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.stdout and "BOOLEAN" not in res.stdout
    out = runner.invoke(app, ["chat", "--help"], terminal_width=100).stdout
    assert "--plain " in out and "-c, --continue " in out
    flat = " ".join(out.split())
    assert "$HCW_HOME/hcw.db" in flat and "~/.local/share/hcw/hcw.db" in flat
    flat = " ".join(runner.invoke(app, ["inspect", "--help"], terminal_width=100).stdout.split())
    assert "$HCW_HOME/hcw.db" in flat and "~/.local/share/hcw/hcw.db" in flat


def test_docstrings_are_paragraphs_not_their_source_lines():
    out = runner.invoke(app, ["replay", "--help"], terminal_width=200).stdout
    # the docstring breaks after "check their"; the help joins it into one line at this width
    assert "Run scripted chat sessions (turns, branches, edits, restarts, faults) and check their expectations;" \
        in out


def test_version_and_completion():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout == f"hcw {version('hcw')}\n"
    out = runner.invoke(app, ["--help"]).stdout
    assert "--install-completion" in out and "--show-completion" in out

