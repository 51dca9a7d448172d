"""What a damage case is: the kinds of damage, the tables they hit, the outcomes a case can end
in (workbench/damage.py says what each means), `Spec` (a case to run), `Damage` (what was done),
and `schedule`, which draws the cases so that every kind on every column is covered."""

from __future__ import annotations

import random
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
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
