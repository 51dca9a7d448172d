"""The workbench's SQLite file: schema and migrations (sqlite-utils), WAL, busy timeout.

One file per workbench home. Tables:
    models    fingerprint -> config (JSON)
    segments  chained segment key, parent key, index, layout fingerprint, token ids (int64 bytes),
              their digest, per-state presence (JSON), bytes; written in the same transaction as
              its blobs, so a segment row is never visible without its data
    blobs     one pack per (segment, state kind, dtype): the tensors of every layer and part of that
              kind (codec hcwp1+zstd; `members` lists each one's layer, part, per-segment flag and
              position), raw length, stored length, checksum (xxh3-128 over the blob *and* its
              identity, members included, so a blob moved or relabelled fails), the bytes. Rows
              written before packs (codec hcwb1+zstd: one tensor, identity in layer/part/
              per_segment/position) are still read
    conversations, messages, threads
              chats as a message tree (store/conversations.py): messages content-addressed under
              their parent, threads a named mutable tip
    conversation_meta
              conversation id -> a JSON object, {"model_name": ...} (store/conversation_meta.py)
"""

from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils
from sqlite_utils.migrations import Migrations

migrations = Migrations("hcw")


@migrations()
def m001_cache_tables(db: sqlite_utils.Database) -> None:
    db["models"].create({"fingerprint": str, "config": str, "created": str}, pk="fingerprint")
    db["segments"].create({"key": str, "parent": str, "idx": int, "layout": str, "tokens": bytes,
                           "token_digest": str, "presence": str, "bytes": int, "created": str}, pk="key")
    db["blobs"].create({"id": int, "segment": str, "layer": int, "kind": str, "part": int, "per_segment": int,
                        "position": int, "is_none": int, "codec": str, "raw_len": int, "length": int,
                        "checksum": bytes, "data": bytes}, pk="id", foreign_keys=[("segment", "segments", "key")])
    db["blobs"].create_index(["segment"])
    db["segments"].create_index(["layout"])


@migrations()
def m002_conversations(db: sqlite_utils.Database) -> None:
    db["conversations"].create({"id": str, "title": str, "model": str, "created": str, "updated": str}, pk="id",
                               not_null={"created", "updated"})
    db["messages"].create({"id": str, "conversation": str, "parent": str, "role": str, "content": str,
                           "tokens": int, "meta": str, "created": str}, pk="id",
                          not_null={"conversation", "role", "content", "meta", "created"},
                          foreign_keys=[("conversation", "conversations", "id"), ("parent", "messages", "id")])
    db["threads"].create({"id": str, "conversation": str, "name": str, "tip": str, "forked_from": str,
                          "created": str, "updated": str}, pk="id",
                         not_null={"conversation", "name", "created", "updated"},
                         foreign_keys=[("conversation", "conversations", "id"), ("tip", "messages", "id"),
                                       ("forked_from", "messages", "id")])
    db["messages"].create_index(["conversation"])
    db["messages"].create_index(["parent"])
    db["threads"].create_index(["conversation"])


@migrations()
def m003_blob_packs(db: sqlite_utils.Database) -> None:
    db["blobs"].add_column("members", str)


@migrations()
def m004_conversation_meta(db: sqlite_utils.Database) -> None:
    # before this migration the first conversation given a model name made the table: such a file
    # has it already, with these columns
    db.execute("CREATE TABLE IF NOT EXISTS conversation_meta (conversation TEXT PRIMARY KEY, meta TEXT)")


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def default_home() -> Path:
    env = os.environ.get("HCW_HOME")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "hcw"


PAGE_SIZE = 65536


def open_db(path: str | Path | None = None, timeout_s: float = 5.0) -> sqlite_utils.Database:
    """Open (creating and migrating) the workbench database."""
    path = Path(path) if path is not None else default_home() / "hcw.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    # the workbench answers in a worker thread; calls are serialized by the caller, and SQLite
    # itself is built thread-safe, so the connection may move between threads
    db = sqlite_utils.Database(sqlite3.connect(path, check_same_thread=False))
    # a new file gets 64 KiB pages (ignored by an existing one): blobs are ~100 KiB each and SQLite
    # reads a blob page by page, so 4 KiB pages cost a read call per 4 KiB of every restore
    db.execute(f"PRAGMA page_size={PAGE_SIZE}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
    db.execute("PRAGMA foreign_keys=ON")
    for attempt in range(2):
        try:
            migrations.apply(db)
            break
        except sqlite3.OperationalError as e:
            # a migration's tables exist already: another process opening a new file applied it
            # first (the second attempt finds it applied), or the file's record of what was applied
            # is damaged and names none of them
            if "already exists" not in str(e) and "duplicate column" not in str(e):
                raise
            if attempt:
                db.conn.close()
                raise sqlite3.DatabaseError(f"{path}: its record of applied migrations "
                                            f"({migrations.migrations_table}) is damaged: {e}") from None
    return db
