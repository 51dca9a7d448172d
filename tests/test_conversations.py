"""Conversations as a message tree: shared rows, threads, edits, drafts, persistence, migrations,
`hcw inspect --session`. Damaged rows: tests/test_damage_store.py."""

from __future__ import annotations

import itertools
import json
import sqlite3
import threading
from types import SimpleNamespace

import pytest
import sqlite_utils
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from store import conversations as conversations_module
from store.conversations import Conversations, walk
from store.db import PAGE_SIZE, migrations, open_db
from workbench.cli import app


@pytest.fixture
def convs(tmp_path):
    return Conversations(open_db(tmp_path / "hcw.db"))


def _rows(convs: Conversations) -> int:
    return convs.db["messages"].count


def _texts(convs: Conversations, thread_id: str) -> list[str]:
    return [m.content for m in convs.path(thread_id)]


def _chat(convs: Conversations):
    """system, user, assistant, user, assistant on "main"."""
    conv, main = convs.create("arithmetic", model="ab" * 16, system="be terse")
    ids = [convs.path(main.id)[0].id]
    for role, text, tokens in [("user", "2+2?", 4), ("assistant", "4", 1), ("user", "3+3?", 4), ("assistant", "6", 1)]:
        ids.append(convs.append(main.id, role, text, tokens=tokens, meta={"ms": 1.5}).id)
    return conv, main, ids


def test_create_makes_a_main_thread_holding_the_system_message(convs):
    conv, main = convs.create("t", system="sys")
    assert main.name == "main" and main.conversation == conv.id and main.forked_from is None
    (system,) = convs.path(main.id)
    assert (system.role, system.content, system.parent) == ("system", "sys", None) and main.tip == system.id
    _, empty = convs.create()
    assert empty.tip is None and convs.path(empty.id) == []


def test_an_edit_is_a_sibling_on_a_new_thread_and_branches_share_their_common_rows(convs):
    conv, main, ids = _chat(convs)
    assert _rows(convs) == 5
    edited, message = convs.edit(main.id, ids[3], "3+4?")
    assert _rows(convs) == 6  # only the new sibling
    assert (message.parent, message.role) == (ids[2], "user") and edited.forked_from == ids[2]
    assert edited.tip == message.id and edited.name == "edit-1"
    convs.append(edited.id, "assistant", "7")
    assert _rows(convs) == 7
    assert _texts(convs, main.id) == ["be terse", "2+2?", "4", "3+3?", "6"]  # the old thread keeps its history
    assert _texts(convs, edited.id) == ["be terse", "2+2?", "4", "3+4?", "7"]
    assert [m.id for m in convs.path(edited.id)][:3] == ids[:3]
    assert [m.content for m in convs.children(ids[2])] == ["3+3?", "3+4?"]
    assert [t.name for t in convs.threads(conv.id)] == ["main", "edit-1"]


def test_editing_the_root_makes_a_second_root(convs):
    conv, main, ids = _chat(convs)
    edited, message = convs.edit(main.id, ids[0], "be verbose")
    assert message.parent is None and edited.forked_from is None
    assert [n["message"].content for n in convs.tree(conv.id)] == ["be terse", "be verbose"]


def test_append_is_idempotent_for_the_same_message_under_the_same_parent(convs):
    _, main, ids = _chat(convs)
    other = convs.fork(ids[2])
    again = convs.append(other.id, "user", "3+3?", tokens=99)
    assert again.id == ids[3] and again.tokens == 4 and _rows(convs) == 5  # the existing row, untouched
    assert convs.thread(other.id).tip == ids[3]
    convs.set_tip(main.id, ids[2])
    assert convs.append(main.id, "user", "3+3?").id == ids[3] and _rows(convs) == 5
    assert convs.append(main.id, "assistant", "6").id == ids[4] and _rows(convs) == 5


