"""PrefixCache: the one object the engine talks to for reuse.

    lookup(prompt)  PrefixIndex.match (logical hit) -> fetch what only the lower tier holds
                    -> Validator.plan (usable hit, ReusePlan) -> assemble a ModelState (assembly.py:
                    pins, layer-4 buffer checks, version check) -> event (`last_lookup`)
    writer(plan)    a per-request recorder (writer.py) that stores each segment the request crosses
                    and keeps checkpoints only where they will be wanted

Its settings are a CacheConfig (config.py). Every state it hands out is made in its own page size
(`new_state`): paged KV in the pools of block_pool.page_for(block_size), so its segments are whole
blocks it shares, whatever block size another cache on the same model has (block_pool.py).

Nothing here knows a model family: pieces are (layer, kind) -> states.Piece, and a missing kind
is routed by kind (recovery.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from typing import NamedTuple, Protocol

import numpy as np
import torch

from engine.cache.assembly import Assembler
from engine.cache.block_pool import page_for
from engine.cache.config import CacheConfig, Reuse
from engine.cache.kv import KVState, PagedKVState
from engine.cache.miss import Miss
from engine.cache.prefix_index import ROOT, PrefixIndex, token_bytes
from engine.cache.recovery import group_of
from engine.cache.rules import AdmissionControl, TopologyGuard, topology_fingerprint
from engine.cache.state_table import SegmentRecord, StateTable
from engine.cache.states import Kind, ModelState, Piece
from engine.cache.validation import OPTIONAL_KINDS, Requirement, ReusePlan, Validator
from engine.cache.writer import RequestWriter
from engine.events import CacheLookup
from engine.model.int8 import weights_format
from engine.model.weights_digest import tensors_digest
from engine.metrics import CacheMetrics

READ_AHEAD = 32  # segments a fetch asks the lower tier for at once (one query each for rows and blobs)
LAYOUT_VERSION = 2  # bump when a state piece's layout changes (2: GDN decay statistics)


IDENTITY_BYTES = 16  # a layout fingerprint's first part: the model's identity


def layout_fingerprint(model, cfg: CacheConfig) -> bytes:
    """Model + layout identity, 32 bytes in two parts:

        identity (16)  config, block size, layout version, arithmetic, and a digest of every byte
                       of the weights: the files' for a loaded model (`load_model` sets
                       `weights_digest`, cached per file), the tensors' for one built in memory
        format (16)    what the loader made of them in memory: the dtype and every tensor's name,
                       dtype and shape (int8 weights are int8 tensors and their scales)

    Segment keys chain the identity only (`layout_identity`), so the segments a lower tier holds
    of the same model under another weights format are still found, a logical hit, and validation
    layer 2 refuses them with that reason, instead of a miss that says nothing."""
    mc = model.config
    desc = {"layout_version": LAYOUT_VERSION, "block_size": cfg.block_size,
            "config": {k: v for k, v in asdict(mc).items() if k != "extra"}}
    if cfg.deterministic:
        desc["arithmetic"] = "one token a step"
    identity = hashlib.blake2b(json.dumps(desc, sort_keys=True, default=str).encode(), digest_size=IDENTITY_BYTES)
    weights = getattr(model, "weights_digest", None)
    identity.update(b"files:" + weights if weights is not None else b"tensors:" + tensors_digest(model))
    # and what the loader made of the files: a loader change that lays them out anew is another layout
    tensors = [[k, str(v.dtype), list(v.shape)] for k, v in sorted(model.state_dict().items())]
    fmt = hashlib.blake2b(json.dumps([str(model.dtype), tensors]).encode(), digest_size=16)
    return identity.digest() + fmt.digest()


def layout_identity(layout: bytes) -> bytes:
    """The model's identity in a layout fingerprint (what segment keys chain); a fingerprint of 16
    bytes (made before the format was a part of its own) is all identity."""
    return layout[:IDENTITY_BYTES]


def _parse_row(row: dict, block_size: int) -> tuple[bytes, bytes, int, list[int]] | str:
    """A lower tier's segment row as (key, parent, index, tokens), or why it is damaged."""
    key = row.get("key")
    name = key if isinstance(key, str) and len(key) < 80 else "(a row)"
    tokens, parent, idx = row.get("tokens"), row.get("parent"), row.get("idx")
    if not isinstance(tokens, bytes) or len(tokens) != 8 * block_size:
        size = f"{len(tokens)} bytes" if isinstance(tokens, bytes) else type(tokens).__name__
        return f"segment {name}: tokens are {size}, not {block_size} int64 ids"
    if type(idx) is not int or idx < 0:
        return f"segment {name}: its index {idx!r} is not a count"
    try:
        key_b, parent_b = bytes.fromhex(key), bytes.fromhex(parent)
    except (TypeError, ValueError):
        return f"segment {name}: its key or parent is not hex"
    if len(key_b) != 16 or len(parent_b) != 16:
        return f"segment {name}: its key or parent is not 128 bits"
    return key_b, parent_b, idx, np.frombuffer(tokens, dtype="<i8").tolist()


