"""The listing of conversations as `hcw conversations` shows them (`recent`): a title, the model's
name, counts, newest first, optionally only those whose text holds a query; and how a title and a
model are shown in one line."""

from __future__ import annotations

import sqlite_utils

from store.conversation_meta import META, has_meta
from store.conversation_rows import cell_text, parse_meta


def recent(db: sqlite_utils.Database, limit: int = 20, query: str | None = None) -> list[dict]:
    """`Conversations.recent`: the database must have `contains` registered as hcw_contains."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    where, args = "", []
    if query is not None:
        if not query.strip():
            raise ValueError("an empty query")
        where = ("WHERE hcw_contains(CAST(c.title AS BLOB), ?) OR EXISTS (SELECT 1 FROM messages m WHERE "
                 "m.conversation = c.id AND hcw_contains(CAST(m.content AS BLOB), ?))")
        args = [query, query]
    names = f"(SELECT CAST(x.meta AS BLOB) FROM {META} x WHERE x.conversation = c.id)" if has_meta(db) else "NULL"
    rows = db.execute(
        "SELECT CAST(c.id AS BLOB), CAST(c.title AS BLOB), CAST(c.model AS BLOB), CAST(c.updated AS BLOB), "
        "(SELECT CAST(m.content AS BLOB) FROM messages m WHERE m.conversation = c.id AND m.role = 'user' "
        "ORDER BY m.rowid LIMIT 1), (SELECT count(*) FROM messages m WHERE m.conversation = c.id), "
        f"(SELECT count(*) FROM threads t WHERE t.conversation = c.id), {names} FROM conversations c {where} "
        "ORDER BY c.updated DESC, c.rowid DESC LIMIT ?", [*args, limit]).fetchall()
    out = []
    for id, title, model, updated, first, n_messages, n_threads, meta in rows:
        title, model, first = cell_text(title), cell_text(model), cell_text(first)
        out.append({"id": cell_text(id), "title": shorten(title or first) if (title or first) else None,
                    "model": model_label(parse_meta(cell_text(meta))[0].get("model_name"), model),
                    "branches": n_threads, "messages": n_messages, "updated": cell_text(updated)})
    return out


def model_label(name, fingerprint) -> str | None:
    """How a conversation's model is shown: its name, else the first 12 digits of its fingerprint
    (conversations made before names were kept), else None."""
    if isinstance(name, str):
        return name
    return fingerprint[:12] if isinstance(fingerprint, str) and fingerprint else None


def shorten(text: str, width: int = 60) -> str:
    """One line of at most `width` characters: whitespace runs become one space, a cut ends in "…"."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 1] + "…"


def contains(haystack: bytes | None, needle: str | None) -> bool:
    """hcw_contains: case-insensitive beyond ASCII (SQLite's lower() and LIKE fold ASCII only)."""
    if haystack is None or needle is None:
        return False
    return needle.casefold() in haystack.decode("utf-8", "replace").casefold()
