"""The damage engine: one workbench file made by a real chat, damaged one way at a time, then used
the way a person would — the conversation resumed and the next question sent through the plain
REPL (`run_plain`), and `hcw inspect --verify` run on a copy — and every case sorted into an
outcome. Used by tests/test_damage_fuzz.py (a few hundred cases) and benchmarks/reliability.py
(ten thousand).

The file (`make_pristine`): a random hcw_hybrid with every layer kind and a byte tokenizer, a chat
of three turns on "main" with a fork and an edit answered again (block 16, a GDN checkpoint at
every segment), a second conversation, and two `models` rows (nothing writes that table yet, so
they are added to have its columns damaged too); closed, so the WAL is checkpointed away.

Damage (`Spec`: kind, table, column, seed), through a raw sqlite3 connection with foreign keys off
(NOT NULL bypassed the way a damaged page would hold it) or on the raw bytes:

    per column   bitflip (one bit of the value: text as UTF-8, possibly left invalid), truncate
                 (a shorter value; an integer's low bytes), null, type (blob for text; text, real
                 or blob for an integer; text or an integer for a blob), swap (with another row)
    per row      delete, clone (a copy under a new key)
    tree         cycle (a message's parent made itself or a descendant), dangling_tip (a thread's
                 tip made an id that is missing, a message of the other conversation, or '')
    file         raw_bitflip (1-8 bits anywhere), truncate_file, zero_page, torn_page (4 KiB
                 sectors of one page zeroed); the page hit is named by `dbstat`

Outcomes of the chat: "correct" — the answer is an oracle answer; "refused" — a ValueError,
KeyError, ConfigError or sqlite3.DatabaseError at open, or an "error: ..." line from the REPL,
one line naming the damage (an id of the damaged row, its table or column, or the file's state);
"warned" — another answer, with a warning naming damage, where the history itself was damaged;
"wrong" — another answer with no warning (the worst); "unclear" — a refusal that is not one line
naming the damage; "crash" — any other exception; "hang" — the case passed its time limit (each
case runs in a worker process the parent kills). `hcw inspect --verify` on the same damage:
"clean" (exit 0), "findings" (exit 1, each named), "error" (one "error: ..." line), "crash" (a
traceback) or "hang"; a case whose chat was refused or warned, or whose history fails the digest
check, while verify said clean is marked `verify_missed`.

The oracle. Answers are greedy, so the oracle is the answer a cold engine (no cache) gives to the
next question on a history; which history depends on what the damage is:

    cache rows (models, segments, blobs): the pristine history of the thread resumed. Nothing here
        may change an answer: a row that fails to parse or verify is a miss and recomputed, so
        these cases must end "correct" (a refusal is a failure too)
    messages.content, messages.role, threads.tip: the history as stored now. Content is the data,
        and a tip is a pointer a person may move (`set_tip`); what must hold is that the cache
        never reuses the states of the old content (segment keys hash the token ids) — the answer
        equals the cold answer on the damaged history, or the damage is refused
    every other column of the conversation tables, and the tree kinds: the history read by a
        strict reader (every row present, of its conversation, a valid role and text, no cycle,
        and each id the digest of its conversation, parent, role and content): when that history
        is whole it is the oracle (a damaged timestamp, token count, meta, title, a thread moved
        away, an id of a message on no path: harmless); when it is not, nothing is an oracle and
        only a refusal (or a warning) is right — a parent set to NULL or swapped must never be
        answered from a shortened or spliced history
    file kinds: either oracle above (a flipped bit may land in a message's text); a page SQLite
        finds malformed may be refused at open, and damage SQLite reads without noticing (an index
        page) may be refused naming the conversation, thread or message it made unreadable

Every oracle answer is computed by `Oracle.answer` with a fresh `Engine` and the session's own
template and sampling, and the pristine file checks it against a reuse="off" session and a cached
one before any case runs.
"""

from __future__ import annotations

import io
import json
import os
import random
import select
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

COLUMN_KINDS = ("bitflip", "truncate", "null", "type", "swap")
ROW_KINDS = ("delete", "clone")
TREE_KINDS = ("cycle", "dangling_tip")
FILE_KINDS = ("raw_bitflip", "truncate_file", "zero_page", "torn_page")
KINDS = COLUMN_KINDS + ROW_KINDS + TREE_KINDS + FILE_KINDS
TABLES = ("models", "segments", "blobs", "conversations", "messages", "threads")
CACHE_TABLES = frozenset({"models", "segments", "blobs"})
DATA_COLUMNS = frozenset({("messages", "content"), ("messages", "role"), ("threads", "tip")})
OUTCOMES = ("correct", "refused", "warned", "wrong", "unclear", "crash", "hang")
FAILURES = ("wrong", "unclear", "crash", "hang")
VERIFY_OUTCOMES = ("clean", "findings", "error", "crash", "hang")
# what a refusal of a file SQLite cannot read may say instead of naming a row
FILE_WORDS = ("malformed", "not a database", "not a workbench database", "corrupt", "damaged", "truncated",
              "disk i/o", "integrity", "unable to open", "no such table")
