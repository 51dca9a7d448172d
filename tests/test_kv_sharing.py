"""Full-attention KV shared, not copied (issue 25 item 2; engine/cache/block_pool.py): a saved
segment is a view of its blocks that holds them, a hit maps those blocks into the new state's
table, a write into a shared block copies it first, and every way a piece leaves the cache lets
its blocks go. Hits stay exact on every family, and the disk tier still round-trips."""

from __future__ import annotations

import gc

import pytest
import torch

import hf_reference as ref
from engine import load_model
from engine.cache.block_pool import BlockPool
from engine.cache.config import CacheConfig
from engine.cache.kv import PagedKVState
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.config import ModelConfig
from engine.engine import Engine, SamplingParams
from engine.model.hybrid import HybridModel
from engine.model.random_init import hcw_hybrid_dict, init_random, qwen3_5_text_dict, write_random_model
from store.tier import DiskTier

H, D, PAGE = 2, 8, 16


def _filled(n: int, pool: BlockPool, seed: int = 0) -> PagedKVState:
    state = PagedKVState.empty(1, H, D, torch.float32, "cpu", pool=pool)
    k, v = torch.randn(2, 1, H, n, D, generator=torch.Generator().manual_seed(seed))
    state.append(k, v)
    return state


def _pool() -> BlockPool:
    return BlockPool(H, D, torch.float32, "cpu", page=PAGE)


def test_saving_a_whole_page_pins_its_blocks_and_letting_the_piece_go_unpins_them():
    pool = _pool()
    state = _filled(3 * PAGE, pool)
    assert [pool.refs[r] for r in state.runs] == [1, 1, 1]
    piece = state.export(PAGE, 2 * PAGE)["kv"]
    k, v = piece.data
    assert k.data_ptr() == pool.k[state.runs[1]].data_ptr()  # a view: not a copy
    assert pool.refs[state.runs[1]] == 3  # the state, the keys' view, the values' view
    partial = state.export(PAGE // 2, PAGE + 3)["kv"]  # not a whole page: a copy, holding nothing
    assert partial.data[0].untyped_storage().data_ptr() != pool.k.untyped_storage().data_ptr()
    assert pool.refs[state.runs[0]] == 1
    del piece, k, v
    assert pool.refs[state.runs[1]] == 1
    runs = list(state.runs)
    del state
    gc.collect()
    assert [pool.refs[r] for r in runs] == [0, 0, 0] and sorted(pool.free) == sorted(runs)


def test_a_run_of_segments_exported_at_once_is_what_one_export_each_gives():
    """The writer exports a forward pass's segments in one call (`export_segments`): whole pages as
    views of their own blocks, each holding its block until it is let go, a part of a page as a
    copy; the same pieces, bytes and holds as one `export` per segment."""
    pool = _pool()
    state = _filled(3 * PAGE + 5, pool)
    bounds = [(0, PAGE), (PAGE, 2 * PAGE), (2 * PAGE, 3 * PAGE), (3 * PAGE, 3 * PAGE + 5)]
    together = state.export_segments(bounds, [True] * 4, [False] * 4)
    one_by_one = [state.export(lo, hi) for lo, hi in bounds]
    for a, b, run in zip(together, one_by_one, state.runs):
        assert all(torch.equal(x, y) for x, y in zip(a["kv"].data, b["kv"].data))
    for piece, run in zip(together[:3], state.runs):
        assert piece["kv"].data[0].data_ptr() == pool.k[run].data_ptr()  # views of the blocks
    assert together[3]["kv"].data[0].untyped_storage().data_ptr() != pool.k.untyped_storage().data_ptr()
    assert [pool.refs[r] for r in state.runs] == [5, 5, 5, 1]  # the state, two views each way
    del one_by_one, a, b
    gc.collect()
    assert [pool.refs[r] for r in state.runs] == [3, 3, 3, 1]
    del together, piece
    gc.collect()
    assert [pool.refs[r] for r in state.runs] == [1, 1, 1, 1]


def test_a_hit_maps_the_cached_blocks_and_a_write_into_a_shared_one_copies_it_first():
    """assemble maps pieces that are views of its pool (no bytes copied); a state resumed inside a
    mapped block (seq_len past its start) copies that block before writing: the cached bytes
    never change under the piece that holds them (rule 3)."""
    pool = _pool()
    writer = _filled(3 * PAGE, pool, seed=1)
    pieces = [writer.export(j * PAGE, (j + 1) * PAGE)["kv"].data for j in range(3)]
    saved = [(k.clone(), v.clone()) for k, v in pieces]
    del writer
    template = PagedKVState.empty(1, H, D, torch.float32, "cpu", pool=pool)
    hit = template.assemble(3 * PAGE - 5, {"kv": pieces})
    assert hit.runs == [pool.owns(*p) for p in pieces] and pool.copied == 0
    assert all(pool.refs[r] == 3 for r in hit.runs)  # the hit, each piece's two views
    written = pool.written
    hit.append(torch.ones(1, H, 7, D), torch.ones(1, H, 7, D))  # positions 43..49: into block 2, shared
    assert hit.runs[:2] == [pool.owns(*p) for p in pieces[:2]] and hit.runs[2] != pool.owns(*pieces[2])
    assert pool.copied == 2 * H * (PAGE - 5) * D * 4  # the block's held positions, once
    assert pool.written - written == 2 * H * 7 * D * 4
    assert all(torch.equal(a, b) for p, s in zip(pieces, saved) for a, b in zip(p, s))
    k, _ = hit.read(3 * PAGE + 2)
    assert torch.equal(k[:, :, :3 * PAGE - 5], torch.cat([s[0] for s in saved], dim=2)[:, :, :3 * PAGE - 5])
    assert torch.equal(k[:, :, 3 * PAGE - 5:], torch.ones(1, H, 7, D))


def test_pieces_not_of_the_pool_are_copied_in_and_counted():
    """A piece from the disk tier, another pool or a drill's replacement is copied: same content."""
    pool, other = _pool(), _pool()
    elsewhere = _filled(2 * PAGE, other, seed=2)
    pieces = [elsewhere.export(0, PAGE)["kv"].data, tuple(t.clone() for t in elsewhere.export(PAGE, 2 * PAGE)["kv"].data)]
    hit = PagedKVState.empty(1, H, D, torch.float32, "cpu", pool=pool).assemble(2 * PAGE, {"kv": pieces})
    assert pool.copied == 2 * 2 * H * PAGE * D * 4
    assert all(torch.equal(a, b) for a, b in zip(hit.read(2 * PAGE), elsewhere.read(2 * PAGE)))


def test_the_pool_grows_under_the_views_it_handed_out():
    pool = _pool()
    state = _filled(PAGE, pool, seed=3)
    k, v = state.export(0, PAGE)["kv"].data
    before = k.clone()
    _filled(40 * PAGE, pool, seed=4)  # more blocks than the pool had: it moves to new storage
    assert k.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr()
    assert torch.equal(k, before) and pool.owns(k, v) == state.runs[0]


def _qwen(hidden: int = 64, layers: int = 4) -> HybridModel:
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=hidden, layers=layers))), 0).eval()
    model.use_kv_layout("paged")
    return model


