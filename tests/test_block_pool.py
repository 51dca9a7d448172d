"""A block pool gives memory back (engine/cache/block_pool.py, `trim`): grown for a long prompt and
then let go, it moves onto smaller storage at its next allocation, the lowest free blocks taken
first so the ones in use sit at its start; live states, handed-out views and cached segments keep
their block numbers and bytes, and hits through a shrunk pool stay exact."""

from __future__ import annotations

import gc
import weakref

import torch

from engine.cache.block_pool import MIN_BLOCKS, BlockPool
from engine.cache.config import CacheConfig
from engine.cache.kv import PagedKVState
from engine.cache.prefix_cache import PrefixCache
from engine.config import ModelConfig
from engine.engine import Engine, SamplingParams
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict

H, D, PAGE = 2, 8, 16


def _pool() -> BlockPool:
    return BlockPool(H, D, torch.float32, "cpu", page=PAGE)


def _filled(n: int, pool: BlockPool, seed: int = 0, batch: int = 1) -> PagedKVState:
    state = PagedKVState.empty(batch, H, D, torch.float32, "cpu", pool=pool)
    k, v = torch.randn(2, batch, H, n, D, generator=torch.Generator().manual_seed(seed))
    state.append(k, v)
    return state


def test_the_lowest_free_blocks_are_taken_first():
    pool = _pool()
    first, second = _filled(4 * PAGE, pool, seed=1), _filled(4 * PAGE, pool, seed=2)
    assert first.runs == [0, 1, 2, 3] and second.runs == [4, 5, 6, 7]
    del first
    gc.collect()
    assert _filled(2 * PAGE, pool, seed=3).runs == [0, 1]
    assert _filled(PAGE, pool, seed=4, batch=2).runs == [0]  # a batch's run of two: blocks 0 and 1


def test_a_block_freed_while_a_run_is_being_found_is_not_lost(monkeypatch):
    """A view collected on this thread in the middle of `alloc` (its weakref callback runs there,
    under the pool's reentrant lock) pushes its block onto the free list while a run of blocks is
    being taken from it: the block stays free instead of leaking."""
    from engine.cache import block_pool

    pool = _pool()
    for _ in range(5):
        pool.alloc(1)  # blocks 0..4, each held once
    pool.release(0)
    pool.release(1)

    def sorted_then_a_view_is_collected(free):
        out = sorted(free)
        pool.release(3)  # what `_collected` does for a view of block 3 let go just now
        return out

    monkeypatch.setattr(block_pool, "sorted", sorted_then_a_view_is_collected, raising=False)
    assert pool.alloc(2) == 0  # the run 0-1
    monkeypatch.undo()
    assert pool.free == [3]
    assert pool.alloc(1) == 3


def test_a_block_freed_while_a_shrinking_pool_filters_its_free_list_is_not_lost():
    """As above, for `trim`: a view collected just as the free list has been filtered (its block
    pushed onto the list being replaced) stays free after the pool shrinks."""
    pool = _pool()
    pool.alloc(2)  # blocks 0 and 1, held
    for first in [pool.alloc(1) for _ in range(62)]:  # 2..63, let go: the pool may shrink
        pool.release(first)

    class Free(list):
        pushed = False

        def __iter__(self):
            yield from list.__iter__(self)
            if not Free.pushed:  # once the filter has read every block: block 1 let go now
                Free.pushed = True
                pool.release(1)

    pool.free = Free(pool.free)
    assert pool.trim()
    assert sorted(pool.free) == [1]
    assert pool.alloc(1) == 1


