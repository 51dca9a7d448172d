"""DeepSeek-V4 attention's state: the sliding window, the compressor (compressed entries, the open
tail, the overlap) and the indexer's keys (V4AttnState holds one layer's).

Boundary snapshots inside a forward pass (the prefix cache's checkpoints, without ending a prefill
chunk there): `mark` names positions strictly inside the next pass; the model keeps, at each, the
window, tails and overlaps a pass ending there would leave, sliced from the projections the pass
computes anyway (engine/model/v4_attention.py), and `export` at such a position hands them over.
Compressed entries and index keys are slices by position: nothing to keep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.cache.states import COMPRESSOR_KINDS, Kind, Piece, StateObject, clone_tree, per_token, tensor_bytes



@dataclass
class WindowState:
    """Sliding window: the shared key/value vectors of the last W-1 positions, [B, n, D], n <= W-1."""

    kv: torch.Tensor
    end: int = 0  # the position after the newest stored entry
    # the positions the next forward pass keeps the window at (`mark`), and the windows kept there
    marks: tuple[int, ...] = ()
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def mark(self, positions: tuple[int, ...]) -> None:
        self.marks, self.kept = tuple(positions), {}

    @property
    def start(self) -> int:
        return self.end - self.kv.shape[1]

    def nbytes(self) -> int:
        return tensor_bytes(self.kv)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        return [per_token(layer, Kind.WINDOW, self.kv, self.start)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        if not snapshots:
            return {}
        # kept inside the last pass (nothing else holds or writes it: no copy), or the state's own
        kept = self.kept.get(hi)
        return {Kind.WINDOW: Piece(False, kept if kept is not None else self.kv.clone())}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> WindowState:
        return WindowState(pieces[Kind.WINDOW].clone(), seq_len)


@dataclass
class CompressedState:
    """A compressor's memory: closed windows as entries, the open window's raw projections (the
    uncompressed tail) and, for overlapping (CSA-style) compressors, the overlap slice of the last
    closed window that the next entry pools together with its own tokens."""

    rate: int  # m: tokens per window
    overlapping: bool  # CSA-style: entry i also pools the second half of window i-1
    entries: torch.Tensor  # [B, n, D]: entry i pools window i, tokens [i*m, (i+1)*m) (+ overlap)
    tail_kv: torch.Tensor  # [B, r, C]: projections of the r < m tokens of the open window
    tail_gate: torch.Tensor  # [B, r, C]: their gate logits (position bias not yet added)
    overlap_kv: torch.Tensor | None = None  # [B, m, D]
    overlap_gate: torch.Tensor | None = None  # [B, m, D] (position bias added)
    # the positions the next forward pass keeps the tail and overlap at (`mark`), and those kept:
    # position -> ((tail_kv, tail_gate), (overlap_kv, overlap_gate) or None), copies of their own
    marks: tuple[int, ...] = ()
    kept: dict[int, tuple] = field(default_factory=dict)

    def mark(self, positions: tuple[int, ...]) -> None:
        self.marks, self.kept = tuple(positions), {}

    @property
    def count(self) -> int:
        return self.entries.shape[1]

    def nbytes(self) -> int:
        return sum(tensor_bytes(p) for p in (self.entries, self.tail_kv, self.tail_gate, self.overlap_kv, self.overlap_gate))

    def objects(self, layer: int, seq_len: int, prefix: str = "") -> list[StateObject]:
        m, n = self.rate, self.count
        span = 2 * m if self.overlapping else m
        entries, tail, overlap = COMPRESSOR_KINDS[prefix]
        out = [
            StateObject(layer, entries, tuple(self.entries.shape), True,
                        (0, n * m), tensor_bytes(self.entries), n, m, span, 0),
            StateObject(layer, tail, (2, *self.tail_kv.shape), True, (n * m, n * m + self.tail_kv.shape[1]),
                        tensor_bytes(self.tail_kv) + tensor_bytes(self.tail_gate), self.tail_kv.shape[1], 1, 1, n * m),
        ]
        if self.overlapping and self.overlap_kv is not None:
            out.append(StateObject(layer, overlap, (2, *self.overlap_kv.shape), True, ((n - 1) * m, n * m),
                                   tensor_bytes(self.overlap_kv) + tensor_bytes(self.overlap_gate), m, 1, 1, (n - 1) * m))
        return out

    def export(self, lo: int, hi: int, snapshots: bool = True, prefix: str = "") -> dict[str, Piece]:
        m = self.rate
        entries, tail, overlap = COMPRESSOR_KINDS[prefix]
        out = {entries: Piece(True, self.entries[:, lo // m: hi // m].clone())}
        if not snapshots:
            return out
        # at hi: kept inside the last pass (copies nothing else holds or writes: handed over), or
        # the state's own (copied: the state goes on)
        kept = self.kept.get(hi)
        if kept is None:
            own = (self.overlap_kv, self.overlap_gate) if self.overlap_kv is not None else None
            kept = (self.tail_kv.clone(), self.tail_gate.clone()), clone_tree(own)
        out[tail] = Piece(False, kept[0])
        if self.overlapping:
            # before the first window closes there is no overlap: stored as zero-length slices, so a
            # piece is never None and a buffer check always has a shape and dtype to hold it to
            empty = self.entries[:, :0]
            out[overlap] = Piece(False, kept[1] if kept[1] is not None else (empty.clone(), empty.clone()))
        return out

    def for_replay(self, pieces: dict[str, object], prefix: str = "") -> CompressedState:
        """Every cached entry, exact; the tail and overlap empty, for a replay to rebuild."""
        entries = torch.cat([self.entries, *pieces[COMPRESSOR_KINDS[prefix][0]]], dim=1)
        return CompressedState(self.rate, self.overlapping, entries, self.tail_kv[:, :0].clone(),
                               self.tail_gate[:, :0].clone())

    def assemble(self, seq_len: int, pieces: dict[str, object], prefix: str = "") -> CompressedState:
        kinds = COMPRESSOR_KINDS[prefix]
        entries = torch.cat([self.entries, *pieces[kinds[0]]], dim=1)
        tail_kv, tail_gate = clone_tree(pieces[kinds[1]])
        overlap = clone_tree(pieces.get(kinds[2])) or (None, None)
        if overlap[0] is not None and overlap[0].shape[1] == 0:
            overlap = (None, None)
        return CompressedState(self.rate, self.overlapping, entries, tail_kv, tail_gate, *overlap)


@dataclass
class V4AttnState:
    """One DeepSeek-V4 attention layer: the sliding window, plus a compressor (CSA / HCA) and, for
    CSA, the lightning indexer's own compressed keys."""

    window: WindowState
    compressor: CompressedState | None = None
    indexer: CompressedState | None = None
    # Tail-Replay: while positions before replay_end run again, the compressed entries (exact,
    # from the cache) are read, never appended; the window, tails and overlaps are rebuilt
    replay_end: int | None = None

    # the window, the open tails and the overlaps at a marked position are kept by each part
    snapshots_inside: ClassVar[bool] = True

    def mark(self, positions: tuple[int, ...]) -> None:
        """Keep the window, tails and overlaps at these positions during the next forward pass (what
        was kept before is dropped)."""
        for part in (self.window, self.compressor, self.indexer):
            if part is not None:
                part.mark(positions)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in (self.window, self.compressor, self.indexer) if s is not None)

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        out = self.window.objects(layer, seq_len)
        if self.compressor is not None:
            out += self.compressor.objects(layer, seq_len)
        if self.indexer is not None:
            out += self.indexer.objects(layer, seq_len, prefix="index_")
        return out

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        out = self.window.export(lo, hi, snapshots)
        if self.compressor is not None:
            out |= self.compressor.export(lo, hi, snapshots)
        if self.indexer is not None:
            out |= self.indexer.export(lo, hi, snapshots, prefix="index_")
        return out

    def for_replay(self, begin: int, end: int, pieces: dict[str, object]) -> V4AttnState:
        """The state a Tail-Replay of [begin, end) starts from: every compressed entry of [0, end)
        exact from the cache; an empty window at `begin`; tails and overlaps empty. The replay
        rebuilds the snapshot parts from the tokens it runs (validation.REBUILT_BY_REPLAY)."""
        return V4AttnState(
            WindowState(self.window.kv[:, :0].clone(), begin),
            self.compressor.for_replay(pieces) if self.compressor is not None else None,
            self.indexer.for_replay(pieces, prefix="index_") if self.indexer is not None else None,
            replay_end=end,
        )

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> V4AttnState:
        return V4AttnState(
            self.window.assemble(seq_len, pieces),
            self.compressor.assemble(seq_len, pieces) if self.compressor is not None else None,
            self.indexer.assemble(seq_len, pieces, prefix="index_") if self.indexer is not None else None,
        )