def _pools(model) -> list[BlockPool]:
    return [p for blk in model.layers for p in blk.mixer.__dict__.get("_kv_pools", {}).values()]


def test_the_table_drops_evictions_and_rollbacks_let_the_blocks_go():
    model = _qwen()
    cache = PrefixCache(model, CacheConfig(block_size=PAGE, checkpoint_every=1))
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 263, (5 * PAGE + 3,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        engine.start(prompt).finish()
    gc.collect()
    (pool,) = _pools(model)  # one full-attention layer
    assert pool.blocks_in_use() == 5  # the request's state is gone: only the five saved segments hold blocks
    mark = cache.mark()
    with torch.no_grad():
        engine.start(prompt + [1] * (3 * PAGE)).finish()
    gc.collect()
    assert pool.blocks_in_use() == 8
    cache.rollback(mark)
    gc.collect()
    assert pool.blocks_in_use() == 5
    first = next(iter(cache.table)).key
    cache.table.drop(first, lambda layer, kind, piece: kind == "kv")
    assert pool.blocks_in_use() == 4
    cache.table.set_budget(1)  # no host tier: everything unpinned is evicted
    gc.collect()
    assert len(cache.table.records) == 0 and all(p.blocks_in_use() == 0 for p in _pools(model))


def test_a_4k_hit_copies_only_the_new_tokens_kv_and_the_snapshots():
    """The bytes that move on a hit of a 4,096-token prefix followed by 64 new tokens: no cached
    key or value (every block of the prefix is the cached one), the new tokens' keys and values,
    and the GDN layers' snapshots."""
    model = _qwen(hidden=64, layers=4)
    cache = PrefixCache(model, CacheConfig(block_size=64, checkpoint_every=16))
    engine = Engine(model, cache=cache)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 263, (4096 + 1,), generator=g).tolist()
    with torch.no_grad():
        engine.start(prompt).finish()
        pools = _pools(model)
        copied, written = sum(p.copied for p in pools), sum(p.written for p in pools)
        run = engine.start(prompt[:4096] + torch.randint(0, 263, (64,), generator=g).tolist())
    assert run.plan.usable_tokens == 4096 and run.plan.exact
    kv = [s for s in run.state.layers if isinstance(s, PagedKVState)]
    assert sum(p.copied for p in pools) == copied == 0
    per_token = sum(2 * s.k_pool.shape[1] * s.k_pool.shape[3] * s.k_pool.element_size() for s in kv)
    assert sum(p.written for p in pools) - written == 64 * per_token
    for i, s in enumerate(run.state.layers):
        if isinstance(s, PagedKVState):  # mapped: the cached blocks themselves
            cached = {s.pool.owns(*rec.pieces[(i, "kv")].data) for rec in cache.table if rec.has(i, "kv")}
            assert set(s.runs[:4096 // 64]) <= cached
    snapshots = sum(s.nbytes() for s in run.state.layers if not isinstance(s, PagedKVState))
    run.finish()
    print(f"4K hit: KV bytes copied 0, new tokens' KV {64 * per_token} B, snapshots {snapshots} B, "
          f"a copy of the prefix's KV would be {4096 * per_token} B")


CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _families():
    return {
        "qwen3_5": lambda folder: ref.save(ref.build("qwen3_5_text", seed=5), folder),
        "qwen3_next": lambda folder: ref.save(ref.build("qwen3_next", seed=5), folder),
        "deepseek_v4": lambda folder: ref.save(ref.build_v4(seed=5, layer_types=[SWA, CSA, HCA], sliding_window=16,
                                                            compress_rates={CSA: 4, HCA: 32}, index_topk=8), folder),
        "hcw_hybrid": lambda folder: write_random_model(folder, hcw_hybrid_dict(hidden=64, window=16), seed=5),
    }


@pytest.mark.parametrize("block", [16, 24])
@pytest.mark.parametrize("family", sorted(_families()))
def test_hits_through_shared_blocks_equal_a_cold_prefill_and_survive_the_disk(family, block, tmp_path):
    """Each turn's hit (blocks mapped where the block size is a page, copied where it is not a
    power of two) gives a cold dense prefill's logits; so does a hit read back from the disk tier
    after memory is forgotten (the tier stores the pieces' bytes, and they come back as copies)."""
    model = load_model(_families()[family](tmp_path / family), device="cpu")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (90,), generator=g).tolist()
    with torch.no_grad():
        model.use_kv_layout("dense")
        cold = Engine(model)
        model.use_kv_layout("paged")
        cfg = CacheConfig(block_size=block, checkpoint_every=1)
        tier = DiskTier(tmp_path / "c.db", layout_fingerprint(model, cfg))
        engine = Engine(model, cache=PrefixCache(model, cfg, lower=tier))
        gen = engine.generate(prompt, SamplingParams(max_new_tokens=8, greedy=True))
        follow = prompt + gen.token_ids + torch.randint(0, vocab, (20,), generator=g).tolist()
        copied = sum(p.copied for p in _pools(model))
        run = engine.start(follow)
        model.use_kv_layout("dense")
        want = cold.start(follow).logits
        model.use_kv_layout("paged")
        assert run.plan.usable_tokens >= 80 and run.plan.exact
        assert (run.logits - want).abs().max().item() <= 1e-4
        if block == 16 and _pools(model):
            assert sum(p.copied for p in _pools(model)) == copied  # mapped, nothing copied
        run.finish()
        engine.cache.forget_memory()
        again = engine.start(follow)
        assert again.plan.usable_tokens >= 80 and engine.cache.metrics.lower_fetches > 0
        assert (again.logits - want).abs().max().item() <= 1e-4
        again.finish()
        tier.close()


def test_a_deep_copied_state_is_a_fork_that_shares_its_blocks_and_copies_before_writing():
    """copy.deepcopy of a paged state (bench replay continues one prefix twice): the blocks holding
    its positions are held once more, not copied; each fork's writes go to blocks of its own, so
    neither sees the other's, and letting the fork go gives its blocks back."""
    import copy

    pool = _pool()
    state = _filled(2 * PAGE + 5, pool, seed=3)
    state.reserve(4 * PAGE)  # blocks reserved past its positions: the original's alone
    before = state.read(2 * PAGE + 5)
    fork = copy.deepcopy(state)
    assert fork.runs == state.runs[:3] and [pool.refs[r] for r in state.runs] == [2, 2, 2, 1]
    a, b = torch.randn(2, 1, H, 20, D, generator=torch.Generator().manual_seed(4))
    fork.append(a, a)
    state.append(b, b)
    assert fork.runs[:2] == state.runs[:2] and fork.runs[2] != state.runs[2]  # the partial block, copied
    for s, new in ((fork, a), (state, b)):
        k, v = s.read(2 * PAGE + 25)
        assert torch.equal(k[:, :, :2 * PAGE + 5], before[0]) and torch.equal(k[:, :, 2 * PAGE + 5:], new)
        assert torch.equal(v[:, :, :2 * PAGE + 5], before[1])
    runs = list(fork.runs)
    del fork
    gc.collect()
    assert all(pool.refs[r] == 1 for r in state.runs) and all(pool.refs[r] == 0 for r in runs[2:])


def test_a_deep_copied_paged_model_state_continues_as_the_original_does():
    import copy

    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4))), 0).eval()
    model.use_kv_layout("paged")
    state = model.new_state()
    with torch.inference_mode():
        model(torch.arange(20), state)
        forked = copy.deepcopy(state)
        one = model(torch.tensor([7, 8]), state)
        two = model(torch.tensor([7, 8]), forked)
    assert torch.equal(one, two)


