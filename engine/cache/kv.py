"""Full attention's state: exact keys and values for every position, in one buffer (KVState) or in
blocks of the layer's pool, shared with every other state and the prefix cache, through a block
table (PagedKVState, the paged-attention kernels' layout; block_pool.py); `kv_layout` picks one
(EngineConfig.kv_layout)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.cache.block_pool import PAGE, BlockPool, release_runs
from engine.cache.states import Kind, Piece, StateObject

# `PagedKVState.pieces`: runs of blocks shorter than this on average are gathered instead (an
# attention takes each piece in products of its own; a quarter of cpu_attention's key block)
MIN_RUN = 256

__all__ = ["PAGE", "KVState", "PagedKVState", "kv_layout"]


class _SlicedByPosition:
    """What KVState and PagedKVState share for ModelState.mark: every piece is a slice by
    position, so a forward pass has nothing to keep at a boundary inside it."""

    snapshots_inside: ClassVar[bool] = True

    def mark(self, positions: tuple[int, ...]) -> None:
        pass


@dataclass
class KVState(_SlicedByPosition):
    """Keys and values of one full-attention layer, grown in place (amortised doubling)."""

    k: torch.Tensor  # [B, Hkv, capacity, D]
    v: torch.Tensor  # [B, Hkv, capacity, D]
    length: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 256) -> KVState:
        shape = (batch, heads, capacity, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, Hkv, T, D] at the end; return views of all keys and values so far."""
        end = self.length + k_new.shape[2]
        self.room(end)
        self.k[:, :, self.length:end] = k_new
        self.v[:, :, self.length:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def room(self, end: int) -> None:
        """Capacity for positions [0, end), grown by doubling; what is held is kept."""
        if end > self.k.shape[2]:
            self._grow(end)

    def written(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Count the t positions a kernel wrote straight into k and v after the held ones (room
        made first); return views of all keys and values so far, as `append` does."""
        end = self.length + t
        if end > self.k.shape[2]:
            raise IndexError(f"{t} positions written past a KV capacity of {self.k.shape[2]}")
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) already held: a replay reads them, never writes."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.k.shape[2])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((*old.shape[:2], cap, old.shape[3]), dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def nbytes(self) -> int:
        per_pos = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return 2 * per_pos * self.length

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        shape = (2, self.k.shape[0], self.k.shape[1], self.length, self.k.shape[3])
        return [StateObject(layer, Kind.KV, shape, True, (0, self.length), self.nbytes(), self.length)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        return {Kind.KV: Piece(True, (self.k[:, :, lo:hi].clone(), self.v[:, :, lo:hi].clone()))}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> KVState:
        """One buffer per tensor with room past seq_len (an eighth more, at least 256 positions) for
        the request's new tokens: appending to an exact-size buffer would copy every restored key
        and value again."""
        parts = pieces[Kind.KV]
        held = sum(p[0].shape[2] for p in parts)
        if held != seq_len:  # (cat into a view of the wrong length would scramble it, not fail)
            raise ValueError(f"the pieces hold {held} positions, not {seq_len}")
        first = parts[0][0]
        b, h, _, d = first.shape
        room = seq_len + max(256, seq_len // 8)
        k, v = first.new_empty(b, h, room, d), first.new_empty(b, h, room, d)
        torch.cat([p[0] for p in parts], dim=2, out=k[:, :, :seq_len])
        torch.cat([p[1] for p in parts], dim=2, out=v[:, :, :seq_len])
        return KVState(k, v, seq_len)


def kv_layout(choice: str, device) -> str:
    """How full-attention layers keep keys and values (EngineConfig.kv_layout): dense (one buffer
    per layer, read by scaled_dot_product_attention), paged (blocks of the layer's pool shared by
    every state and the prefix cache, through a block table: a hit maps cached blocks, read in place
    by the paged-attention kernels, Triton on CUDA and kernels/native on the CPU), or auto: paged,
    on the CPU too since it costs a CPU prefill and decode step nothing measurable (docs/BENCHMARKS.md,
    "Dense vs paged KV on the CPU")."""
    if choice == "auto":
        return "paged"
    if choice not in ("dense", "paged"):
        raise ValueError(f"KV layout {choice!r}; one of auto, dense, paged")
    return choice


class PagedKVState(_SlicedByPosition):
    """Keys and values of one full-attention layer in blocks of a `BlockPool` (block_pool.py).

    `runs` names, per page of positions, the first of `batch` consecutive pool blocks (sequence b's
    j-th block is runs[j] + b), so the blocks of one position range form one [B, ...] slab that a
    write fills with a single strided copy and a piece views without copying. `table` ([B, M]
    int32) and `lengths` ([B] int32) are the kernels' view of the same thing. The state holds each
    of its runs once, released when it is collected; it writes only at positions >= length, and
    copies a block first when another holder shares it.

    What the cache sees is KVState's: pieces are [B, Hkv, n, D] tensors; `export` of one whole
    page is a view of its blocks (the piece then holds them), of any other range a copy; `assemble`
    maps the blocks of pieces that are views of its pool and copies the rest in."""

    def __init__(self, pool: BlockPool, batch: int):
        self.pool = pool
        self.batch = batch
        self.runs: list[int] = []
        self.length = 0
        self.at: torch.Tensor | None = None  # static decode (engine/static_decode.py): the new token's position, [1] long
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=pool.k.device)  # positions held, per sequence
        self.table = _table(self.runs, batch, pool.k.device)
        weakref.finalize(self, release_runs, pool, self.runs, batch)

    def __deepcopy__(self, memo) -> PagedKVState:
        """A fork (a deep copy of a ModelState, as bench replay takes to continue one prefix twice):
        the blocks holding its positions, held once more, not copied; blocks reserved past them
        stay the original's. Either state copies a shared block before writing into it (`reserve`)."""
        fork = PagedKVState(self.pool, self.batch)
        held = self.runs[:-(-self.length // self.page)]
        for first in held:
            self.pool.share(first, self.batch)
        fork.runs.extend(held)  # (the list its finalizer releases)
        fork.table = _table(fork.runs, self.batch, self.pool.k.device)
        fork.length = self.length
        fork.lengths.copy_(self.lengths)
        fork.at = None if self.at is None else self.at.clone()
        memo[id(self)] = fork
        return fork

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 0,
              pool: BlockPool | None = None) -> PagedKVState:
        """A state with no positions, in `pool` (a pool of its own when None), blocks for
        `capacity` positions reserved."""
        state = cls(pool or BlockPool(heads, head_dim, dtype, device), batch)
        state.reserve(capacity)
        return state

    @property
    def k_pool(self) -> torch.Tensor:  # [N, Hkv, page, D]
        return self.pool.k

    @property
    def v_pool(self) -> torch.Tensor:
        return self.pool.v

    @property
    def page(self) -> int:
        return self.pool.page

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write [B, Hkv, T, D] at positions length..length+T-1 (the kernels then read them)."""
        self._write(k_new, v_new)
        self.pool.written += 2 * k_new.numel() * k_new.element_size()

    def _write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        end = self.length + k_new.shape[2]
        self.reserve(end)
        b, page = self.batch, self.page
        for pool, new in ((self.pool.k, k_new), (self.pool.v, v_new)):
            at = self.length
            while at < end:
                j, lo = divmod(at, page)
                hi = min(page, lo + end - at)
                first = self.runs[j]
                pool[first:first + b, :, lo:hi] = new[:, :, at - self.length:at - self.length + hi - lo]
                at += hi - lo
        self.length = end
        self.lengths.fill_(end)

    def write_at(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Static decode: [B, Hkv, 1, D] written at the position `at` holds and `lengths` set past
        it, all in tensors (the caller keeps `length` and has reserved the block)."""
        block = self.table.index_select(1, torch.div(self.at, self.page, rounding_mode="floor"))[:, 0].long()  # [B]
        offset = self.at % self.page
        self.pool.k[block, :, offset] = k_new[:, :, 0]
        self.pool.v[block, :, offset] = v_new[:, :, 0]
        self.lengths.copy_(self.at + 1)

    def reserve(self, end: int) -> None:
        """Blocks of its own through position end-1: the block holding position `length` copied
        first if another holder shares it (static decode reserves ahead: it never allocates in a step)."""
        b, page, changed = self.batch, self.page, False
        j = self.length // page
        if j < len(self.runs) and self.pool.shared(self.runs[j]):
            own = self.pool.alloc(b)
            self.pool.copy(self.runs[j], own, b, self.length - j * page)
            self.pool.release(self.runs[j], b)
            self.runs[j], changed = own, True
        while len(self.runs) * page < end:
            self.runs.append(self.pool.alloc(b))
            changed = True
        if changed:
            self.table = _table(self.runs, b, self.pool.k.device)

    def room(self, end: int) -> None:
        """Blocks of its own for positions up to end-1 (KVState.room's counterpart)."""
        self.reserve(end)

    def slab(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The [B, Hkv, page, D] blocks holding `position` (room made first), for a kernel to write
        into at position % page; not views the cache keeps."""
        first = self.runs[position // self.page]
        return self.pool.k[first:first + self.batch], self.pool.v[first:first + self.batch]

    def written(self, t: int) -> None:
        """Count the t positions a kernel wrote into `slab`s after the held ones (KVState.written's
        counterpart; the attention then reads them through the table)."""
        end = self.length + t
        if end > len(self.runs) * self.page:
            raise IndexError(f"{t} positions written past the {len(self.runs)} blocks held")
        self.length = end
        self.lengths.fill_(end)
        k = self.pool.k  # (its sizes, not a view of it: this runs every decode step)
        self.pool.written += 2 * t * self.batch * k.shape[1] * k.shape[3] * k.element_size()

    def _map(self, first: int) -> None:
        """Take the run (whole blocks some piece holds) as this state's next page: shared, not
        copied (the caller remakes `table` once it has mapped them all)."""
        self.pool.share(first, self.batch)
        self.runs.append(first)

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) as dense [B, Hkv, end, D] copies (a replay reads them)."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        return self._dense(0, end)

    def pieces(self, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of positions [0, end) held, in order, as pieces [B, Hkv, n, D] to read
        at once (before anything is written): for one sequence with one key-value head, views of
        its runs of consecutive pool blocks, each one plain tensor where they lie; otherwise, or
        where those runs average under MIN_RUN positions (each piece costs an attention its own
        small products), one gathered copy."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        if end == 0:
            return []
        k = self.pool.k
        if self.batch == 1 and k.shape[1] == 1:
            runs: list[list[int]] = []  # [first block, blocks] of each run of consecutive blocks
            for first in self.runs[:-(-end // self.page)]:
                if runs and runs[-1][0] + runs[-1][1] == first:
                    runs[-1][1] += 1
                else:
                    runs.append([first, 1])
            if len(runs) * MIN_RUN <= end or len(runs) == 1:
                out, at = [], 0
                for first, blocks in runs:
                    n = min(blocks * self.page, end - at)
                    out.append(tuple(pool[first:first + blocks].view(1, 1, -1, k.shape[3])[:, :, :n]
                                     for pool in (k, self.pool.v)))
                    at += n
                return out
        return [self._dense(0, end)]

    def _dense(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [lo, hi) as [B, Hkv, hi-lo, D] tensors of their own: the blocks they lie in
        gathered out of the pool (kernels.segments.gather: Triton on CUDA), then cut to the range."""
        from kernels.segments import gather

        b, page = self.batch, self.page
        first, last = lo // page, -(-hi // page)
        ids = self.table[:, first:last].t().flatten().clone()  # page by page, each its B blocks (kernels check)
        out = []
        for pool in (self.pool.k, self.pool.v):
            blocks = gather(pool, ids, trusted=True).view(last - first, b, *pool.shape[1:])  # [m, B, Hkv, page, D]
            run = blocks.permute(1, 2, 0, 3, 4).reshape(b, pool.shape[1], (last - first) * page, pool.shape[3])
            cut = run[:, :, lo - first * page:hi - first * page]
            out.append(cut if cut.shape[2] == run.shape[2] else cut.clone())  # no view pinning the rest
        return out[0], out[1]

    def nbytes(self) -> int:
        per_pos = self.batch * self.pool.k.shape[1] * self.pool.k.shape[3] * self.pool.k.element_size()
        return 2 * per_pos * self.length

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        shape = (2, self.batch, self.pool.k.shape[1], self.length, self.pool.k.shape[3])
        return [StateObject(layer, Kind.KV, shape, True, (0, self.length), self.nbytes(), self.length)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        """A whole page held: a view of its blocks, which it holds until the piece lets go; any
        other range: a copy."""
        return self.export_segments([(lo, hi)], [snapshots], [False])[0]

    def export_segments(self, bounds: list[tuple[int, int]], snapshots: list[bool],
                        sketches: list[bool]) -> list[dict[str, Piece]]:
        """export() for each of `bounds`, the whole pages' views made in one call of the pool."""
        page = self.page
        whole = [lo % page == 0 and hi - lo == page and hi <= self.length for lo, hi in bounds]
        views = iter(self.pool.views([self.runs[lo // page] for (lo, _), w in zip(bounds, whole) if w], self.batch))
        return [{Kind.KV: Piece(True, next(views) if w else self._dense(lo, hi), hi)} for (lo, hi), w in zip(bounds, whole)]

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> PagedKVState:
        """A state in this one's pool holding the pieces' first seq_len positions: a piece that is
        a view of the pool's blocks at a page's start is mapped into the table (no copy), the others
        are copied into blocks of its own (counted in `pool.copied`)."""
        parts = pieces[Kind.KV]
        held = sum(p[0].shape[2] for p in parts)
        if held < seq_len:
            raise ValueError(f"the pieces hold {held} positions, not {seq_len}")
        state = PagedKVState(self.pool, self.batch)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # pieces to copy, written together
        at = 0
        for k, v in parts:
            if at >= seq_len:
                break
            first = self.pool.owns(k, v)
            if first is not None and at % self.page == 0 and k.shape[2] == self.page and k.shape[0] == self.batch:
                state._copy_in(pending)
                state._map(first)
                state.length = at + self.page
            else:
                pending.append((k[:, :, :seq_len - at], v[:, :, :seq_len - at]))
            at += k.shape[2]
        state._copy_in(pending)
        state.table = _table(state.runs, self.batch, self.pool.k.device)
        # a mapped page may run past seq_len: the next write there copies it first (reserve)
        state.length = seq_len
        state.lengths.fill_(seq_len)
        return state

    def _copy_in(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pending:
            return
        k = pending[0][0] if len(pending) == 1 else torch.cat([p[0] for p in pending], dim=2)
        v = pending[0][1] if len(pending) == 1 else torch.cat([p[1] for p in pending], dim=2)
        self._write(k, v)
        self.pool.copied += 2 * k.numel() * k.element_size()
        pending.clear()


def _table(runs: list[int], batch: int, device) -> torch.Tensor:
    """[B, M] int32: sequence b's j-th block is runs[j] + b."""
    first = torch.tensor(runs, dtype=torch.int32).view(1, -1)
    return (first + torch.arange(batch, dtype=torch.int32).view(-1, 1)).to(device)
