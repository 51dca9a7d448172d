"""`apply_damage`: one case's damage done to a copy of the pristine file, through a raw sqlite3
connection with foreign keys off (a NOT NULL lifted the way a damaged page would not honour it) for
the column, row and tree kinds; the file kinds are in damage_file.py."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from workbench.damage_file import file_damage
from workbench.damage_spec import CACHE_TABLES, COLUMN_KINDS, FILE_KINDS, Damage, Spec, columns
from workbench.damage_values import Invalid, bitflip, retype, short, truncate


def apply_damage(db: Path, spec: Spec, info: dict) -> Damage:
    """Damage the file `db` (a copy of the pristine one) as `spec` says; deterministic in the seed."""
    rng = random.Random(spec.seed)
    if spec.kind in FILE_KINDS:
        return file_damage(db, spec, rng, info)
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
        _write(con, table, column, rowid, -(1 << 62) if rowid_alias else Invalid(b"\x00swap"))
        _write(con, table, column, other, old)
        _write(con, table, column, rowid, value)
        if rowid_alias:
            rowid = value
        return _made(spec, f"swapped {table}.{column} of rows {rowid} and {other}", names, column)
    for _ in range(20):  # a value a unique column already holds is drawn again
        if spec.kind == "null":
            new = None if not rowid_alias else _free_rowid(con, table)
        elif spec.kind == "bitflip":
            new = bitflip(old, rng)
        elif spec.kind == "truncate":
            new = truncate(old, rng)
        else:
            new = retype(old, decl, rng) if not rowid_alias else -old
        if _write(con, table, column, rowid, new):
            break
    else:
        return _made(spec, f"{spec.kind}: {table}.{column} of row {rowid}: every value drawn collides", names,
                     column)
    shown = repr(new if not isinstance(new, bytes) or len(new) < 40 else new[:40] + b"...")
    return _made(spec, f"{spec.kind}: {table}.{column} of row {rowid}: {short(old)} -> {shown}", names, column)


def _free_rowid(con, table: str) -> int:
    # an INTEGER PRIMARY KEY set to NULL takes the next rowid, as an insert would
    return con.execute(f'SELECT coalesce(max(rowid), 0) + 1 FROM "{table}"').fetchone()[0]


def _pick_names(con, table: str, rowid: int) -> list:
    (name,) = con.execute(f'SELECT "{_key(table)}" FROM "{table}" WHERE rowid = ?', [rowid]).fetchone()
    return [name, str(name)[:8]]


def _key(table: str) -> str:
    return "fingerprint" if table == "models" else "key" if table == "segments" else "id"


def _write(con, table: str, column: str, rowid: int, value) -> bool:
    """Set one value (False when a unique column holds it already); a NOT NULL that a damaged page
    would not honour is lifted around the write."""
    sql = f'UPDATE "{table}" SET "{column}" = {"CAST(? AS TEXT)" if isinstance(value, Invalid) else "?"} ' \
          "WHERE rowid = ?"
    arg = bytes(value) if isinstance(value, Invalid) else value
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
