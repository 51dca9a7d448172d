"""Int8 GDN sketches: an approximate replay may restart from a sketch of the state instead of
zero. The sketch's error is measured exactly when it is taken, the bound it gives holds, a plan
seeded by one is labelled approximate and keeps to its budget, the exact policy never reads one,
and sketches survive the disk tier and are dropped when damaged."""

from __future__ import annotations

import pytest
import torch

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.replay import ReplayPolicy, Seeds, _seeded_bounds, bounds, choose
from engine.cache.gdn_state import sketch, unsketch
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict

B = 16


@pytest.fixture(scope="module")
def qwen():
    """A random Qwen3.5-architecture model whose GDN layers remember for hundreds of tokens (random
    decays forget within tens, where a restart from zero is already as good as exact), like the
    trained models here."""
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0)
    with torch.no_grad():
        for i in _gdn(model):
            model.layers[i].mixer.A_log.fill_(-6.0)
    return model.eval()


def _gdn(model):
    return [i for i, blk in enumerate(model.layers) if hasattr(blk.mixer, "A_log")]


def _prompts(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (160,), generator=g).tolist()
    return first, first[:120] + torch.randint(0, vocab, (20,), generator=g).tolist()  # 7 whole segments shared


def _cache(model, reuse="approximate", budget=0.25, tolerance=None, sketch_every=2, checkpoint_every=100, lower=None):
    return PrefixCache(model, CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=checkpoint_every,
                                          checkpoint_branch_point=False, sketch_every=sketch_every, reuse=reuse,
                                          replay_budget=budget, replay_tolerance=tolerance), lower=lower)


def _exact_states(model, prefix):
    engine = Engine(model)
    state = engine.new_state().track_statistics()
    engine.prefill(prefix, state)
    return state


# ---- the sketch itself ------------------------------------------------------------------------

def test_a_sketch_reports_its_own_error_exactly_in_a_quarter_of_the_bytes():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 4, 8, 16, generator=g) * torch.logspace(-3, 1, 16)  # rows of very different scales
    codes, scale, error = sketch(s)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and error.dtype == torch.float64
    measured = (s.double() - unsketch((codes, scale, error)).double()).flatten(2).norm(dim=-1)
    assert (measured <= error).all() and torch.allclose(measured, error, rtol=1e-5)
    assert 0 < (error / s.double().flatten(2).norm(dim=-1)).max() < 0.01  # int8 per row: < 1% of the norm
    nbytes = sum(t.numel() * t.element_size() for t in (codes, scale, error))
    assert nbytes < 0.33 * s.numel() * s.element_size()
    zero = sketch(torch.zeros(1, 2, 4, 4))
    assert float(zero[2].max()) == 0.0 and not unsketch(zero).any()


def test_a_replay_from_a_sketch_stays_within_its_bound(qwen):
    """The first GDN layer, replayed from the sketch at s through the whole model: its error at
    the end is at most the sketch's error times the recorded decay since s."""
    prefix = _prompts(qwen.config.vocab_size)[0][:112]
    exact = _exact_states(qwen, prefix)
    engine = Engine(qwen)
    first = _gdn(qwen)[0]
    warm = qwen.layers[first].mixer.kernel - 1
    for s in (32, 96, 112):
        at_s = _exact_states(qwen, prefix[:s])
        state = engine.new_state()
        engine.prefill(prefix, state)
        fresh = qwen.new_state()
        seeds = {}
        for i in _gdn(qwen):
            state.layers[i] = fresh.layers[i]
            seeds[i] = sketch(at_s.layers[i].recurrent)
            state.layers[i].seed = unsketch(seeds[i])
        engine.replay(prefix[s - warm:], state, s - warm, {i: s for i in _gdn(qwen)})
        assert all(state.layers[i].seed is None for i in _gdn(qwen))  # a seed is used once
        error = (state.layers[first].recurrent - exact.layers[first].recurrent).flatten(2).norm(dim=-1)
        bound = _seeded_bounds(exact.layers[first].stats[:, :112], seeds[first][2][:, None], [s])
        assert error.max().item() <= bound.item() + 1e-7
        # and far below what a restart from zero at s certifies
        assert bound.item() < 0.05 * bounds(exact.layers[first].stats[:, :112])[s].item()


