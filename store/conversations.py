"""Conversations as a tree of messages in the workbench database (tables: store/db.py, m002, m004): the
`Conversations` front door, its writes, and the reads that the modules below answer.

A message's id is a digest of (conversation, parent, role, content): the same message under the
same parent is one row, so branches share the rows they have in common, and appending what is
already there only moves the tip. A thread is a name and a mutable tip; its path is the chain of
parents from the tip up to a root. Nothing is deleted but a draft: an edit is a sibling on a new
thread, and an answer written while it streams (meta {"incomplete": true}) is replaced row by row
(`append(..., replaces=)`) or discarded (`discard_draft`) while nothing else refers to it.

    system ── user ── assistant ─┬─ user ── assistant      <- main
                                 └─ user' ── assistant'    <- edit-1 (forked_from: that assistant)

The API takes whole ids; `resolve` turns a unique prefix that a person typed into one. `recent`
lists conversations as `hcw conversations` shows them (a title from the first user message, the
model's name, counts), newest first, optionally only those whose text matches a query.

A conversation's model name lives in a table of its own, `conversation_meta` (conversation id ->
a JSON object, {"model_name": ...}), made by the migration m004 (store/db.py) when a file is
opened: older readers of the conversations table find it as they know it.

The rows may be damaged (a file edited by hand, written with foreign keys off, restored from a
broken copy): every walk is bounded, `path` raises `ConversationDamaged` naming the damage and what
is intact rather than returning a shorter history, `tree` breaks cycles and hangs a message whose
parent is gone as a root marked "damaged", and `check` lists every finding.

    conversation_types.py    Conversation, Thread, Message, ConversationDamaged, message_digest
    conversation_rows.py     a row as a value, and what is wrong with one that is not
    conversation_meta.py     the model name of a conversation (conversation_meta)
    conversation_listing.py  recent: the listing and its search; model_label, shorten
    message_tree.py          the bounded walks: a thread's path, a conversation's tree, walk
    conversation_check.py    check: every finding in the tables
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

import sqlite_utils

from store import conversation_check, conversation_listing, conversation_meta
from store.conversation_listing import contains, model_label, shorten
from store.conversation_meta import conversation_from_row
from store.conversation_rows import TABLES, message_from_row, row
from store.conversation_types import ROLES, Conversation, ConversationDamaged, Message, Thread, message_digest
from store.db import now
from store.message_tree import damaged, owners, path_of, tree_of, walk

# what callers import from here
__all__ = ["ROLES", "Conversation", "ConversationDamaged", "Conversations", "Message", "Thread", "message_digest",
           "model_label", "shorten", "walk"]

_HEX = frozenset("0123456789abcdef")
_PARENT = object()  # discard_draft's default tip: the draft's parent


class Conversations:
    """The conversation tables of one database opened with `store.db.open_db`. Every write is one
    transaction; unknown ids raise KeyError naming the id, bad values ValueError (content that is not
    text, TypeError) and nothing is written."""

    def __init__(self, db: sqlite_utils.Database):
        self.db = db
        # recent(query=): case-insensitive beyond ASCII (SQLite's lower() and LIKE fold ASCII only)
        db.conn.create_function("hcw_contains", 2, contains, deterministic=True)

    def create(self, title: str | None = None, model: str | None = None,
               system: str | None = None, *, model_name: str | None = None) -> tuple[Conversation, Thread]:
        """A new conversation with one thread, "main", holding the system message if one is given.
        `model`: the model's fingerprint; `model_name`: what a person calls it (kept in
        conversation_meta)."""
        with self._writing():
            stamp = now()
            conv = Conversation(secrets.token_hex(6), title, model, stamp, stamp)
            self._insert("conversations", {k: v for k, v in asdict(conv).items() if k != "model_name"})
            if model_name is not None:
                conversation_meta.keep_model_name(self.db, conv.id, model_name)
            thread = self._new_thread(conv.id, "main", None, None)
            if system is not None:
                self.append(thread.id, "system", system)
        return self.conversation(conv.id), self.thread(thread.id)

    def append(self, thread_id: str, role: str, content: str, tokens: int | None = None,
               meta: dict | None = None, replaces: str | None = None) -> Message:
        """A child of the thread's tip, which becomes the tip. Content already there under that
        parent is the existing row (its tokens and meta are kept, unless that row is an incomplete
        draft and this message is not: then it is complete now and takes these).

        `replaces`: the id of a draft this same turn wrote, which must be the thread's tip. The tip
        first moves back to the draft's parent; the draft row is deleted when it is marked
        incomplete and nothing refers to it (no child, no thread's tip or fork point); the new
        message then goes under that parent. A streamed answer is written as
        `append(t, "assistant", text_so_far, meta={"incomplete": True}, replaces=last_draft)`,
        the final one without the marker."""
        with self._writing():
            thread = self.thread(thread_id)
            parent = thread.tip
            if parent is not None:  # a damaged tip: named, never a foreign-key error or an orphan
                owner = owners(self.db, {parent}).get(parent)
                if owner != thread.conversation:
                    raise damaged(thread, f"its tip {parent} " + (
                        "is missing" if owner is None else f"belongs to conversation {owner}"), [], parent)
            if replaces is not None:
                draft = self._tip_draft(thread, replaces)
                parent = draft.parent
                self._move(thread, parent)
                self._drop_draft(draft)
            message = self._add(thread.conversation, parent, role, content, tokens, meta)
            self._move(thread, message.id)
        return message

    def discard_draft(self, thread_id: str, message_id: str, tip: str | None | object = _PARENT) -> Thread:
        """A turn that failed: the thread's tip, which must be the draft `message_id`, moves to
        `tip` (by default the draft's parent; or where the thread was before the turn; None empties
        it), and the draft row is deleted when it is marked incomplete and nothing else refers to it."""
        with self._writing():
            thread = self.thread(thread_id)
            draft = self._tip_draft(thread, message_id)
            if tip is _PARENT:
                tip = draft.parent
            if tip is not None and self.message(tip).conversation != thread.conversation:
                raise ValueError(f"message {tip} belongs to another conversation than thread {thread_id}")
            self._move(thread, tip)
            self._drop_draft(draft)
        return self.thread(thread_id)

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
        return conversation_from_row(self.db, row(self.db, "conversation", id))

    def thread(self, id: str) -> Thread:
        return Thread(**row(self.db, "thread", id))

    def message(self, id: str) -> Message:
        return message_from_row(row(self.db, "message", id))

    def conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        return [conversation_from_row(self.db, r)
                for r in self.db.query("SELECT * FROM conversations ORDER BY updated DESC, rowid DESC")]

    def recent(self, limit: int = 20, query: str | None = None) -> list[dict]:
        """The `limit` most recently updated conversations, newest first, each {"id", "title",
        "model", "branches", "messages", "updated"}: title the stored one, else the first user
        message (shortened, one line); model its name, else the first 12 digits of its
        fingerprint (conversations made before names were kept), else None. With `query`: only
        those with a message (or title) holding that text, case-insensitively. Damaged rows are
        listed as they read (text that is not UTF-8 with replacement characters, a value of
        another type as its text), never an error: `check` names what is wrong."""
        return conversation_listing.recent(self.db, limit, query)

    def threads(self, conversation_id: str) -> list[Thread]:
        """In the order they were made."""
        self.conversation(conversation_id)
        return [Thread(**r) for r in self.db.query("SELECT * FROM threads WHERE conversation = ? ORDER BY rowid",
                                                   [conversation_id])]

    def latest_threads(self, conversation_id: str) -> list[Thread]:
        """The threads that can be continued, most recently updated first (a thread row without an
        id cannot be named or continued; `hcw inspect --verify` lists it)."""
        return sorted((t for t in self.threads(conversation_id) if isinstance(t.id, str)),
                      key=lambda t: t.updated if isinstance(t.updated, str) else "", reverse=True)

    def counts(self, conversation_id: str) -> tuple[int, int]:
        """(messages, threads) of the conversation."""
        self.conversation(conversation_id)
        return self.db.execute("SELECT (SELECT count(*) FROM messages WHERE conversation = ?), "
                               "(SELECT count(*) FROM threads WHERE conversation = ?)",
                               [conversation_id, conversation_id]).fetchone()

    def children(self, message_id: str) -> list[Message]:
        """The messages answering or following this one, oldest first: the branches at this point."""
        self.message(message_id)
        return [message_from_row(r) for r in self.db.query("SELECT * FROM messages WHERE parent = ? ORDER BY rowid",
                                                           [message_id])]

    def path(self, thread_id: str) -> list[Message]:
        """The thread's messages, root first, tip last: the whole history or ConversationDamaged
        (a cycle, a missing parent or tip, a message of another conversation, a row that is not a
        message, one whose id is not the digest of what it says: a parent set to NULL or another
        message would cut or splice the history), never a shorter one. One bounded query: a path
        holds each of the conversation's messages at most once, so a walk longer than that has met
        a cycle."""
        return path_of(self.db, self.thread(thread_id))

    def tree(self, conversation_id: str) -> list[dict]:
        """The roots, each {"message": Message, "children": [nodes], "threads": [names of the threads
        whose tip it is], "damaged": None or why it hangs where it does}; children oldest first. Walk
        it with `walk`: it can be deeper than recursion. Damage never stops it: a message whose
        parent is missing, of another conversation or unreadable is a root marked damaged, a cycle
        is broken at its oldest message (a root marked damaged), and a row that is not a message
        is left out (`check` names it)."""
        tips: dict[str, list[str]] = {}
        for t in self.threads(conversation_id):
            if t.tip is not None:
                tips.setdefault(t.tip, []).append(t.name)
        return tree_of(self.db, conversation_id, tips)

    def check(self, conversation_id: str | None = None) -> list[str]:
        """Every finding in the conversation tables (or in one conversation's rows), one line each
        naming the ids: messages and threads of missing conversations, missing parents, parents of
        another conversation, cycles, rows that are not messages (role, content, tokens, meta, an id
        that is not their digest), and each thread whose path is damaged (its tip missing
        included) or whose fork point is missing. [] when sound. Every walk is bounded."""
        return conversation_check.check(self.db, conversation_id)

    def resolve(self, kind: str, prefix: str) -> str:
        """The one id of `kind` (conversation, thread, message) that starts with `prefix`: KeyError
        when none does, ValueError when several do."""
        if kind not in TABLES:
            raise ValueError(f"kind must be one of {', '.join(TABLES)}, got {kind!r}")
        prefix = prefix.strip().lower()
        if not prefix:
            raise ValueError(f"an empty {kind} id")
        # ids are lowercase hex, so anything else matches nothing and GLOB needs no escaping
        found = [] if set(prefix) - _HEX else [id for (id,) in self.db.execute(
            f"SELECT id FROM {TABLES[kind]} WHERE id GLOB ? ORDER BY id LIMIT 6", [prefix + "*"])]
        if not found:
            raise KeyError(f"no {kind} {prefix!r}")
        if len(found) > 1:
            more = ", ..." if len(found) > 5 else ""
            raise ValueError(f"{kind} prefix {prefix!r} is ambiguous: {', '.join(found[:5])}{more}")
        return found[0]

    def delete_if_empty(self, conversation_id: str) -> bool:
        """Delete a conversation nobody wrote in (no message but its system one): a chat started
        and quit leaves nothing behind. Returns whether it was deleted."""
        with self._writing():
            written = self.db.execute("SELECT COUNT(*) FROM messages WHERE conversation = ? AND role != 'system'",
                                      [conversation_id]).fetchone()[0]
            if written:
                return False
            self.db.execute("DELETE FROM threads WHERE conversation = ?", [conversation_id])
            self.db.execute("DELETE FROM messages WHERE conversation = ?", [conversation_id])
            conversation_meta.forget(self.db, conversation_id)
            self.db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
        return True

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

    def _insert(self, table: str, values: dict) -> None:
        self.db.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                        list(values.values()))

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
            raise ConversationDamaged(f"conversation {conversation}: message {new.id} is stored with other "
                                      "content than its id says",
                                      conversation=conversation, at=new.id)
        if old.meta.get("incomplete") is True and new.meta.get("incomplete") is not True:
            # a draft's text, now written as a whole message: it is complete
            self.db.execute("UPDATE messages SET tokens = ?, meta = ? WHERE id = ?",
                            [new.tokens, json.dumps(new.meta, sort_keys=True, default=str), old.id])
            return replace(old, tokens=new.tokens, meta=new.meta)
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

    def _tip_draft(self, thread: Thread, message_id: str) -> Message:
        if thread.tip != message_id:
            raise ValueError(f"message {message_id} is not the tip of thread {thread.id} ({thread.name}), "
                             f"{thread.tip}: it is not this turn's draft")
        return self.message(message_id)

    def _drop_draft(self, draft: Message) -> bool:
        """Delete a draft the tip has left: only a row marked incomplete that nothing refers to, so a
        complete row that a draft's text happened to equal is never lost."""
        if draft.meta.get("incomplete") is not True:
            return False
        used = self.db.execute("SELECT EXISTS (SELECT 1 FROM messages WHERE parent = ?) OR EXISTS "
                               "(SELECT 1 FROM threads WHERE tip = ? OR forked_from = ?)",
                               [draft.id] * 3).fetchone()[0]
        if not used:
            self.db.execute("DELETE FROM messages WHERE id = ?", [draft.id])
        return not used

    def _free_name(self, conversation: str, stem: str) -> str:
        taken = {name for (name,) in self.db.execute("SELECT name FROM threads WHERE conversation = ?",
                                                     [conversation])}
        n = 1
        while f"{stem}-{n}" in taken:
            n += 1
        return f"{stem}-{n}"
