"""A conversation's model name, kept in a table of its own, `conversation_meta` (conversation id ->
a JSON object, {"model_name": ...}; made by store/db.py's migration m004), so that the
conversations table stays as older readers know it."""

from __future__ import annotations

import json
from dataclasses import fields

import sqlite_utils

from store.conversation_rows import cell_text, parse_meta
from store.conversation_types import Conversation

META = "conversation_meta"


def has_meta(db: sqlite_utils.Database) -> bool:
    """Whether the table is there: a migrated file has it, but one damaged by hand may have lost it,
    and the reads still answer (without model names)."""
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [META]).fetchone() is not None


def keep_model_name(db: sqlite_utils.Database, conversation_id: str, model_name: str) -> None:
    """Without the table (a file that lost it by hand) the name is not kept: the conversation is."""
    if not has_meta(db):
        return
    db.execute(f"INSERT INTO {META} (conversation, meta) VALUES (?, ?)",
               [conversation_id, json.dumps({"model_name": model_name})])


def forget(db: sqlite_utils.Database, conversation_id: str) -> None:
    if has_meta(db):
        db.execute(f"DELETE FROM {META} WHERE conversation = ?", [conversation_id])


def conversation_from_row(db: sqlite_utils.Database, row: dict) -> Conversation:
    """A conversations row as a Conversation, its model name added (None when unknown or unreadable)."""
    name = None
    if has_meta(db):
        found = db.execute(f"SELECT CAST(meta AS BLOB) FROM {META} WHERE conversation = ?", [row["id"]]).fetchone()
        name = parse_meta(cell_text(found[0]))[0].get("model_name") if found else None
    known = {f.name for f in fields(Conversation)} - {"model_name"}
    return Conversation(**{k: v for k, v in row.items() if k in known},
                        model_name=name if isinstance(name, str) else None)