# ---- choosing a start -------------------------------------------------------------------------

def _decay(groups: int, g: float = -0.01, n: float = 10.0) -> torch.Tensor:
    """[1, groups, 1, 2]: a constant log-decay per group and a constant norm bound."""
    return torch.stack([torch.full((1, groups, 1), g), torch.full((1, groups, 1), n)], dim=-1)


def test_a_fixed_budget_takes_the_lowest_bound_within_it_and_never_a_sketch_outside():
    decay = {0: _decay(64)}  # 64 tokens, stride 1
    seeds = Seeds((16, 48, 60), {0: torch.tensor([[[1e-4], [1e-2], [1e-3]]], dtype=torch.float64)})
    pick = choose(ReplayPolicy("approximate", budget=20), 64, decay, warmup=3, seeds=seeds)
    # 16 is outside the budget (its replay would begin at 13); of 48 and 60, 60's bound is lower
    assert pick.seed == 60 and pick.seeded == (0,) and pick.begin == 57 and 64 - pick.begin <= 20
    assert pick.bound == pytest.approx(1e-3 * torch.exp(torch.tensor(-0.04, dtype=torch.float64)).item(), rel=1e-5)
    without = choose(ReplayPolicy("approximate", budget=20), 64, decay, warmup=3)
    assert without.seed is None and without.begin == 44 and without.bound > 1  # from zero: 10 * e^-0.17
    # a budget the sketch's warm-up does not fit in: the zero starts inside it remain
    assert choose(ReplayPolicy("approximate", budget=5), 64, decay, warmup=3, seeds=seeds).seed is None


def test_adaptive_takes_the_latest_start_within_tolerance():
    decay = {0: _decay(64), 1: _decay(64, g=-0.5)}
    errors = {0: torch.tensor([[[1e-4], [5e-3]]], dtype=torch.float64),
              1: torch.tensor([[[1e-4], [1e-4]]], dtype=torch.float64)}
    seeds = Seeds((16, 48), errors)
    pick = choose(ReplayPolicy("approximate", budget=None, tolerance=1e-3), 64, decay, warmup=3, seeds=seeds)
    # 48: layer 0's bound 5e-3 * e^-0.16 > 1e-3; 16: 1e-4 * e^-0.48 within; no zero start after 16 is
    assert pick.seed == 16 and pick.begin == 13 and pick.bound <= 1e-3
    loose = choose(ReplayPolicy("approximate", budget=None, tolerance=1e-2), 64, decay, warmup=3, seeds=seeds)
    assert loose.seed == 48 and loose.bound <= 1e-2
    assert loose.seeded == (0, 1) and dict(loose.starts) == {0: 48, 1: 48}
    # a layer whose zero start bounds lower than its sketch keeps the zero start
    decay[1] = _decay(64, g=-50.0)  # layer 1 forgets everything within a token
    mixed = choose(ReplayPolicy("approximate", budget=None, tolerance=1e-2), 64, decay, warmup=3, seeds=seeds)
    assert mixed.seed == 48 and mixed.seeded == (0,) and dict(mixed.bounds)[1] < 1e-300


# ---- through the cache ------------------------------------------------------------------------

def _resume(model, **kw):
    cache = _cache(model, **kw)
    engine = Engine(model, cache=cache)
    first, second = _prompts(model.config.vocab_size)
    engine.start(first).finish()
    run = engine.start(second)
    run.finish()
    return run, cache


