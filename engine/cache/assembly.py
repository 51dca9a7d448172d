"""Assembly: the records a plan reuses become the ModelState compute resumes from.

    restore(plan)  pin the records -> promote host ones -> each layer from its pieces, every piece
                   checked first (its stamped position; layer 4: parts, dtype, shape, device,
                   contiguity, alignment) -> `before_use` -> versions compared -> touch

Rule 3 (temporal consistency) lives here: the records stay pinned from the check to the use, and
a version that changed in between re-plans. A piece that fails a check is dropped from its
record, and so are a boundary's snapshots that pass every check but do not assemble; the caller
then re-plans without them. Under a Tail-Replay the GDN layers start fresh (from a sketch where
the plan seeds them) and V4-kind layers take only their per-segment pieces: the replay rebuilds
the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cache.gdn_state import GDNState, sketch, unsketch
from engine.cache.miss import Miss
from engine.cache.state_table import SegmentRecord, StateTable
from engine.cache.states import Kind, ModelState, Piece
from engine.cache.validation import OPTIONAL_KINDS, ReusePlan, check_buffer
from engine.metrics import CacheMetrics


class Assembler:
    """Builds a plan's prefix state from the table's records; `template` is a fresh state of the
    model and `template_pieces` its layers' empty pieces, the shapes every piece is held to;
    `new_state` makes a fresh state as the cache does (its page size)."""

    def __init__(self, model, table: StateTable, template: ModelState, template_pieces: list[dict[str, Piece]],
                 block_size: int, metrics: CacheMetrics, new_state: Callable[[], ModelState]):
        self.model = model
        self.new_state = new_state
        self.table = table
        self.template = template
        self.template_pieces = template_pieces
        self.block_size = block_size
        self.metrics = metrics

    def restore(self, plan: ReusePlan, before_use: Callable[[ReusePlan], None]) -> tuple[ModelState | None, str]:
        """Assemble the plan's prefix. Returns (None, reason) when the plan went stale (a record
        changed between check and use) or a piece failed a check; the caller re-plans."""
        if not plan.usable_tokens:
            return self.new_state(), ""
        keys = list(plan.keys)
        self.table.pin(keys)  # from here to the end of assembly nothing can evict them
        try:
            records = [self.table.get(k) for k in keys]
            for rec in records:
                self.table.promote(rec, self.model.device)
            versions = [r.version for r in records]
            layers, why = self._layers(plan, records)
            if layers is None:
                return None, why
            before_use(plan)
            # one comparison covers assembly and the seam before use: any change since the check re-plans
            if [r.version for r in records] != versions:
                self.metrics.validation_failures["temporal"] += 1
                return None, "a record changed between check and use"
            for r in records:
                self.table.touch(r)
            return ModelState(layers, plan.usable_tokens), ""
        finally:
            self.table.unpin(keys)

    def _layers(self, plan: ReusePlan, records: list[SegmentRecord]) -> tuple[list | None, str]:
        """Every layer's state at the plan's boundary, or (None, why) at the first that fails."""
        device = self.model.device  # (read once: a module attribute lookup per piece added up)
        fresh = self.new_state() if plan.replay_from is not None else None
        layers = []
        for i, template in enumerate(self.template.layers):
            if fresh is not None and Kind.RECURRENT in self.template_pieces[i]:
                layer, why = self._replayed_gdn(fresh.layers[i], i, plan, records, device)
            else:
                layer, why = self._assembled(template, i, plan, records, device)
            if layer is None:
                return None, why
            layers.append(layer)
        return layers, ""

    def _replayed_gdn(self, layer: GDNState, i: int, plan: ReusePlan, records: list[SegmentRecord],
                      device) -> tuple[GDNState | None, str]:
        """Layer i's fresh GDN state, for the replay to rebuild: its statistics continue the
        recorded ones (an exact replay from the start needs none: a record may lack them)."""
        decay = [r.pieces[(i, Kind.DECAY)].data for r in records] if all(
            (i, Kind.DECAY) in r.pieces for r in records) else None
        layer.resume_stats(plan.usable_tokens, decay)
        if i in plan.replay_seeded:
            bad = self._seed(layer, i, records[plan.replay_seed // self.block_size - 1], plan.replay_seed, device)
            if bad:
                return None, bad
        return layer, ""

    def _seed(self, layer: GDNState, i: int, rec: SegmentRecord, position: int, device) -> str | None:
        """Give layer i's fresh state the sketch `rec` holds of it to restart the replay from;
        the reason (the piece dropped, so the re-plan restarts from zero) when it cannot."""
        piece = rec.pieces.get((i, Kind.SKETCH))
        miss = Miss("layer 3", "is gone") if piece is None else \
            self._verify(piece, position, sketch(self.template.layers[i].recurrent), device)
        if miss is not None:
            self._drop(rec, i, Kind.SKETCH, miss)
            return f"{miss.kind}: layer {i} sketch {miss.detail}"
        layer.seed = unsketch(piece.data)
        return None

    def _assembled(self, template, i: int, plan: ReusePlan, records: list[SegmentRecord], device) -> tuple[object, str]:
        """Layer i assembled from its checked pieces (under a replay, the state the replay starts
        from), or (None, why)."""
        replayed = plan.replay_from is not None and hasattr(template, "for_replay")
        pieces, why = self._pieces(i, records, replayed, device)
        if pieces is None:
            return None, why
        pool = getattr(template, "pool", None)  # a paged layer's blocks: mapped, or copied in and counted
        copied = pool.copied if pool is not None else 0
        try:
            layer = (template.for_replay(plan.replay_from, plan.usable_tokens, pieces) if replayed
                     else template.assemble(plan.usable_tokens, pieces))
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            # pieces that passed each check but do not fit together: drop the boundary, re-plan
            self.table.drop(records[-1].key, lambda layer, k, p, li=i: layer == li and not p.per_segment)
            self.metrics.validation_failures["layer 4"] += 1
            return None, f"layer 4: layer {i} pieces do not assemble: {e}"
        # what the hit copied: every byte of a layer assembled into fresh tensors, a paged one's
        # copied blocks only
        self.metrics.bytes_copied += pool.copied - copied if pool is not None else layer.nbytes()
        return layer, ""

    def _pieces(self, i: int, records: list[SegmentRecord], replayed: bool, device) -> tuple[dict | None, str]:
        """Layer i's pieces by kind (a per-segment kind's as a list, in segment order), each
        checked; (None, why) for the first that fails, which is dropped from its record."""
        pieces = {}
        for kind, tp in self.template_pieces[i].items():
            if replayed and not tp.per_segment:
                continue  # a window, tail or overlap: the replay rebuilds it
            owners = records if tp.per_segment else records[-1:]
            if kind in OPTIONAL_KINDS and not all((i, kind) in r.pieces for r in owners):
                pieces[kind] = None
                continue
            for rec in owners:
                miss = self._verify(rec.pieces[(i, kind)], (rec.index + 1) * self.block_size, tp.data, device)
                if miss is not None:
                    # a piece compute cannot take is treated as absent: drop it and re-plan
                    self._drop(rec, i, kind, miss)
                    return None, f"{miss.kind}: layer {i} {kind}: {miss.detail}"
            datas = [r.pieces[(i, kind)].data for r in owners]
            pieces[kind] = datas if tp.per_segment else datas[0]
        return pieces, ""

    def _verify(self, piece: Piece, position: int, template_data, device: torch.device) -> Miss | None:
        """Why `piece` cannot be handed to compute as the state at `position`, by validation layer."""
        if piece.position != position:
            return Miss("layer 1", f"describes position {piece.position}, not {position}")
        bad = _check_parts(piece.data, template_data, device)
        return Miss("layer 4", bad) if bad else None

    def _drop(self, rec: SegmentRecord, i: int, kind: str, miss: Miss) -> None:
        self.table.drop(rec.key, lambda layer, k, p: (layer, k) == (i, kind))
        self.metrics.validation_failures[miss.kind] += 1


def _check_parts(data, template_data, device: torch.device) -> str | None:
    """Layer 4 over a piece's parts: as many as the template's, each a tensor that passes
    `check_buffer`."""
    tensors = data if isinstance(data, tuple) else (data,)
    likes = template_data if isinstance(template_data, tuple) else (template_data,)
    if len(tensors) != len(likes):
        return f"{len(tensors)} parts, the state has {len(likes)}"
    for t, like in zip(tensors, likes):
        if not isinstance(t, torch.Tensor):
            return f"a part is {type(t).__name__}, not a tensor"
        why = check_buffer(t, like, device)
        if why:
            return why
    return None