def test_fork_then_append_diverges_and_leaves_the_original_tip(convs):
    _, main, ids = _chat(convs)
    fork = convs.fork(ids[2], name="what-if")
    assert (fork.tip, fork.forked_from, fork.name) == (ids[2], ids[2], "what-if")
    convs.append(fork.id, "user", "5+5?")
    convs.append(fork.id, "assistant", "10")
    assert _texts(convs, fork.id) == ["be terse", "2+2?", "4", "5+5?", "10"]
    assert convs.thread(main.id).tip == ids[4] and _rows(convs) == 7
    assert convs.fork(ids[1]).name == "fork-1"  # default names do not collide


def test_a_message_is_addressed_by_its_parent_and_conversation_too(convs):
    _, main = convs.create()
    first = convs.append(main.id, "user", "ok")
    second = convs.append(main.id, "user", "ok")
    assert first.id != second.id and second.parent == first.id and _rows(convs) == 2
    _, elsewhere = convs.create()
    assert convs.append(elsewhere.id, "user", "ok").id != first.id and _rows(convs) == 3
    assert convs.append(main.id, "assistant", "ok").id != convs.append(main.id, "user", "ok").id


def test_set_tip_and_rename(convs):
    _, main, ids = _chat(convs)
    assert convs.set_tip(main.id, ids[1]).tip == ids[1]
    assert _texts(convs, main.id) == ["be terse", "2+2?"]
    assert convs.set_tip(main.id, None).tip is None and convs.path(main.id) == []
    assert convs.rename(main.id, "trunk").name == "trunk"
    _, other = convs.create(system="x")
    with pytest.raises(ValueError, match="another conversation"):
        convs.set_tip(main.id, convs.thread(other.id).tip)
    with pytest.raises(ValueError, match="empty"):
        convs.rename(main.id, "  ")


def test_a_streamed_answer_is_written_as_drafts_each_replacing_the_last(convs):
    _, main, ids = _chat(convs)
    user = convs.append(main.id, "user", "4+4?")
    rows = _rows(convs)
    first = convs.append(main.id, "assistant", "8", meta={"incomplete": True})
    assert first.parent == user.id and convs.thread(main.id).tip == first.id and _rows(convs) == rows + 1
    second = convs.append(main.id, "assistant", "8, since", meta={"incomplete": True}, replaces=first.id)
    assert second.parent == user.id and _rows(convs) == rows + 1
    with pytest.raises(KeyError):
        convs.message(first.id)
    final = convs.append(main.id, "assistant", "8, since 4+4=8", tokens=7, meta={"stop_reason": "eos"},
                         replaces=second.id)
    assert _rows(convs) == rows + 1 and _texts(convs, main.id)[-2:] == ["4+4?", "8, since 4+4=8"]
    assert convs.message(final.id).meta == {"stop_reason": "eos"} and convs.children(user.id) == [final]
    # the answer's last draft already holds its whole text: the row is written again, complete
    convs.append(main.id, "user", "again")
    draft = convs.append(main.id, "assistant", "same", meta={"incomplete": True})
    done = convs.append(main.id, "assistant", "same", tokens=1, meta={"stop_reason": "eos"}, replaces=draft.id)
    assert done.id == draft.id and (convs.message(done.id).tokens, convs.message(done.id).meta) == (
        1, {"stop_reason": "eos"})
    assert convs.check() == []


def test_a_draft_equal_to_a_complete_sibling_never_deletes_it(convs):
    _, main, ids = _chat(convs)
    convs.set_tip(main.id, ids[3])  # "3+3?" answered again; "6" is its complete answer
    draft = convs.append(main.id, "assistant", "6", meta={"incomplete": True})
    assert draft.id == ids[4] and draft.meta == {"ms": 1.5}  # that complete row, as it was
    convs.append(main.id, "assistant", "6, of course", meta={"incomplete": True}, replaces=draft.id)
    final = convs.append(main.id, "assistant", "6, of course.", replaces=convs.thread(main.id).tip)
    assert [m.content for m in convs.children(ids[3])] == ["6", "6, of course."]
    assert convs.message(ids[4]).meta == {"ms": 1.5} and convs.thread(main.id).tip == final.id
    convs.set_tip(main.id, ids[3])
    again = convs.append(main.id, "assistant", "6", meta={"incomplete": True})
    convs.discard_draft(main.id, again.id, ids[3])
    assert convs.message(ids[4]).content == "6" and convs.thread(main.id).tip == ids[3]