def test_a_pool_grown_for_a_long_state_shrinks_at_its_next_allocation():
    """Letting the long state go moves nothing (it may happen on another thread); the next
    allocation moves the pool onto storage twice the blocks in use (at least MIN_BLOCKS), and the
    live state and the view it handed out read the same bytes from the same block numbers."""
    pool = _pool()
    small = _filled(2 * PAGE, pool, seed=1)
    k, v = small.export(0, PAGE)["kv"].data  # a cached piece's view of block 0
    saved, held = k.clone(), small.read(2 * PAGE)
    long = _filled(60 * PAGE, pool, seed=2)
    grown = pool.k.shape[0]
    assert grown >= 62
    old = weakref.ref(pool.k)
    del long
    gc.collect()
    assert pool.k.shape[0] == grown and pool.blocks_in_use() == 2
    new = torch.randn(2, 1, H, 1, D, generator=torch.Generator().manual_seed(3))
    small.append(*new)  # past its two blocks: an allocation
    gc.collect()
    assert pool.k.shape[0] == MIN_BLOCKS and old() is None
    assert small.runs == [0, 1, 2] and pool.owns(k, v) == 0
    assert k.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr() and torch.equal(k, saved)
    got = small.read(2 * PAGE + 1)
    assert all(torch.equal(a[:, :, :2 * PAGE], b) for a, b in zip(got, held))
    assert all(torch.equal(a[:, :, 2 * PAGE:], b) for a, b in zip(got, new))


def test_a_block_in_use_near_the_end_keeps_the_storage():
    """A view of the long state's last block holds it: the blocks past the last one in use are too
    few to give back until the view goes; then the pool shrinks around the blocks still in use."""
    pool = _pool()
    long = _filled(60 * PAGE, pool, seed=5)
    last = long.export(59 * PAGE, 60 * PAGE)["kv"].data
    saved = last[0].clone()
    grown = pool.k.shape[0]
    del long
    gc.collect()
    assert not pool.trim() and pool.k.shape[0] == grown
    assert torch.equal(last[0], saved) and pool.owns(*last) == 59
    quarter = _filled(PAGE, pool, seed=6)
    assert pool.k.shape[0] == grown and quarter.runs == [0]
    del last
    gc.collect()
    assert pool.trim() and pool.k.shape[0] == MIN_BLOCKS
    assert not pool.trim()  # nothing more to give back
    assert quarter.runs == [0] and pool.blocks_in_use() == 1


def _qwen() -> HybridModel:
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4))), 0).eval()
    model.use_kv_layout("paged")
    return model


def test_hits_through_a_shrunk_pool_equal_a_cold_run_and_the_cached_segments_keep_their_bytes():
    """A short conversation cached, a long prompt run and rolled back out of the cache: the next
    request's allocation shrinks the pool under the cached segments, which keep their bytes, and
    its hit on the short conversation gives a cold dense run's logits."""
    model = _qwen()
    cache = PrefixCache(model, CacheConfig(block_size=PAGE, checkpoint_every=1))
    engine = Engine(model, cache=cache)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 263, (3 * PAGE + 5,), generator=g).tolist()
    with torch.no_grad():
        answer = engine.generate(prompt, SamplingParams(max_new_tokens=4, greedy=True)).token_ids
        cached = {(rec.key, i): tuple(t.clone() for t in p.data) for rec in cache.table
                  for (i, kind), p in rec.pieces.items() if kind == "kv"}
        mark = cache.mark()
        engine.start(torch.randint(0, 263, (40 * PAGE,), generator=g).tolist()).finish()
        cache.rollback(mark)
        gc.collect()
        (pool,) = [s.pool for s in cache.template.layers if isinstance(s, PagedKVState)]
        grown = pool.k.shape[0]
        assert grown >= 64 and pool.blocks_in_use() == len(cached)
        follow = prompt + answer + torch.randint(0, 263, (20,), generator=g).tolist()
        run = engine.start(follow)
        assert pool.k.shape[0] <= grown // 2
        model.use_kv_layout("dense")
        cold = Engine(model).start(follow)
    assert run.plan.usable_tokens >= 3 * PAGE and run.plan.exact
    assert (run.logits - cold.logits).abs().max().item() <= 1e-4
    for rec in cache.table:
        for (i, kind), p in rec.pieces.items():
            if (rec.key, i) in cached:
                assert all(torch.equal(a, b) for a, b in zip(p.data, cached[rec.key, i]))
                assert p.data[0].untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr()
