"""A miss is a value: the validator and the lower tiers report (kind, detail), counters key on the
kind, and what the user reads is "kind: detail" as before."""

from __future__ import annotations

import torch

from engine.cache.config import CacheConfig
from engine.cache.faults import MemoryTier
from engine.cache.miss import Miss
from engine.cache.prefix_cache import PrefixCache
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict
from store.tier import Miss as TierMiss

B = 16


def _model():
    return init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0)


def test_a_miss_reads_as_kind_colon_detail_on_both_sides_of_the_tier_interface():
    assert str(Miss("layer 3", "kv missing in layers [1]")) == "layer 3: kv missing in layers [1]"
    assert str(TierMiss("checksum", "blob 0:kv:0")) == "checksum: blob 0:kv:0"
    assert f"{Miss('io', 'disk: full')}" == "io: disk: full"  # a colon in the detail stays in the detail
    assert Miss("io", "disk: full").kind == "io"


def test_last_lookup_is_the_event_the_latest_lookup_recorded():
    model = _model()
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1))
    assert cache.last_lookup is None
    prompt = torch.randint(0, 263, (3 * B,), generator=torch.Generator().manual_seed(0)).tolist()
    Engine(model, cache=cache).start(prompt).finish()
    first = cache.last_lookup
    assert first is cache.events[-1] and first.outcome == "miss"
    cache.lookup(prompt + [1])
    assert cache.last_lookup is cache.events[-1] and cache.last_lookup is not first
    assert cache.last_lookup.plan.usable_tokens == 3 * B


def test_a_validation_failure_is_counted_by_its_kind_and_shown_as_its_text():
    model = _model()
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1))
    prompt = torch.randint(0, 263, (3 * B,), generator=torch.Generator().manual_seed(1)).tolist()
    Engine(model, cache=cache).start(prompt).finish()
    cache.forget_memory()  # indexed, but no record: layer 3
    plan, _, _ = cache.lookup(prompt + [1])
    assert plan.failures == (Miss("layer 3", "segment 0 has no state record"),)
    assert cache.metrics.validation_failures["layer 3"] == 1
    assert cache.last_lookup.reasons == ("layer 3: segment 0 has no state record",)
    assert plan.summary()["failures"] == ["layer 3: segment 0 has no state record"]


def test_a_lower_tier_miss_is_counted_by_its_kind_and_named_in_the_event():
    model = _model()
    lower = MemoryTier()
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1), lower=lower)
    prompt = torch.randint(0, 263, (3 * B,), generator=torch.Generator().manual_seed(2)).tolist()
    Engine(model, cache=cache).start(prompt).finish()
    cache.forget_memory()
    lower.mode = "fail"
    plan, _, _ = cache.lookup(prompt + [1])
    assert plan.usable_tokens == 0 and cache.metrics.lower_failures == {"io": 1}
    assert "lower tier: segment 0: io: injected read error (EIO); recomputed from there" in cache.last_lookup.reasons[-1]
