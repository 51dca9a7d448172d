"""Per-request layer state objects: what each layer kind keeps between forward calls.

The model's modules hold weights only; everything a layer remembers about a sequence lives in one
of these objects, owned by the caller. That is what lets the cache layer snapshot, validate and
rebuild each state on its own.

This module is the interface every kind implements (StateObject, Piece, LayerState) and the
sequence's whole state (ModelState); the kinds live beside it:

    full_attention    kv.py         KVState (one buffer), PagedKVState (blocks of a pool, a block table)
    linear_attention  gdn_state.py  GDNState: conv window + recurrent matrix per head, decay
                                    statistics, int8 sketches
    V4 attention      v4_state.py   WindowState, CompressedState, V4AttnState (window, compressor,
                                    indexer)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.cache.gdn_state import GDNState
    from engine.cache.kv import KVState, PagedKVState
    from engine.cache.v4_state import V4AttnState


class Kind(StrEnum):
    """Every state kind a layer keeps (a StrEnum: equal to its name as text, as stored on disk)."""

    KV = "kv"
    CONV = "conv"
    RECURRENT = "recurrent"
    DECAY = "decay"
    SKETCH = "sketch"
    WINDOW = "window"
    COMPRESSED = "compressed"
    TAIL = "tail"
    OVERLAP = "overlap"
    INDEX_KEYS = "index_keys"
    INDEX_TAIL = "index_tail"
    INDEX_OVERLAP = "index_overlap"


# a compressor's kinds (its closed entries, its open tail, its overlap), by the prefix its owner gives it
COMPRESSOR_KINDS = {"": (Kind.COMPRESSED, Kind.TAIL, Kind.OVERLAP),
                    "index_": (Kind.INDEX_KEYS, Kind.INDEX_TAIL, Kind.INDEX_OVERLAP)}


@dataclass(frozen=True)
class StateObject:
    """One piece of per-sequence state, as the cache layer sees it: what it is, where its content
    comes from, and what it costs. Every layer kind describes its state only through these.

    Token-addressable objects hold `entries` entries; entry i derives from tokens
    `entry_range(i)`: a window of `span` tokens ending at first + (i + 1) * stride. Objects that
    are not token-addressable (a recurrent matrix) summarise all of `tokens` at once.
    """

    layer: int
    kind: str  # a Kind
    shape: tuple[int, ...]
    token_addressable: bool
    tokens: tuple[int, int]  # [lo, hi): the token positions this object's content derives from
    nbytes: int
    entries: int = 0
    stride: int = 1
    span: int = 1
    first: int = 0

    def entry_range(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.entries:
            raise IndexError(f"{self.kind} of layer {self.layer} has {self.entries} entries, not {i + 1}")
        hi = self.first + (i + 1) * self.stride
        return max(0, hi - self.span), hi


@dataclass(frozen=True)
class Piece:
    """What the cache keeps of one state kind for one segment [lo, hi).

    per_segment: the slice produced by the segment's own tokens (KV, compressed entries, index
    keys); a prefix needs the pieces of every segment before it. Otherwise a snapshot of the
    state exactly at hi (GDN recurrent and conv, SWA window, tails, overlaps); a prefix ending
    at hi needs that one snapshot. `data` is a tensor or a tuple of tensors; an empty state is a
    zero-length tensor, never None, so every piece can be held to its template's shape and dtype."""

    per_segment: bool
    data: object
    position: int = -1  # the token position the piece ends at / describes; stamped when cached

    def nbytes(self) -> int:
        data = self.data
        if isinstance(data, tuple):
            return sum(t.nbytes for t in data if t is not None)
        return 0 if data is None else data.nbytes


class LayerState(Protocol):
    """What every per-layer state object offers the cache layer."""

    def objects(self, layer: int, seq_len: int) -> list[StateObject]: ...
    def nbytes(self) -> int: ...
    # copies of this state's pieces for the segment [lo, hi): its per-segment slices, and, when
    # `snapshots`, the snapshots at hi (the state's current seq_len, or a position `mark`ed for
    # the forward pass that just ran)
    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]: ...
    # whether the state can keep its snapshots at positions inside a forward pass, and `mark`,
    # which names those positions for the next forward pass
    snapshots_inside: bool
    def mark(self, positions: tuple[int, ...]) -> None: ...
    # a new state at seq_len from pieces (per-segment kinds: a list in segment order), with this
    # (fresh) state as the template for shapes, dtypes and rates
    def assemble(self, seq_len: int, pieces: dict[str, object]) -> LayerState: ...


def clone_tree(x):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(clone_tree(t) for t in x)
    return x.clone()


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.nbytes


def per_token(layer: int, kind: str, t: torch.Tensor, first: int, dim: int = 1) -> StateObject:
    """An object whose entries are single consecutive tokens starting at `first`."""
    n = t.shape[dim]
    return StateObject(layer, kind, tuple(t.shape), True, (first, first + n), tensor_bytes(t), n, 1, 1, first)


@dataclass
class ModelState:
    """All layer states of one sequence plus how many tokens they describe."""

    layers: list[KVState | PagedKVState | GDNState | V4AttnState]
    seq_len: int = 0
    extra: dict = field(default_factory=dict)

    def track_statistics(self) -> ModelState:
        """Have every layer that keeps statistics for the cache (GDN decay) record them."""
        for layer in self.layers:
            if hasattr(layer, "tracking"):
                layer.tracking = True
        return self

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    @property
    def snapshots_inside(self) -> bool:
        """Every layer keeps its snapshots at positions inside a forward pass (see `mark`)."""
        return all(layer.snapshots_inside for layer in self.layers)

    def mark(self, positions=()) -> None:
        """The positions inside the next forward pass at which each layer keeps its snapshots,
        for `export` afterwards (no positions: what was kept is dropped)."""
        for layer in self.layers:
            layer.mark(tuple(positions))

    def objects(self) -> list[StateObject]:
        return [obj for i, s in enumerate(self.layers) for obj in s.objects(i, self.seq_len)]