QUESTION = "And what was my name again?"
SECTOR = 4096


@dataclass(frozen=True)
class Spec:
    kind: str
    table: str | None  # None: chosen from the page a file kind hits
    column: str | None
    seed: int


@dataclass(frozen=True)
class Damage:
    kind: str
    table: str  # the table hit ("free", "sqlite_schema", an index's table, "-" for the whole file)
    column: str | None
    detail: str  # what was done, to reproduce it by hand
    names: tuple[str, ...]  # what a refusal may name: ids of the rows, the table, the column
    scope: str  # cache | history | file

    @property
    def data(self) -> bool:
        """The history as stored is an oracle too (content is data; file damage may be in content)."""
        return self.scope == "file" or (self.table, self.column) in DATA_COLUMNS


def chat_options(folder: Path, db: Path, **kw):
    from workbench.session import ChatOptions

    return ChatOptions(model=folder, db=db, block_size=16, checkpoint_every=1, max_new_tokens=6, **kw)


def make_pristine(root: Path, model=None) -> Path:
    """Write the model, the workbench file and pristine.json (what workers read) under `root`."""
    from engine import load_model
    from engine.model.random_init import hcw_hybrid_dict, write_random_model
    from workbench.session import ChatSession

    root.mkdir(parents=True, exist_ok=True)
    folder = root / "model"
    if not (folder / "config.json").exists():
        write_random_model(folder, hcw_hybrid_dict(hidden=64), seed=3)
    model = model if model is not None else load_model(folder)
    db = root / "pristine.db"
    for p in (db, *_sidecars(db)):
        p.unlink(missing_ok=True)
    s = ChatSession(chat_options(folder, db), model=model)
    s.send("Hello, my name is Ada and I keep bees.")
    s.send("What is two plus two?")
    s.fork(name="aside")
    s.send("Tell me about the bees.")
    s.switch("main")
    s.edit(3, "What is three plus three?")
    s.regenerate()
    s.switch("main")
    s.send("Which flowers do they like?")  # main is the most recently updated: what a resume opens
    conv = s.conversation.id
    s.tier.register_model(bytes.fromhex(s.tier.layout), {"block_size": 16})
    s.tier.register_model(bytes(16), {"block_size": 64, "note": "another layout"})
    s.close()
    other = ChatSession(chat_options(folder, db), model=model)
    other.send("A different chat about rivers.")
    other_conv = other.conversation.id
    other.close()
    if any(p.exists() for p in _sidecars(db)):
        raise RuntimeError(f"closing the sessions left a WAL beside {db}")
    con = sqlite3.connect(db)
    threads = [tid for (tid,) in con.execute("SELECT id FROM threads ORDER BY rowid")]
    con.close()
    info = {"db": str(db), "model": str(folder), "conversation": conv, "other": other_conv, "threads": threads,
            "question": QUESTION, "pages": _pages(db), "page_size": _page_size(db), "oracle": []}
    (root / "pristine.json").write_text(json.dumps(info))
    oracle = Oracle(info, model)
    # the oracle is what a reuse="off" session and a cached one both answer on the pristine file
    for reuse in ("off", "exact"):
        scratch = root / f"check-{reuse}.db"
        shutil.copy(db, scratch)
        s = ChatSession(chat_options(folder, scratch, session=conv, reuse=reuse), model=model)
        expected = oracle.answer(read_history(scratch, s.thread.id, strict=True))
        got = s.send(QUESTION).text
        s.close()
        if got != expected:
            raise RuntimeError(f"reuse={reuse} answers {got!r}, the cold engine {expected!r}: no oracle")
        for p in (scratch, *_sidecars(scratch)):
            p.unlink(missing_ok=True)
    for tid in threads:
        oracle.answer(read_history(db, tid, strict=True))
    info["oracle"] = [[list(map(list, h)), a] for h, a in oracle.memo.items()]
    (root / "pristine.json").write_text(json.dumps(info))
    return root / "pristine.json"


