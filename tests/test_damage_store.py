"""A damaged workbench file: every kind of damage to its conversation tables and segment rows is
named, by `Conversations.path` / `check` and by `hcw inspect` (exit 1), and is never a hang, a
traceback, or a history silently cut short. The damage is written with raw SQL on a connection of
its own with foreign keys off, as a hand edit or a broken copy would leave it."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
import threading

import pytest
import torch
from typer.testing import CliRunner

from engine.cache.prefix_index import ROOT, segment_hash
from store.conversations import ConversationDamaged, Conversations, walk
from store.db import open_db
from store.tier import DiskTier
from workbench.cli import app

runner = CliRunner()
LAYOUT = bytes(range(16))
B = 4  # tokens per segment


def _within(seconds: float, conn: sqlite3.Connection, call):
    """call() on a watchdog: a walk that never ends is interrupted (SQLite stops the statement) and
    the test fails, instead of hanging the run."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(seconds):
        conn.interrupt()
        done.wait(5)
        pytest.fail(f"did not finish within {seconds} s: an unbounded walk")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _workbench(path, segments: int = 4):
    """A workbench file: a chat of five messages on "main", an edit on "edit-1", and a chain of
    `segments` cached segments whose keys are the engine's own. Returns (conversation id, thread
    ids by name, message ids of main's path, segment keys)."""
    convs = Conversations(open_db(path))
    conv, main = convs.create("arith", system="be terse")
    for role, text in [("user", "2+2?"), ("assistant", "4"), ("user", "3+3?"), ("assistant", "6")]:
        convs.append(main.id, role, text, tokens=1, meta={"stop_reason": "eos"})
    ids = [m.id for m in convs.path(main.id)]
    edited, _ = convs.edit(main.id, ids[3], "3+4?")
    convs.append(edited.id, "assistant", "7")
    convs.db.close()
    tier = DiskTier(path, LAYOUT)
    keys, parent = [], ROOT
    for i in range(segments):
        tokens = struct.pack(f"<{B}q", *range(i * B, (i + 1) * B))
        key = segment_hash(parent, LAYOUT, tokens)
        gen = torch.Generator().manual_seed(i)
        pieces = {(0, "kv"): (True, (torch.randn(1, 2, B, 8, generator=gen), torch.randn(1, 2, B, 8, generator=gen)), 0),
                  (1, "recurrent"): (False, torch.randn(2, 8, 8, generator=gen), (i + 1) * B)}
        assert tier.save(key, parent, i, tokens, LAYOUT, pieces) == (True, None)
        keys.append(key.hex())
        parent = key
    tier.close()
    return conv.id, {"main": main.id, "edit-1": edited.id}, ids, keys


def _damage(path, *statements: tuple[str, list], nullable: str | None = None) -> None:
    """Run the statements with foreign keys off; `nullable`: first drop that table's NOT NULL
    constraints from the schema, as a damaged page could hold a NULL there."""
    if nullable is not None:
        con = sqlite3.connect(path)
        con.execute("PRAGMA writable_schema=ON")
        con.execute("UPDATE sqlite_master SET sql = replace(sql, 'NOT NULL', '') WHERE name = ?", [nullable])
        con.commit()
        con.close()
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA foreign_keys=OFF")
        for sql, args in statements:
            con.execute(sql, args)
        con.commit()
    finally:
        con.close()


