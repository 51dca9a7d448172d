"""DiskTier: the lowest tier of the prefix cache. It implements the engine's `LowerTier`
protocol (engine/cache/prefix_cache.py) with plain values, so store/ imports nothing of engine/:
a piece is (per_segment, data, position), data a tensor, a tuple of tensors, or None.

    save(...)            every piece's tensors encoded (codec.py), blobs and the segment row
                         written in one transaction: visible only after commit, never half
    load(key, deadline)  row -> layout fingerprint -> each blob: stored length, checksum over blob
                         and identity, decode (header, declared size, zstd checksum) -> pieces,
                         or (None, reason): the cache then recomputes that range

A disk hit is only a logical hit until `load` returns pieces.
"""

from __future__ import annotations

import json
import sqlite3
import struct
import time
from pathlib import Path

import sqlite_utils

from store.codec import BlobError, checksum, decode_many, encode
from store.db import now, open_db


class DiskMiss(Exception):
    """A segment the disk tier cannot deliver; the message is the reason."""


def _identity(key: str, layer: int, kind: str, part: int, per_segment: int, position: int) -> bytes:
    """What a blob is, hashed together with its bytes: moved, relabelled or re-positioned, it fails."""
    return key.encode() + struct.pack("<iIBq", layer, part, per_segment, position) + kind.encode()


