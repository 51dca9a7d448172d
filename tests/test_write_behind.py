"""Write-behind spills: saves are queued and written on a background thread with its own
connection; queued segments stay readable; flush makes them durable; a failed background write
is reported and the cache forgets that segment, so the output stays exact."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.engine import Engine
from engine.config import ModelConfig
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict
from store.tier import DiskTier, Miss
from store.write_behind import WriteBehind

LAYOUT = b"\x07" * 16


def _pieces(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {(0, "kv"): (True, (torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)), 16),
            (1, "recurrent"): (False, torch.randn(1, 2, 4, 4, generator=g), 16)}


@pytest.fixture
def blocked_writer(monkeypatch):
    """DiskTier.save blocks in the write-behind thread until the test releases it."""
    release = threading.Event()
    real = DiskTier.save

    def save(self, *args):
        if threading.current_thread().name == "hcw-write-behind":
            release.wait()
        return real(self, *args)
    monkeypatch.setattr(DiskTier, "save", save)
    return release


def test_a_queued_save_returns_at_once_stays_readable_and_flush_makes_it_durable(tmp_path, blocked_writer):
    wb = WriteBehind(tmp_path / "w.db", LAYOUT)
    pieces = _pieces(1)
    assert wb.save(b"k" * 16, b"\x00" * 16, 0, bytes(8 * 16), LAYOUT, pieces) == (True, None)
    assert wb.queued == 1 and not DiskTier(tmp_path / "w.db", LAYOUT).has(b"k" * 16)
    got, why = wb.load(b"k" * 16)
    assert why is None and torch.equal(got[(1, "recurrent")][1], pieces[(1, "recurrent")][1])
    assert [r["key"] for r in wb.segments()] == [(b"k" * 16).hex()]
    blocked_writer.set()
    assert wb.flush(timeout=30)
    assert wb.queued == 0 and wb.saved == 1
    again, why = DiskTier(tmp_path / "w.db", LAYOUT).load(b"k" * 16)
    assert why is None and torch.equal(again[(0, "kv")][1][0], pieces[(0, "kv")][1][0])
    wb.close()


def test_saves_of_one_segment_merge_while_queued(tmp_path, blocked_writer):
    wb = WriteBehind(tmp_path / "m.db", LAYOUT)
    a, b = _pieces(1), _pieces(2)
    wb.save(b"s" * 16, b"\x00" * 16, 0, bytes(128), LAYOUT, {(0, "kv"): a[(0, "kv")]})
    wb.save(b"s" * 16, b"\x00" * 16, 0, bytes(128), LAYOUT, {(1, "recurrent"): b[(1, "recurrent")]})
    blocked_writer.set()
    wb.close()
    got, _ = DiskTier(tmp_path / "m.db", LAYOUT).load(b"s" * 16)
    assert set(got) == {(0, "kv"), (1, "recurrent")}


def _model():
    return init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0)


def test_spills_under_a_small_budget_go_through_the_queue_and_hits_stay_exact(tmp_path):
    model = _model()
    g = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, 263, (160,), generator=g).tolist() for _ in range(2))
    probe = PrefixCache(model, CacheConfig(block_size=16))
    Engine(model, cache=probe).start(first).finish()
    one_prompt = probe.table.used
    cfg = CacheConfig(block_size=16, budget_bytes=int(1.5 * one_prompt))  # one prompt fits, two do not
    wb = WriteBehind(tmp_path / "s.db", layout_fingerprint(model, cfg))
    engine = Engine(model, cache=PrefixCache(model, cfg, lower=wb))
    engine.start(first).finish()
    engine.start(second).finish()  # evicts much of the first: spilled through the queue
    assert engine.cache.metrics.spills > 0 and wb.queued == 0  # finish() saved and flushed
    query = first + [5, 6, 7]
    run = engine.start(query)
    cold = Engine(model).start(query).logits
    assert run.plan.usable_tokens > 0 and engine.cache.metrics.lower_fetches > 0
    assert (run.logits - cold).abs().max().item() <= 1e-4
    wb.close()


def test_a_failed_background_write_is_reported_and_the_segment_forgotten(tmp_path, monkeypatch):
    model = _model()
    cfg = CacheConfig(block_size=16, checkpoint_every=1)
    monkeypatch.setattr(DiskTier, "save", lambda self, *a: (False, Miss("io", "disk full")))
    wb = WriteBehind(tmp_path / "f.db", layout_fingerprint(model, cfg))
    cache = PrefixCache(model, cfg, lower=wb)
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 263, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.start(prompt).finish()
    assert cache.metrics.lower_failures["save: io"] > 0 and not cache.persisted
    for key in [r.key for r in cache.table]:
        cache.table.remove(key)  # as if evicted: neither memory nor disk holds it now
    run = engine.start(prompt + [1, 2])
    assert run.plan.usable_tokens == 0
    assert (run.logits - Engine(model).start(prompt + [1, 2]).logits).abs().max().item() <= 1e-4
    wb.close()


def test_an_exception_in_a_background_write_is_a_reported_failure_not_a_dead_writer(tmp_path, monkeypatch):
    calls = []

    def explode(self, *args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("encoder blew up")
        return DiskTier._real_save(self, *args)
    monkeypatch.setattr(DiskTier, "_real_save", DiskTier.save, raising=False)
    monkeypatch.setattr(DiskTier, "save", explode)
    wb = WriteBehind(tmp_path / "x.db", LAYOUT)
    wb.save(b"a" * 16, b"\x00" * 16, 0, bytes(128), LAYOUT, _pieces(1))
    assert wb.flush(timeout=30)
    assert [str(why) for _, why in wb.take_failures()] == ["unexpected: RuntimeError: encoder blew up"]
    assert wb.save(b"b" * 16, b"\x00" * 16, 1, bytes(128), LAYOUT, _pieces(2)) == (True, None)
    assert wb.flush(timeout=30) and wb.saved == 1  # the writer lived on
    wb.close()
    assert wb.save(b"c" * 16, b"\x00" * 16, 2, bytes(128), LAYOUT, _pieces(3))[0] is False


def test_load_many_serves_queued_segments_from_the_queue_and_the_rest_from_disk(tmp_path, blocked_writer):
    disk = DiskTier(tmp_path / "lm.db", LAYOUT)
    on_disk = [bytes([i]) * 16 for i in (1, 2)]
    for i, key in enumerate(on_disk):
        assert disk.save(key, b"\x00" * 16, i, bytes(8 * 16), LAYOUT, _pieces(10 + i)) == (True, None)
    wb = WriteBehind(tmp_path / "lm.db", LAYOUT)
    queued = b"q" * 16
    assert wb.save(queued, b"\x00" * 16, 2, bytes(8 * 16), LAYOUT, _pieces(3)) == (True, None)
    got = list(wb.load_many([on_disk[0], queued, on_disk[1], b"z" * 16]))
    assert [why.kind if why else "" for _, why in got] == ["", "", "", "missing"]
    assert torch.equal(got[1][0][(1, "recurrent")][1], _pieces(3)[(1, "recurrent")][1])
    assert torch.equal(got[2][0][(1, "recurrent")][1], _pieces(11)[(1, "recurrent")][1])
    blocked_writer.set()
    wb.close()


def test_a_lookup_reuses_segments_spilled_into_the_queue(blocked_writer, tmp_path):
    """Segments evicted to the write-behind queue but not written yet are still hits (found in
    review: the fetch's batched read went past the queue to the disk)."""
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0)
    cfg = CacheConfig(block_size=16)
    wb = WriteBehind(tmp_path / "spill.db", layout_fingerprint(model, cfg))
    cache = PrefixCache(model, cfg, lower=wb)
    prompt = torch.randint(0, 263, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    Engine(model, cache=cache).start(prompt)  # records made; nothing flushed
    for rec in list(cache.table):  # spilled under memory pressure: into the queue
        cache.table.remove(rec.key)
        cache._evicted(rec)
    assert wb.queued == 6
    plan, _, _ = cache.lookup(prompt + [1, 2])
    assert plan.usable_tokens == 96 and cache.metrics.lower_fetches == 6
    assert not cache.metrics.lower_failures
    blocked_writer.set()
    wb.close()


def test_a_queued_partial_save_reads_back_merged_over_what_the_disk_holds(tmp_path, blocked_writer):
    """A save merges into the stored segment (pieces it does not give are kept): read while it
    waits in the queue, the segment already shows that merge, as it will once written (found in
    review: the queued pieces alone came back)."""
    key = b"p" * 16
    first = _pieces(1)
    assert DiskTier(tmp_path / "part.db", LAYOUT).save(key, b"\x00" * 16, 0, bytes(8 * 16), LAYOUT, first) == (True, None)
    wb = WriteBehind(tmp_path / "part.db", LAYOUT)
    newer = {(1, "recurrent"): _pieces(2)[(1, "recurrent")]}
    assert wb.save(key, b"\x00" * 16, 0, bytes(8 * 16), LAYOUT, newer) == (True, None)
    for got, why in (wb.load(key), next(wb.load_many([key]))):
        assert why is None and sorted(got) == [(0, "kv"), (1, "recurrent")]
        assert torch.equal(got[(1, "recurrent")][1], newer[(1, "recurrent")][1])
        assert torch.equal(got[(0, "kv")][1][0], first[(0, "kv")][1][0])
    blocked_writer.set()
    assert wb.flush(timeout=30)
    written, _ = wb.load(key)
    assert sorted(written) == [(0, "kv"), (1, "recurrent")]
    assert torch.equal(written[(1, "recurrent")][1], newer[(1, "recurrent")][1])
    wb.close()


def test_the_writer_reads_the_saved_storage_even_if_the_callers_view_is_re_pointed(tmp_path, blocked_writer):
    """A block pool that moves re-points its handed-out views (`set_`) on the engine's thread; the
    queued save holds tensors of its own over the old storage, so the writer never reads a view
    while it changes, and writes the bytes that were saved."""
    wb = WriteBehind(tmp_path / "w.db", LAYOUT)
    pieces = _pieces(2)
    view = pieces[(1, "recurrent")][1]
    want = view.clone()
    assert wb.save(b"m" * 16, b"\x00" * 16, 0, bytes(8 * 16), LAYOUT, pieces) == (True, None)
    moved = torch.zeros_like(view)
    view.set_(moved.untyped_storage(), 0, view.shape, view.stride())  # as BlockPool._move does
    blocked_writer.set()
    assert wb.flush(timeout=30)
    got, why = DiskTier(tmp_path / "w.db", LAYOUT).load(b"m" * 16)
    assert why is None and torch.equal(got[(1, "recurrent")][1], want)
    wb.close()



def test_a_queued_save_holds_its_pool_blocks_after_the_cache_lets_the_piece_go(tmp_path, blocked_writer):
    """Paged KV: a saved piece is a block pool's view, which holds its blocks until it is collected.
    The cache may evict the piece while its save is queued; the queue still holds the blocks, so the
    pool cannot give them to a new sequence that overwrites them, and the writer writes the bytes
    that were saved. Once written, the blocks are free again."""
    import gc

    from engine.cache.block_pool import BlockPool

    pool = BlockPool(2, 8, torch.float32, "cpu", page=16)
    first = pool.alloc()
    pool.k[first].copy_(torch.randn(2, 16, 8))
    pool.v[first].copy_(torch.randn(2, 16, 8))
    want = (pool.k[first].clone(), pool.v[first].clone())
    view = pool.view(first)
    pool.release(first)  # the sequence that wrote the block is gone: the view alone holds it
    wb = WriteBehind(tmp_path / "w.db", LAYOUT)
    assert wb.save(b"p" * 16, b"\x00" * 16, 0, bytes(8 * 16), LAYOUT, {(0, "kv"): (True, view, 16)}) == (True, None)
    del view
    gc.collect()  # the cache evicted the piece
    assert pool.refs[first] > 0  # still held, by the queued save
    other = pool.alloc()
    assert other != first
    pool.k[other].fill_(7.0)
    pool.v[other].fill_(7.0)
    blocked_writer.set()
    assert wb.flush(timeout=30)
    got, why = DiskTier(tmp_path / "w.db", LAYOUT).load(b"p" * 16)
    assert why is None
    assert torch.equal(got[(0, "kv")][1][0][0], want[0]) and torch.equal(got[(0, "kv")][1][1][0], want[1])
    gc.collect()
    assert pool.refs[first] == 0  # written: the writer let the block go, with the writer still running
    wb.close()