class LowerTier(Protocol):
    """A slower tier behind the table (store.tier.DiskTier, store.write_behind.WriteBehind,
    faults.MemoryTier). Plain values only: a piece is (per_segment, data, position); failures come
    back as values, (None, miss) or (False, miss), never as exceptions. A miss is a `Miss`
    (miss.py) or the tier's own of its shape (store/ imports nothing of engine/): the cache reads
    its `kind`, which it counts, and its str(), "kind: detail", which the event shows.

    The cache's obligations: it hands over pieces it will not change (the tier may keep them
    until written) and calls `flush` before it reports a turn saved; `take_failures` after a
    flush names the segments that did not reach the disk, which the cache then forgets."""

    def save(self, key: bytes, parent: bytes, index: int, tokens: bytes, layout: bytes,
             pieces: dict[tuple[int, str], tuple[bool, object, int]]) -> tuple[bool, Miss | None]:
        """Merge `pieces` into what the tier holds for the segment: (True, None) or (False, why)."""
    def load(self, key: bytes, deadline: float | None = None) -> tuple[dict | None, Miss | None]:
        """(pieces, None): one segment's pieces, verified; or (None, why), also when `deadline` passed."""
    def load_many(self, keys: list[bytes], deadline: float | None = None) -> Iterator[tuple[dict | None, Miss | None]]:
        """`load` of each key, in order, lazily: a tier may read them a query at a time."""
    def segments(self) -> list[dict]:
        """Every segment row as the tier holds it (key, parent, idx, tokens, layout in hex), damaged
        ones too; a row without its layout is refused at validation layer 2, never reused."""
    def flush(self) -> bool:
        """Wait until every save handed over is written; False if that is not possible."""
    def take_failures(self) -> list[tuple[bytes, Miss]]:
        """The saves that failed since the last call, once each: (key, why)."""


class SegmentView(NamedTuple):
    """One matched segment as `segments_of` reports it: `record` is None when memory no longer
    holds it (spilled to the lower tier, or gone); `persisted`: saved to the lower tier."""
    index: int
    key: bytes
    record: SegmentRecord | None
    persisted: bool