def _inspect(*args: str):
    res = runner.invoke(app, ["inspect", *map(str, args)])
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def _inspect_process(*args: str, timeout: float = 60):
    """`hcw inspect` in a process of its own: one that never ends is killed and the test fails."""
    try:
        res = subprocess.run([sys.executable, "-c", "from workbench.cli import app; app()", "inspect", *map(str, args)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hcw inspect {' '.join(map(str, args))} ran past {timeout} s")
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    return res


@pytest.fixture
def bench(tmp_path):
    path = tmp_path / "hcw.db"
    conv, threads, ids, keys = _workbench(path)
    convs = Conversations(open_db(path))
    yield path, convs, conv, threads, ids, keys
    convs.db.close()


def test_a_sound_file_verifies_clean(bench):
    path, convs, conv, threads, ids, keys = bench
    assert convs.check() == [] and convs.check(conv) == []
    res = _inspect(path, "--verify", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["findings"] == [] and report["verify"]["integrity_check"] == "ok" and report["segments"] == 4
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 0 and "damage" not in res.stdout


@pytest.mark.parametrize("links, cycle", [
    (lambda ids: [(ids[1], ids[2]), (ids[2], ids[1])], "form a cycle"),  # user 2+2? <-> assistant 4
    (lambda ids: [(ids[2], ids[2])], "is its own parent"),
    (lambda ids: [(ids[0], ids[4])], "form a cycle"),  # the root under the tip: no root at all
], ids=["two", "self", "whole-path"])
def test_a_cycle_in_the_tree_is_named_and_never_hangs(bench, links, cycle):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, *[("UPDATE messages SET parent = ? WHERE id = ?", [parent, child]) for child, parent in links(ids)])
    with pytest.raises(ConversationDamaged, match="form a cycle") as e:
        _within(10, convs.db.conn, lambda: convs.path(threads["main"]))
    assert f"conversation {conv}: thread main:" in str(e.value) and f"hcw inspect --session {conv}" in str(e.value)
    found = _within(10, convs.db.conn, convs.check)
    assert any(cycle in f and conv in f for f in found), found
    assert any(f.startswith(f"conversation {conv}: thread main:") for f in found), found
    # the tree ends, holds every message once, and marks where the cycle was broken
    nodes = [n for _, n in _within(10, convs.db.conn, lambda: list(walk(convs.tree(conv))))]
    assert sorted(n["message"].id for n in nodes) == sorted(
        r[0] for r in convs.db.execute("SELECT id FROM messages WHERE conversation = ?", [conv]))
    assert any("cycle" in (n["damaged"] or "") for n in nodes)
    res = _inspect_process(path, "--session", conv[:6])
    assert res.returncode == 1 and cycle in res.stdout and "damaged" in res.stdout
    res = _inspect_process(path, "--verify")
    assert res.returncode == 1 and cycle in res.stdout


def test_a_missing_middle_message_is_named_never_a_shorter_history(bench):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, ("DELETE FROM messages WHERE id = ?", [ids[2]]))
    with pytest.raises(ConversationDamaged) as e:
        convs.path(threads["main"])
    assert (f"conversation {conv}: thread main: message {ids[3]}'s parent {ids[2]} is missing "
            f"(2 intact messages from {ids[3]} to the tip)") in str(e.value)
    assert e.value.conversation == conv and e.value.at == ids[2]
    assert f"conversation {conv}: message {ids[3]}'s parent {ids[2]} is missing" in convs.check()
    # the edit's sibling hangs off the same lost message: both are roots marked damaged
    sibling = convs.message(convs.thread(threads["edit-1"]).tip).parent
    assert [(n["message"].id, n["damaged"]) for n in convs.tree(conv)] == [
        (ids[0], None), (ids[3], f"parent {ids[2]} is missing"), (sibling, f"parent {ids[2]} is missing")]
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 1 and "damaged" in res.stdout and f"{ids[3]}'s parent {ids[2]} is missing" in res.stdout
    assert f"{threads['main']}  main         tip {ids[4][:8]}  damaged" in res.stdout
    res = _inspect(path, "--session", conv, "--json")
    report = json.loads(res.stdout)
    assert res.exit_code == 1 and report["findings"] and [t["messages"] for t in report["threads"]] == [None, None]
    res = _inspect(path, "--verify")
    assert res.exit_code == 1 and f"{ids[3]}'s parent {ids[2]} is missing" in res.stdout


def test_a_dangling_tip_is_named_and_append_writes_nothing(bench):
    path, convs, conv, threads, ids, keys = bench
    gone = "ab" * 16
    _damage(path, ("UPDATE threads SET tip = ? WHERE id = ?", [gone, threads["main"]]))
    with pytest.raises(ConversationDamaged, match=f"thread main: its tip {gone} is missing"):
        convs.path(threads["main"])
    rows = convs.db["messages"].count
    with pytest.raises(ConversationDamaged, match=f"its tip {gone} is missing"):
        convs.append(threads["main"], "user", "hello")
    assert convs.db["messages"].count == rows
    assert any(f"thread main: its tip {gone} is missing" in f for f in convs.check(conv))
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 1 and f"its tip {gone} is missing" in res.stdout


def test_a_message_of_another_conversation_on_the_path_is_named(bench):
    path, convs, conv, threads, ids, keys = bench
    other, other_main = convs.create("other", system="elsewhere")
    stranger = convs.path(other_main.id)[0].id
    _damage(path, ("UPDATE messages SET parent = ? WHERE id = ?", [stranger, ids[1]]))
    with pytest.raises(ConversationDamaged, match=f"message {ids[1]}'s parent {stranger} belongs to conversation "
                                                  f"{other.id}"):
        convs.path(threads["main"])
    assert f"conversation {conv}: message {ids[1]}'s parent {stranger} belongs to conversation {other.id}" \
        in convs.check()
    assert convs.check(other.id) == []
    assert any(f"parent {stranger} belongs to conversation {other.id}" in (n["damaged"] or "")
               for n in convs.tree(conv))


@pytest.mark.parametrize("parent", [None, 0], ids=["cut", "spliced"])
def test_a_parent_set_to_null_or_to_another_message_is_never_a_shorter_history(bench, parent):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, ("UPDATE messages SET parent = ? WHERE id = ?", [None if parent is None else ids[parent], ids[3]]))
    with pytest.raises(ConversationDamaged) as e:
        convs.path(threads["main"])
    assert (f"thread main: message {ids[3]}: its id is not the digest of its conversation, parent, role and content "
            f"(the row was changed) (1 intact message from {ids[4]} to the tip)") in str(e.value)
    assert f"conversation {conv}: message {ids[3]}: its id is not the digest of its conversation, parent, role and " \
           "content (the row was changed)" in convs.check()
    assert [n["damaged"] for _, n in walk(convs.tree(conv)) if n["message"].id == ids[3]] == [
        "its id is not the digest of its conversation, parent, role and content (the row was changed)"]
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 1 and "(damaged: its id is not the digest" in res.stdout