class DiskTier:
    def __init__(self, path: str | Path | None = None, layout: bytes = b""):
        self.db: sqlite_utils.Database = open_db(path)
        self.path = Path(self.db.conn.execute("PRAGMA database_list").fetchone()[2])
        self.layout = layout.hex()
        self.saved = 0
        self.failures: dict[str, int] = {}
        self.read_hook = None  # fault-injection seam: called with the key before each read
        # zstd threads per segment load: 1 (measured: starting threads per segment of small blobs
        # costs more than it saves); 0 uses one per core
        self.decode_threads = 1

    def register_model(self, fingerprint: bytes, config: dict) -> None:
        self.db["models"].upsert({"fingerprint": fingerprint.hex(), "config": json.dumps(config, default=str),
                                  "created": now()}, pk="fingerprint")

    def has(self, key: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM segments WHERE key = ?", [key.hex()]).fetchone() is not None

    def save(self, key_b: bytes, parent: bytes, index: int, tokens: bytes, layout: bytes,
             pieces: dict[tuple[int, str], tuple[bool, object, int]]) -> tuple[bool, str]:
        """Merge `pieces` into the segment's row (kinds not given keep what is stored):
        (True, "") or (False, reason); nothing is half-written either way."""
        try:
            self._save(key_b.hex(), parent, index, tokens, layout, pieces)
        except (sqlite3.Error, OSError, BlobError, ValueError) as e:
            self.failures["save"] = self.failures.get("save", 0) + 1
            return False, f"save: {type(e).__name__}: {e}"
        self.saved += 1
        return True, ""

    def _save(self, key: str, parent: bytes, index: int, tokens: bytes, layout: bytes, pieces: dict) -> None:
        rows = []
        counts = {}
        for (layer, kind), (per_segment, data, position) in sorted(pieces.items()):
            items = data if isinstance(data, tuple) else (data,)
            counts[f"{layer}:{kind}"] = len(items)
            for part, t in enumerate(items):
                if t is None:
                    raise ValueError(f"piece {layer}:{kind} part {part} is None")
                blob = encode(t)
                ident = _identity(key, layer, kind, part, int(per_segment), position)
                rows.append({"segment": key, "layer": layer, "kind": kind, "part": part,
                             "per_segment": int(per_segment), "position": position, "is_none": 0,
                             "codec": "hcwb1+zstd", "raw_len": t.numel() * t.element_size(), "length": len(blob),
                             "checksum": checksum(blob, prefix=ident), "data": blob})
        if not rows:
            raise ValueError("a segment with no pieces")
        conn = self.db.conn
        # one transaction, in plain SQL: sqlite-utils' own helpers commit on their way out, which
        # would let the row become visible before its blobs
        with conn:
            old = conn.execute("SELECT presence, bytes FROM segments WHERE key = ?", [key]).fetchone()
            presence = json.loads(old[0]) if old else {}
            for name in counts:
                layer, kind = name.split(":", 1)
                conn.execute("DELETE FROM blobs WHERE segment = ? AND layer = ? AND kind = ?", [key, int(layer), kind])
            presence.update(counts)
            stored = conn.execute("SELECT coalesce(sum(length), 0) FROM blobs WHERE segment = ?", [key]).fetchone()[0]
            segment = {"key": key, "parent": parent.hex(), "idx": index, "layout": layout.hex(), "tokens": tokens,
                       "token_digest": checksum(tokens).hex(), "presence": json.dumps(presence, sort_keys=True),
                       "bytes": stored + sum(r["length"] for r in rows), "created": now()}
            conn.execute(f"INSERT OR REPLACE INTO segments ({', '.join(segment)}) "
                         f"VALUES ({', '.join('?' * len(segment))})", list(segment.values()))
            cols = list(rows[0])
            conn.executemany(f"INSERT INTO blobs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                             [[r[c] for c in cols] for r in rows])

    def segments(self) -> list[dict]:
        """Rows of this layout, parents before children."""
        return list(self.db.query("SELECT key, parent, idx, tokens FROM segments WHERE layout = ? ORDER BY idx",
                                  [self.layout]))

    def load(self, key: bytes, deadline: float | None = None) -> tuple[dict | None, str]:
        """(pieces, "") or (None, reason); every failure is counted by its kind."""
        try:
            return self._load(key.hex(), deadline), ""
        except DiskMiss as e:
            reason = str(e)
        except (sqlite3.Error, OSError) as e:
            reason = f"io: {e}"
        except Exception as e:  # noqa: BLE001 - whatever else a damaged file provokes is a counted miss, not a crash
            reason = f"unexpected: {type(e).__name__}: {e}"
        kind = reason.split(":", 1)[0]
        self.failures[kind] = self.failures.get(kind, 0) + 1
        return None, reason

    def _load(self, key: str, deadline: float | None) -> dict:
        if self.read_hook is not None:
            self.read_hook(key)
        row = self.db.execute("SELECT layout, tokens, token_digest, presence FROM segments WHERE key = ?",
                              [key]).fetchone()
        if row is None:
            raise DiskMiss("missing: no segment row")
        layout, tokens, digest, presence = row
        if layout != self.layout:
            raise DiskMiss("fingerprint: written under another model or layout")
        if checksum(tokens).hex() != digest:
            raise DiskMiss("checksum: token ids do not match their digest")
        parts: dict[tuple[int, str], dict[int, object]] = {}
        flags: dict[tuple[int, str], tuple[bool, int]] = {}
        names, blobs = [], []
        for layer, kind, part, per_segment, position, length, csum, data in self.db.execute(
                "SELECT layer, kind, part, per_segment, position, length, checksum, data FROM blobs "
                "WHERE segment = ?", [key]):
            if deadline is not None and time.monotonic() > deadline:
                raise DiskMiss("timeout: the read deadline passed")
            if not isinstance(data, bytes) or len(data) != length:
                got = len(data) if isinstance(data, bytes) else type(data).__name__
                raise DiskMiss(f"length: blob {layer}:{kind}:{part} holds {got}, row says {length} bytes")
            if checksum(data, prefix=_identity(key, layer, kind, part, per_segment, position)) != csum:
                raise DiskMiss(f"checksum: blob {layer}:{kind}:{part}")
            names.append((layer, kind, part))
            blobs.append(data)
            flags[(layer, kind)] = (bool(per_segment), position)
        # every blob verified: decompress them together (one call, not one per blob)
        for (layer, kind, part), value in zip(names, decode_many(blobs, self.decode_threads)):
            if isinstance(value, BlobError):
                raise DiskMiss(f"decode: blob {layer}:{kind}:{part}: {value}")
            parts.setdefault((layer, kind), {})[part] = value
        expected = json.loads(presence)
        found = {f"{layer}:{kind}": len(by_part) for (layer, kind), by_part in parts.items()}
        if found != expected:
            raise DiskMiss("missing: the segment's blobs do not match its recorded pieces and parts")
        pieces = {}
        for k, by_part in parts.items():
            if sorted(by_part) != list(range(len(by_part))):
                raise DiskMiss(f"missing: piece {k[0]}:{k[1]} lacks a part")
            values = [by_part[i] for i in range(len(by_part))]
            per_segment, position = flags[k]
            pieces[k] = (per_segment, values[0] if len(values) == 1 else tuple(values), position)
        return pieces

    def close(self) -> None:
        self.db.conn.close()