def test_a_view_keeps_no_old_pool_alive_after_the_pool_grows():
    """A handed-out view is moved onto the grown pool's storage and is no slice of the old pool
    tensor, so the old storage is freed while the view lives on with its bytes."""
    import weakref

    pool = _pool()
    state = _filled(PAGE, pool, seed=5)
    k, v = state.export(0, PAGE)["kv"].data
    saved = k.clone()
    old = weakref.ref(pool.k)
    grower = PagedKVState.empty(1, H, D, torch.float32, "cpu", pool=pool, capacity=40 * PAGE)
    gc.collect()
    assert old() is None and k._base is None
    assert k.untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr() and torch.equal(k, saved)
    del grower, v


def test_freed_runs_of_a_batch_are_reused():
    """A batch's blocks come in runs of B consecutive ones; runs let go are taken again, so
    requests one after another keep the pool at the size one of them needs."""
    pool = _pool()
    for seed in range(20):
        state = PagedKVState.empty(2, H, D, torch.float32, "cpu", pool=pool)
        k = torch.randn(2, H, 4 * PAGE, D, generator=torch.Generator().manual_seed(seed))
        state.append(k, k)
        assert torch.equal(state.read(4 * PAGE)[0], k)
        del state
        gc.collect()
    assert pool.k.shape[0] <= 16 and pool.blocks_in_use() == 0