@pytest.mark.parametrize("meta, why", [("{not json", "meta is not JSON"), ("[1, 2]", "meta is not a JSON object")])
def test_unreadable_meta_loads_the_message_and_is_a_finding(bench, meta, why):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, ("UPDATE messages SET meta = ? WHERE id = ?", [meta, ids[2]]))
    path_ = convs.path(threads["main"])
    assert [m.id for m in path_] == ids and path_[2].meta == {"damaged": why} and path_[2].content == "4"
    assert convs.check() == [f"conversation {conv}: message {ids[2]}: {why}"]
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 1 and why in res.stdout and res.stdout.count(why) == 1
    res = _inspect(path, "--verify")
    assert res.exit_code == 1 and why in res.stdout


@pytest.mark.parametrize("column, value, why", [
    ("role", "tool", "role 'tool' is not one of system, user, assistant"),
    ("content", b"\x00\xff", "content is bytes, not text"),
    ("tokens", "many", "tokens is 'many', not a count"),
    ("tokens", -3, "tokens is -3, not a count"),
])
def test_a_row_that_is_not_a_message_is_named_not_a_raw_error(bench, column, value, why):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, (f"UPDATE messages SET {column} = ? WHERE id = ?", [value, ids[3]]))
    with pytest.raises(ConversationDamaged) as e:
        convs.path(threads["main"])
    assert f"thread main: message {ids[3]}: {why} (1 intact message from {ids[4]} to the tip)" in str(e.value)
    with pytest.raises(ConversationDamaged, match=why):
        convs.message(ids[3])
    assert f"conversation {conv}: message {ids[3]}: {why}" in convs.check()
    # the tree leaves the row out and hangs its child as a damaged root
    assert [n["damaged"] for n in convs.tree(conv)][1:] == [f"parent {ids[3]} is not a readable message"]
    res = _inspect(path, "--session", conv)
    assert res.exit_code == 1 and why in res.stdout


