"""`Conversations.recent` (what `hcw conversations` and `hcw chat -c` read) and model names kept
with a conversation."""

from __future__ import annotations

import sqlite3

import pytest

from store.conversations import Conversations, shorten
from store.db import open_db


@pytest.fixture
def convs(tmp_path):
    return Conversations(open_db(tmp_path / "hcw.db"))


def _stamp(convs: Conversations, conv_id: str, updated: str) -> None:
    with convs.db.conn:
        convs.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", [updated, conv_id])


def test_recent_lists_newest_first_with_title_model_and_counts(convs):
    old, main = convs.create(model="ab" * 16, system="be terse")
    convs.append(main.id, "user", "The code for Mira is 4821.\n  What is the code?")
    convs.append(main.id, "assistant", "4821")
    convs.fork(convs.path(main.id)[1].id, "other")
    new, t = convs.create(model="cd" * 16, model_name="hcw-tiny")
    convs.append(t.id, "user", "hello")
    _stamp(convs, old.id, "2020-01-01T00:00:00+00:00")
    assert convs.recent() == [
        {"id": new.id, "title": "hello", "model": "hcw-tiny", "branches": 1, "messages": 1,
         "updated": convs.conversation(new.id).updated},
        # no name kept (made before names were): the fingerprint's first 12 digits
        {"id": old.id, "title": "The code for Mira is 4821. What is the code?", "model": "ab" * 6, "branches": 2,
         "messages": 3, "updated": "2020-01-01T00:00:00+00:00"},
    ]
    assert [c["id"] for c in convs.recent(1)] == [new.id]
    _stamp(convs, old.id, "2999-01-01T00:00:00+00:00")
    assert [c["id"] for c in convs.recent(1)] == [old.id]


def test_recent_title_prefers_a_stored_title_and_is_shortened(convs):
    named, _ = convs.create("arithmetic")
    _, t = convs.create()
    convs.append(t.id, "user", "x" * 100)
    empty, _ = convs.create()
    by_id = {c["id"]: c for c in convs.recent()}
    assert by_id[named.id]["title"] == "arithmetic" and by_id[empty.id]["title"] is None
    assert by_id[t.conversation]["title"] == "x" * 59 + "…"
    assert shorten("a\n\tb  c", 3) == "a …" and shorten("abc", 3) == "abc"


def test_recent_query_matches_message_text_case_insensitively(convs):
    _, a = convs.create()
    convs.append(a.id, "user", "first")
    convs.append(a.id, "assistant", "The GRÜNE door")
    _, b = convs.create()
    convs.append(b.id, "user", "something else")
    assert [c["id"] for c in convs.recent(query="grüne")] == [a.conversation]  # beyond ASCII
    assert [c["id"] for c in convs.recent(query="ELSE")] == [b.conversation]
    assert convs.recent(query="absent") == []
    assert convs.recent(query="%") == [] and convs.recent(query="_") == []  # no LIKE wildcards
    with pytest.raises(ValueError, match="empty query"):
        convs.recent(query="  ")
    with pytest.raises(ValueError, match="at least 1"):
        convs.recent(0)


def test_model_name_is_kept_with_the_conversation(convs):
    conv, _ = convs.create(model="ab" * 16, model_name="hcw-tiny-qwen3.5")
    assert convs.conversation(conv.id).model_name == "hcw-tiny-qwen3.5"
    assert convs.conversation(conv.id).model == "ab" * 16
    plain, _ = convs.create(model="ab" * 16)
    assert convs.conversation(plain.id).model_name is None
    assert {c.id: c.model_name for c in convs.conversations()} == {conv.id: "hcw-tiny-qwen3.5", plain.id: None}


def test_a_conversation_without_a_model_name_has_no_meta_row(convs):
    convs.create(model="ab" * 16)
    # the table is made by migration m004 (tests/test_store_migration.py); only a name adds a row
    assert convs.db.execute("SELECT count(*) FROM conversation_meta").fetchone()[0] == 0
    assert convs.recent()[0]["model"] == "ab" * 6


def test_recent_lists_damaged_rows_without_failing(convs):
    _, t = convs.create(model_name="m")
    convs.append(t.id, "user", "fine")
    _, bad = convs.create()
    convs.append(bad.id, "user", "will be damaged")
    db = convs.db
    db.execute("PRAGMA foreign_keys=OFF")
    with db.conn:
        # text that is not UTF-8 (sqlite3 cannot hand such a cell over as str), a name that is not JSON,
        # a message whose conversation is missing
        db.execute("UPDATE messages SET content = CAST(x'ff41fe' AS TEXT) WHERE conversation = ?", [bad.conversation])
        db.execute("UPDATE conversation_meta SET meta = 'not json'")
        db.execute("INSERT INTO messages (id, conversation, parent, role, content, tokens, meta, created) "
                   "VALUES ('ee', 'nosuch', NULL, 'user', 'orphan', NULL, '{}', 'x')")
    with pytest.raises(sqlite3.OperationalError):  # what a plain read meets
        db.execute("SELECT content FROM messages WHERE conversation = ?", [bad.conversation]).fetchall()
    listed = {c["id"]: c for c in convs.recent()}
    assert listed[bad.conversation]["title"] == "\ufffdA\ufffd" and listed[bad.conversation]["messages"] == 1
    assert listed[t.conversation]["model"] is None and listed[t.conversation]["title"] == "fine"
    assert [c["id"] for c in convs.recent(query="a")] == [bad.conversation]
    assert convs.conversation(t.conversation).model_name is None
    assert "nosuch" not in listed
