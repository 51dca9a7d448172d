"""State table: per cached segment, which state pieces exist, their version and last use.

A record holds the segment's pieces per (layer, kind) (see `states.Piece`): per-segment slices
(KV, compressed entries, index keys) and boundary snapshots at the segment's end (GDN checkpoint,
SWA window, tails, overlaps). Presence is read off the pieces themselves, never kept twice.
Two tiers with a byte budget each: records live on the model's device; past the device budget
the least-recently-used are demoted to host memory, past the host budget (checked against the
memory psutil reports available) they are evicted. A pinned record is never moved or evicted.
Every change to a record's pieces (or tier) bumps its version, so a plan made before can tell.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections import Counter
from dataclasses import dataclass, field, replace

import psutil

from engine.cache.states import Piece

PieceKey = tuple[int, str]  # (layer, kind)


@dataclass(eq=False)
class SegmentRecord:
    key: bytes
    index: int
    layout: bytes  # layout fingerprint the pieces were written under
    pieces: dict[PieceKey, Piece] = field(default_factory=dict)
    version: int = 0
    tier: str = "device"
    written_step: int = 0
    last_access_step: int = 0
    pins: int = 0
    exact: bool = True  # False: written after an approximate (tail-replay) resume; never used by exact reuse

    def has(self, layer: int, kind: str) -> bool:
        return (layer, kind) in self.pieces

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.pieces.values())

    def drop(self, predicate) -> dict[PieceKey, Piece]:
        """Remove the pieces `predicate(layer, kind, piece)` selects; returns them."""
        doomed = {k: p for k, p in self.pieces.items() if predicate(k[0], k[1], p)}
        for k in doomed:
            del self.pieces[k]
        if doomed:
            self.version += 1
        return doomed


def _to(data, device):
    if data is None:
        return None
    if isinstance(data, tuple):
        return tuple(_to(t, device) for t in data)
    return data.to(device)


class StateTable:
    """Budgets: one per tier (device, host), and optionally one per cache group (e.g. "recurrent"
    checkpoints, "full_kv", "swa", "compressed", "indexer"; `group_of` maps a state kind to its
    group). Past a group's budget the least-recently-used unpinned records lose that group's
    pieces only; the validator then routes around what is gone."""

    def __init__(self, budget_bytes: int, host_budget_bytes: int = 0, group_budgets: dict[str, int] | None = None,
                 group_of=lambda kind: kind):
        if budget_bytes <= 0 or host_budget_bytes < 0:
            raise ValueError("the cache budget must be > 0 bytes (and the host budget >= 0)")
        available = psutil.virtual_memory().available
        if budget_bytes + host_budget_bytes > available:
            raise ValueError(f"cache budgets {budget_bytes + host_budget_bytes} B exceed the {available} B of "
                             "memory available")
        self.budget = budget_bytes
        self.host_budget = host_budget_bytes
        self.records: dict[bytes, SegmentRecord] = {}
        self.used = 0
        self.host_used = 0
        self.demotions = 0
        self.group_budgets = dict(group_budgets or {})
        self.group_of = group_of
        self.group_used: Counter = Counter()
        self.group_drops = 0
        self.step = 0
        self.evictions = 0
        self.on_evict = None  # called with each evicted record (spill it, or forget it in the index)

    def __contains__(self, key: bytes) -> bool:
        return key in self.records

    def get(self, key: bytes) -> SegmentRecord | None:
        return self.records.get(key)

    def tick(self) -> int:
        self.step += 1
        return self.step

    def touch(self, record: SegmentRecord) -> None:
        record.last_access_step = self.step

    def put(self, key: bytes, index: int, layout: bytes, pieces: dict[PieceKey, Piece],
            exact: bool = True) -> SegmentRecord:
        """Add pieces to the segment's record (creating it); existing pieces are kept. Exact and
        approximate pieces never mix: approximate ones are not added to an exact record, and exact
        ones replace an approximate record's."""
        rec = self.records.get(key)
        if rec is not None and rec.exact != exact:
            if not exact:
                self.touch(rec)
                return rec
            self.remove(key)
            rec = None
        if rec is None:
            rec = self.records[key] = SegmentRecord(key, index, layout, written_step=self.step, exact=exact)
        added = {k: p for k, p in pieces.items() if k not in rec.pieces}
        if added:
            if rec.tier == "host":
                added = {k: replace(p, data=_to(p.data, "cpu")) for k, p in added.items()}
            self._account(rec, added, +1)
            rec.pieces.update(added)
            rec.version += 1
        self.touch(rec)
        self.enforce_budget()
        return rec

    def _account(self, rec: SegmentRecord, pieces: dict[PieceKey, Piece], sign: int) -> None:
        by_kind: dict[str, int] = {}
        for (_, kind), p in pieces.items():
            by_kind[kind] = by_kind.get(kind, 0) + p.nbytes()
        total = sign * sum(by_kind.values())
        if rec.tier == "host":
            self.host_used += total
        else:
            self.used += total
        for kind, n in by_kind.items():
            self.group_used[self.group_of(kind)] += sign * n

    def drop(self, key: bytes, predicate) -> None:
        rec = self.records.get(key)
        if rec is not None:
            self._account(rec, rec.drop(predicate), -1)

    def remove(self, key: bytes) -> SegmentRecord | None:
        rec = self.records.pop(key, None)
        if rec is not None:
            self._account(rec, rec.pieces, -1)
        return rec

    def promote(self, rec: SegmentRecord, device) -> None:
        """Bring a host-tier record back to the device before its pieces are used."""
        if rec.tier != "host":
            return
        rec.pieces = {k: replace(p, data=_to(p.data, device)) for k, p in rec.pieces.items()}
        rec.tier = "device"
        rec.version += 1
        size = rec.nbytes()
        self.host_used -= size
        self.used += size

    def _demote(self, rec: SegmentRecord) -> None:
        rec.pieces = {k: replace(p, data=_to(p.data, "cpu")) for k, p in rec.pieces.items()}
        rec.tier = "host"
        rec.version += 1
        size = rec.nbytes()
        self.used -= size
        self.host_used += size
        self.demotions += 1

    def set_budget(self, budget_bytes: int) -> list[bytes]:
        self.budget = budget_bytes
        return self.enforce_budget()

    def enforce_budget(self) -> list[bytes]:
        """Trim over-budget groups, then demote unpinned device records to host, then evict
        unpinned host records, least recently used first, until every budget holds."""
        self._enforce_groups()
        evicted = []
        if self.used <= self.budget and self.host_used <= self.host_budget:
            return evicted
        for rec in sorted(self.records.values(), key=lambda r: r.last_access_step):
            if self.used <= self.budget or not self.host_budget:  # no host tier: evict directly
                break
            if not rec.pins and rec.tier == "device":
                self._demote(rec)
        for rec in sorted(self.records.values(), key=lambda r: r.last_access_step):
            if self.host_used <= self.host_budget and self.used <= self.budget:
                break
            if rec.pins or (rec.tier == "device" and self.used <= self.budget):
                continue
            self.remove(rec.key)
            evicted.append(rec.key)
            if self.on_evict is not None:
                self.on_evict(rec)
        self.evictions += len(evicted)
        return evicted

    def _enforce_groups(self) -> None:
        for group, limit in self.group_budgets.items():
            if self.group_used[group] <= limit:
                continue
            for rec in sorted(self.records.values(), key=lambda r: r.last_access_step):
                if self.group_used[group] <= limit:
                    break
                if rec.pins:
                    continue
                before = len(rec.pieces)
                self.drop(rec.key, lambda layer, kind, p, g=group: self.group_of(kind) == g)
                self.group_drops += before - len(rec.pieces)

    def pin(self, keys: list[bytes]) -> None:
        for k in keys:
            self.records[k].pins += 1

    def unpin(self, keys: list[bytes]) -> None:
        for k in keys:
            rec = self.records.get(k)
            if rec is not None:
                rec.pins -= 1

    def __iter__(self) -> Iterator[SegmentRecord]:
        return iter(self.records.values())