def test_a_draft_that_something_refers_to_is_kept(convs):
    _, main, ids = _chat(convs)
    user = convs.append(main.id, "user", "q")
    draft = convs.append(main.id, "assistant", "partial", meta={"incomplete": True})
    keep = convs.fork(draft.id, "keep")  # another thread's tip and fork point
    convs.append(main.id, "assistant", "partial answer", replaces=draft.id)
    assert convs.message(draft.id).meta == {"incomplete": True} and convs.thread(keep.id).tip == draft.id
    convs.set_tip(main.id, user.id)
    held = convs.append(main.id, "assistant", "half", meta={"incomplete": True})
    child = convs.append(main.id, "user", "go on")
    convs.set_tip(main.id, held.id)
    convs.discard_draft(main.id, held.id, user.id)
    assert convs.message(held.id).content == "half" and convs.message(child.id).parent == held.id
    # the kept draft's text, written whole: that row is complete now
    convs.set_tip(main.id, user.id)
    whole = convs.append(main.id, "assistant", "partial", tokens=1, meta={"stop_reason": "eos"})
    assert whole.id == draft.id and convs.message(draft.id).meta == {"stop_reason": "eos"}
    assert convs.check() == []


def test_replacing_or_discarding_what_is_not_the_tip_writes_nothing(convs):
    conv, main, ids = _chat(convs)
    with pytest.raises(ValueError, match="not the tip"):
        convs.append(main.id, "assistant", "x", replaces=ids[3])
    with pytest.raises(ValueError, match="not the tip"):
        convs.discard_draft(main.id, ids[3], ids[2])
    _, other = convs.create(system="elsewhere")
    with pytest.raises(ValueError, match="another conversation"):
        convs.discard_draft(main.id, ids[4], convs.thread(other.id).tip)
    with pytest.raises(KeyError, match="feed"):
        convs.discard_draft(main.id, ids[4], "feed")
    assert _rows(convs) == 6 and convs.thread(main.id).tip == ids[4]
    # a complete tip "discarded" only moves the tip: the row is not a draft
    assert convs.discard_draft(main.id, ids[4], ids[3]).tip == ids[3] and convs.message(ids[4]).content == "6"


def test_a_failed_turn_discards_its_draft(convs):
    _, main, ids = _chat(convs)
    user = convs.append(main.id, "user", "q")
    draft = convs.append(main.id, "assistant", "par", meta={"incomplete": True})
    assert convs.discard_draft(main.id, draft.id, ids[4]).tip == ids[4]  # where the thread was before the turn
    with pytest.raises(KeyError):
        convs.message(draft.id)
    assert convs.message(user.id).content == "q" and _texts(convs, main.id)[-1] == "6"
    draft = convs.append(main.id, "assistant", "again", meta={"incomplete": True})
    assert convs.discard_draft(main.id, draft.id).tip == ids[4]  # by default, the draft's parent
    assert _rows(convs) == 6
    _, empty = convs.create()
    draft = convs.append(empty.id, "assistant", "x", meta={"incomplete": True})
    assert convs.discard_draft(empty.id, draft.id, None).tip is None and convs.path(empty.id) == []
    assert convs.check() == []


def test_conversations_are_listed_most_recently_updated_first(convs):
    older, older_main = convs.create("older")
    convs.create("newer")
    assert [c.title for c in convs.conversations()] == ["newer", "older"]
    convs.append(older_main.id, "user", "bump")
    assert [c.title for c in convs.conversations()] == ["older", "newer"]
    assert convs.counts(older.id) == (1, 1)