def test_rows_changed_after_they_were_written_and_lost_references_are_findings(bench):
    path, convs, conv, threads, ids, keys = bench
    gone = "cd" * 16
    _damage(path, ("UPDATE messages SET content = '5' WHERE id = ?", [ids[2]]),
            ("UPDATE threads SET forked_from = ? WHERE id = ?", [gone, threads["edit-1"]]),
            ("INSERT INTO threads VALUES ('feedfeedfeed', 'nowhere', 'lost', NULL, NULL, 'x', 'x')", []),
            ("INSERT INTO messages VALUES (?, 'nowhere', NULL, 'user', 'hi', NULL, '{}', 'x')", ["ef" * 16]))
    found = convs.check()
    assert f"conversation {conv}: message {ids[2]}: its id is not the digest of its conversation, parent, role and " \
           "content (the row was changed)" in found
    assert f"conversation {conv}: thread edit-1: its fork point {gone} is missing" in found
    assert "thread feedfeedfeed (lost): its conversation nowhere is missing" in found
    assert f"message {'ef' * 16}: its conversation nowhere is missing" in found
    assert convs.check(conv) == [f for f in found if f.startswith(f"conversation {conv}:")]


def test_a_thread_without_an_id_is_a_finding(bench):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, ("UPDATE threads SET id = NULL WHERE id = ?", [threads["main"]]))
    assert f"conversation {conv}: thread main: its id None is not text: it cannot be opened" in convs.check()
    res = _inspect(path, "--verify")
    assert res.exit_code == 1 and "thread main: its id None is not text" in res.stdout


def test_path_stays_one_bounded_query_for_a_long_chat(tmp_path):
    convs = Conversations(open_db(tmp_path / "long.db"))
    _, main = convs.create(system="s")
    with convs._writing():
        for i in range(1000):
            convs.append(main.id, "user" if i % 2 else "assistant", f"turn {i}")
    statements = []
    convs.db.conn.set_trace_callback(statements.append)
    path = convs.path(main.id)
    convs.db.conn.set_trace_callback(None)
    assert len(path) == 1001 and path[0].role == "system"
    # a fixed number of statements, whatever the chat's length (not one per message)
    queries = [q for q in statements if not q.startswith(("SAVEPOINT", "RELEASE"))]
    assert len(queries) <= 3, queries


# ---- segment rows ---------------------------------------------------------------------------

@pytest.mark.parametrize("damage, finding", [
    (lambda k: ("UPDATE segments SET tokens = substr(tokens, 1, 24) WHERE key = ?", [k[1]]),
     "tokens hold 24 bytes, most segments of its layout 32 (a block of 4 tokens)"),
    (lambda k: ("UPDATE segments SET tokens = x'0102030405' WHERE key = ?", [k[1]]),
     "tokens hold 5 bytes, not a whole number of int64 token ids"),
    (lambda k: ("UPDATE segments SET tokens = 'abcd' WHERE key = ?", [k[1]]), "tokens is str, not bytes"),
    (lambda k: ("UPDATE segments SET parent = 'zz' WHERE key = ?", [k[1]]), "parent 'zz' is not 32 hex digits"),
    (lambda k: ("UPDATE segments SET idx = -1 WHERE key = ?", [k[1]]), "idx -1 is not a non-negative integer"),
    (lambda k: ("UPDATE segments SET idx = 'one' WHERE key = ?", [k[1]]), "idx 'one' is not a non-negative integer"),
    (lambda k: ("UPDATE segments SET presence = '{oops' WHERE key = ?", [k[1]]), "presence is not JSON"),
    (lambda k: ("UPDATE segments SET idx = 2 WHERE key = ?", [k[1]]), "is not segment 1 of its layout"),
    (lambda k: ("UPDATE segments SET parent = ? WHERE key = ?", [k[0], k[0]]), "not the root"),
    (lambda k: ("DELETE FROM segments WHERE key = ?", [k[1]]),
     "is missing: the chain before segment 2 is broken"),
    (lambda k: ("UPDATE segments SET tokens = ?, token_digest = ? WHERE key = ?",
                [bytes(32), __import__("store.codec", fromlist=["checksum"]).checksum(bytes(32)).hex(), k[3]]),
     "key does not recompute from its parent, layout and tokens"),
    (lambda k: ("UPDATE segments SET key = 'nothex' WHERE key = ?", [k[3]]), "key 'nothex' is not 32 hex digits"),
], ids=["short-tokens", "ragged-tokens", "text-tokens", "parent", "idx", "idx-text", "presence", "chain-index",
        "first-parent", "chain-gap", "rehashed", "key"])
