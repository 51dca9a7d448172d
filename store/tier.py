"""DiskTier: the lowest tier of the prefix cache. It implements the engine's `LowerTier`
protocol (engine/cache/prefix_cache.py) with plain values, so store/ imports nothing of engine/:
a piece is (per_segment, data, position), data a tensor, a tuple of tensors, or None; a failure
is a `Miss` (kind, detail).

    save(...)            every piece's tensors packed by state kind and dtype (codec.py), blobs and
                         the segment row written in one transaction: visible only after commit,
                         never half
    load(key, deadline)  row -> layout fingerprint -> each blob: stored length, checksum over blob
                         and identity, decode (header, declared size, zstd checksum) -> pieces,
                         or (None, Miss): the cache then recomputes that range

A disk hit is only a logical hit until `load` returns pieces.
"""

from __future__ import annotations

import collections
import functools
import json
import sqlite3
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import sqlite_utils

from store.codec import BlobError, checksum, decode_many, encode_pack
from store.db import now, open_db


@dataclass(frozen=True)
class Miss:
    """Why the tier cannot deliver or keep a segment: `kind` is what it is counted by (missing,
    fingerprint, checksum, length, decode, timeout, io, unexpected, save), `detail` what exactly;
    str() is "kind: detail". The engine's LowerTier protocol reads only those (its own
    engine/cache/miss.py has the same shape: store/ imports nothing of engine/)."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class DiskMiss(Exception):
    """Raised inside a read: the segment cannot be delivered, for the reason `miss`."""

    def __init__(self, kind: str, detail: str):
        self.miss = Miss(kind, detail)
        super().__init__(str(self.miss))


def _identity(key: str, layer: int, kind: str, part: int, per_segment: int, position: int) -> bytes:
    """What a blob is, hashed together with its bytes: moved, relabelled or re-positioned, it fails."""
    return key.encode() + struct.pack("<iIBq", layer, part, per_segment, position) + kind.encode()


def _pack_identity(key: str, kind: str, members: str) -> bytes:
    return key.encode() + b"|pack|" + kind.encode() + b"|" + members.encode()


PACK_CODEC = "hcwp1+zstd"
# a layout fingerprint of this many bytes begins with the model's identity (store/ imports nothing of
# engine/: engine/cache/prefix_cache.py's layout_fingerprint, IDENTITY_BYTES)
LAYOUT_BYTES, IDENTITY_BYTES = 32, 16


@functools.lru_cache(maxsize=256)
def _recorded(presence: str) -> tuple[tuple[int, str, int], ...]:
    """A segment's presence column as (layer, kind, part count): segments of one layout share a
    handful of these, so each is parsed once."""
    out = []
    for name, count in json.loads(presence).items():
        layer, kind = name.split(":", 1)
        out.append((int(layer), kind, count))
    return tuple(out)


def _value(kind: str, raw: bytes | None):
    """A value read as (typeof, CAST AS BLOB) as sqlite3 would give it, but text that is not UTF-8
    as its bytes."""
    if kind == "text":
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return raw
    if kind == "integer":
        return int(raw)
    if kind == "real":
        return float(raw)
    return raw  # a blob, or None


def _presence(raw) -> dict[str, int] | None:
    """A stored presence column (text or its bytes) as {"layer:kind": parts}, or None when it is
    not one (damaged)."""
    try:
        presence = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(presence, dict):
        return None
    for name, count in presence.items():
        layer, sep, kind = name.partition(":")
        if not (sep and kind and layer.isdigit() and type(count) is int and count >= 0):
            return None
    return presence


class SegmentRow(NamedTuple):
    """A segments row as a read takes it (`DiskTier._SEGMENT`'s columns after the key)."""

    layout: str
    tokens: bytes
    digest: str
    presence: str


class BlobRow(NamedTuple):
    """A blobs row as a read takes it (`DiskTier._BLOBS`'s columns after the segment)."""

    layer: int
    kind: str
    part: int
    per_segment: int
    position: int
    length: int
    checksum: bytes
    data: bytes
    codec: str
    members: str | None


class DiskTier:
    def __init__(self, path: str | Path | None = None, layout: bytes = b""):
        self.db: sqlite_utils.Database = open_db(path)
        self.path = Path(self.db.conn.execute("PRAGMA database_list").fetchone()[2])
        self.layout = layout.hex()
        self.saved = 0
        self.failures: dict[str, int] = {}
        self.read_hook = None  # fault-injection seam: called with the key before each read

    def register_model(self, fingerprint: bytes, config: dict) -> None:
        self.db["models"].upsert({"fingerprint": fingerprint.hex(), "config": json.dumps(config, default=str),
                                  "created": now()}, pk="fingerprint")

    def flush(self) -> bool:
        return True  # the LowerTier protocol: every save is written when it returns

    def take_failures(self) -> list[tuple[bytes, Miss]]:
        return []  # a save reports its own failure

    def has(self, key: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM segments WHERE key = ?", [key.hex()]).fetchone() is not None

    def save(self, key_b: bytes, parent: bytes, index: int, tokens: bytes, layout: bytes,
             pieces: dict[tuple[int, str], tuple[bool, object, int]]) -> tuple[bool, Miss | None]:
        """Merge `pieces` into the segment's row (kinds not given keep what is stored):
        (True, None) or (False, why); nothing is half-written either way."""
        try:
            self._save(key_b.hex(), parent, index, tokens, layout, pieces)
        except (sqlite3.Error, OSError, BlobError, ValueError) as e:
            self.failures["save"] = self.failures.get("save", 0) + 1
            return False, Miss("save", f"{type(e).__name__}: {e}")
        self.saved += 1
        return True, None

    def _save(self, key: str, parent: bytes, index: int, tokens: bytes, layout: bytes, pieces: dict) -> None:
        counts = {}
        members: dict[tuple[str, str], list[tuple[list, object]]] = collections.defaultdict(list)
        for (layer, kind), (per_segment, data, position) in sorted(pieces.items()):
            items = data if isinstance(data, tuple) else (data,)
            counts[f"{layer}:{kind}"] = len(items)
            for part, t in enumerate(items):
                if t is None:
                    raise ValueError(f"piece {layer}:{kind} part {part} is None")
                members[(kind, str(t.dtype))].append(([layer, part, int(per_segment), position], t))
        if not members:
            raise ValueError("a segment with no pieces")
        conn = self.db.conn
        # one transaction, in plain SQL: sqlite-utils' own helpers commit on their way out, which
        # would let the row become visible before its blobs
        with conn:
            # (as bytes: damaged text that is not UTF-8 must not fail the save that replaces it)
            old = conn.execute("SELECT CAST(presence AS BLOB), layout FROM segments WHERE key = ?", [key]).fetchone()
            presence = _presence(old[0]) if old else {}
            # a damaged row is replaced whole, or it would fail every save and load; so is one of
            # another layout (the same model's segment under another weights format): none of its
            # pieces belong with this save's
            if presence is None or (old and old[1] != layout.hex()):
                conn.execute("DELETE FROM blobs WHERE segment = ?", [key])
                presence = {}
            kinds = sorted({kind for kind, _ in members})
            # a kind given replaces what is stored of it; its layers not given are kept (re-packed)
            for kind, member, t in self._kept(key, kinds, counts, presence):
                members[(kind, str(t.dtype))].append((member, t))
            conn.executemany("DELETE FROM blobs WHERE segment = ? AND kind = ?", [[key, k] for k in kinds])
            rows = []
            for (kind, _), group in sorted(members.items()):
                group.sort(key=lambda m: m[0][:2])
                names = json.dumps([m for m, _ in group])
                blob = encode_pack([t for _, t in group])
                part = sum(r[2] == kind for r in rows)  # a kind's packs of different dtypes: 0, 1, ..
                rows.append([key, -1, kind, part, -1, -1, 0, PACK_CODEC,
                             sum(t.numel() * t.element_size() for _, t in group), len(blob),
                             checksum(blob, prefix=_pack_identity(key, kind, names)), blob, names])
            kept = {f"{m[0]}:{kind}" for (kind, _), group in members.items() for m, _ in group}
            presence = {k: v for k, v in presence.items() if k.split(":", 1)[1] not in kinds or k in kept}
            presence.update(counts)
            stored = conn.execute("SELECT coalesce(sum(length), 0) FROM blobs WHERE segment = ?", [key]).fetchone()[0]
            segment = {"key": key, "parent": parent.hex(), "idx": index, "layout": layout.hex(), "tokens": tokens,
                       "token_digest": checksum(tokens).hex(), "presence": json.dumps(presence, sort_keys=True),
                       "bytes": stored + sum(r[9] for r in rows), "created": now()}
            conn.execute(f"INSERT OR REPLACE INTO segments ({', '.join(segment)}) "
                         f"VALUES ({', '.join('?' * len(segment))})", list(segment.values()))
            conn.executemany("INSERT INTO blobs (segment, layer, kind, part, per_segment, position, is_none, codec, "
                             "raw_len, length, checksum, data, members) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             rows)

    def _kept(self, key: str, kinds: list[str], counts: dict[str, int],
              presence: dict[str, int]) -> list[tuple[str, list, object]]:
        """(kind, member, tensor) of the stored layers of `kinds` that this save (`counts`: what
        it gives) does not replace. Each kind is read on its own; one that no longer verifies is
        dropped (it would be a miss anyway)."""
        out = []
        for kind in kinds:
            if all(name in counts for name in presence if name.split(":", 1)[1] == kind):
                continue  # every stored layer of this kind is replaced: nothing to read
            pieces, _ = self._guarded(lambda kind=kind: self._load(key, None, [kind]))
            for (layer, _kind), (per_segment, data, position) in (pieces or {}).items():
                if f"{layer}:{kind}" in counts:
                    continue
                for part, t in enumerate(data if isinstance(data, tuple) else (data,)):
                    out.append((kind, [layer, part, int(per_segment), position], t))
        return out

    def segments(self) -> list[dict]:
        """Rows of this layout, parents before children, each with its key, parent, idx, tokens and
        layout. A layout of 32 bytes is the model's identity and its weights' format (the cache's
        `layout_fingerprint`): rows of the same identity under another format are listed too, for
        the cache to refuse by name (`load` never delivers them). Each value is read with its
        storage class, so a damaged row's text that is not UTF-8 comes back as bytes (for the
        cache to name as damage) instead of an error that fails every row."""
        cols = ("key", "parent", "idx", "tokens", "layout")
        read = ", ".join(f"typeof({c}), CAST({c} AS BLOB)" for c in cols)
        if len(self.layout) == 2 * LAYOUT_BYTES:
            # GLOB with a constant prefix reads the layout index
            rows = self.db.execute(f"SELECT {read} FROM segments WHERE layout GLOB ? AND length(layout) = ? "
                                   "ORDER BY idx", [self.layout[:2 * IDENTITY_BYTES] + "*", 2 * LAYOUT_BYTES])
        else:
            rows = self.db.execute(f"SELECT {read} FROM segments WHERE layout = ? ORDER BY idx", [self.layout])
        return [{c: _value(row[2 * i], row[2 * i + 1]) for i, c in enumerate(cols)} for row in rows.fetchall()]

    def load(self, key: bytes, deadline: float | None = None) -> tuple[dict | None, Miss | None]:
        """(pieces, None) or (None, why); every failure is counted by its kind."""
        return self._counted(self._guarded(lambda: self._load(key.hex(), deadline)))

    def _counted(self, result: tuple[dict | None, Miss | None]) -> tuple[dict | None, Miss | None]:
        if result[0] is None:
            kind = result[1].kind
            self.failures[kind] = self.failures.get(kind, 0) + 1
        return result

    @staticmethod
    def _guarded(step) -> tuple[object | None, Miss | None]:
        """A read step's value, or (None, why) for whatever it raised."""
        try:
            return step(), None
        except DiskMiss as e:
            return None, e.miss
        except (sqlite3.Error, OSError) as e:
            return None, Miss("io", str(e))
        except Exception as e:  # noqa: BLE001 - whatever else a damaged file provokes is a counted miss, not a crash
            return None, Miss("unexpected", f"{type(e).__name__}: {e}")

    _SEGMENT = "SELECT key, layout, tokens, token_digest, presence FROM segments WHERE key IN ({})"
    _BLOBS = ("SELECT segment, layer, kind, part, per_segment, position, length, checksum, data, codec, members "
              "FROM blobs WHERE segment IN ({})")

    def load_many(self, keys: list[bytes], deadline: float | None = None, batch: int = 32):
        """`load` of each key in order, yielded as (pieces, why); the rows of up to `batch` segments
        come from one query each for segments and blobs, which a resume of hundreds of segments
        otherwise pays twice per segment. Stop iterating at the first failure you will not use
        past: the rest of its batch was read, nothing more. The deadline is checked blob by blob
        after a batch is read, so a slow disk can overrun it by one batch."""
        for at in range(0, len(keys), batch):
            chunk = [k.hex() for k in keys[at:at + batch]]
            rows, _ = self._guarded(lambda chunk=chunk: self._rows(chunk))
            for key in chunk:
                if rows is None:  # one unreadable row fails the whole query: key by key, it costs only its own
                    yield self._counted(self._guarded(lambda key=key: self._load(key, deadline)))
                    continue
                yield self._counted(self._guarded(lambda key=key: self._decoded(key, rows.get(key), deadline, None)))

    def _rows(self, keys: list[str]) -> dict[str, tuple[SegmentRow, list[BlobRow]]]:
        """key -> (segment row, its blob rows) for the segments of `keys` that exist, both queries
        in one read transaction: a save committed between them cannot pair a segment row with
        another version's blobs. A blob whose segment row is absent is left out (the key is a miss)."""
        marks = ", ".join("?" * len(keys))
        conn = self.db.conn
        own = not conn.in_transaction  # (unless the caller already holds one)
        if own:
            conn.execute("BEGIN")
        try:
            out = {row[0]: (SegmentRow(*row[1:]), []) for row in conn.execute(self._SEGMENT.format(marks), keys)}
            for row in conn.execute(self._BLOBS.format(marks), keys):
                if row[0] in out:
                    out[row[0]][1].append(BlobRow(*row[1:]))
        finally:
            if own and conn.in_transaction:  # (SQLite may have ended it itself after an I/O error)
                conn.execute("ROLLBACK")  # it only read; this ends it after an error too
        return out

    def _load(self, key: str, deadline: float | None, kinds: list[str] | None = None) -> dict:
        return self._decoded(key, self._rows([key]).get(key), deadline, kinds)

    def _decoded(self, key: str, rows: tuple[SegmentRow, list[BlobRow]] | None, deadline: float | None, kinds: list[str] | None) -> dict:
        (presence, names, kinds), blobs = self._verified(key, rows, deadline, kinds)
        return self._assemble(presence, names, kinds, decode_many(blobs))

    def _verified(self, key: str, rows: tuple[SegmentRow, list[BlobRow]] | None, deadline: float | None, kinds: list[str] | None):
        """The segment row and its blobs, each verified (length, checksum over blob and identity)
        before anything is decompressed: ((presence, names, kinds), blobs)."""
        if self.read_hook is not None and kinds is None:
            self.read_hook(key)
        if rows is None:
            raise DiskMiss("missing", "no segment row")
        segment, blob_rows = rows
        if segment.layout != self.layout:
            raise DiskMiss("fingerprint", "written under another model or layout")
        if checksum(segment.tokens).hex() != segment.digest:
            raise DiskMiss("checksum", "token ids do not match their digest")
        presence = segment.presence
        names, blobs = [], []
        for layer, kind, part, per_segment, position, length, csum, data, codec, members in blob_rows:
            if kinds is not None and kind not in kinds:
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise DiskMiss("timeout", "the read deadline passed")
            if not isinstance(data, bytes) or len(data) != length:
                got = len(data) if isinstance(data, bytes) else type(data).__name__
                raise DiskMiss("length", f"blob {layer}:{kind}:{part} holds {got}, row says {length} bytes")
            if codec == PACK_CODEC:
                ident = _pack_identity(key, kind, members if isinstance(members, str) else "")
                try:
                    entries = json.loads(members)
                except (TypeError, ValueError):
                    raise DiskMiss("checksum", f"pack {kind}:{part} has unreadable members") from None
            else:  # a row written before packs: one tensor
                ident = _identity(key, layer, kind, part, per_segment, position)
                entries = [(layer, part, per_segment, position)]
            if checksum(data, prefix=ident) != csum:
                raise DiskMiss("checksum", f"blob {layer}:{kind}:{part}")
            names.append((kind, entries))
            blobs.append(data)
        return (presence, names, kinds), blobs

    @staticmethod
    def _assemble(presence: str, names: list, kinds: list[str] | None, decoded: list) -> dict:
        """Pieces from the decoded blobs (`names`: each blob's kind and members), checked against
        the segment's recorded presence: every recorded piece with all its parts, nothing stored
        twice, nothing unrecorded."""
        stored: dict[tuple[int, str, int], tuple] = {}
        members = 0
        for (kind, entries), value in zip(names, decoded):
            if isinstance(value, BlobError):
                raise DiskMiss("decode", f"blob {kind}: {value}")
            values = value if isinstance(value, list) else [value]
            if len(values) != len(entries):
                raise DiskMiss("decode", f"pack {kind} holds {len(values)} tensors for {len(entries)} members")
            members += len(entries)
            for (layer, part, per_segment, position), t in zip(entries, values):
                stored[layer, kind, part] = (t, per_segment, position)
        if len(stored) != members:
            raise DiskMiss("decode", "a piece's part is stored twice")
        pieces = {}
        for layer, kind, count in _recorded(presence):
            if kinds is not None and kind not in kinds:
                continue
            if count < 1:
                raise DiskMiss("missing", f"piece {layer}:{kind} is recorded with no parts")
            if count == 1:
                got = stored.pop((layer, kind, 0), None)
                if got is None:
                    raise DiskMiss("missing", f"piece {layer}:{kind}")
                pieces[layer, kind] = (bool(got[1]), got[0], got[2])
                continue
            parts = [stored.pop((layer, kind, part), None) for part in range(count)]
            if None in parts:
                raise DiskMiss("missing", f"piece {layer}:{kind} lacks a part")
            pieces[layer, kind] = (bool(parts[0][1]), tuple(p[0] for p in parts), parts[0][2])
        if stored:
            raise DiskMiss("missing", "the segment's blobs do not match its recorded pieces and parts")
        return pieces

    def close(self) -> None:
        self.db.conn.close()