class PrefixCache:
    def __init__(self, model, config: CacheConfig | None = None, lower: LowerTier | None = None):
        self.config = config or CacheConfig()
        self.lower = lower
        self.persisted: dict[bytes, int] = {}  # key -> record version last saved to the lower tier
        # save() waits until the lower tier has written what it handed over (a chat's turn is on disk
        # when it ends); a server decoding other requests meanwhile hands over and goes on
        self.wait_for_disk = True
        self.model = model
        self.kv_page = page_for(self.config.block_size)  # a segment a whole block: saved and hit without a copy
        self.template = self.new_state()
        # the layout of the KV states it assembles (its model's when it was made); None: no full attention
        kinds = {type(s) for s in self.template.layers} & {KVState, PagedKVState}
        self.kv_layout = None if not kinds else "paged" if PagedKVState in kinds else "dense"
        self.layout = layout_fingerprint(model, self.config)
        self.index = PrefixIndex(self.config.block_size, layout_identity(self.layout))
        # segments the lower tier holds only under another layout of this model (another weights
        # format): key -> what differs; matched, then refused at validation layer 2, never fetched
        self.foreign: dict[bytes, str] = {}
        self.table = StateTable(self.config.budget_bytes, self.config.host_budget_bytes,
                                dict(self.config.group_budgets), group_of)
        self.table.on_evict = self._evicted
        self.template_pieces = [s.export(0, 0) for s in self.template.layers]
        reqs = [Requirement(i, kind, piece.per_segment)
                for i, pieces in enumerate(self.template_pieces) for kind, piece in pieces.items()
                if kind not in OPTIONAL_KINDS]
        # a replay first runs this many tokens before its earliest GDN restart: the conv states'
        # inputs, and (V4-kind layers) a window and the open compressor windows to rebuild
        warmup = max([p[Kind.CONV].data.shape[-1] for p in self.template_pieces if Kind.CONV in p]
                     + [blk.mixer.replay_warmup for blk in model.layers if hasattr(blk.mixer, "replay_warmup")])
        replay_cost = self.config.exact_replay_cost
        if replay_cost is None:  # a replay runs the layers up to the last GDN one: at least the rest is saved
            gdn = [i for i, pieces in enumerate(self.template_pieces) if Kind.RECURRENT in pieces]
            replay_cost = (max(gdn) + 1) / len(self.template_pieces) if gdn else 1.0
        self.validator = Validator(self.config.block_size, self.layout, reqs, self.config.replay_policy, warmup,
                                   replay_cost if self.config.exact_replay else None)
        self.metrics = CacheMetrics()
        self.assembler = Assembler(model, self.table, self.template, self.template_pieces, self.config.block_size,
                                   self.metrics, self.new_state)
        self.events: deque[CacheLookup] = deque(maxlen=1000)
        self.admission = AdmissionControl(self.config.max_pending_recoveries, self.config.recovery_budget_tokens)
        self.topology = topology_fingerprint(self.config.block_size, self.template_pieces)
        self.guard = TopologyGuard()
        if self.config.static:
            self.guard.freeze(self.topology)
        self._rng = random.Random(self.config.seed)
        if lower is not None:
            self._index_lower()

    def _evicted(self, rec) -> None:
        """Out of memory, a record is spilled to the lower tier (still matchable, fetched on use);
        without one it is forgotten."""
        node = self.index.nodes.get(rec.key)
        if self.lower is None or node is None or not rec.exact:  # approximate state never goes to disk
            self.index.remove(rec.key)
            return
        if self.persisted.get(rec.key) != rec.version and not self._save_record(rec, node):
            self.index.remove(rec.key)  # neither in memory nor on the lower tier: not a hit any more
            return
        self.metrics.spills += 1

    def _save_record(self, rec, node) -> bool:
        ok, why = self.lower.save(rec.key, node.parent, node.index, node.data, rec.layout,
                                  {k: (p.per_segment, p.data, p.position) for k, p in rec.pieces.items()})
        if ok:
            self.persisted[rec.key] = rec.version
            self.foreign.pop(rec.key, None)  # the lower tier's row is this layout's now
        else:
            self.metrics.lower_failures["save: " + why.kind] += 1
        return ok

    def _index_lower(self) -> None:
        """Make the lower tier's segments matchable: they are logical hits until fetched. A row
        that does not parse, or whose key is not its content's, is damaged: skipped, counted and
        named in `lower_damage`; its descendants (and any row whose parent the tier lacks) can
        then never be reached, so they are skipped too: every one of them is a miss, recomputed,
        and the rest of the file is used as before. A row of this model under another layout (a
        tier lists those too, with their `layout`) is matchable and `foreign`."""
        self.lower_damage: list[str] = []
        unreachable, own = 0, self.layout.hex()
        for row in self.lower.segments():
            parsed = _parse_row(row, self.config.block_size)
            if isinstance(parsed, str):
                self.lower_damage.append(parsed)
                continue
            key, parent, idx, tokens = parsed
            above = self.index.nodes.get(parent)
            if (idx == 0) != (parent == ROOT) or (idx > 0 and (above is None or above.index != idx - 1)):
                unreachable += 1  # under a damaged or missing segment, or at the wrong depth
                continue
            if self.index.hash_fn(parent, self.index.fingerprint, token_bytes(tokens)) != key:
                self.lower_damage.append(f"segment {key.hex()}: its key is not the hash of its parent and tokens")
                continue
            self.index.insert(parent, idx, tokens)
            if row.get("layout") != own:  # (a row that does not say its layout is never taken for ours)
                self.foreign[key] = (f"this model's, with its weights in another dtype or format (now "
                                     f"{weights_format(self.model)}); recomputed")
        if self.lower_damage:
            self.metrics.lower_failures["damaged row"] += len(self.lower_damage)
        if unreachable:
            self.metrics.lower_failures["unreachable row"] += unreachable

    def _fetch(self, segments, prompt_len: int, reasons: list[str]) -> None:
        """Bring matched segments that only the lower tier holds into the table, in order, until
        one fails or the deadline passes: what does not arrive verified is recomputed."""
        if self.lower is None:
            return
        deadline = time.monotonic() + self.config.lower_deadline_s + self.config.lower_deadline_per_token_s * prompt_len

        def missing(node) -> bool:  # (an approximate record does not hide the exact copy below from an exact lookup)
            held = self.table.get(node.key)
            return held is None or not (held.exact or self.config.reuse == Reuse.APPROXIMATE)

        ahead, unread = iter(()), set()  # results read ahead, in order; the keys not taken from them yet
        for i, node in enumerate(segments):
            if not missing(node):
                continue  # checked as it comes: a put below may have evicted it since
            if node.key in self.foreign:
                return  # held only under another layout: validation refuses it (layer 2)
            if node.key in unread:
                for key, result in ahead:  # results of keys that memory held after all are passed over
                    unread.discard(key)
                    if key == node.key:
                        break
                else:  # never another key's result under this one: read it alone
                    result = self.lower.load(node.key, deadline)
            elif unread:  # held when the batch was planned, evicted since by this fetch's own puts
                result = self.lower.load(node.key, deadline)
            else:
                keys = list(itertools.islice((n.key for n in segments[i:] if missing(n)), READ_AHEAD))
                loads = self.lower.load_many(keys, deadline)  # a query for many segments, where the tier can
                ahead, unread = zip(keys, loads), set(keys)
                _, result = next(ahead)
                unread.discard(node.key)
            pieces, why = result
            if pieces is None:
                reasons.append(f"lower tier: segment {node.index}: {why}; recomputed from there")
                self.metrics.lower_failures[why.kind] += 1
                return
            device = self.model.device
            rec = self.table.put(node.key, node.index, self.layout,
                                 {k: Piece(v[0], _to(v[1], device), v[2]) for k, v in pieces.items()})
            self.persisted[node.key] = rec.version
            self.metrics.lower_fetches += 1

    def save(self) -> int:
        """Write every record the lower tier lacks (or holds an older version of); returns count."""
        if self.lower is None:
            return 0
        n = 0
        for rec in list(self.table):
            node = self.index.nodes.get(rec.key)
            if node is None or not rec.exact or self.persisted.get(rec.key) == rec.version:
                continue
            n += self._save_record(rec, node)
        if self.wait_for_disk:
            self.lower.flush()  # what was answered is on disk before we return
        self._forget_failed_writes()
        return n

    def _forget_failed_writes(self) -> None:
        """Segments a write-behind tier failed to write are neither in memory nor on disk: not hits."""
        for key, why in self.lower.take_failures() if self.lower is not None else ():
            self.persisted.pop(key, None)
            self.metrics.lower_failures["save: " + why.kind] += 1
            if key not in self.table:
                self.index.remove(key)

    def set_policy(self, reuse: str, replay_budget: float | None = 0.05, replay_tolerance: float | None = None) -> None:
        """Change what the next lookups may take (exact / approximate with its budget and tolerance
        / off); what is recorded is untouched. Checked like a new CacheConfig."""
        self.config = replace(self.config, reuse=reuse, replay_budget=replay_budget, replay_tolerance=replay_tolerance)
        self.validator.policy = self.config.replay_policy

    def mark(self) -> dict[bytes, frozenset]:
        """What the cache holds now, per record the (layer, kind) of its pieces: for `rollback`."""
        return {rec.key: frozenset(rec.pieces) for rec in self.table}

    def rollback(self, mark: dict[bytes, frozenset]) -> int:
        """Back to `mark`: every record and index node added since is dropped, and so is every
        piece added since to a record that was there (an exact recompute from the start adds its
        checkpoints to the segments it passes). Returns the records dropped."""
        gone = {rec.key for rec in self.table if rec.key not in mark} | {k for k in self.index.nodes if k not in mark}
        for key in gone:
            self.table.remove(key)
            self.index.remove(key)
        for key, kept in mark.items():
            if key in self.table:
                self.table.drop(key, lambda layer, kind, piece, kept=kept: (layer, kind) not in kept)
        return len(gone)

    def should_shadow(self) -> bool:
        return self.config.shadow_fraction > 0 and self._rng.random() < self.config.shadow_fraction

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def new_state(self) -> ModelState:
        """A fresh state of its model (batch 1), paged KV in the pools of this cache's page: the
        states it hands out and Engine.new_state for its engine, so their pages are its segments."""
        return self.model.new_state(kv_page=self.kv_page)

    def lookup(self, tokens: Sequence[int]) -> tuple[ReusePlan, ModelState, int | None]:
        """(plan, assembled state, admission ticket to release when the request ends)."""
        step = self.table.tick()
        self._forget_failed_writes()
        abandoned: list[str] = []
        if not self.guard.check(self.topology):
            abandoned.append("rule 4: the cache topology differs from the captured one; running eager")
        for _attempt in range(3):
            match = self.index.match(tokens)
            if self.config.reuse == Reuse.OFF:
                match = match._replace(segments=[])
            self._fetch(match.segments[:(len(tokens) - 1) // self.block_size], len(tokens), abandoned)
            plan = self.validator.plan(len(tokens), match, self.table, self.foreign)
            state, why = self.assembler.restore(plan, self.before_use)
            if state is not None:
                break
            abandoned.append(why)
            self.metrics.replans += 1
        else:
            plan, state = self._cold_plan(tokens, match), self.new_state()
            abandoned.append("gave up reuse after repeated re-plans")
        ticket = self.admission.admit(plan)
        if ticket is None:
            abandoned.append(f"rule 1: admission cap ({len(self.admission.pending)} recoveries pending, "
                             f"budget {self.admission.recovery_budget_tokens} tokens); recomputing instead")
            plan, state = self._cold_plan(tokens, self.index.match(tokens)), self.new_state()
            ticket = self.admission.admit(plan)
        event = CacheLookup(step, plan, "; ".join(abandoned))
        self.events.append(event)
        self.metrics.record(event)
        return plan, state.track_statistics(), ticket

    @property
    def last_lookup(self) -> CacheLookup | None:
        """The event the latest lookup recorded (None before the first)."""
        return self.events[-1] if self.events else None

    def _cold_plan(self, tokens: Sequence[int], match) -> ReusePlan:
        """A plan that reuses nothing although `match` was a hit: it counts as degraded."""
        plan = self.validator.plan(len(tokens), match._replace(segments=[]), self.table)
        return replace(plan, granular_tokens=min(len(match.segments), (len(tokens) - 1) // self.block_size)
                       * self.block_size)

    def before_use(self, plan: ReusePlan) -> None:
        """Called after assembly, before the state is used; a seam for fault drills."""

    def forget(self, plan: ReusePlan) -> None:
        """Drop every segment `plan` reused, from the table and the index (a hit that disagreed
        with a cold prefill under shadow verification must not be reused again)."""
        for key in plan.keys:
            self.table.remove(key)
            self.index.remove(key)

    def segments_of(self, tokens: Sequence[int]) -> list[SegmentView]:
        """The cached segments of `tokens`' longest matched prefix, root first: what the workbench's
        segment table shows and what a fault drill damages. Touches nothing (no fetch, no access)."""
        return [SegmentView(node.index, node.key, self.table.get(node.key), node.key in self.persisted)
                for node in self.index.match(tokens).segments]

    def forget_memory(self) -> int:
        """Drop every record held in memory (the index and the lower tier keep theirs): the next
        hit must come from the lower tier. Returns how many were dropped."""
        keys = [rec.key for rec in self.table]
        for key in keys:
            self.table.remove(key)
        return len(keys)

    def writer(self, plan: ReusePlan, ticket: int | None = None) -> RequestWriter:
        return RequestWriter(self, plan, ticket)


def _to(data, device):
    if isinstance(data, tuple):
        return tuple(_to(t, device) for t in data)
    return data.to(device) if isinstance(data, torch.Tensor) else data
