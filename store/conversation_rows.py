"""Rows of the conversation tables read as values, and what is wrong with a row that is not one: a
role or content of the wrong kind, meta that is not a JSON object, an id that is not the digest of
what the row says (it was changed after it was written)."""

from __future__ import annotations

import json

import sqlite_utils

from store.conversation_types import ROLES, ConversationDamaged, Message, message_digest

TABLES = {"conversation": "conversations", "thread": "threads", "message": "messages"}
COLUMNS = ("id", "conversation", "parent", "role", "content", "tokens", "created", "meta")
CHANGED = "its id is not the digest of its conversation, parent, role and content (the row was changed)"


def row(db: sqlite_utils.Database, kind: str, id: str) -> dict:
    """The row of `kind` (conversation, thread, message) with that id: KeyError naming it when none."""
    found = next(db.query(f"SELECT * FROM {TABLES[kind]} WHERE id = ?", [id]), None)
    if found is None:
        raise KeyError(f"no {kind} {id!r}")
    return found


def message_from_row(row: dict) -> Message:
    """A messages row as a Message: ConversationDamaged naming the row when it is not one. Meta is
    auxiliary (stop reason, timings): unreadable, it is {"damaged": why} and the message loads."""
    bad = unbuildable(row)
    if bad:
        raise ConversationDamaged(f"conversation {row['conversation']}: message {row['id']}: {'; '.join(bad)}",
                                  row["conversation"], row["id"])
    meta, why = parse_meta(row["meta"])
    return Message(**{**row, "meta": meta if why is None else {"damaged": why}})


def unbuildable(row: dict) -> list[str]:
    """Why a messages row cannot be a Message: [] when it can."""
    out = [] if isinstance(row["id"], str) else [f"id {row['id']!r} is not text"]
    if row["role"] not in ROLES:
        out.append(f"role {row['role']!r} is not one of {', '.join(ROLES)}")
    if not isinstance(row["content"], str):
        out.append(f"content is {'NULL' if row['content'] is None else type(row['content']).__name__}, not text")
    tokens = row["tokens"]
    if tokens is not None and (type(tokens) is not int or tokens < 0):
        out.append(f"tokens is {tokens!r}, not a count")
    return out


def row_damage(row: dict) -> list[str]:
    """Everything wrong with a messages row: what `unbuildable` finds, unreadable meta, and an id
    that is not the digest of what the row says (it was changed after it was written)."""
    out = unbuildable(row)
    why = parse_meta(row["meta"])[1]
    if why is not None:
        out.append(why)
    if not out and not addressed(row):
        out.append(CHANGED)
    return out


def addressed(row: dict) -> bool:
    """Whether a buildable row's id is the digest of what it says."""
    return (isinstance(row["conversation"], str) and isinstance(row["parent"], str | None)
            and row["id"] == message_digest(row["conversation"], row["parent"], row["role"], row["content"]))


def parse_meta(raw) -> tuple[dict, str | None]:
    """(the meta object, None), or ({}, why) when it is not a JSON object."""
    try:
        meta = json.loads(raw)
    except (TypeError, ValueError):
        return {}, "meta is not JSON"
    return (meta, None) if isinstance(meta, dict) else ({}, "meta is not a JSON object")


def cell_text(raw: bytes | None) -> str | None:
    """A cell read as a BLOB (so that text which is not UTF-8 cannot stop a listing) as text."""
    return raw.decode("utf-8", "replace") if raw is not None else None