def test_a_seeded_resume_is_labelled_budgeted_and_within_its_bound(qwen):
    run, cache = _resume(qwen, budget=0.25)
    plan = run.plan
    assert plan.replay_seed is not None and plan.replay_seed % (2 * B) == 0 and plan.replay_seeded
    assert not plan.exact and plan.usable_tokens == 112 and 0 < plan.replay_tokens <= 28
    summary = plan.summary()
    assert summary["exact"] is False and summary["replay_seed"] == plan.replay_seed
    assert any("int8 GDN sketches" in o["path"] and "approximate" in o["path"] for o in summary["objects"])
    second = _prompts(qwen.config.vocab_size)[1]
    exact = _exact_states(qwen, second[:112])
    first = _gdn(qwen)[0]
    # the state the cache restores for that plan (seeds set by the cache), replayed by the engine:
    # its first GDN layer before the question's tokens
    fresh = _cache(qwen, budget=0.25)  # (the run above cached `second` itself)
    Engine(qwen, cache=fresh).start(_prompts(qwen.config.vocab_size)[0]).finish()
    again, state, ticket = fresh.lookup(second)
    fresh.admission.release(ticket)
    assert again.replay_seed == plan.replay_seed and all(state.layers[i].seed is not None for i in plan.replay_seeded)
    Engine(qwen).replay(second[again.replay_from:112], state, again.replay_from, dict(again.replay_starts))
    error = (state.layers[first].recurrent - exact.layers[first].recurrent).flatten(2).norm(dim=-1).max().item()
    assert 0 < error <= plan.replay_bound + 1e-7
    # and the answer is close to a cold prefill's: closer than a replay of the same length from zero
    cold = Engine(qwen).start(second).logits
    zero, _ = _resume(qwen, budget=plan.replay_tokens, sketch_every=0)
    assert zero.plan.replay_seed is None and zero.plan.replay_tokens == plan.replay_tokens
    assert (run.logits - cold).abs().max() < (zero.logits - cold).abs().max()


def test_the_exact_policy_never_reads_a_sketch(qwen):
    run, cache = _resume(qwen, reuse="exact")
    assert run.plan.exact and run.plan.replay_seed is None and run.plan.replay_bound == 0.0
    assert any(k == "sketch" for r in cache.table for (_, k) in r.pieces)  # there were some to read


def test_sketches_are_kept_where_no_checkpoint_is_and_only_there(qwen):
    cache = _cache(qwen, sketch_every=2, checkpoint_every=4)
    Engine(qwen, cache=cache).start(_prompts(qwen.config.vocab_size)[0]).finish()
    by_boundary = {}
    for node in cache.index.match(_prompts(qwen.config.vocab_size)[0]).segments:
        rec = cache.table.get(node.key)
        kinds = {k for (_, k), p in rec.pieces.items() if not p.per_segment}
        by_boundary[(rec.index + 1)] = kinds
    assert by_boundary[2] == {"sketch"} and by_boundary[6] == {"sketch"}  # every 2nd segment, no checkpoint
    assert by_boundary[4] == by_boundary[8] == {"recurrent", "conv"}  # a checkpoint: no sketch beside it
    assert by_boundary[1] == by_boundary[3] == set()
    rec = cache.table.get(cache.index.match(_prompts(qwen.config.vocab_size)[0]).segments[1].key)
    full = sum(p.nbytes() for (i, k), p in cache.table.get(
        cache.index.match(_prompts(qwen.config.vocab_size)[0]).segments[3].key).pieces.items() if k == "recurrent")
    assert sum(p.nbytes() for (_, k), p in rec.pieces.items() if k == "sketch") < 0.33 * full


def test_an_approximate_resume_writes_no_sketches(qwen):
    run, cache = _resume(qwen, budget=0.25)
    written = [cache.table.get(n.key) for n in cache.index.match(_prompts(qwen.config.vocab_size)[1]).segments[7:]]
    assert written and all(not r.exact for r in written)
    assert not any(k == "sketch" for r in written for (_, k) in r.pieces)