def _sidecars(db: Path) -> list[Path]:
    return [db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def _page_size(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("PRAGMA page_size").fetchone()[0]
    finally:
        con.close()


def _pages(db: Path) -> dict[str, str]:
    """page number -> the table it belongs to (an index's page: its table's), from dbstat."""
    con = sqlite3.connect(db)
    try:
        owner = {name: table for name, table in con.execute("SELECT name, tbl_name FROM sqlite_master")}
        return {str(page): owner.get(name, name) for name, page in con.execute("SELECT name, pageno FROM dbstat")}
    except sqlite3.Error:  # a build without dbstat: the file kinds name no table
        return {}
    finally:
        con.close()


class Oracle:
    """Cold answers to the question on a history, memoized: a fresh Engine per answer, the
    session's template and sampling."""

    def __init__(self, info: dict, model):
        from workbench.session import ChatSession

        self.question = info["question"]
        self.model = model
        scratch = Path(info["db"]).with_name(f"oracle-{os.getpid()}.db")
        self.session = ChatSession(chat_options(Path(info["model"]), scratch, reuse="off"), model=model)
        self.session.tier.close()  # only its template, tokenizer and sampling are used
        self.memo: dict[tuple, str] = {tuple(map(tuple, h)): a for h, a in info.get("oracle", [])}

    def answer(self, history: list[tuple[str, str]]) -> str:
        from engine.engine import Engine
        from store.conversations import Message

        key = tuple(history)
        if key not in self.memo:
            msgs = [Message("-", "-", None, role, content, None, "") for role, content in history]
            msgs.append(Message("-", "-", None, "user", self.question, None, ""))
            s = self.session
            gen = Engine(self.model).generate(s.prompt_ids(msgs), s.sampling())
            self.memo[key] = s.tok.decode([t for t in gen.token_ids if t not in s.tok.eos_ids])
        return self.memo[key]


def read_history(db: Path, thread_id, strict: bool) -> list[tuple[str, str]] | None:
    """The thread's history as (role, content), root first, read on a connection of its own; None
    when it is not whole (a row missing, of another conversation, not a message, a cycle; with
    `strict`, an id that is not the digest of its row)."""
    from store.conversations import ROLES, message_digest

    try:
        con = sqlite3.connect(db)
    except sqlite3.Error:
        return None
    try:
        row = con.execute("SELECT conversation, tip FROM threads WHERE id = ?", [thread_id]).fetchone()
        if row is None:
            return None
        conv, at = row
        bound = con.execute("SELECT count(*) FROM messages").fetchone()[0]
        out, seen = [], set()
        while at is not None:
            if at in seen or len(out) > bound:
                return None
            seen.add(at)
            m = con.execute("SELECT conversation, parent, role, content FROM messages WHERE id = ?", [at]).fetchone()
            if m is None or m[0] != conv or m[2] not in ROLES or not isinstance(m[3], str) \
                    or not isinstance(m[1], str | None):
                return None
            if strict and at != message_digest(conv, m[1], m[2], m[3]):
                return None
            out.append((m[2], m[3]))
            at = m[1]
        return out[::-1]
    except sqlite3.Error:
        return None
    finally:
        con.close()


def columns(db: Path) -> dict[str, list[tuple[str, str]]]:
    """table -> [(column, declared type)] of the six tables, from the file itself."""
    con = sqlite3.connect(db)
    try:
        return {t: [(r[1], r[2].upper()) for r in con.execute(f'PRAGMA table_info("{t}")')] for t in TABLES}
    finally:
        con.close()


def combos(cols: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str | None, str | None]]:
    """Every (kind, table, column) the engine knows: each column kind on every column of every
    table, each row kind on every table, the tree kinds, the file kinds."""
    out = [(k, t, c) for t in TABLES for c, _ in cols[t] for k in COLUMN_KINDS]
    out += [(k, t, None) for t in TABLES for k in ROW_KINDS]
    out += [("cycle", "messages", "parent"), ("dangling_tip", "threads", "tip")]
    out += [(k, None, None) for k in FILE_KINDS]
    return out


def schedule(db: Path, n: int, seed: int = 0) -> list[Spec]:
    """`n` cases: every combination once (in order) while n allows, then a kind drawn at random and
    one of its combinations (so each kind gets about as many cases as another)."""
    all_ = combos(columns(db))
    by_kind = defaultdict(list)
    for c in all_:
        by_kind[c[0]].append(c)
    rng = random.Random(seed)
    picked = [all_[i] if i < len(all_) else rng.choice(by_kind[rng.choice(KINDS)]) for i in range(n)]
    return [Spec(k, t, c, seed * 1_000_003 + i) for i, (k, t, c) in enumerate(picked)]


def apply_damage(db: Path, spec: Spec, info: dict) -> Damage:
    """Damage the file `db` (a copy of the pristine one) as `spec` says; deterministic in the seed."""
    rng = random.Random(spec.seed)
    if spec.kind in FILE_KINDS:
        return _file_damage(db, spec, rng, info)
    con = _connect(db)
    try:
        if spec.kind in COLUMN_KINDS:
            return _column_damage(con, db, spec, rng, info)
        if spec.kind == "delete":
            rowid, names = _pick_row(con, spec.table, rng, info)
            con.execute(f'DELETE FROM "{spec.table}" WHERE rowid = ?', [rowid])
            con.commit()
            return _made(spec, f"deleted {spec.table} row {rowid}", names)
        if spec.kind == "clone":
            return _clone(con, spec, rng, info)
        if spec.kind == "cycle":
            return _cycle(con, spec, rng, info)
        if spec.kind == "dangling_tip":
            return _dangling(con, spec, rng, info)
    finally:
        con.close()
    raise ValueError(f"unknown damage kind {spec.kind!r}")


def _connect(db: Path) -> sqlite3.Connection:
    con = sqlite3.connect(db)
    con.execute("PRAGMA foreign_keys=OFF")
    return con


def _made(spec: Spec, detail: str, names, column: str | None = None) -> Damage:
    table = spec.table
    scope = "cache" if table in CACHE_TABLES else "history"
    names = tuple(str(n) for n in names if n is not None and str(n)) + (table,) + ((column,) if column else ())
    return Damage(spec.kind, table, column or spec.column, detail, names, scope)


def _pick_row(con, table: str, rng: random.Random, info: dict, column: str | None = None,
              non_null: bool = False) -> tuple[int, list]:
    """A row of `table` (of the resumed conversation, most of the time), and what names it."""
    key = _key(table)
    where = f'WHERE "{column}" IS NOT NULL' if non_null and column else ""
    rows = con.execute(f'SELECT rowid, "{key}" FROM "{table}" {where} ORDER BY rowid').fetchall()
    if not rows:
        rows = con.execute(f'SELECT rowid, "{key}" FROM "{table}" ORDER BY rowid').fetchall()
    if table in ("messages", "threads") and rng.random() < 0.8:
        own = {r for (r,) in con.execute(f'SELECT rowid FROM "{table}" WHERE conversation = ?',
                                         [info["conversation"]])}
        rows = [r for r in rows if r[0] in own] or rows
    rowid, name = rng.choice(rows)
    names = [name, str(name)[:8]] + ([] if table == "segments" or table == "blobs" else [info["conversation"]])
    if table == "blobs":
        names.append(con.execute("SELECT segment FROM blobs WHERE rowid = ?", [rowid]).fetchone()[0])
    return rowid, names


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return b"\x01"
    out = bytearray(data)
    out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _as_text(raw: bytes):
    """Bytes as a TEXT value: a str when they are UTF-8, else left invalid (what a flipped bit on
    disk gives), marked for `_write`."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return _Invalid(raw)


class _Invalid(bytes):
    """Bytes to store as TEXT (CAST): not UTF-8."""


def _column_damage(con, db: Path, spec: Spec, rng: random.Random, info: dict) -> Damage:
    table, column = spec.table, spec.column
    decl = dict(columns(db)[table])[column]
    rowid_alias = decl == "INTEGER" and column == "id" and table == "blobs"  # always an integer in a file
    rowid, names = _pick_row(con, table, rng, info, column, non_null=spec.kind != "null")
    (old,) = con.execute(f'SELECT "{column}" FROM "{table}" WHERE rowid = ?', [rowid]).fetchone()
    if spec.kind == "swap":
        rows = con.execute(f'SELECT rowid, "{column}" FROM "{table}" WHERE rowid != ? ORDER BY rowid',
                           [rowid]).fetchall()
        differ = [r for r in rows if r[1] != old] or rows
        if not differ:
            return _made(spec, f"swap: {table} has one row", names, column)
        other, value = rng.choice(differ)
        names += _pick_names(con, table, other)
        # through a value no row holds, so a unique column never holds one value twice
        _write(con, table, column, rowid, -(1 << 62) if rowid_alias else _Invalid(b"\x00swap"))
        _write(con, table, column, other, old)
        _write(con, table, column, rowid, value)
        if rowid_alias:
            rowid = value
        return _made(spec, f"swapped {table}.{column} of rows {rowid} and {other}", names, column)
    for _ in range(20):  # a value a unique column already holds is drawn again
        if spec.kind == "null":
            new = None if not rowid_alias else _free_rowid(con, table)
        elif spec.kind == "bitflip":
            new = _bitflip(old, rng)
        elif spec.kind == "truncate":
            new = _truncate(old, rng)
        else:
            new = _retype(old, decl, rng) if not rowid_alias else -old
        if _write(con, table, column, rowid, new):
            break
    else:
        return _made(spec, f"{spec.kind}: {table}.{column} of row {rowid}: every value drawn collides", names,
                     column)
    shown = repr(new if not isinstance(new, bytes) or len(new) < 40 else new[:40] + b"...")
    return _made(spec, f"{spec.kind}: {table}.{column} of row {rowid}: {_short(old)} -> {shown}", names, column)


def _free_rowid(con, table: str) -> int:
    # an INTEGER PRIMARY KEY set to NULL takes the next rowid, as an insert would
    return con.execute(f'SELECT coalesce(max(rowid), 0) + 1 FROM "{table}"').fetchone()[0]


def _pick_names(con, table: str, rowid: int) -> list:
    (name,) = con.execute(f'SELECT "{_key(table)}" FROM "{table}" WHERE rowid = ?', [rowid]).fetchone()
    return [name, str(name)[:8]]


def _key(table: str) -> str:
    return "fingerprint" if table == "models" else "key" if table == "segments" else "id"


def _short(value) -> str:
    r = repr(value)
    return r if len(r) < 60 else r[:57] + "..."


def _bitflip(old, rng: random.Random):
    if isinstance(old, int):  # one bit of its 64-bit two's complement, as SQLite stores it
        flipped = (old ^ (1 << rng.randrange(64))) & ((1 << 64) - 1)
        return flipped - (1 << 64) if flipped >= 1 << 63 else flipped
    if isinstance(old, float):
        return -old
    if isinstance(old, str):
        return _as_text(_flip(old.encode(), rng))
    if isinstance(old, bytes):
        return _flip(old, rng)
    return rng.randrange(1 << 16)  # NULL: a value where none was


def _truncate(old, rng: random.Random):
    if isinstance(old, int):
        return old % (256 ** rng.randrange(8)) if old >= 0 else old % 256
    if isinstance(old, str):
        return old[:rng.randrange(len(old))] if old else ""
    if isinstance(old, bytes):
        return old[:rng.randrange(len(old))] if old else b""
    return old


def _retype(old, decl: str, rng: random.Random):
    """The same value as another storage class (a TEXT column keeps text put in it as an integer,
    so text becomes a blob)."""
    if "INT" in decl:
        return rng.choice([f"{old}x", (old or 0) + 0.5, str(old).encode()])
    if "TEXT" in decl:
        return (old or "").encode() if isinstance(old, str) else b"\x00\x01"
    return rng.choice([old.hex() if isinstance(old, bytes) else "x", rng.randrange(1 << 30)])


def _write(con, table: str, column: str, rowid: int, value) -> bool:
    """Set one value (False when a unique column holds it already); a NOT NULL that a damaged page
    would not honour is lifted around the write."""
    sql = f'UPDATE "{table}" SET "{column}" = {"CAST(? AS TEXT)" if isinstance(value, _Invalid) else "?"} ' \
          "WHERE rowid = ?"
    arg = bytes(value) if isinstance(value, _Invalid) else value
    try:
        con.execute(sql, [arg, rowid])
        con.commit()
    except sqlite3.IntegrityError as e:
        con.rollback()
        if "NOT NULL" not in str(e):
            return False
        _loose(con, table, lambda: con.execute(sql, [arg, rowid]))
    return True


def _loose(con, table: str, write) -> None:
    """Run `write` with the table's NOT NULL constraints out of its schema, then put them back."""
    (sql,) = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()

    def schema(text: str) -> None:
        con.execute("PRAGMA writable_schema=ON")
        version = con.execute("PRAGMA schema_version").fetchone()[0]
        con.execute("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", [text, table])
        con.execute(f"PRAGMA schema_version={version + 1}")
        con.execute("PRAGMA writable_schema=OFF")
        con.commit()

    schema(sql.replace(" NOT NULL", ""))
    try:
        write()
        con.commit()
    finally:
        schema(sql)


def _clone(con, spec: Spec, rng: random.Random, info: dict) -> Damage:
    table = spec.table
    rowid, names = _pick_row(con, table, rng, info)
    cols = [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]
    (row,) = con.execute(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in cols)} FROM "{table}" '
                         "WHERE rowid = ?", [rowid]).fetchall()
    row = dict(zip(cols, row))
    key = _key(table)
    if table == "blobs":
        row["id"] = None  # a new rowid: the same blob stored twice
    else:
        row[key] = rng.randbytes(16 if table in ("models", "segments", "messages") else 6).hex()
    con.execute(f'INSERT INTO "{table}" ({", ".join(chr(34) + c + chr(34) for c in row)}) '
                f'VALUES ({", ".join("?" * len(row))})', list(row.values()))
    con.commit()
    return _made(spec, f"cloned {table} row {rowid} as {row[key]}", names + [row[key]])


