"""Write-behind in front of a DiskTier: saves are queued and written by a background thread on its
own SQLite connection, so a spill never blocks the prefill or decode that caused it.

A queued segment stays readable: `load` serves it from the queue, merged over what the disk
already holds of it (the pieces the segment will hold once written). `flush()` waits until the
queue is empty — the end of every turn calls it (through PrefixCache.save), so a killed process
loses nothing already answered. A background write that fails is reported once by
`take_failures()`; the cache then forgets that segment (it is neither in memory nor on disk any
more).
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

import torch

from store.tier import DiskTier, Miss


class WriteBehind:
    def __init__(self, path: str | Path | None = None, layout: bytes = b""):
        self.tier = DiskTier(path, layout)  # reads, on the caller's connection
        self._layout = layout
        self._cond = threading.Condition()
        self._pending: dict[bytes, tuple] = {}  # key -> save arguments, merged while queued
        self._order: deque[bytes] = deque()
        self._failures: list[tuple[bytes, Miss]] = []
        self._writing: tuple | None = None  # the save being written: still readable from here
        self._closed = False
        self.saved = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hcw-write-behind", daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def db(self):
        return self.tier.db

    @property
    def path(self) -> Path:
        return self.tier.path

    @property
    def layout(self) -> str:
        return self.tier.layout

    @property
    def failures(self) -> dict[str, int]:
        return self.tier.failures

    def has(self, key: bytes) -> bool:
        return self.tier.has(key)

    def register_model(self, fingerprint: bytes, config: dict) -> None:
        self.tier.register_model(fingerprint, config)

    @property
    def read_hook(self):  # the fault-injection seam of reads, on the caller's connection
        return self.tier.read_hook

    @read_hook.setter
    def read_hook(self, hook) -> None:
        self.tier.read_hook = hook

    def save(self, key: bytes, parent: bytes, index: int, tokens: bytes, layout: bytes,
             pieces: dict) -> tuple[bool, Miss | None]:
        # tensors of their own over the same storage, made on the caller's thread: the writer reads
        # these, never the cache's views, which a block pool may re-point (set_) when it moves
        pieces = {k: (p, _detached(d), pos) for k, (p, d, pos) in pieces.items()}
        with self._cond:
            if self._closed or not self._thread.is_alive():
                return False, Miss("io", "the write-behind writer is not running")
            if key in self._pending:
                old = self._pending[key]
                pieces = {**old[5], **pieces}
            else:
                self._order.append(key)
            self._pending[key] = (key, parent, index, tokens, layout, pieces)
            self._cond.notify_all()
        return True, None

    def load(self, key: bytes, deadline: float | None = None) -> tuple[dict | None, Miss | None]:
        queued = self._queued(key)
        if queued is not None:
            return self._merged(key, queued, deadline), None
        return self.tier.load(key, deadline)

    def load_many(self, keys: list[bytes], deadline: float | None = None):
        """`load` of each key in order: a queued one from the queue, each run of the others read
        from disk together (DiskTier.load_many)."""
        at = 0
        while at < len(keys):
            queued = self._queued(keys[at])
            if queued is not None:
                yield self._merged(keys[at], queued, deadline), None
                at += 1
                continue
            end = at + 1
            while end < len(keys) and self._queued(keys[end]) is None:
                end += 1
            yield from self.tier.load_many(keys[at:end], deadline)
            at = end

    def _merged(self, key: bytes, queued: tuple, deadline: float | None) -> dict:
        """What the segment will hold once its queued save is written: a save merges into the
        stored pieces (those it does not give are kept), so a read before the write must too."""
        stored = self.tier.load(key, deadline)[0] if self.tier.has(key) else None
        return {**(stored or {}), **queued[5]}

    def _queued(self, key: bytes) -> tuple | None:
        """The save arguments of `key` while it waits in the queue or is being written."""
        with self._cond:
            queued = self._pending.get(key)
            if queued is None and self._writing is not None and self._writing[0] == key:
                queued = self._writing
        return queued

    def segments(self) -> list[dict]:
        rows = self.tier.segments()
        with self._cond:
            known = {r["key"] for r in rows}
            queued = list(self._pending.values()) + ([self._writing] if self._writing is not None else [])
            rows += [{"key": a[0].hex(), "parent": a[1].hex(), "idx": a[2], "tokens": a[3], "layout": a[4].hex()}
                     for a in queued if a[0].hex() not in known]
        # a damaged row's idx may be NULL, text or a blob: after the others, in the order read (the
        # cache names it as damage; sorting it with the integers would raise)
        return sorted(rows, key=lambda r: (0, r["idx"]) if type(r["idx"]) is int else (1, 0))

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._pending) + (self._writing is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (True) or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: (not self._pending and self._writing is None)
                                       or not self._thread.is_alive(), timeout) and not self._pending

    def take_failures(self) -> list[tuple[bytes, Miss]]:
        with self._cond:
            out, self._failures = self._failures, []
        return out

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.tier.close()

    def _run(self) -> None:
        try:
            writer = DiskTier(self.tier.path, self._layout)  # its own connection: transactions never interleave
        finally:
            self._ready.set()  # (if opening failed the thread ends: saves then report that it is not running)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._order or self._closed)
                if not self._order:
                    break
                key = self._order.popleft()
                args = self._writing = self._pending.pop(key)
            try:
                ok, why = writer.save(*args)
            except Exception as e:  # noqa: BLE001 - whatever a save raises is a failed write, reported; the writer lives on
                ok, why = False, Miss("unexpected", f"{type(e).__name__}: {e}")
            args = None  # written: its tensors (and the pool blocks they hold) are let go now, not at the next save
            with self._cond:
                self._writing = None
                if ok:
                    self.saved += 1
                else:
                    self._failures.append((key, why))
                self._cond.notify_all()
        writer.close()


def _detached(data):
    """A tensor of its own over `data`'s storage, holding `data` itself: a block pool's view keeps its
    blocks held until it is collected (BlockPool.view), so while the save is queued the cache may
    evict the piece, but the pool cannot hand its blocks to a new sequence and overwrite them."""
    if isinstance(data, tuple):
        return tuple(_detached(t) for t in data)
    if not isinstance(data, torch.Tensor):
        return data
    own = data.detach()
    own._hcw_holds = data
    return own
