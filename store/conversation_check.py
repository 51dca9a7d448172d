"""`Conversations.check`: every finding in the conversation tables, one line each naming the ids,
found by bounded reads that damage cannot stop (text that is not UTF-8 included)."""

from __future__ import annotations

import sqlite3

import sqlite_utils

from store.conversation_rows import COLUMNS, row, row_damage
from store.conversation_types import ConversationDamaged, Thread
from store.message_tree import cycles, owners, path_of


def check(db: sqlite_utils.Database, conversation_id: str | None = None) -> list[str]:
    """`Conversations.check`."""
    undecodable = _undecodable(db, conversation_id)
    try:
        return undecodable + _findings(db, conversation_id)
    except sqlite3.OperationalError:
        if undecodable:  # the rows the rest would read: named, and the rest needs them readable
            return undecodable
        raise


def _undecodable(db: sqlite_utils.Database, conversation_id: str | None) -> list[str]:
    """Text cells that are not UTF-8: sqlite3 cannot hand such a row over, so the chat cannot
    open its conversation. One line per cell."""
    findings = []
    for table, owner in (("conversations", "id"), ("threads", "conversation"), ("messages", "conversation")):
        columns = [c[1] for c in db.execute(f"PRAGMA table_info({table})")]
        for col in columns:
            query = (f"SELECT rowid, CAST(id AS BLOB), CAST({owner} AS BLOB), CAST({col} AS BLOB) FROM {table} "
                     f"WHERE typeof({col}) = 'text'")
            for rowid, id, conv, value in db.execute(query):
                try:
                    value.decode("utf-8")
                    continue
                except UnicodeDecodeError:
                    pass
                conv = conv.decode("utf-8", "replace") if conv is not None else None
                if conversation_id is not None and conv != conversation_id:
                    continue
                name = id.decode("utf-8", "replace") if id is not None else f"rowid {rowid}"
                findings.append(f"conversation {conv}: {table} row {name}: its {col} is not UTF-8 text "
                                "(the chat cannot read the row)")
    return findings


def _findings(db: sqlite_utils.Database, conversation_id: str | None) -> list[str]:
    where, args = ("WHERE conversation = ?", [conversation_id]) if conversation_id is not None else ("", [])
    if conversation_id is not None:
        row(db, "conversation", conversation_id)  # KeyError naming it when there is none
    known = {id for (id,) in db.execute("SELECT id FROM conversations")}
    rows = [dict(zip(COLUMNS, r)) for r in db.execute(
        f"SELECT {', '.join(COLUMNS)} FROM messages {where} ORDER BY rowid", args)]
    return _message_findings(db, rows, known) + cycles(rows) + _thread_findings(db, where, args, known)


def _message_findings(db: sqlite_utils.Database, rows: list[dict], known: set[str]) -> list[str]:
    conv_of = {r["id"]: r["conversation"] for r in rows}
    owner_of = owners(db, {r["parent"] for r in rows} - set(conv_of) - {None})
    findings = []
    for r in rows:
        id, conv, parent = r["id"], r["conversation"], r["parent"]
        if conv not in known:
            findings.append(f"message {id}: its conversation {conv} is missing")
        owner = conv_of.get(parent, owner_of.get(parent))
        if parent is not None and owner is None:
            findings.append(f"conversation {conv}: message {id}'s parent {parent} is missing")
        elif parent is not None and owner != conv:
            findings.append(f"conversation {conv}: message {id}'s parent {parent} belongs to conversation {owner}")
        findings += [f"conversation {conv}: message {id}: {why}" for why in row_damage(r)]
    return findings


def _thread_findings(db: sqlite_utils.Database, where: str, args: list, known: set[str]) -> list[str]:
    findings = []
    for t in list(db.query(f"SELECT * FROM threads {where} ORDER BY rowid", args)):
        if not isinstance(t["id"], str):
            findings.append(f"conversation {t['conversation']}: thread {t['name']}: its id {t['id']!r} is not "
                            "text: it cannot be opened")
        if t["conversation"] not in known:
            findings.append(f"thread {t['id']} ({t['name']}): its conversation {t['conversation']} is missing")
        try:
            path_of(db, Thread(**t))
        except ConversationDamaged as e:
            findings.append(e.finding)
        fork = t["forked_from"]
        if fork is not None:
            owner = owners(db, {fork}).get(fork)
            label = f"conversation {t['conversation']}: thread {t['name']}: its fork point {fork}"
            if owner is None:
                findings.append(f"{label} is missing")
            elif owner != t["conversation"]:
                findings.append(f"{label} belongs to conversation {owner}")
    return findings