def _paths(con, conversation: str) -> list[list[str]]:
    """Each thread's path of message ids, tip first (the pristine file's are whole)."""
    out = []
    for (tip,) in con.execute("SELECT tip FROM threads WHERE conversation = ? ORDER BY rowid", [conversation]):
        path = []
        while tip is not None and len(path) < 1000:
            path.append(tip)
            tip = (con.execute("SELECT parent FROM messages WHERE id = ?", [tip]).fetchone() or [None])[0]
        out.append(path)
    return out


def _cycle(con, spec: Spec, rng: random.Random, info: dict) -> Damage:
    path = rng.choice(_paths(con, info["conversation"]))
    low = rng.randrange(len(path))  # the tip is index 0: `low` is at or below `high`
    high = rng.randrange(low, len(path))
    con.execute("UPDATE messages SET parent = ? WHERE id = ?", [path[low], path[high]])
    con.commit()
    what = "its own parent" if low == high else f"the parent of its ancestor {path[high]}"
    return _made(spec, f"cycle: message {path[low]} made {what}", [path[low], path[high], info["conversation"]])


def _dangling(con, spec: Spec, rng: random.Random, info: dict) -> Damage:
    rows = con.execute("SELECT rowid, id, name, tip FROM threads WHERE conversation = ? ORDER BY rowid",
                       [info["conversation"]]).fetchall()
    rowid, tid, name, old = rng.choice(rows)
    how = rng.choice(["missing", "foreign", "empty"])
    if how == "missing":
        tip = rng.randbytes(16).hex()
    elif how == "foreign":
        (tip,) = con.execute("SELECT id FROM messages WHERE conversation = ? ORDER BY rowid LIMIT 1",
                             [info["other"]]).fetchone()
    else:
        tip = ""
    con.execute("UPDATE threads SET tip = ? WHERE rowid = ?", [tip, rowid])
    con.commit()
    return _made(spec, f"dangling tip ({how}): thread {name} ({tid}) tip {old} -> {tip!r}",
                 [tid, name, tip, old, info["conversation"]])


