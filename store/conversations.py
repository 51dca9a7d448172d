"""Conversations as a tree of messages in the workbench database (tables: store/db.py, m002).

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
a JSON object, {"model_name": ...}), made by the first `create` that has one: older files and
older readers of the conversations table are left as they are.

The rows may be damaged (a file edited by hand, written with foreign keys off, restored from a
broken copy): every walk is bounded, `path` raises `ConversationDamaged` naming the damage and what
is intact rather than returning a shorter history, `tree` breaks cycles and hangs a message whose
parent is gone as a root marked "damaged", and `check` lists every finding.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace

import sqlite_utils

from store.db import now

ROLES = ("system", "user", "assistant")
_TABLES = {"conversation": "conversations", "thread": "threads", "message": "messages"}
_HEX = frozenset("0123456789abcdef")
_COLUMNS = ("id", "conversation", "parent", "role", "content", "tokens", "created", "meta")
_PARENT = object()  # discard_draft's default tip: the draft's parent
_META = "conversation_meta"


class ConversationDamaged(ValueError):
    """A conversation's rows cannot give a whole history. The message is one line naming the
    conversation, the thread, the damaged message or field and what is intact."""

    def __init__(self, finding: str, conversation: str | None = None, at: str | None = None, hint: str = ""):
        super().__init__(f"{finding}; {hint}" if hint else finding)
        self.finding = finding  # the line without the hint, as `check` lists it
        self.conversation = conversation
        self.at = at  # the damaged message, or the id that is missing


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str | None
    model: str | None  # the model's fingerprint, hex
    created: str
    updated: str
    model_name: str | None = None  # what the model was called (a built-in's name, a folder's)


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
        # recent(query=): case-insensitive beyond ASCII (SQLite's lower() and LIKE fold ASCII only)
        db.conn.create_function("hcw_contains", 2, _contains, deterministic=True)

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
                self.db.execute(f"CREATE TABLE IF NOT EXISTS {_META} (conversation TEXT PRIMARY KEY, meta TEXT)")
                self.db.execute(f"INSERT INTO {_META} (conversation, meta) VALUES (?, ?)",
                                [conv.id, json.dumps({"model_name": model_name})])
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
                owner = self._owners({parent}).get(parent)
                if owner != thread.conversation:
                    raise self._damaged(thread, f"its tip {parent} " + (
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
        return self._conversation(self._row("conversation", id))

    def thread(self, id: str) -> Thread:
        return Thread(**self._row("thread", id))

    def message(self, id: str) -> Message:
        return _message(self._row("message", id))

    def conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        return [self._conversation(r) for r in self.db.query("SELECT * FROM conversations ORDER BY updated DESC, "
                                                             "rowid DESC")]

    def recent(self, limit: int = 20, query: str | None = None) -> list[dict]:
        """The `limit` most recently updated conversations, newest first, each {"id", "title",
        "model", "branches", "messages", "updated"}: title the stored one, else the first user
        message (shortened, one line); model its name, else the first 12 digits of its
        fingerprint (conversations made before names were kept), else None. With `query`: only
        those with a message (or title) holding that text, case-insensitively. Damaged rows are
        listed as they read (text that is not UTF-8 with replacement characters, a value of
        another type as its text), never an error: `check` names what is wrong."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        where, args = "", []
        if query is not None:
            if not query.strip():
                raise ValueError("an empty query")
            where = ("WHERE hcw_contains(CAST(c.title AS BLOB), ?) OR EXISTS (SELECT 1 FROM messages m WHERE "
                     "m.conversation = c.id AND hcw_contains(CAST(m.content AS BLOB), ?))")
            args = [query, query]
        names = (f"(SELECT CAST(x.meta AS BLOB) FROM {_META} x WHERE x.conversation = c.id)" if self._has_meta()
                 else "NULL")
        rows = self.db.execute(
            "SELECT CAST(c.id AS BLOB), CAST(c.title AS BLOB), CAST(c.model AS BLOB), CAST(c.updated AS BLOB), "
            "(SELECT CAST(m.content AS BLOB) FROM messages m WHERE m.conversation = c.id AND m.role = 'user' "
            "ORDER BY m.rowid LIMIT 1), (SELECT count(*) FROM messages m WHERE m.conversation = c.id), "
            f"(SELECT count(*) FROM threads t WHERE t.conversation = c.id), {names} FROM conversations c {where} "
            "ORDER BY c.updated DESC, c.rowid DESC LIMIT ?", [*args, limit]).fetchall()
        out = []
        for id, title, model, updated, first, n_messages, n_threads, meta in rows:
            title, model, first = _text(title), _text(model), _text(first)
            out.append({"id": _text(id), "title": shorten(title or first) if (title or first) else None,
                        "model": model_label(_meta(_text(meta))[0].get("model_name"), model),
                        "branches": n_threads, "messages": n_messages, "updated": _text(updated)})
        return out

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
        """The thread's messages, root first, tip last: the whole history or ConversationDamaged
        (a cycle, a missing parent or tip, a message of another conversation, a row that is not a
        message, one whose id is not the digest of what it says: a parent set to NULL or another
        message would cut or splice the history), never a shorter one. One bounded query: a path
        holds each of the conversation's messages at most once, so a walk longer than that has met
        a cycle."""
        return self._path(self.thread(thread_id))

    def _path(self, thread: Thread) -> list[Message]:
        if thread.tip is None:
            return []
        conv = thread.conversation
        cols = ", ".join(f"m.{c}" for c in _COLUMNS)
        rows = self.db.execute(
            "WITH RECURSIVE up(id, depth) AS (SELECT ?, 0 UNION ALL SELECT m.parent, up.depth + 1 "
            "FROM up JOIN messages m ON m.id = up.id WHERE m.conversation = ? AND m.parent IS NOT NULL "
            "AND up.depth < (SELECT count(*) FROM messages WHERE conversation = ?)) "
            f"SELECT up.id, {cols} FROM up LEFT JOIN messages m ON m.id = up.id ORDER BY up.depth",
            [thread.tip, conv, conv]).fetchall()
        out: list[Message] = []  # tip first
        seen: set[str] = set()
        changed: tuple[str, list[Message]] | None = None  # the first row whose id is not its digest
        for at, *values in rows:
            row = dict(zip(_COLUMNS, values))
            where = f"message {out[-1].id}'s parent {at}" if out else f"its tip {at}"
            if row["id"] is None:
                raise self._damaged(thread, f"{where} is missing", out, at)
            if row["conversation"] != conv:
                raise self._damaged(thread, f"{where} belongs to conversation {row['conversation']}", out, at)
            if at in seen:
                raise self._damaged(thread, f"{where} is already on the path: the parents form a cycle", out, at,
                                    intact=f"the {len(out)} messages from {out[-1].id} to the tip have no root")
            seen.add(at)
            bad = _unbuildable(row)
            if bad:
                raise self._damaged(thread, f"message {at}: {'; '.join(bad)}", out, at)
            if changed is None and not _addressed(row):
                changed = at, list(out)  # named after the walk, unless it meets worse: a cycle, a gap
            out.append(_message(row))
        if out and out[-1].parent is not None:  # the bound stopped the walk: never a shortened history
            raise self._damaged(thread, f"message {out[-1].id}'s parent {out[-1].parent} was not reached", out,
                                out[-1].parent)
        if changed is not None:  # a parent set to NULL or to another message: a cut or spliced history
            raise self._damaged(thread, f"message {changed[0]}: {_CHANGED}", changed[1], changed[0])
        out.reverse()
        return out

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
        nodes: dict[str, dict] = {}
        unreadable: set[str] = set()
        for r in self.db.query("SELECT * FROM messages WHERE conversation = ? ORDER BY rowid", [conversation_id]):
            try:
                m = _message(r)
            except ConversationDamaged:
                unreadable.add(r["id"])
                continue
            nodes[m.id] = {"message": m, "children": [], "threads": tips.get(m.id, []),
                           "damaged": None if _addressed(r) else _CHANGED}
        roots = []
        lost = {n["message"].parent for n in nodes.values()} - set(nodes) - unreadable - {None}
        owners = self._owners(lost)
        for node in nodes.values():
            parent = node["message"].parent
            if parent in nodes:
                nodes[parent]["children"].append(node)
                continue
            if parent is not None:
                node["damaged"] = _also(node["damaged"], (
                    f"parent {parent} is not a readable message" if parent in unreadable else
                    f"parent {parent} belongs to conversation {owners[parent]}" if parent in owners
                    else f"parent {parent} is missing"))
            roots.append(node)
        reached = {n["message"].id for _, n in walk(roots)}
        order = {id: i for i, id in enumerate(nodes)}
        # what no root reaches hangs off a cycle: break each at its oldest message
        for id in nodes:
            if id in reached:
                continue
            chain: dict[str, int] = {}  # an unreached message's parent is unreached too: this meets a cycle
            at = id
            while at not in chain:
                chain[at] = len(chain)
                at = nodes[at]["message"].parent
            cycle = list(chain)[chain[at]:]
            oldest = nodes[min(cycle, key=order.__getitem__)]
            parent = oldest["message"].parent
            nodes[parent]["children"].remove(oldest)
            oldest["damaged"] = _also(oldest["damaged"],
                                      f"parent {parent} is a descendant of it: the parents form a cycle")
            roots.append(oldest)
            reached.update(n["message"].id for _, n in walk([oldest]))
        return roots

    def check(self, conversation_id: str | None = None) -> list[str]:
        """Every finding in the conversation tables (or in one conversation's rows), one line each
        naming the ids: messages and threads of missing conversations, missing parents, parents of
        another conversation, cycles, rows that are not messages (role, content, tokens, meta, an id
        that is not their digest), and each thread whose path is damaged (its tip missing
        included) or whose fork point is missing. [] when sound. Every walk is bounded."""
        undecodable = self._undecodable(conversation_id)
        try:
            return undecodable + self._check(conversation_id)
        except sqlite3.OperationalError:
            if undecodable:  # the rows the rest would read: named, and the rest needs them readable
                return undecodable
            raise

    def _undecodable(self, conversation_id: str | None) -> list[str]:
        """Text cells that are not UTF-8: sqlite3 cannot hand such a row over, so the chat cannot
        open its conversation. One line per cell."""
        findings = []
        for table, owner in (("conversations", "id"), ("threads", "conversation"), ("messages", "conversation")):
            columns = [c[1] for c in self.db.execute(f"PRAGMA table_info({table})")]
            for col in columns:
                query = (f"SELECT rowid, CAST(id AS BLOB), CAST({owner} AS BLOB), CAST({col} AS BLOB) FROM {table} "
                         f"WHERE typeof({col}) = 'text'")
                for rowid, id, conv, value in self.db.execute(query):
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

    def _check(self, conversation_id: str | None) -> list[str]:
        where, args = ("WHERE conversation = ?", [conversation_id]) if conversation_id is not None else ("", [])
        if conversation_id is not None:
            self.conversation(conversation_id)
        known = {id for (id,) in self.db.execute("SELECT id FROM conversations")}
        rows = [dict(zip(_COLUMNS, r)) for r in self.db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM messages {where} ORDER BY rowid", args)]
        conv_of = {r["id"]: r["conversation"] for r in rows}
        owners = self._owners({r["parent"] for r in rows} - set(conv_of) - {None})
        findings = []
        for r in rows:
            id, conv, parent = r["id"], r["conversation"], r["parent"]
            if conv not in known:
                findings.append(f"message {id}: its conversation {conv} is missing")
            owner = conv_of.get(parent, owners.get(parent))
            if parent is not None and owner is None:
                findings.append(f"conversation {conv}: message {id}'s parent {parent} is missing")
            elif parent is not None and owner != conv:
                findings.append(f"conversation {conv}: message {id}'s parent {parent} belongs to conversation {owner}")
            findings += [f"conversation {conv}: message {id}: {why}" for why in _row_damage(r)]
        findings += self._cycles(rows)
        for t in list(self.db.query(f"SELECT * FROM threads {where} ORDER BY rowid", args)):
            if not isinstance(t["id"], str):
                findings.append(f"conversation {t['conversation']}: thread {t['name']}: its id {t['id']!r} is not "
                                "text: it cannot be opened")
            if t["conversation"] not in known:
                findings.append(f"thread {t['id']} ({t['name']}): its conversation {t['conversation']} is missing")
            try:
                self._path(Thread(**t))
            except ConversationDamaged as e:
                findings.append(e.finding)
            fork = t["forked_from"]
            if fork is not None:
                owner = self._owners({fork}).get(fork)
                label = f"conversation {t['conversation']}: thread {t['name']}: its fork point {fork}"
                if owner is None:
                    findings.append(f"{label} is missing")
                elif owner != t["conversation"]:
                    findings.append(f"{label} belongs to conversation {owner}")
        return findings

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
            if self._has_meta():
                self.db.execute(f"DELETE FROM {_META} WHERE conversation = ?", [conversation_id])
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

    def _has_meta(self) -> bool:
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                               [_META]).fetchone() is not None

    def _conversation(self, row: dict) -> Conversation:
        """A conversations row as a Conversation, its model name added (None when unknown or unreadable)."""
        name = None
        if self._has_meta():
            found = self.db.execute(f"SELECT CAST(meta AS BLOB) FROM {_META} WHERE conversation = ?",
                                    [row["id"]]).fetchone()
            name = _meta(_text(found[0]))[0].get("model_name") if found else None
        known = {f.name for f in fields(Conversation)} - {"model_name"}
        return Conversation(**{k: v for k, v in row.items() if k in known},
                            model_name=name if isinstance(name, str) else None)

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

    def _owners(self, ids: set[str]) -> dict[str, str]:
        """message id -> its conversation, for those of `ids` that exist."""
        ids, out = sorted(ids, key=str), {}
        for at in range(0, len(ids), 500):
            chunk = ids[at:at + 500]
            out.update(self.db.execute(f"SELECT id, conversation FROM messages WHERE id IN "
                                       f"({', '.join('?' * len(chunk))})", chunk).fetchall())
        return out

    @staticmethod
    def _cycles(rows: list[dict]) -> list[str]:
        """One finding per cycle of parent links among `rows` (links into another conversation end a
        walk: they are findings of their own)."""
        parent = {r["id"]: r["parent"] for r in rows}
        conv = {r["id"]: r["conversation"] for r in rows}
        done: set[str] = set()
        findings = []
        for start in parent:
            walked: dict[str, int] = {}
            at = start
            while at is not None and at in parent and at not in done and at not in walked \
                    and conv[at] == conv[start]:
                walked[at] = len(walked)
                at = parent[at]
            if at in walked:
                cycle = list(walked)[walked[at]:]
                what = (f"message {at} is its own parent" if len(cycle) == 1 else
                        f"messages {', '.join(map(str, cycle))} form a cycle (each one's parent is the next, the last's "
                        "the first)")
                findings.append(f"conversation {conv[at]}: {what}")
            done.update(walked)
        return findings

    @staticmethod
    def _damaged(thread: Thread, what: str, found: list[Message], at: str | None,
                 intact: str | None = None) -> ConversationDamaged:
        """`found`: the messages read from the tip down to the damage."""
        if intact is None:
            n = len(found)
            intact = f"{n} intact message{'s' * (n != 1)} from {found[-1].id} to the tip" if found else \
                "no intact message"
        c = thread.conversation
        return ConversationDamaged(f"conversation {c}: thread {thread.name}: {what} ({intact})", c, at,
                                   hint=f"`hcw inspect --session {c}` shows the tree")

    def _free_name(self, conversation: str, stem: str) -> str:
        taken = {name for (name,) in self.db.execute("SELECT name FROM threads WHERE conversation = ?",
                                                     [conversation])}
        n = 1
        while f"{stem}-{n}" in taken:
            n += 1
        return f"{stem}-{n}"


