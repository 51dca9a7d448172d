"""BlockPool: one full-attention layer's keys and values for every request state and the prefix
cache of one model, in blocks of `page` positions, each with a reference count (vLLM's block
table and block manager, one pool per layer, on the CPU too).

A layer keeps one pool per page size (GatedAttention.kv_pool). A PrefixCache makes every state
it hands out (hits and cold starts alike, and Engine.new_state for its engine) in the pools of
its own block size's page (`page_for`), so two caches of different block sizes on one model each
share their own segments without copying; the model's `kv_page` is only the page of states made
without a cache.

    pool.k  [N, Hkv, page, D]  (pool.v alike)
              ┌────┬────┬────┬────┬────┐
    block     │ 0  │ 1  │ 2  │ 3  │ 4  │
    refs      │ 3  │ 3  │ 1  │ 1  │ 0  │     4: free
              └────┴────┴────┴────┴────┘
    request A  runs [0, 1, 2]    wrote 0-2; its saved segments 0, 1 are views of blocks 0, 1 (+1 each)
    request B  runs [0, 1, 3]    a hit on segments 0-1: blocks mapped (+1 each), not copied; B
                                 writes only past its length, into block 3, its own

Who holds a reference: a state, one for each block in its table (released when the state is
collected), and each view `view` hands out (a cached piece's data, released when the view is
collected): so the state table's drops, evictions, rollbacks and demotions unpin by letting go
of a piece, without knowing about blocks, and a piece queued for the disk tier keeps its blocks
until it is written. A block with more than one reference never changes (rule 3: not under a
reader): a state about to write into such a block copies it first (copy on write), and a state
never writes below its length, so a whole block it saved is never written again.

Blocks are allocated in runs of `batch` consecutive ones (a batch's sequences' blocks for one
range of positions: a [B, Hkv, page, D] slab, the shape of a piece), the lowest free ones first,
so the blocks in use gather at the pool's start and the free ones at its end. The pool grows by
doubling and moves the views it handed out onto the new storage, so no view holds an old pool
alive; it shrinks the same way (`trim`): when the blocks past the last one in use are more than
three quarters of it, it moves onto storage twice the blocks up to that one (at least half of it
given back; room for them to double before it grows again). No block changes its number or its
bytes either way, so block tables stay valid and a shared block is never written (rule 3); only
the storage under them is new. Both happen in `alloc`, on the thread that writes into the pool
(a state making room), never where a block is let go (a piece may be dropped on another thread):

    before  │ A │ v │ . │ . │ B │ . │ . │ . │ . │ . │ . │ . │ . │ . │ . │ . │ ... │   64 blocks
    after   │ A │ v │ . │ . │ B │ . │ . │ . │ . │ . │ ... │ 16 blocks: 2 x 5, raised to MIN_BLOCKS
            (A, B: states' blocks, v: a cached piece's view, .: free; every block keeps its number)

`copied` and `written` count the bytes that went into blocks: keys and values copied from ones
held elsewhere (a copy on write, a piece not of this pool) and new positions' keys and values.
"""

from __future__ import annotations

import heapq
import threading
import weakref

import torch

PAGE = 64  # positions per block unless told (a power of two: the Triton kernels tile by it)
MIN_BLOCKS = 16  # the smallest storage a pool grows to or shrinks to


def page_for(block_size: int) -> int:
    """The page of the pool a prefix cache of `block_size` shares its segments in: the block size
    where it is a power of two of at least 16 (the Triton kernels' smallest tile), so a segment is
    a whole block; else PAGE, and its segments are copied."""
    return block_size if block_size >= 16 and block_size & (block_size - 1) == 0 else PAGE


