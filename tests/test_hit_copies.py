"""What a hit copies (CacheMetrics.bytes_copied, reported per hit by `hcw bench replay`): with
dense KV every byte of the assembled state, with paged KV only the snapshots and the blocks it
could not map (issue 25: "bytes copied per hit reported")."""

from __future__ import annotations

import pytest
import torch

from engine.cache.assembly import Assembler
from engine.cache.config import CacheConfig
from engine.cache.kv import KVState, PagedKVState
from engine.cache.prefix_cache import PrefixCache
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_hit_counts_the_bytes_its_assembly_copied(layout, monkeypatch):
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4))), 0).eval()
    model.use_kv_layout(layout)
    cache = PrefixCache(model, CacheConfig(block_size=64, checkpoint_every=4))
    engine = Engine(model, cache=cache)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 263, (1024 + 1,), generator=g).tolist()
    assembled = []
    real = Assembler.restore

    def restore(self, plan, before_use):
        state, why = real(self, plan, before_use)
        if state is not None:  # the state as assembly hands it over, before any new token
            assembled.append([layer.nbytes() for layer in state.layers])
        return state, why
    monkeypatch.setattr(Assembler, "restore", restore)
    with torch.no_grad():
        engine.start(prompt).finish()
        before = cache.metrics.bytes_copied
        run = engine.start(prompt[:1024] + torch.randint(0, 263, (64,), generator=g).tolist())
    assert run.plan.usable_tokens == 1024 and run.plan.exact
    kinds = [type(s) for s in run.state.layers]
    kv = [n for n, kind in zip(assembled[-1], kinds) if kind in (KVState, PagedKVState)]
    snapshots = sum(n for n, kind in zip(assembled[-1], kinds) if kind not in (KVState, PagedKVState))
    assert snapshots > 0 and all(n > 0 for n in kv)
    # dense: the cached keys and values are copied into the new buffers; paged: mapped, none copied
    want = snapshots + (sum(kv) if layout == "dense" else 0)
    assert cache.metrics.bytes_copied - before == want
    run.finish()
