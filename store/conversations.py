"""Conversations as a tree of messages in the workbench database (tables: store/db.py, m002).

A message's id is a digest of (conversation, parent, role, content): the same message under the
same parent is one row, so branches share the rows they have in common, and appending what is
already there only moves the tip. A thread is a name and a mutable tip; its path is the chain of
parents from the tip up to a root. Nothing is deleted: an edit is a sibling on a new thread.

    system ── user ── assistant ─┬─ user ── assistant      <- main
                                 └─ user' ── assistant'    <- edit-1 (forked_from: that assistant)

The API takes whole ids; `resolve` turns a unique prefix that a person typed into one.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import sqlite_utils

from store.db import now

ROLES = ("system", "user", "assistant")
_TABLES = {"conversation": "conversations", "thread": "threads", "message": "messages"}
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str | None
    model: str | None  # the model's fingerprint, hex
    created: str
    updated: str


@dataclass(frozen=True)
class Thread:
    id: str
    conversation: str
    name: str
    tip: str | None  # None while the thread is empty
    forked_from: str | None
    created: str
    updated: str


@dataclass(frozen=True)
class Message:
    id: str
    conversation: str
    parent: str | None
    role: str
    content: str
    tokens: int | None
    created: str
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"content must be text, got {type(self.content).__name__}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 0):
            raise ValueError(f"tokens must be a count, got {self.tokens!r}")


def message_digest(conversation: str, parent: str | None, role: str, content: str) -> str:
    key = json.dumps([conversation, parent or "", role, content]).encode()
    return hashlib.blake2b(key, digest_size=16).hexdigest()


class Conversations:
    """The conversation tables of one database opened with `store.db.open_db`. Every write is one
    transaction; unknown ids raise KeyError naming the id, bad values ValueError (content that is not
    text, TypeError) and nothing is written."""

    def __init__(self, db: sqlite_utils.Database):
        self.db = db

    def create(self, title: str | None = None, model: str | None = None,
               system: str | None = None) -> tuple[Conversation, Thread]:
        """A new conversation with one thread, "main", holding the system message if one is given."""
        with self._writing():
            stamp = now()
            conv = Conversation(secrets.token_hex(6), title, model, stamp, stamp)
            self._insert("conversations", asdict(conv))
            thread = self._new_thread(conv.id, "main", None, None)
            if system is not None:
                self.append(thread.id, "system", system)
        return self.conversation(conv.id), self.thread(thread.id)

    def append(self, thread_id: str, role: str, content: str, tokens: int | None = None,
               meta: dict | None = None) -> Message:
        """A child of the thread's tip, which becomes the tip. Content already there under that
        parent is the existing row (its tokens and meta are kept)."""
        with self._writing():
            thread = self.thread(thread_id)
            message = self._add(thread.conversation, thread.tip, role, content, tokens, meta)
            self._move(thread, message.id)
        return message

    def fork(self, message_id: str, name: str | None = None) -> Thread:
        """A new thread whose tip is the message."""
        with self._writing():
            message = self.message(message_id)
            thread = self._new_thread(message.conversation, name or self._free_name(message.conversation, "fork"),
                                      message.id, message.id)
        return thread

    def edit(self, thread_id: str, message_id: str, content: str, *, name: str | None = None,
             tokens: int | None = None, meta: dict | None = None) -> tuple[Thread, Message]:
        """A sibling of a message on the thread's path (same parent and role, new content) as the tip of
        a new thread forked at their parent; the old thread and everything after the message stay."""
        with self._writing():
            thread = self.thread(thread_id)
            old = self.message(message_id)
            if old.id not in {m.id for m in self.path(thread.id)}:
                raise ValueError(f"message {message_id} is not on the path of thread {thread_id} ({thread.name})")
            message = self._add(thread.conversation, old.parent, old.role, content, tokens, meta)
            new = self._new_thread(thread.conversation, name or self._free_name(thread.conversation, "edit"),
                                   message.id, old.parent)
        return new, message

    def set_tip(self, thread_id: str, message_id: str | None) -> Thread:
        """Switch or rewind a thread to any message of its conversation (None: empty it)."""
        with self._writing():
            thread = self.thread(thread_id)
            if message_id is not None and self.message(message_id).conversation != thread.conversation:
                raise ValueError(f"message {message_id} belongs to another conversation than thread {thread_id}")
            self._move(thread, message_id)
        return self.thread(thread_id)

    def rename(self, thread_id: str, name: str) -> Thread:
        if not name.strip():
            raise ValueError("a thread name cannot be empty")
        with self._writing():
            thread = self.thread(thread_id)
            self.db.execute("UPDATE threads SET name = ?, updated = ? WHERE id = ?", [name, now(), thread.id])
        return self.thread(thread_id)

    def conversation(self, id: str) -> Conversation:
        return Conversation(**self._row("conversation", id))

    def thread(self, id: str) -> Thread:
        return Thread(**self._row("thread", id))

    def message(self, id: str) -> Message:
        return _message(self._row("message", id))

    def conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        return [Conversation(**r) for r in self.db.query("SELECT * FROM conversations ORDER BY updated DESC, "
                                                         "rowid DESC")]

    def threads(self, conversation_id: str) -> list[Thread]:
        """In the order they were made."""
        self.conversation(conversation_id)
        return [Thread(**r) for r in self.db.query("SELECT * FROM threads WHERE conversation = ? ORDER BY rowid",
                                                   [conversation_id])]

    def counts(self, conversation_id: str) -> tuple[int, int]:
        """(messages, threads) of the conversation."""
        self.conversation(conversation_id)
        return self.db.execute("SELECT (SELECT count(*) FROM messages WHERE conversation = ?), "
                               "(SELECT count(*) FROM threads WHERE conversation = ?)",
                               [conversation_id, conversation_id]).fetchone()

    def children(self, message_id: str) -> list[Message]:
        """The messages answering or following this one, oldest first: the branches at this point."""
        self.message(message_id)
        return [_message(r) for r in self.db.query("SELECT * FROM messages WHERE parent = ? ORDER BY rowid",
                                                   [message_id])]

    def path(self, thread_id: str) -> list[Message]:
        """The thread's messages, root first, tip last."""
        rows = self.db.query("WITH RECURSIVE up(id, depth) AS (SELECT tip, 0 FROM threads WHERE id = ? "
                             "UNION ALL SELECT m.parent, up.depth + 1 FROM messages m JOIN up ON m.id = up.id "
                             "WHERE m.parent IS NOT NULL) "
                             "SELECT m.* FROM up JOIN messages m ON m.id = up.id ORDER BY up.depth DESC",
                             [self.thread(thread_id).id])
        return [_message(r) for r in rows]

    def tree(self, conversation_id: str) -> list[dict]:
        """The roots, each {"message": Message, "children": [nodes], "threads": [names of the threads
        whose tip it is]}; children oldest first. Walk it with `walk`: it can be deeper than recursion."""
        tips: dict[str, list[str]] = {}
        for t in self.threads(conversation_id):
            if t.tip is not None:
                tips.setdefault(t.tip, []).append(t.name)
        messages = [_message(r) for r in self.db.query("SELECT * FROM messages WHERE conversation = ? "
                                                       "ORDER BY rowid", [conversation_id])]
        nodes = {m.id: {"message": m, "children": [], "threads": tips.get(m.id, [])} for m in messages}
        roots = []
        for m in messages:
            (nodes[m.parent]["children"] if m.parent is not None else roots).append(nodes[m.id])
        return roots

    def resolve(self, kind: str, prefix: str) -> str:
        """The one id of `kind` (conversation, thread, message) that starts with `prefix`: KeyError
        when none does, ValueError when several do."""
        if kind not in _TABLES:
            raise ValueError(f"kind must be one of {', '.join(_TABLES)}, got {kind!r}")
        prefix = prefix.strip().lower()
        if not prefix:
            raise ValueError(f"an empty {kind} id")
        # ids are lowercase hex, so anything else matches nothing and GLOB needs no escaping
        found = [] if set(prefix) - _HEX else [id for (id,) in self.db.execute(
            f"SELECT id FROM {_TABLES[kind]} WHERE id GLOB ? ORDER BY id LIMIT 6", [prefix + "*"])]
        if not found:
            raise KeyError(f"no {kind} {prefix!r}")
        if len(found) > 1:
            more = ", ..." if len(found) > 5 else ""
            raise ValueError(f"{kind} prefix {prefix!r} is ambiguous: {', '.join(found[:5])}{more}")
        return found[0]

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction. BEGIN IMMEDIATE takes the write lock before the tip is read, so a
        second writer waits out the busy timeout instead of failing on a stale snapshot; nested, a
        savepoint."""
        if self.db.conn.in_transaction:
            with self.db.atomic():
                yield
            return
        self.db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.conn.execute("COMMIT")
        except BaseException:
            self.db.rollback()
            raise

    def _row(self, kind: str, id: str) -> dict:
        row = next(self.db.query(f"SELECT * FROM {_TABLES[kind]} WHERE id = ?", [id]), None)
        if row is None:
            raise KeyError(f"no {kind} {id!r}")
        return row

    def _insert(self, table: str, row: dict) -> None:
        self.db.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                        list(row.values()))

    def _add(self, conversation: str, parent: str | None, role: str, content: str, tokens: int | None,
             meta: dict | None) -> Message:
        new = Message(message_digest(conversation, parent, role, content), conversation, parent, role, content,
                      tokens, now(), meta or {})
        try:
            old = self.message(new.id)
        except KeyError:
            self._insert("messages", {**asdict(new), "meta": json.dumps(new.meta, sort_keys=True, default=str)})
            return new
        # the same digest must be the same message, never reused unchecked
        if (old.conversation, old.parent, old.role, old.content) != (conversation, parent, role, content):
            raise RuntimeError(f"message id {new.id} collides with a different message")
        return old

    def _new_thread(self, conversation: str, name: str, tip: str | None, forked_from: str | None) -> Thread:
        stamp = now()
        thread = Thread(secrets.token_hex(6), conversation, name, tip, forked_from, stamp, stamp)
        self._insert("threads", asdict(thread))
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", [stamp, conversation])
        return thread

    def _move(self, thread: Thread, tip: str | None) -> None:
        stamp = now()
        self.db.execute("UPDATE threads SET tip = ?, updated = ? WHERE id = ?", [tip, stamp, thread.id])
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", [stamp, thread.conversation])

    def _free_name(self, conversation: str, stem: str) -> str:
        taken = {name for (name,) in self.db.execute("SELECT name FROM threads WHERE conversation = ?",
                                                     [conversation])}
        n = 1
        while f"{stem}-{n}" in taken:
            n += 1
        return f"{stem}-{n}"


def walk(tree: list[dict]) -> Iterator[tuple[int, dict]]:
    """(depth, node) for every node of `Conversations.tree`, parents before children, without recursion."""
    stack = [(0, node) for node in reversed(tree)]
    while stack:
        depth, node = stack.pop()
        yield depth, node
        stack.extend((depth + 1, child) for child in reversed(node["children"]))


def _message(row: dict) -> Message:
    return Message(**{**row, "meta": json.loads(row["meta"])})
