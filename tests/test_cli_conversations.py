"""`hcw conversations`, `hcw export`, and what `hcw inspect` says of conversations (model names,
branches, the file it read)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from store.conversations import Conversations
from store.db import open_db
from workbench.cli import app

runner = CliRunner()


@pytest.fixture
def stored(tmp_path):
    """Two conversations: "mira" (hcw-tiny, two branches, newest) and "old" (no model name kept)."""
    path = tmp_path / "hcw.db"
    convs = Conversations(open_db(path))
    old, t = convs.create(model="ab" * 16, system="be terse")
    convs.append(t.id, "user", "What is 2+2?")
    convs.append(t.id, "assistant", "4")
    mira, main = convs.create(model="cd" * 16, system="sys", model_name="hcw-tiny")
    user = convs.append(main.id, "user", "The code for Mira is 4821.")
    convs.append(main.id, "assistant", "Noted.")
    edited, _ = convs.edit(main.id, user.id, "The code for Mira is 1234.")
    convs.append(edited.id, "assistant", "Noted: 1234.", meta={"incomplete": True})
    with convs.db.conn:
        convs.db.execute("UPDATE conversations SET updated = '2020-01-01T00:00:00+00:00' WHERE id = ?", [old.id])
        # main is the most recently updated branch of mira, the one a resume continues
        convs.db.execute("UPDATE threads SET updated = '2999-01-01T00:00:00+00:00' WHERE id = ?", [main.id])
    convs.db.close()
    return path, mira.id, old.id


def test_conversations_lists_newest_first(stored):
    path, mira, old = stored
    res = runner.invoke(app, ["conversations", "--db", str(path)])
    assert res.exit_code == 0, res.output
    header, first, second = res.stdout.splitlines()
    assert header.split() == ["id", "updated", "model", "branches", "messages", "title"]
    assert first.startswith(mira) and "hcw-tiny" in first and first.endswith("The code for Mira is 4821.")
    assert first.split()[4:6] == ["2", "5"]  # branches, messages
    assert second.startswith(old) and "2020-01-01 00:00" in second and "ab" * 6 in second


def test_conversations_json_limit_and_query(stored):
    path, mira, old = stored
    res = runner.invoke(app, ["conversations", "--db", str(path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["db"] == str(path)
    assert [(c["id"], c["model"], c["branches"], c["messages"]) for c in report["conversations"]] == [
        (mira, "hcw-tiny", 2, 5), (old, "ab" * 6, 1, 3)]
    res = runner.invoke(app, ["conversations", "--db", str(path), "--json", "-n", "1"])
    assert [c["id"] for c in json.loads(res.stdout)["conversations"]] == [mira]
    res = runner.invoke(app, ["conversations", "--db", str(path), "--json", "-q", "2+2"])
    assert [c["id"] for c in json.loads(res.stdout)["conversations"]] == [old]
    res = runner.invoke(app, ["conversations", "--db", str(path), "-q", "nowhere"])
    assert res.exit_code == 0 and res.stdout == f'no conversations matching "nowhere" in {path}\n'


def test_conversations_without_a_file_lists_none_and_bad_input_exits_2(tmp_path):
    missing = tmp_path / "none.db"
    res = runner.invoke(app, ["conversations", "--db", str(missing), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["conversations"] == []
    assert not missing.exists()  # listing never makes a file
    res = runner.invoke(app, ["conversations", "--db", str(missing), "-n", "0"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["conversations", "--db", str(missing), "-q", " "])
    assert res.exit_code == 2 and "empty query" in res.stderr
    other = tmp_path / "other.txt"
    other.write_text("not a database")
    res = runner.invoke(app, ["conversations", "--db", str(other)])
    assert res.exit_code == 1 and res.stderr.startswith("error: ") and "not a workbench database" in res.stderr
    assert "Traceback" not in res.output


def test_conversations_default_file_is_under_hcw_home(stored, monkeypatch):
    path, mira, _ = stored
    monkeypatch.setenv("HCW_HOME", str(path.parent))
    res = runner.invoke(app, ["conversations", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["conversations"][0]["id"] == mira


def test_export_markdown_of_the_current_branch(stored):
    path, mira, _ = stored
    res = runner.invoke(app, ["export", mira[:5], "--db", str(path)])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert out.startswith("# The code for Mira is 4821.\n")
    assert f"- conversation: {mira}\n- branch: main\n- model: hcw-tiny\n" in out
    assert out.index("## system\n\nsys\n") < out.index("## user\n\nThe code for Mira is 4821.\n") \
        < out.index("## assistant\n\nNoted.\n")
    assert "1234" not in out


def test_export_json_of_a_named_branch(stored):
    path, mira, _ = stored
    res = runner.invoke(app, ["export", mira, "--branch", "edit-1", "--format", "json", "--db", str(path)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert (report["id"], report["branch"], report["model"]) == (mira, "edit-1", "hcw-tiny")
    assert [(m["role"], m["content"]) for m in report["messages"]] == [
        ("system", "sys"), ("user", "The code for Mira is 1234."), ("assistant", "Noted: 1234.")]
    assert report["messages"][-1]["meta"] == {"incomplete": True}
    md = runner.invoke(app, ["export", mira, "--branch", "edit-1", "--db", str(path)]).stdout
    assert "## assistant (incomplete)\n\nNoted: 1234.\n" in md


@pytest.mark.parametrize("args, message", [
    (["beef"], "no conversation 'beef'"),
    (["{mira}", "--branch", "nosuch"], "no branch 'nosuch'"),
    (["{mira}", "--format", "html"], "--format must be one of md, json"),
    (["xyz!"], "no conversation"),
])
def test_export_refusals_exit_2(stored, args, message):
    path, mira, _ = stored
    res = runner.invoke(app, ["export", *[a.format(mira=mira) for a in args], "--db", str(path)])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: ") and message in res.stderr and res.stderr.count("\n") == 1


def test_export_of_a_damaged_branch_exits_1_naming_it(stored):
    path, mira, _ = stored
    db = open_db(path)
    db.execute("PRAGMA foreign_keys=OFF")
    with db.conn:
        db.execute("DELETE FROM messages WHERE conversation = ? AND role = 'user' AND content LIKE '%4821%'", [mira])
    db.close()
    res = runner.invoke(app, ["export", mira, "--db", str(path)])
    assert res.exit_code == 1 and res.stderr.startswith("error: ") and "is missing" in res.stderr
    assert res.stdout == ""


def test_export_without_a_file_exits_2(tmp_path):
    res = runner.invoke(app, ["export", "ab", "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 2 and "no workbench database at" in res.stderr


def test_inspect_names_models_and_branches_and_the_default_file(stored, monkeypatch):
    path, mira, old = stored
    res = runner.invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"workbench file {path}"  # named: not the default
    (line,) = [x for x in lines if mira in x]
    assert "hcw-tiny" in line and "5 messages  2 branches" in line and "thread" not in res.stdout
    (line,) = [x for x in lines if old in x]
    assert "ab" * 6 in line and "1 branch " in line
    monkeypatch.setenv("HCW_HOME", str(path.parent))
    res = runner.invoke(app, ["inspect"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith(f"workbench file {path} (the default file")
    res = runner.invoke(app, ["inspect", "--session", mira])
    assert res.exit_code == 0, res.output
    out = res.stdout.splitlines()
    assert out[0].startswith(f"workbench file {path} (the default")
    assert out[1].startswith(f"conversation {mira}") and "model hcw-tiny" in out[1] and out[2] == "  branches:"
    report = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert {c["id"]: c["model"] for c in report["conversations"]} == {mira: "hcw-tiny", old: "ab" * 6}
    report = json.loads(runner.invoke(app, ["inspect", str(path), "--session", mira, "--json"]).stdout)
    assert report["conversation"]["model_name"] == "hcw-tiny"
