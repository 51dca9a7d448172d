"""Full attention's state: exact keys and values for every position, in one buffer (KVState) or in
fixed-size blocks of a pool through a block table (PagedKVState, the paged-attention kernels'
layout); `kv_layout` picks one (EngineConfig.kv_layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.cache.states import Kind, Piece, StateObject


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


PAGE = 64  # positions per block of a paged KV state (a power of two: the Triton kernels tile by it)


def kv_layout(choice: str, device) -> str:
    """How full-attention layers keep keys and values (EngineConfig.kv_layout): dense (one buffer
    per layer, read by scaled_dot_product_attention), paged (a block pool and a block table, read by
    the paged-attention kernels: Triton on CUDA, their torch reference elsewhere), or auto: paged on
    CUDA, dense elsewhere, where the reference's per-sequence gather costs more than one contiguous
    buffer."""
    if choice == "auto":
        return "paged" if torch.device(device).type == "cuda" else "dense"
    if choice not in ("dense", "paged"):
        raise ValueError(f"KV layout {choice!r}; one of auto, dense, paged")
    return choice


@dataclass
class PagedKVState(_SlicedByPosition):
    """Keys and values of one full-attention layer in blocks of PAGE positions.

    The pools are [N, Hkv, PAGE, D]; sequence b's j-th block is pool block j * B + b, so growing
    the pool appends blocks and never moves a sequence's earlier ones, and the blocks of one
    position range form one [B, ...] slab that a write fills with a single strided copy. `table`
    ([B, M] int32) and `lengths` ([B] int32) are the kernels' view of the same thing. Everything the
    cache sees (objects, export, assemble) is the same as KVState's: pieces are dense either way."""

    k_pool: torch.Tensor  # [N, Hkv, PAGE, D], N = M * B
    v_pool: torch.Tensor
    table: torch.Tensor  # [B, M] int32
    lengths: torch.Tensor  # [B] int32: positions held, the same for every sequence
    length: int = 0
    at: torch.Tensor | None = None  # static decode (engine/static_decode.py): the new token's position, [1] long

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 256) -> PagedKVState:
        blocks = -(-capacity // PAGE)
        pools = [torch.empty(blocks * batch, heads, PAGE, head_dim, dtype=dtype, device=device) for _ in range(2)]
        return cls(*pools, _table(batch, blocks, device), torch.zeros(batch, dtype=torch.int32, device=device))

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write [B, Hkv, T, D] at positions length..length+T-1 (the kernels then read them)."""
        end = self.length + k_new.shape[2]
        self.reserve(end)
        b = self.batch
        for pool, new in ((self.k_pool, k_new), (self.v_pool, v_new)):
            slabs = pool.view(-1, b, *pool.shape[1:])  # [M, B, Hkv, PAGE, D]
            at = self.length
            while at < end:
                j, lo = divmod(at, PAGE)
                hi = min(PAGE, lo + end - at)
                slabs[j, :, :, lo:hi] = new[:, :, at - self.length:at - self.length + hi - lo]
                at += hi - lo
        self.length = end
        self.lengths.fill_(end)

    def write_at(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Static decode: [B, Hkv, 1, D] written at the position `at` holds and `lengths` set past
        it, all in tensors (the caller keeps `length` and has made sure the block exists)."""
        block = self.table.index_select(1, torch.div(self.at, PAGE, rounding_mode="floor"))[:, 0].long()  # [B]
        offset = self.at % PAGE
        self.k_pool[block, :, offset] = k_new[:, :, 0]
        self.v_pool[block, :, offset] = v_new[:, :, 0]
        self.lengths.copy_(self.at + 1)

    def reserve(self, end: int) -> None:
        """Blocks through position end-1 (static decode reserves ahead: it must never grow the pools)."""
        if end > self.table.shape[1] * PAGE:
            self._grow(end)

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) as dense [B, Hkv, end, D] copies (a replay reads them)."""
        if end > self.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {self.length}")
        return self._dense(0, end)

    def _dense(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [lo, hi) as [B, Hkv, hi-lo, D] tensors of their own: the blocks they lie in
        gathered out of the pool (kernels.segments.gather: Triton on CUDA), then cut to the range."""
        from kernels.segments import gather

        b, first, last = self.batch, lo // PAGE, -(-hi // PAGE)
        ids = self.table[:, first:last].flatten().clone()  # b's blocks in order, aligned (kernels check)
        out = []
        for pool in (self.k_pool, self.v_pool):
            blocks = gather(pool, ids, trusted=True).view(b, last - first, *pool.shape[1:])  # [B, m, Hkv, PAGE, D]
            run = blocks.transpose(1, 2).reshape(b, pool.shape[1], -1, pool.shape[3])
            cut = run[:, :, lo - first * PAGE:hi - first * PAGE]
            out.append(cut if cut.shape[2] == run.shape[2] else cut.clone())  # no view pinning the rest
        return out[0], out[1]

    def _grow(self, needed: int) -> None:
        blocks = max(-(-needed // PAGE), 2 * self.table.shape[1])
        b = self.batch
        for name in ("k_pool", "v_pool"):
            old = getattr(self, name)
            new = torch.empty(blocks * b, *old.shape[1:], dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old  # block j * B + b keeps its id
            setattr(self, name, new)
        self.table = _table(b, blocks, self.table.device)

    def nbytes(self) -> int:
        per_pos = self.batch * self.k_pool.shape[1] * self.k_pool.shape[3] * self.k_pool.element_size()
        return 2 * per_pos * self.length

    def objects(self, layer: int, seq_len: int) -> list[StateObject]:
        shape = (2, self.batch, self.k_pool.shape[1], self.length, self.k_pool.shape[3])
        return [StateObject(layer, Kind.KV, shape, True, (0, self.length), self.nbytes(), self.length)]

    def export(self, lo: int, hi: int, snapshots: bool = True) -> dict[str, Piece]:
        return {Kind.KV: Piece(True, self._dense(lo, hi))}

    def assemble(self, seq_len: int, pieces: dict[str, object]) -> PagedKVState:
        """A state holding the pieces' first seq_len positions, written into its pool's blocks at
        once (kernels.segments.scatter: Triton on CUDA)."""
        from kernels.segments import scatter

        b, heads, d = self.batch, self.k_pool.shape[1], self.k_pool.shape[3]
        state = PagedKVState.empty(b, heads, d, self.k_pool.dtype, self.k_pool.device, capacity=max(seq_len, 1))
        m = -(-seq_len // PAGE)
        ids = state.table[:, :m].flatten().clone()
        for pool, i in ((state.k_pool, 0), (state.v_pool, 1)):
            run = torch.cat([p[i] for p in pieces[Kind.KV]], dim=2)[:, :, :seq_len]
            if seq_len % PAGE:  # the last block's unused positions: never read (lengths stops before them)
                run = torch.cat([run, run.new_zeros(b, heads, m * PAGE - seq_len, d)], dim=2)
            blocks = run.reshape(b, heads, m, PAGE, d).transpose(1, 2).reshape(b * m, heads, PAGE, d)
            scatter(pool, ids, blocks, trusted=True)
        state.length = seq_len
        state.lengths.fill_(seq_len)
        return state


def _table(batch: int, blocks: int, device) -> torch.Tensor:
    """[B, M] int32: sequence b's j-th block is pool block j * B + b."""
    ids = torch.arange(blocks * batch, dtype=torch.int32, device=device)
    return ids.view(blocks, batch).t().contiguous()
