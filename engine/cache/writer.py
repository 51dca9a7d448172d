"""RequestWriter: one request's recorder. At every segment boundary the engine crosses it stores
each layer's pieces (through the state interface only); at the request's end it keeps boundary
snapshots (checkpoints) only every K segments, at the request end, at the branch point and, for a
long prompt, at its last boundaries, and drops the rest it wrote."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.cache.config import Reuse
from engine.cache.gdn_state import GDNState
from engine.cache.kv import PagedKVState
from engine.cache.prefix_index import ROOT
from engine.cache.states import Kind, ModelState, Piece
from engine.cache.validation import ReusePlan

if TYPE_CHECKING:
    from engine.cache.prefix_cache import PrefixCache


class RequestWriter:
    """Records one request's segments as the engine crosses their boundaries."""

    def __init__(self, cache: PrefixCache, plan: ReusePlan, ticket: int | None = None):
        self.cache = cache
        self.ticket = ticket
        self.parent = plan.keys[-1] if plan.keys else ROOT
        self.next_index = plan.usable_tokens // cache.block_size
        self.prompt_end = plan.prompt_tokens // cache.block_size * cache.block_size
        self.first: bytes | None = None  # the branch point: the first boundary whose snapshots we added
        self.prompt_end_key: bytes | None = None  # the prompt's last whole segment: resent prompts resume here
        # (key, segment index, the snapshot pieces we added there): finish drops only what this
        # request added, never a checkpoint another request kept at the same boundary
        self.captured: list[tuple[bytes, int, frozenset]] = []
        self.exact = plan.exact  # what follows an approximate resume is approximate too
        self.replayed: bytes | None = None  # the boundary an exact replay ended at, kept as a checkpoint
        # the dense tail before the prompt's end, for a request with a long prompt part only
        cfg = cache.config
        self.tail = cfg.checkpoint_tail if self.prompt_end - plan.usable_tokens >= cfg.checkpoint_tail_min else 0
        self.sketch_every = cfg.sketch_every if self.exact else 0  # (a sketch of an approximate state: no)
        self.branch_asked = False  # the branch point's stop was given (`stops`)

    def stops(self, seq_len: int, end: int) -> list[int]:
        """The boundaries in (seq_len, end] whose snapshots this request will keep, in order: the
        branch point (the first boundary it crosses), every K-th segment, each of the last
        `checkpoint_tail` boundaries before the prompt's end (when this request computes at least
        `checkpoint_tail_min` prompt tokens), and that end. The engine captures each: inside a
        forward pass where the state can keep snapshots there (ModelState.mark), else by ending a
        chunk at it; segments in between get their per-segment pieces at the next stop."""
        out = []
        while (stop := self._next_stop(seq_len)) <= end:
            out.append(stop)
            self.branch_asked = True
            seq_len = stop
        return out

    def _next_stop(self, seq_len: int) -> int:
        cfg = self.cache.config
        b, every = self.cache.block_size, cfg.checkpoint_every
        nxt = (seq_len // b + 1) * b
        stops = [(seq_len // (b * every) + 1) * b * every]
        if self.sketch_every:
            stops.append((seq_len // (b * self.sketch_every) + 1) * b * self.sketch_every)
        if not self.branch_asked and cfg.checkpoint_branch_point:
            stops.append(nxt)
        if self.prompt_end > seq_len:
            stops.append(self.prompt_end)
            if self.tail:
                stops.append(max(nxt, self.prompt_end - self.tail * b))
        return min(stops)

    def capture(self, state: ModelState, tokens: Sequence[int], at: int | None = None) -> None:
        """Register every whole segment up to `at` (default state.seq_len; a multiple of the block
        size, and a position the last forward pass kept snapshots at when below seq_len): each
        with its per-segment pieces, the last one also with the state's snapshots there."""
        self.capture_stops(state, tokens, [state.seq_len if at is None else at])

    def capture_stops(self, state: ModelState, tokens: Sequence[int], stops: Sequence[int]) -> None:
        """Register every whole segment up to the last of `stops` (ascending multiples of the block
        size: the state's seq_len, or positions the last forward pass kept snapshots at), each with
        its per-segment pieces and, at each stop, the state's snapshots there. One call for all
        the boundaries a forward pass crossed: each layer exports the run of segments at once
        (GDN's decay statistics in a few tensor ops, not a few per segment)."""
        if self.cache.config.reuse == Reuse.OFF or self.next_index < 0 or not stops:
            return
        b = self.cache.block_size
        first, last = self.next_index, stops[-1] // b - 1
        keys = []
        for j in range(first, last + 1):
            node = self.cache.index.insert(self.parent, j, tokens[j * b:(j + 1) * b])
            if node is None:  # collision: the chain stops here for this request
                self.next_index = -1
                break
            self.next_index = j + 1
            self.parent = node.key
            if (j + 1) * b == self.prompt_end:
                self.prompt_end_key = node.key
            keys.append(node.key)
        if not keys:
            return
        bounds = [(j * b, (j + 1) * b) for j in range(first, first + len(keys))]
        at = {p // b - 1 for p in stops}
        snaps = [j in at for j in range(first, first + len(keys))]
        sketches = [s and bool(self.sketch_every) and (j + 1) % self.sketch_every == 0
                    for j, s in zip(range(first, first + len(keys)), snaps)]
        exported = [_export(layer, bounds, snaps, sketches) for layer in state.layers]
        for n, (key, (lo, hi)) in enumerate(zip(keys, bounds)):
            j = lo // b
            before = self.cache.table.get(key)
            had = set(before.pieces) if before is not None else set()
            # (stamped with the position they describe; GDN and paged KV pieces come stamped)
            pieces = {(i, kind): piece if piece.position == hi else Piece(piece.per_segment, piece.data, hi)
                      for i, layer_pieces in enumerate(exported) for kind, piece in layer_pieces[n].items()}
            self.cache.table.put(key, j, self.cache.layout, pieces, exact=self.exact)
            added = frozenset(k for k, p in pieces.items() if not p.per_segment and k not in had)
            if added:
                self.captured.append((key, j, added))
                if self.first is None:
                    self.first = key

    def capture_replayed(self, state: ModelState) -> None:
        """After an exact replay over the usable prefix (state.seq_len, a boundary): that boundary's
        record keeps the rebuilt GDN snapshots, so the next request resuming there replays nothing."""
        if self.cache.config.reuse == Reuse.OFF or not self.exact or self.parent == ROOT:
            return
        b = self.cache.block_size
        j = state.seq_len // b - 1
        pieces = {(i, kind): Piece(piece.per_segment, piece.data, (j + 1) * b) for i, layer in enumerate(state.layers)
                  for kind, piece in layer.export(j * b, (j + 1) * b, snapshots=True).items() if not piece.per_segment}
        self.cache.table.put(self.parent, j, self.cache.layout, pieces, exact=True)
        self.replayed = self.parent

    def finish(self) -> None:
        """Keep boundary snapshots only every K segments, at the request end, at the branch point
        (the first boundary this request wrote) and, for a long prompt part, at the last
        `checkpoint_tail` boundaries before the prompt's end (so an edit near it, a new question
        after a document, replays at most one segment); drop the others it wrote."""
        if self.ticket is not None:
            self.cache.admission.release(self.ticket)
            self.ticket = None
        if not self.captured:
            self.cache.save()
            return
        cfg = self.cache.config
        every = cfg.checkpoint_every
        keep = {self.replayed} if self.replayed is not None else set()
        if cfg.checkpoint_branch_point and self.first is not None:
            keep.add(self.first)
        if cfg.checkpoint_request_end:
            keep.add(self.captured[-1][0])
            if self.prompt_end_key is not None:
                keep.add(self.prompt_end_key)
        tail_from = self.prompt_end - self.tail * self.cache.block_size
        for key, j, added in self.captured:
            end = (j + 1) * self.cache.block_size
            if not (key in keep or (j + 1) % every == 0 or (self.tail and tail_from <= end < self.prompt_end)):
                self.cache.table.drop(key, lambda layer, kind, piece: (layer, kind) in added and kind != Kind.SKETCH)
            # a sketch beside an exact checkpoint (ours or another request's) would never be read
            rec = self.cache.table.get(key) if cfg.sketch_every else None
            if rec is not None:
                exact = {layer for (layer, kind) in rec.pieces if kind == Kind.RECURRENT}
                self.cache.table.drop(key, lambda layer, kind, piece: kind == Kind.SKETCH and layer in exact)
        # the end of every turn: what was answered is on the lower tier before the next one
        self.cache.save()


def _export(layer, bounds: list[tuple[int, int]], snapshots: list[bool], sketches: list[bool]) -> list[dict]:
    """A layer's pieces for consecutive segments `bounds`, with its snapshots where `snapshots`:
    in one call where the state exports a run at once (GDN, paged KV)."""
    if isinstance(layer, (GDNState, PagedKVState)):
        return layer.export_segments(bounds, snapshots, sketches)
    return [layer.export(lo, hi, snapshots=s) for (lo, hi), s in zip(bounds, snapshots)]