def walk(tree: list[dict]) -> Iterator[tuple[int, dict]]:
    """(depth, node) for every node of `Conversations.tree`, parents before children, without
    recursion. Each node once: a hand-made tree that holds a node twice (or in a loop) still ends."""
    stack = [(0, node) for node in reversed(tree)]
    seen: set[int] = set()
    while stack:
        depth, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield depth, node
        stack.extend((depth + 1, child) for child in reversed(node["children"]))


def _message(row: dict) -> Message:
    """A messages row as a Message: ConversationDamaged naming the row when it is not one. Meta is
    auxiliary (stop reason, timings): unreadable, it is {"damaged": why} and the message loads."""
    bad = _unbuildable(row)
    if bad:
        raise ConversationDamaged(f"conversation {row['conversation']}: message {row['id']}: {'; '.join(bad)}",
                                  row["conversation"], row["id"])
    meta, why = _meta(row["meta"])
    return Message(**{**row, "meta": meta if why is None else {"damaged": why}})


def _unbuildable(row: dict) -> list[str]:
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


def _row_damage(row: dict) -> list[str]:
    """Everything wrong with a messages row: what `_unbuildable` finds, unreadable meta, and an id
    that is not the digest of what the row says (it was changed after it was written)."""
    out = _unbuildable(row)
    why = _meta(row["meta"])[1]
    if why is not None:
        out.append(why)
    if not out and not _addressed(row):
        out.append(_CHANGED)
    return out


_CHANGED = "its id is not the digest of its conversation, parent, role and content (the row was changed)"


def _addressed(row: dict) -> bool:
    """Whether a buildable row's id is the digest of what it says."""
    return (isinstance(row["conversation"], str) and isinstance(row["parent"], str | None)
            and row["id"] == message_digest(row["conversation"], row["parent"], row["role"], row["content"]))


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


def _text(raw: bytes | None) -> str | None:
    """A cell read as a BLOB (so that text which is not UTF-8 cannot stop a listing) as text."""
    return raw.decode("utf-8", "replace") if raw is not None else None


def _contains(haystack: bytes | None, needle: str | None) -> bool:
    if haystack is None or needle is None:
        return False
    return needle.casefold() in haystack.decode("utf-8", "replace").casefold()


def _also(damaged: str | None, why: str) -> str:
    return why if damaged is None else f"{damaged}; {why}"


def _meta(raw) -> tuple[dict, str | None]:
    try:
        meta = json.loads(raw)
    except (TypeError, ValueError):
        return {}, "meta is not JSON"
    return (meta, None) if isinstance(meta, dict) else ({}, "meta is not a JSON object")