def test_damaged_segment_rows_are_named_by_verify(bench, damage, finding):
    path, convs, conv, threads, ids, keys = bench
    convs.db.close()
    _damage(path, damage(keys))
    res = _inspect(path, "--verify")
    assert res.exit_code == 1, res.output
    assert finding in res.stdout, res.stdout
    report = json.loads(_inspect(path, "--verify", "--json").stdout)
    assert any(finding in f for f in report["findings"]), report["findings"]


def test_a_blob_that_does_not_verify_and_a_blob_without_its_segment_are_findings(bench):
    path, convs, conv, threads, ids, keys = bench
    convs.db.close()
    _damage(path, ("UPDATE blobs SET data = zeroblob(length(data)) WHERE segment = ? AND kind = 'kv'", [keys[0]]),
            ("DELETE FROM segments WHERE key = ?", [keys[3]]))
    res = _inspect(path, "--verify")
    assert res.exit_code == 1
    assert f"segment {keys[0]}: checksum: blob -1:kv:0" in res.stdout
    assert "foreign_key_check: blobs row" in res.stdout and "refers to a missing segments row" in res.stdout


def test_conversation_damage_is_a_verify_finding(bench):
    path, convs, conv, threads, ids, keys = bench
    _damage(path, ("UPDATE messages SET parent = ? WHERE id = ?", [ids[4], ids[0]]))
    res = _inspect_process(path, "--verify", "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 1 and any("form a cycle" in f for f in report["findings"]), report["findings"]


# ---- a file that is not a workbench database ---------------------------------------------------

def _variants(path, tmp_path):
    """(name, file): the workbench file made unreadable in each way."""
    data = path.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    page = 65536 if page == 1 else page
    out = {"not-sqlite": b"this is a text file, not a database\n" * 50, "empty": b"",
           "header-only": data[:60], "truncated": data[:len(data) // 2], "zeroed-header": bytes(page) + data[page:]}
    for name, blob in out.items():
        (tmp_path / name).write_bytes(blob)
    other = tmp_path / "other-sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE notes (x)")
    con.commit()
    con.close()
    return [tmp_path / name for name in out] + [other]


def test_a_file_that_is_not_a_workbench_database_is_one_error_line(bench, tmp_path):
    path, convs, conv, *_ = bench
    convs.db.close()
    for bad in _variants(path, tmp_path):
        before = bad.read_bytes()
        for args in ([], ["--verify"], ["--json"], ["--session", conv]):
            res = _inspect(bad, *args)
            assert res.exit_code == 1, (bad.name, args, res.output)
            assert res.stderr.startswith(f"error: {bad} is not a workbench database (") and \
                res.stderr.count("\n") == 1, (bad.name, args, res.stderr)
        assert bad.read_bytes() == before  # nothing was written into it


@pytest.mark.parametrize("lost, exists", [("m001_cache_tables", 'table "models" already exists'),
                                          ("m003_blob_packs", "duplicate column name: members")])
def test_a_lost_record_of_the_migrations_applied_is_one_error_line(bench, lost, exists):
    # opening migrates: with the record gone, a migration already applied runs again and fails
    path, convs, conv, *_ = bench
    convs.db.close()
    _damage(path, ("DELETE FROM _sqlite_migrations WHERE name = ?", [lost]))
    for args in ([], ["--verify"], ["--session", conv]):
        res = _inspect(path, *args)
        lines = res.stderr.splitlines()
        assert res.exit_code == 1 and len(lines) == 1, res.stderr
        assert lines[0].startswith(f"error: {path} is not a workbench database (opening it: ") and exists in lines[0]
        assert "record of applied migrations (_sqlite_migrations) is damaged" in lines[0]


def test_every_zeroed_page_is_an_error_line_or_findings_never_a_traceback(bench, tmp_path):
    path, convs, conv, *_ = bench
    convs.db.close()
    data = path.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    page = 65536 if page == 1 else page
    pages = len(data) // page
    assert pages >= 4
    for n in range(1, pages):  # page 1 (the header) is the variant above
        bad = tmp_path / f"zeroed-{n + 1}"
        bad.write_bytes(data[:n * page] + bytes(page) + data[(n + 1) * page:])
        res = _inspect(bad, "--verify")
        assert res.exit_code == 1, (n + 1, res.output)
        assert "is not a workbench database" in res.stderr or "finding(s)" in res.stdout, (n + 1, res.output)
        for args in ([], ["--session", conv]):
            res = _inspect(bad, *args)
            assert res.exit_code in (0, 1), (n + 1, args, res.output)
            if res.exit_code == 1 and "error:" in res.stderr:
                assert "not a workbench database" in res.stderr or "cannot read" in res.stderr


# ---- every column, every kind of value -----------------------------------------------------------

_VALUES = [None, "zz", -1, 1.5, b"\x00\xff"]


def test_any_value_in_any_column_is_the_same_history_or_named_never_a_traceback(tmp_path):
    """One cell at a time, of one row of every table, set to NULL, text, a negative integer, a real
    and a blob: each thread's path is the pristine one (ids, roles, contents) or ConversationDamaged
    (or a KeyError for a thread whose own id is gone, and an empty path for a tip set to NULL: a
    tip is a pointer `set_tip` moves); a changed path is always a finding; `hcw inspect` never
    prints a traceback."""
    pristine = tmp_path / "pristine.db"
    conv, threads, ids, keys = _workbench(pristine)
    tier = DiskTier(pristine, LAYOUT)
    tier.register_model(LAYOUT, {"hidden": 8})
    tier.close()
    convs = Conversations(open_db(pristine))
    before = {name: [(m.id, m.role, m.content) for m in convs.path(t)] for name, t in threads.items()}
    convs.db.close()
    con = sqlite3.connect(pristine)
    targets = {"conversations": ("id", conv), "messages": ("id", ids[3]), "threads": ("id", threads["main"]),
               "segments": ("key", keys[1]), "models": ("fingerprint", LAYOUT.hex()),
               "blobs": ("id", con.execute("SELECT min(id) FROM blobs").fetchone()[0])}
    columns = {table: [r[1] for r in con.execute(f"PRAGMA table_info({table})")] for table in targets}
    con.close()
    data, failures, cases = pristine.read_bytes(), [], 0
    for table, (pk, at) in targets.items():
        for column in columns[table]:
            for value in _VALUES:
                cases += 1
                case = f"{table}.{column} = {value!r}"
                db = tmp_path / "case.db"
                for leftover in (tmp_path / "case.db-wal", tmp_path / "case.db-shm"):
                    leftover.unlink(missing_ok=True)
                db.write_bytes(data)
                try:
                    _damage(db, (f"UPDATE {table} SET {column} = ? WHERE {pk} = ?", [value, at]),
                            nullable=table if value is None else None)
                except sqlite3.IntegrityError:  # an INTEGER PRIMARY KEY holds integers only: no such file
                    continue
                convs = Conversations(open_db(db))
                changed = False
                for name, t in threads.items():
                    try:
                        got = [(m.id, m.role, m.content) for m in _within(10, convs.db.conn,
                                                                          lambda t=t: convs.path(t))]
                    except ConversationDamaged:
                        changed = True
                        continue
                    except KeyError:
                        if (table, column) == ("threads", "id") and name == "main":
                            continue
                        raise
                    emptied = (table, column, value) == ("threads", "tip", None) and got == []
                    if got != before[name] and not emptied:
                        failures.append(f"{case}: thread {name}'s path changed without a finding: {got}")
                found = _within(10, convs.db.conn, convs.check)
                convs.db.close()
                if changed and not found:
                    failures.append(f"{case}: a path is damaged and check() finds nothing")
                for args in (["--verify", "--json"], ["--session", conv], []):
                    res = runner.invoke(app, ["inspect", str(db), *args])
                    if "Traceback" in res.output or not isinstance(res.exception, SystemExit | None):
                        failures.append(f"{case}: hcw inspect {' '.join(args)}: {res.exception!r}")
                    elif args[:1] == ["--verify"] and changed and res.exit_code != 1:
                        failures.append(f"{case}: hcw inspect --verify exit {res.exit_code} on a damaged path")
    assert cases > 200
    assert not failures, "\n".join(failures[:20])