def test_the_tree_is_the_same_after_reopening_the_file(tmp_path):
    path = tmp_path / "hcw.db"
    convs = Conversations(open_db(path))
    conv, main, ids = _chat(convs)
    edited, _ = convs.edit(main.id, ids[3], "3+4?")
    convs.append(edited.id, "assistant", "7", meta={"plan": {"reused": 12}})
    before = [(d, n["message"], n["threads"]) for d, n in walk(convs.tree(conv.id))]
    convs.db.close()
    again = Conversations(open_db(path))
    assert [(d, n["message"], n["threads"]) for d, n in walk(again.tree(conv.id))] == before
    assert before[-1][1].meta == {"plan": {"reused": 12}} and before[-1][2] == ["edit-1"]
    assert _texts(again, edited.id)[-1] == "7"


def test_a_new_database_has_large_pages_and_a_write_ahead_log(tmp_path):
    db = open_db(tmp_path / "new.db")
    assert db.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrations_upgrade_a_database_made_before_conversations(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m002_conversations")
    old["models"].insert({"fingerprint": "ff", "config": "{}", "created": "then"})
    assert "messages" not in old.table_names()
    old.close()
    db = open_db(path)
    assert db.execute("PRAGMA page_size").fetchone()[0] == 4096  # an existing file keeps its pages
    assert {"conversations", "messages", "threads"} <= set(db.table_names())
    assert [r["fingerprint"] for r in db["models"].rows] == ["ff"]
    assert {r["name"] for r in db["_sqlite_migrations"].rows} == {"m001_cache_tables", "m002_conversations",
                                                                  "m003_blob_packs", "m004_conversation_meta"}
    assert "members" in db["blobs"].columns_dict
    _, main = Conversations(db).create(system="hi")
    assert Conversations(db).path(main.id)[0].content == "hi"


@pytest.mark.parametrize("call, missing", [
    (lambda c, ids: c.conversation("feed"), "feed"),
    (lambda c, ids: c.thread("feed"), "feed"),
    (lambda c, ids: c.message("feed"), "feed"),
    (lambda c, ids: c.threads("feed"), "feed"),
    (lambda c, ids: c.tree("feed"), "feed"),
    (lambda c, ids: c.append("feed", "user", "x"), "feed"),
    (lambda c, ids: c.path("feed"), "feed"),
    (lambda c, ids: c.fork("feed"), "feed"),
    (lambda c, ids: c.children("feed"), "feed"),
    (lambda c, ids: c.edit(ids["main"], "feed", "x"), "feed"),
    (lambda c, ids: c.set_tip(ids["main"], "feed"), "feed"),
    (lambda c, ids: c.rename("feed", "x"), "feed"),
], ids=["conversation", "thread", "message", "threads", "tree", "append", "path", "fork", "children", "edit",
        "set_tip", "rename"])
def test_unknown_ids_raise_key_error_naming_the_id(convs, call, missing):
    _, main, _ = _chat(convs)
    rows = _rows(convs)
    with pytest.raises(KeyError, match=missing):
        call(convs, {"main": main.id})
    assert _rows(convs) == rows and convs.thread(main.id).tip == convs.path(main.id)[-1].id


def test_bad_values_raise_value_error_and_write_nothing(convs):
    conv, main, ids = _chat(convs)
    with pytest.raises(ValueError, match="role"):
        convs.append(main.id, "tool", "x")
    with pytest.raises(ValueError, match="tokens"):
        convs.append(main.id, "user", "x", tokens=-1)
    with pytest.raises(TypeError, match="text"):
        convs.append(main.id, "user", None)
    assert _rows(convs) == 5
    other, _ = convs.edit(main.id, ids[3], "3+4?")
    rows = _rows(convs)
    with pytest.raises(ValueError, match="not on the path"):
        convs.edit(main.id, convs.thread(other.id).tip, "y")
    assert _rows(convs) == rows and len(convs.threads(conv.id)) == 2
    assert convs.thread(main.id).tip == ids[4]


def test_prefixes_resolve_like_git(convs, monkeypatch):
    fixed = iter(["aaa111000000", "0000000000a1", "aaa222000000", "0000000000a2"])
    # ids only: sqlite-utils draws its savepoint names from the same function
    monkeypatch.setattr(conversations_module, "secrets", SimpleNamespace(token_hex=lambda n: next(fixed)))
    first, _ = convs.create("one")
    second, _ = convs.create("two")
    assert convs.resolve("conversation", "aaa1") == first.id
    assert convs.resolve("conversation", "AAA2") == second.id
    assert convs.resolve("conversation", second.id) == second.id
    assert convs.resolve("thread", "0000000000a2") == "0000000000a2"
    with pytest.raises(ValueError, match="ambiguous: aaa111000000, aaa222000000"):
        convs.resolve("conversation", "aaa")
    with pytest.raises(KeyError, match="no conversation 'bbb'"):
        convs.resolve("conversation", "bbb")
    with pytest.raises(KeyError, match="no thread"):
        convs.resolve("thread", "a%_*")  # not hex: matches nothing, never a pattern
    with pytest.raises(ValueError, match="kind"):
        convs.resolve("segment", "aa")


def test_a_second_writer_waits_for_the_first_and_reads_its_tip(tmp_path):
    path = tmp_path / "hcw.db"
    convs = Conversations(open_db(path))
    _, main, ids = _chat(convs)
    # another process rewinds the thread and holds its write transaction open for a moment
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    other.execute("UPDATE threads SET tip = ? WHERE id = ?", [ids[0], main.id])
    threading.Timer(0.3, other.execute, ["COMMIT"]).start()
    reply = convs.append(main.id, "user", "hello again")
    assert reply.parent == ids[0]  # appended to the tip it committed, not the one read before
    other.close()


# few texts, so that appends and edits often meet rows that are already there
_op = st.tuples(st.sampled_from(["append", "fork", "edit", "set_tip"]), st.integers(0, 10**6),
                st.integers(0, 10**6), st.sampled_from(["a", "b", "hello"]), st.sampled_from(["user", "assistant"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=30))
def test_random_appends_forks_edits_and_rewinds_keep_the_tree_sound(ops):
    db = sqlite_utils.Database(memory=True)
    db.execute("PRAGMA foreign_keys=ON")
    migrations.apply(db)
    convs = Conversations(db)
    # the oracle: each thread's path as (role, content) pairs; every path prefix any thread ever had
    expected: dict[str, list[tuple[str, str]]] = {}
    prefixes: dict[str, set[tuple]] = {}
    for system in ("sys", None):
        conv, thread = convs.create(system=system)
        expected[thread.id] = [("system", system)] if system else []
        prefixes[conv.id] = {tuple(expected[thread.id])} if system else set()
    for kind, i, j, text, role in ops:
        thread = convs.thread(sorted(expected)[i % len(expected)])
        path = expected[thread.id]
        if kind == "append":
            convs.append(thread.id, role, text)
            expected[thread.id] = path + [(role, text)]
        elif kind in ("fork", "edit") and path:
            at = j % len(path)
            message = convs.path(thread.id)[at]
            if kind == "fork":
                new = convs.fork(message.id)
                expected[new.id] = path[:at + 1]
            else:
                new, _ = convs.edit(thread.id, message.id, text)
                expected[new.id] = path[:at] + [(path[at][0], text)]
        elif kind == "set_tip":
            source = convs.thread(sorted(expected)[j % len(expected)])
            target = convs.path(source.id)[-1].id if expected[source.id] else None
            if target is not None and source.conversation != thread.conversation:
                with pytest.raises(ValueError):
                    convs.set_tip(thread.id, target)
                continue
            convs.set_tip(thread.id, target)
            expected[thread.id] = list(expected[source.id])
        for t in convs.threads(thread.conversation):
            prefixes[t.conversation].update(tuple(expected[t.id][:k]) for k in range(1, len(expected[t.id]) + 1))
    for conv_id, seen in prefixes.items():
        messages = {r["id"] for r in db.query("SELECT id FROM messages WHERE conversation = ?", [conv_id])}
        assert len(messages) == len(seen)  # one row per distinct path prefix: branches share the rest
        tree_ids = [n["message"].id for _, n in walk(convs.tree(conv_id))]
        assert sorted(tree_ids) == sorted(messages)  # every message exactly once
        for t in convs.threads(conv_id):
            path = convs.path(t.id)
            assert [(m.role, m.content) for m in path] == expected[t.id]
            if path:
                assert path[0].parent is None and path[-1].id == t.tip
                assert all(m.conversation == conv_id for m in path)
                assert all(b.parent == a.id for a, b in itertools.pairwise(path))
        assert convs.check(conv_id) == []
    assert convs.check() == []
    assert db.execute("SELECT count(*) FROM messages m JOIN messages p ON p.id = m.parent "
                      "WHERE p.conversation != m.conversation").fetchone()[0] == 0


runner = CliRunner()


def _session_db(tmp_path):
    path = tmp_path / "hcw.db"
    convs = Conversations(open_db(path))
    conv, main, ids = _chat(convs)
    edited, _ = convs.edit(main.id, ids[3], "3+4?")
    convs.append(edited.id, "assistant", "7 " + "x" * 80)
    convs.db.close()
    return path, conv, main, edited, ids


def test_hcw_inspect_session_text(tmp_path):
    path, conv, main, edited, ids = _session_db(tmp_path)
    res = runner.invoke(app, ["inspect", str(path), "--session", conv.id[:6]])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert f"conversation {conv.id}" in out and '"arithmetic"' in out
    assert f"{main.id}  main" in out and f"{edited.id}  edit-1" in out and f"forked from {ids[2][:8]}" in out
    lines = out.splitlines()
    tree = lines[lines.index("  tree:") + 1:]
    assert len(tree) == 7
    assert tree[0].strip().startswith(ids[0][:8]) and "system" in tree[0] and "- tok" in tree[0]
    assert tree[3].lstrip().startswith("├─ " + ids[3][:8]) and '"3+3?"  4 tok' in tree[3]
    assert tree[4].endswith("<- main") and tree[4].lstrip().startswith("│  ")
    assert tree[5].lstrip().startswith("└─ ") and '"3+4?"' in tree[5]
    assert tree[6].endswith("<- edit-1") and "7 " + "x" * 57 + "…" in tree[6] and "x" * 60 not in tree[6]


def test_hcw_inspect_session_json(tmp_path):
    path, conv, _, _, ids = _session_db(tmp_path)
    res = runner.invoke(app, ["inspect", str(path), "--session", conv.id, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["conversation"]["id"] == conv.id and report["conversation"]["model"] == "ab" * 16
    assert [(t["name"], t["messages"], t["forked_from"]) for t in report["threads"]] == [
        ("main", 5, None), ("edit-1", 5, ids[2])]
    messages = report["messages"]
    assert [m["id"] for m in messages[:5]] == ids and [m["depth"] for m in messages] == [0, 1, 2, 3, 4, 3, 4]
    assert messages[4]["tip_of"] == ["main"] and messages[6]["tip_of"] == ["edit-1"]
    assert messages[1]["tokens"] == 4 and messages[1]["meta"] == {"ms": 1.5}
    assert all(m["damaged"] is None for m in messages) and report["findings"] == []


def test_hcw_inspect_lists_conversations_and_refuses_unknown_sessions(tmp_path):
    path, conv, *_ = _session_db(tmp_path)
    res = runner.invoke(app, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["segments"] == 0
    assert [(c["id"], c["title"], c["model"], c["messages"], c["branches"]) for c in report["conversations"]] == [
        (conv.id, "arithmetic", "ab" * 6, 7, 2)]
    res = runner.invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0 and f"{conv.id}  \"arithmetic\"  {'ab' * 6}  7 messages  2 branches" in res.stdout
    res = runner.invoke(app, ["inspect", str(path), "--session", "beef"])
    assert res.exit_code == 2 and "no conversation 'beef'" in res.stderr
    res = runner.invoke(app, ["inspect", str(path), "--session", conv.id, "--verify"])
    assert res.exit_code == 2 and "--session" in res.stderr