def _file_damage(db: Path, spec: Spec, rng: random.Random, info: dict) -> Damage:
    data = bytearray(db.read_bytes())
    size, page = len(data), info["page_size"]
    if spec.kind == "raw_bitflip":
        at = rng.randrange(size)
        bits = 1 if rng.random() < 0.7 else rng.randint(2, 8)
        for _ in range(bits):
            where = min(size - 1, at + rng.randrange(16))
            data[where] ^= 1 << rng.randrange(8)
        detail = f"{bits} bit(s) flipped at byte {at}"
    elif spec.kind == "truncate_file":
        at = rng.randrange(size // page) * page if rng.random() < 0.4 else rng.randrange(size)
        data = data[:at]
        detail = f"truncated to {at} of {size} bytes"
    elif spec.kind == "zero_page":
        at = rng.randrange(size // page) * page
        data[at:at + page] = bytes(page)
        detail = f"page {at // page + 1} zeroed"
    else:
        base = rng.randrange(size // page) * page
        first = rng.randrange(page // SECTOR)
        last = rng.randrange(first, page // SECTOR)
        data[base + first * SECTOR:base + (last + 1) * SECTOR] = bytes((last + 1 - first) * SECTOR)
        at = base + first * SECTOR
        detail = f"page {base // page + 1}: sectors {first}..{last} zeroed"
    db.write_bytes(bytes(data))
    hit = info["pages"].get(str(at // page + 1), "free") if spec.kind != "truncate_file" else "-"
    # what SQLite reads without noticing surfaces as a row gone missing: naming its id names it
    names = (hit, info["conversation"], info["other"], *info["threads"])
    return Damage(spec.kind, hit, None, detail, names, "file")


class Runner:
    """Runs cases on one process's copy of the pristine file: the model loaded once."""

    def __init__(self, pristine: Path, scratch: Path, model=None):
        from engine import load_model

        self.info = json.loads(Path(pristine).read_text())
        self.folder, self.pristine = Path(self.info["model"]), Path(self.info["db"])
        self.model = model if model is not None else load_model(self.folder)
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.oracle = Oracle({**self.info, "db": str(self.scratch / "oracle.db")}, self.model)

    def run(self, spec: Spec) -> dict:
        t0 = time.perf_counter()
        db, copy = self.scratch / "case.db", self.scratch / "verify.db"
        for p in (db, copy, *_sidecars(db), *_sidecars(copy)):
            p.unlink(missing_ok=True)
        shutil.copy(self.pristine, db)
        damage = apply_damage(db, spec, self.info)
        shutil.copy(db, copy)
        verify, verify_text = _verify(copy)
        chat, message, strict_whole = self._chat(db, damage)
        missed = verify == "clean" and (chat in ("refused", "warned") or strict_whole is False)
        return {**asdict(spec), "hit": damage.table, "scope": damage.scope, "detail": damage.detail,
                "chat": chat, "verify": verify, "verify_missed": missed, "message": message,
                "verify_text": verify_text, "outcome": _worst(chat, verify),
                "ms": round(1000 * (time.perf_counter() - t0), 1)}

    def _chat(self, db: Path, damage: Damage) -> tuple[str, str, bool | None]:
        """(outcome, what the user was told, whether the strict reader found a whole history)."""
        from engine.config import ConfigError
        from workbench.plain import run_plain
        from workbench.session import ChatSession

        try:
            session = ChatSession(chat_options(self.folder, db, session=self.info["conversation"]), model=self.model)
        except (ConfigError, ValueError, KeyError, sqlite3.DatabaseError, OSError) as e:
            _release_writers()
            msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
            return self._refusal(msg, damage), f"{type(e).__name__}: {msg}", None
        except Exception:  # noqa: BLE001 - any other exception at open is the crash being counted
            _release_writers()
            return "crash", traceback.format_exc(limit=-3), None
        try:
            warnings = list(getattr(session, "warnings", list)())
            strict = read_history(db, session.thread.id, strict=True)
            answers = {self.oracle.answer(strict)} if strict is not None else set()
            if damage.data:
                lenient = read_history(db, session.thread.id, strict=False)
                if lenient is not None:
                    answers.add(self.oracle.answer(lenient))
            turns = []
            send = session.send

            def recorded(text, on_text=None, should_stop=None):
                turns.append(send(text, on_text, should_stop))
                return turns[-1]

            session.send = recorded
            out = io.StringIO()
            run_plain(session, [self.info["question"]], out)
        except Exception:  # noqa: BLE001 - the REPL let an exception out: a crash
            _close_quietly(session)
            return "crash", traceback.format_exc(limit=-3), None
        text = out.getvalue()
        errors = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
        told = "; ".join(warnings)
        if not turns:
            return (self._refusal(errors[0], damage) if errors else "crash"), (errors or [text[-300:]])[0], \
                strict is not None
        if turns[0].text in answers:
            return "correct", told, strict is not None
        if warnings and damage.scope != "cache":
            return "warned", told, strict is not None
        return "wrong", f"answered {turns[0].text!r}, oracle {sorted(answers)!r}; warnings: {told or 'none'}", \
            strict is not None

    @staticmethod
    def _refusal(message: str, damage: Damage) -> str:
        """"refused" when the message is one line that names the damage, else "unclear"."""
        lowered = message.lower()
        named = any(n and n.lower() in lowered for n in damage.names) or \
            (damage.scope == "file" and any(w in lowered for w in FILE_WORDS))
        return "refused" if message.strip() and "\n" not in message and named else "unclear"


def _release_writers() -> None:
    """A session whose open failed leaves its write-behind thread and connections behind (a CLI
    exits; a worker running thousands of cases would run out of files): close them."""
    for t in threading.enumerate():
        writer = getattr(getattr(t, "_target", None), "__self__", None)
        if t.name == "hcw-write-behind" and writer is not None:
            _close_quietly(writer)


def _close_quietly(session) -> None:
    try:
        (session.tier if hasattr(session, "engine") else session).close()
    except Exception:  # noqa: BLE001 - the case is already counted as a crash; this only frees the file
        pass


def _verify(db: Path) -> tuple[str, str]:
    """`hcw inspect --verify` through the CLI: (outcome, its output's first lines)."""
    from typer.testing import CliRunner

    from workbench.cli import app

    res = CliRunner().invoke(app, ["inspect", str(db), "--verify"])
    output = res.output
    head = "\n".join(output.splitlines()[-8:])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return "crash", "".join(traceback.format_exception(res.exception, limit=-3))
    if "Traceback" in output:
        return "crash", head
    if res.exit_code == 0:
        return "clean", ""
    errors = res.stderr.strip().splitlines()
    if errors and errors[0].startswith("error: "):
        return ("error" if len(errors) == 1 else "crash"), res.stderr.strip()
    return "findings", head


def _worst(chat: str, verify: str) -> str:
    return verify if verify in ("crash", "hang") and chat not in FAILURES else chat


def run_cases(pristine: Path, specs: list[Spec], workers: int = 1, timeout_s: float = 60.0,
              progress=None, scratch: Path | None = None) -> list[dict]:
    """Every case in a worker process (`python -m workbench.damage worker`) that is killed and
    replaced when a case passes `timeout_s` (a "hang") or the process dies (a "crash")."""
    scratch = Path(scratch or Path(pristine).parent / "workers")
    results: list[dict | None] = [None] * len(specs)
    todo = iter(range(len(specs)))
    lock = threading.Lock()
    done = [0]

    def serve(w: int) -> None:
        worker = None
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                if worker is None:
                    worker = _Worker(pristine, scratch / f"w{w}")
                results[i] = worker.run(specs[i], timeout_s)
                if worker.dead:
                    worker = None
                with lock:
                    done[0] += 1
                    if progress is not None:
                        progress(done[0], len(specs), results[i])
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


class _Worker:
    def __init__(self, pristine: Path, scratch: Path):
        scratch.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        self.log = open(scratch / "worker.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.damage", "worker", str(pristine), str(scratch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=root,
                                     env=env, text=True, bufsize=1)
        self.dead = False
        self.started = False

    def run(self, spec: Spec, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(asdict(spec)) + "\n")
        self.proc.stdin.flush()
        # the first case also waits for the worker to start (imports, the model)
        limit = time.monotonic() + timeout_s + (0 if self.started else 120)
        while time.monotonic() < limit:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, limit - time.monotonic()))
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:  # the worker died under the case
                self.close()
                return _lost(spec, "crash", f"the worker process died (exit {self.proc.poll()})")
            self.started = True
            return json.loads(line)
        self.close()
        return _lost(spec, "hang", f"no result within {timeout_s:.0f} s")

    def close(self) -> None:
        self.dead = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def _lost(spec: Spec, outcome: str, why: str) -> dict:
    return {**asdict(spec), "hit": spec.table or "-", "scope": "-", "detail": f"seed {spec.seed}", "chat": outcome,
            "verify": "-", "verify_missed": False, "message": why, "verify_text": "", "outcome": outcome, "ms": 0.0}


def _serve(pristine: str, scratch: str) -> None:
    """The worker: a spec per line on stdin, a result per line on the original stdout (anything
    else printed goes to stderr)."""
    import torch

    torch.set_num_threads(1)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    runner = Runner(Path(pristine), Path(scratch))
    for line in sys.stdin:
        spec = Spec(**json.loads(line))
        try:
            result = runner.run(spec)
        except Exception:  # noqa: BLE001 - the damage engine itself failed: reported, never counted as the code's
            result = {**_lost(spec, "harness", traceback.format_exc(limit=-4)), "outcome": "harness"}
        proto.write(json.dumps(result) + "\n")


def failed(r: dict) -> bool:
    """A failure: wrong, unclear, crash, hang, the harness's own error, or damage to a cache row
    that did not end in the right answer (it must be recomputed)."""
    return r["outcome"] in (*FAILURES, "harness") or (r["scope"] == "cache" and r["outcome"] != "correct")


def summarize(results: list[dict]) -> dict:
    """Counts: outcome overall, per kind and per table hit; verify's outcomes; failures listed."""
    per_kind: dict[str, Counter] = defaultdict(Counter)
    per_table: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        per_kind[r["kind"]][r["outcome"]] += 1
        per_table[r["hit"]][r["outcome"]] += 1
    outcomes = Counter(r["outcome"] for r in results)
    return {"cases": len(results), "outcomes": dict(outcomes),
            "ok": sum(outcomes[o] for o in ("correct", "refused", "warned")),
            "verify": dict(Counter(r["verify"] for r in results)),
            "verify_missed": sum(r["verify_missed"] for r in results),
            "per_kind": {k: dict(v) for k, v in sorted(per_kind.items())},
            "per_table": {k: dict(v) for k, v in sorted(per_table.items())},
            "failures": [r for r in results if failed(r)]}


def main(argv: list[str]) -> None:
    """`python -m workbench.damage case DIR KIND TABLE COLUMN SEED`: one case, printed (the pristine
    file is made in DIR first unless it is there; '-' for no table or column). `worker PRISTINE
    SCRATCH` is what run_cases starts."""
    if argv[:1] == ["worker"]:
        _serve(argv[1], argv[2])
        return
    if argv[:1] == ["case"] and len(argv) == 6:
        root, kind, table, column, seed = argv[1:6]
        pristine = Path(root) / "pristine.json"
        if not pristine.exists():
            make_pristine(Path(root))
        spec = Spec(kind, None if table == "-" else table, None if column == "-" else column, int(seed))
        print(json.dumps(Runner(pristine, Path(root) / "case").run(spec), indent=1))
        return
    raise SystemExit(main.__doc__)


def reproducer(root: Path | str, r: dict) -> str:
    """The command that runs one result's case again."""
    return (f"python -m workbench.damage case {root} {r['kind']} {r['table'] or '-'} {r['column'] or '-'} "
            f"{r['seed']}")


if __name__ == "__main__":
    main(sys.argv[1:])