@pytest.mark.parametrize("damage, layer_no", [("dtype", "layer 4"), ("position", "layer 1")])
def test_a_damaged_sketch_is_dropped_and_the_replay_restarts_from_zero(qwen, damage, layer_no):
    cache = _cache(qwen, budget=0.25)
    engine = Engine(qwen, cache=cache)
    first, second = _prompts(qwen.config.vocab_size)
    engine.start(first).finish()
    plan = cache.validator.plan(len(second), cache.index.match(second), cache.table)
    rec = cache.table.get(plan.keys[plan.replay_seed // B - 1])
    layer = plan.replay_seeded[0]
    piece = rec.pieces[(layer, "sketch")]
    codes, scale, error = piece.data
    rec.pieces[(layer, "sketch")] = (type(piece)(False, (codes.float(), scale, error), piece.position)  # not int8
                                     if damage == "dtype" else type(piece)(False, piece.data, piece.position - B))
    run = engine.start(second)
    assert cache.metrics.validation_failures[layer_no] == 1
    assert (layer, "sketch") not in rec.pieces
    assert not run.plan.exact and run.plan.replay_from is not None
    assert run.plan.replay_seed != plan.replay_seed or layer not in run.plan.replay_seeded


def test_sketches_survive_the_disk_tier(qwen, tmp_path):
    from engine.cache.prefix_cache import layout_fingerprint
    from store.tier import DiskTier

    cfg = CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=100, checkpoint_branch_point=False, sketch_every=2)
    first, second = _prompts(qwen.config.vocab_size)
    tier = DiskTier(tmp_path / "hcw.db", layout_fingerprint(qwen, cfg))
    Engine(qwen, cache=PrefixCache(qwen, cfg, lower=tier)).start(first).finish()
    tier.close()
    # a new cache over the same database only: the approximate resume is seeded from disk
    tier = DiskTier(tmp_path / "hcw.db", layout_fingerprint(qwen, cfg))
    approx = PrefixCache(qwen, CacheConfig(**{**cfg.__dict__, "reuse": "approximate", "replay_budget": 0.25}), lower=tier)
    run = Engine(qwen, cache=approx).start(second)
    assert run.plan.replay_seed is not None and not run.plan.exact and approx.metrics.lower_fetches
    in_memory, _ = _resume(qwen, budget=0.25)
    assert run.plan.replay_seed == in_memory.plan.replay_seed
    assert torch.allclose(run.logits, in_memory.logits, atol=1e-5)
    tier.close()


def test_bad_sketch_settings_are_refused():
    with pytest.raises(ValueError, match="sketch_every"):
        CacheConfig(sketch_every=-1)


def test_a_request_that_recomputes_through_a_kept_checkpoint_never_drops_it(qwen):
    """A later request that adds only a sketch at a boundary another request checkpointed (here
    refused reuse, so it recomputes through it) drops nothing of that checkpoint at its end."""
    cache = _cache(qwen, reuse="exact", sketch_every=2)
    engine = Engine(qwen, cache=cache)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, qwen.config.vocab_size, (65,), generator=g).tolist()  # its prompt ends at boundary 4
    b = a[:64] + torch.randint(0, qwen.config.vocab_size, (60,), generator=g).tolist()
    engine.start(a).finish()
    key = cache.index.match(a).segments[3].key
    assert {k for (_, k), p in cache.table.get(key).pieces.items() if not p.per_segment} == {"recurrent", "conv"}
    admit = cache.admission.admit
    cache.admission.admit = lambda plan: None if plan.usable_tokens else admit(plan)  # rule 1 refuses the hit
    engine.start(b).finish()
    cache.admission.admit = admit
    assert {k for (_, k), p in cache.table.get(key).pieces.items() if not p.per_segment} == {"recurrent", "conv"}
    assert engine.start(a).plan.usable_tokens == 64