def test_two_caches_of_different_block_sizes_on_one_model_each_share_their_own_blocks():
    """Caches of blocks of 16 and 32 made on one model before either runs: each makes its states in
    the pools of its own page, so each one's hit maps its cached blocks (no byte copied) and gives a
    cold dense run's logits; the second cache does not turn the first's hits into copies."""
    model = _qwen()
    engines = {block: Engine(model, cache=PrefixCache(model, CacheConfig(block_size=block, checkpoint_every=1)))
               for block in (16, 32)}
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 263, (100,), generator=g).tolist()
    follow = prompt + torch.randint(0, 263, (20,), generator=g).tolist()
    with torch.no_grad():
        model.use_kv_layout("dense")
        want = Engine(model).start(follow).logits
        model.use_kv_layout("paged")
        for block, engine in engines.items():
            engine.start(prompt).finish()
            copied = sum(p.copied for p in _pools(model))
            run = engine.start(follow)
            assert run.plan.usable_tokens == 96 and run.plan.exact
            assert sum(p.copied for p in _pools(model)) == copied  # mapped, nothing copied
            assert (run.logits - want).abs().max().item() <= 1e-4
            (kv,) = [s for s in run.state.layers if isinstance(s, PagedKVState)]
            cached = {kv.pool.owns(*rec.pieces[(3, "kv")].data) for rec in engine.cache.table}
            assert kv.page == block and set(kv.runs[:96 // block]) <= cached
            assert engine.new_state().layers[3].page == block
            run.finish()
    assert sorted(p.page for p in _pools(model)) == [16, 32]