class BlockPool:
    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device, page: int = PAGE):
        if page < 1:
            raise ValueError(f"a block of {page} positions")
        self.page = page
        # (never inference tensors: a pool made under an engine's inference mode is written outside it too)
        with torch.inference_mode(False):
            self.k = torch.empty(0, heads, page, head_dim, dtype=dtype, device=device)  # [N, Hkv, page, D]
            self.v = torch.empty_like(self.k)
        self.refs: list[int] = []  # per block ever allocated; blocks past it are spare capacity
        self.free: list[int] = []  # blocks whose count fell to 0, a heap: the lowest is taken first
        self.copied = 0
        self.written = 0
        self._views: dict[int, weakref.ref] = {}  # id -> each view handed out and alive
        # a piece may be let go on another thread (the write-behind tier's, once it is written)
        self._lock = threading.RLock()

    @property
    def block_bytes(self) -> int:
        """Keys and values of one block."""
        return 2 * self.k[0].numel() * self.k.element_size()

    def blocks_in_use(self) -> int:
        return sum(1 for r in self.refs if r)

    def alloc(self, n: int = 1) -> int:
        """A run of n consecutive blocks held once (by the caller); returns its first block."""
        with self._lock:
            return self._alloc(n)

    def _alloc(self, n: int) -> int:
        self._trim()
        first = self._free_run(n)
        if first is None:
            first = len(self.refs)
            self.refs.extend([0] * n)
            if len(self.refs) > self.k.shape[0]:
                self._grow(len(self.refs))
        for i in range(first, first + n):
            self.refs[i] = 1
        return first

    def _free_run(self, n: int) -> int | None:
        """The first of the lowest n consecutive free blocks, taken off the free list (a batch's
        run must be consecutive); None when the free list holds no such run."""
        if len(self.free) < n:
            return None
        if n == 1:
            return heapq.heappop(self.free)
        free = sorted(self.free)
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:  # (the numbers are distinct: a run)
                first = free[i]
                # taken out of the list in place, not replaced by one made from `free`: a view
                # collected meanwhile (its weakref callback runs on this thread, whose lock this
                # is) may have pushed a block onto it, which a new list would lose for good
                for block in range(first, first + n):
                    self.free.remove(block)
                heapq.heapify(self.free)
                return first
        return None

    def trim(self) -> bool:
        """Give back the storage past the last block in use when it is more than three quarters of
        the pool (the module docstring); True if it shrank. Call it only where `alloc` may run: on
        the thread that writes into the pool, no block of it being written."""
        with self._lock:
            return self._trim()

    def _trim(self) -> bool:
        cap = self.k.shape[0]
        # the free blocks and the capacity past `refs` bound the free end: most calls stop here
        if len(self.free) + cap - len(self.refs) < cap - cap // 4 or cap <= MIN_BLOCKS:
            return False
        end = len(self.refs)
        while end and not self.refs[end - 1]:
            end -= 1
        keep = max(MIN_BLOCKS, 2 * end)
        if keep > cap // 2:
            return False
        del self.refs[end:]
        old = self.free
        self.free = [f for f in old if f < end]
        # a view collected on this thread while the list was being made (its weakref callback runs
        # under this reentrant lock) pushed its block onto the old list: carried over, not lost
        kept = set(self.free)
        self.free += [f for f in old if f < end and f not in kept]
        heapq.heapify(self.free)
        self._move(keep, end)
        return True

    def share(self, first: int, n: int = 1, holders: int = 1) -> None:
        """`holders` more holders of the run (a hit mapping it, a view of it)."""
        with self._lock:
            for i in range(first, first + n):
                if self.refs[i] < 1:
                    raise ValueError(f"block {i} is free: nothing to share")
                self.refs[i] += holders

    def release(self, first: int, n: int = 1) -> None:
        with self._lock:
            for i in range(first, first + n):
                self.refs[i] -= 1
                if self.refs[i] == 0:
                    heapq.heappush(self.free, i)
                elif self.refs[i] < 0:
                    raise ValueError(f"block {i} released more often than it was held")

    def shared(self, first: int) -> bool:
        return self.refs[first] > 1

    def view(self, first: int, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's keys and values, [n, Hkv, page, D] each, not copies: each holds the run until it
        is collected."""
        return self.views([first], n)[0]

    def views(self, firsts: list[int], n: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`view` of each run in `firsts` (a saved request's segments, one call for all of them)."""
        out = []
        with self._lock, torch.inference_mode(False), torch.no_grad():
            # (the pools' storages, block size and strides once for every view)
            at = [(pool.untyped_storage(), pool.stride(), (n, *pool.shape[1:]), pool.dtype, pool.device)
                  for pool in (self.k, self.v)]
            size = self.k.stride(0)  # (an empty pool too: no block to index)
            for first in firsts:
                pair = tuple(_based_on_nothing(storage, first * size, shape, stride, dtype, device)
                             for storage, stride, shape, dtype, device in at)
                self.share(first, n, holders=2)  # one per tensor: each gives its own back when collected
                for t in pair:
                    # the weak reference's callback gives the hold back when the view is collected
                    key = id(t)
                    self._views[key] = weakref.ref(t, lambda _, key=key, first=first: self._collected(key, first, n))
                out.append(pair)
        return out

    def _collected(self, key: int, first: int, n: int) -> None:
        with self._lock:
            del self._views[key]
            self.release(first, n)

    def _handed_out(self, t: torch.Tensor) -> bool:
        ref = self._views.get(id(t))
        return ref is not None and ref() is t

    def owns(self, k: torch.Tensor, v: torch.Tensor) -> int | None:
        """The first block of the run that k and v are `view`s of, as handed out (whole blocks of
        this pool, both of one run); None for any other tensors."""
        if not (self._handed_out(k) and self._handed_out(v)) or k.shape != v.shape:
            return None
        size = self.k[0].numel()
        first = k.storage_offset() // size
        if v.storage_offset() != k.storage_offset() or k.storage_offset() % size:
            return None
        return first

    def copy(self, src: int, dst: int, n: int, positions: int) -> None:
        """The first `positions` of run src's blocks into run dst's (a copy on write)."""
        for pool in (self.k, self.v):
            pool[dst:dst + n, :, :positions] = pool[src:src + n, :, :positions]
        self.copied += 2 * n * self.k[0, :, :positions].numel() * self.k.element_size()

    def _grow(self, needed: int) -> None:
        self._move(max(needed, 2 * self.k.shape[0], MIN_BLOCKS), self.k.shape[0])

    def _move(self, cap: int, blocks: int) -> None:
        """The pool onto new storage of `cap` blocks, its first `blocks` copied (each keeps its
        number), every view handed out moved with it."""
        moved = {}
        with torch.inference_mode(False), torch.no_grad():
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(cap, *old.shape[1:], dtype=old.dtype, device=old.device)
                new[:blocks] = old[:blocks]
                moved[old.untyped_storage().data_ptr()] = new
                setattr(self, name, new)
            for ref in list(self._views.values()):
                t = ref()
                new = None if t is None else moved.get(t.untyped_storage().data_ptr())
                if new is not None:
                    t.set_(new.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _based_on_nothing(storage, offset: int, shape: tuple, stride: tuple, dtype, device) -> torch.Tensor:
    """A tensor on the pool's storage at `offset` (a run of blocks) without being a view of the pool
    tensor: a slice's `_base` would keep that tensor (and, after a growth, its old storage) alive
    for as long as the slice lives, whatever `_grow` moves it onto. Call it outside inference mode
    and autograd (`views` does, once for all its views)."""
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def release_runs(pool: BlockPool, runs: list[int], batch: int) -> None:
    """A state's hold on its blocks, let go when it is collected."""
    for first in runs:
        pool.release(first, batch)
    runs.clear()
