"""Opening a workbench file made before `conversation_meta` was a migration (store/db.py, m004)
upgrades it once: the table is there afterwards, and the conversations written before it are
intact and can be written to, named and listed."""

from __future__ import annotations

import sqlite_utils

from store.conversations import Conversations
from store.db import migrations, open_db

BEFORE = "m004_conversation_meta"


def _old_file(path, with_lazy_table: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    """A file with every migration before m004 and one conversation of three messages; with
    `with_lazy_table`, also the table as the first named conversation used to make it, with a row.
    Returns (conversation id, thread id, the path as (role, content))."""
    old = sqlite_utils.Database(path)
    old.execute("PRAGMA foreign_keys=ON")
    migrations.apply(old, stop_before=BEFORE)
    convs = Conversations(old)
    conv, main = convs.create("old chat", model="ab" * 16, system="be brief")
    convs.append(main.id, "user", "What is two plus two?")
    convs.append(main.id, "assistant", "Four.")
    if with_lazy_table:
        old.execute("CREATE TABLE conversation_meta (conversation TEXT PRIMARY KEY, meta TEXT)")
        old.execute("INSERT INTO conversation_meta VALUES (?, ?)", [conv.id, '{"model_name": "hcw-tiny"}'])
        old.conn.commit()
    assert ("conversation_meta" in old.table_names()) == with_lazy_table
    history = [(m.role, m.content) for m in convs.path(main.id)]
    old.close()
    return conv.id, main.id, history


def _applied(db) -> list[str]:
    return [r["name"] for r in db["_sqlite_migrations"].rows]


def test_opening_an_old_file_makes_conversation_meta_once(tmp_path):
    path = tmp_path / "old.db"
    _old_file(path)
    db = open_db(path)
    assert "conversation_meta" in db.table_names()
    assert set(db["conversation_meta"].columns_dict) == {"conversation", "meta"}
    db.close()
    again = open_db(path)
    assert _applied(again).count(BEFORE) == 1
    again.close()


def test_the_old_conversations_are_intact_and_usable_after_the_upgrade(tmp_path):
    path = tmp_path / "old.db"
    conv_id, thread_id, history = _old_file(path)
    convs = Conversations(open_db(path))
    assert [(m.role, m.content) for m in convs.path(thread_id)] == history
    assert convs.check() == []
    old = convs.conversation(conv_id)
    assert (old.title, old.model, old.model_name) == ("old chat", "ab" * 16, None)
    assert convs.recent()[0]["model"] == "ab" * 6  # no name: its fingerprint, shortened
    convs.append(thread_id, "user", "And three plus three?")
    assert [m.content for m in convs.path(thread_id)][-2:] == ["Four.", "And three plus three?"]
    new, _ = convs.create(model="cd" * 16, model_name="hcw-tiny-qwen3.5")
    assert convs.conversation(new.id).model_name == "hcw-tiny-qwen3.5"
    assert {c["id"]: c["model"] for c in convs.recent()} == {new.id: "hcw-tiny-qwen3.5", conv_id: "ab" * 6}
    assert convs.delete_if_empty(new.id)
    assert convs.db.execute("SELECT count(*) FROM conversation_meta").fetchone() == (0,)


def test_a_file_whose_table_was_made_by_a_named_conversation_keeps_its_names(tmp_path):
    path = tmp_path / "old.db"
    conv_id, thread_id, history = _old_file(path, with_lazy_table=True)
    convs = Conversations(open_db(path))
    assert BEFORE in _applied(convs.db)
    assert convs.conversation(conv_id).model_name == "hcw-tiny"
    assert [(m.role, m.content) for m in convs.path(thread_id)] == history


def test_a_file_that_lost_the_table_still_takes_a_new_conversation(tmp_path):
    """(Found in review.) m004 is recorded as done, so it does not run again: the name is not kept,
    the conversation is, and the listing still answers."""
    db = open_db(tmp_path / "w.db")
    db.execute("DROP TABLE conversation_meta")
    convs = Conversations(open_db(tmp_path / "w.db"))
    conv, main = convs.create(system="hi", model_name="hcw-tiny")
    assert convs.path(main.id)[0].content == "hi"
    assert [c["id"] for c in convs.recent()] == [conv.id]
