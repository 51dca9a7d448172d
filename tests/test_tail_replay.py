"""Tail-Replay: GDN states rebuilt by replaying a budgeted suffix from zero, every other layer's
cached state read exactly and never overwritten; approximate results are labelled, never taken
under the exact policy, and exact whenever the window reaches a checkpoint or the prefix start."""

from __future__ import annotations

import pytest
import torch

from engine.cache.faults import MemoryTier
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.validation import ReplayPolicy, Validator
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.hybrid import HybridModel
from engine.model.random_init import hcw_hybrid_dict, init_random, qwen3_5_text_dict

B = 16


def _model(raw) -> HybridModel:
    return init_random(HybridModel(ModelConfig.from_dict(raw)), 0).eval()


@pytest.fixture(scope="module")
def qwen():
    return _model(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))


def _prompts(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (160,), generator=g).tolist()
    # shares 120 tokens (7 whole segments) with the first, then goes elsewhere
    second = first[:120] + torch.randint(0, vocab, (20,), generator=g).tolist()
    return first, second


def _resume(model, budget, reuse="approximate", checkpoint_every=100, lower=None, branch_point=True):
    """The second prompt's run after the first was cached: checkpoints only at the first
    boundary (the branch point), the prompt end and the request end (every 100 segments and no
    dense tail: never in between)."""
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=checkpoint_every, reuse=reuse,
                                           replay_budget=budget, checkpoint_branch_point=branch_point), lower=lower)
    engine = Engine(model, cache=cache)
    first, second = _prompts(model.config.vocab_size)
    engine.start(first).finish()
    run = engine.start(second)
    run.finish()
    cold = Engine(model).start(second).logits
    return run, cache, (run.logits - cold).abs().max().item()


def test_replaying_the_whole_prefix_is_exact(qwen):
    run, _, diff = _resume(qwen, budget=10_000, branch_point=False)
    assert run.plan.replay_from == 0 and run.plan.usable_tokens == 112 and run.plan.exact
    assert diff <= 1e-4


def test_a_checkpoint_inside_the_window_is_used_exactly(qwen):
    run, _, diff = _resume(qwen, budget=0.5, checkpoint_every=2)  # checkpoints every 32 tokens
    assert run.plan.replay_from is None and run.plan.exact and run.plan.usable_tokens == 96
    assert diff <= 1e-4


@pytest.mark.parametrize("budget, allowed", [(0.25, 28), (40, 40), (0.05, 5)])
def test_an_approximate_resume_is_labelled_and_keeps_to_its_budget(qwen, budget, allowed):
    run, cache, diff = _resume(qwen, budget)
    plan = run.plan
    assert plan.replay_from is not None and not plan.exact
    assert plan.usable_tokens == 112 and 0 < plan.replay_tokens <= allowed
    summary = plan.summary()
    assert summary["exact"] is False and summary["replay"] == [plan.replay_from, 112]
    assert any("tail replay" in o["path"] and "approximate" in o["path"] for o in summary["objects"])
    assert cache.events[-1].plan is plan and torch.isfinite(run.logits).all()
    # what the request wrote after an approximate resume is itself approximate
    written = [cache.table.get(n.key) for n in cache.index.match(_prompts(qwen.config.vocab_size)[1]).segments[7:]]
    assert written and all(not r.exact for r in written)


def _replayed_state_error(model, prefix, r):
    """Largest error of the GDN states rebuilt by replaying the last r tokens of `prefix` from
    zero (every other layer's state exact), against the states of a full prefill."""
    engine = Engine(model)
    exact = engine.new_state()
    engine.prefill(prefix, exact)
    state = engine.new_state()
    engine.prefill(prefix, state)
    fresh = model.new_state()
    gdn = [i for i, layer in enumerate(state.layers) if hasattr(layer, "recurrent")]
    for i in gdn:
        state.layers[i] = fresh.layers[i]
    engine.replay(prefix[len(prefix) - r:], state, len(prefix) - r)
    assert state.seq_len == len(prefix)
    return max((state.layers[i].recurrent - exact.layers[i].recurrent).abs().max().item() for i in gdn)


def test_a_budget_too_small_to_rebuild_the_conv_state_falls_back_to_exact(qwen):
    run, _, diff = _resume(qwen, budget=2)  # the conv state needs the 3 tokens before the restart
    assert run.plan.replay_from is None and run.plan.exact and diff <= 1e-4


def test_a_short_replay_is_approximate_and_a_longer_one_closer(qwen):
    prefix = _prompts(qwen.config.vocab_size)[0][:112]
    errors = [_replayed_state_error(qwen, prefix, r) for r in (1, 4, 16, 112)]
    assert errors[0] > 1e-3  # dropping the older state changes it: the result is approximate
    assert errors[0] >= errors[1] >= errors[2]
    assert errors[-1] <= 1e-5  # the whole prefix from zero: exact


def test_cached_kv_is_never_overwritten_by_replayed_values(qwen):
    cache = PrefixCache(qwen, CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=100, reuse="approximate", replay_budget=8))
    engine = Engine(qwen, cache=cache)
    first, second = _prompts(qwen.config.vocab_size)
    engine.start(first).finish()
    records = [cache.table.get(n.key) for n in cache.index.match(second).segments]
    before = {(j, k): tuple(t.clone() for t in p.data) for j, r in enumerate(records) for k, p in r.pieces.items()
              if p.per_segment}
    run = engine.start(second)
    run.finish()
    assert run.plan.replay_from is not None
    for (j, k), tensors in before.items():
        now = records[j].pieces[k].data
        assert all(torch.equal(a, b) for a, b in zip(tensors, now)), (j, k)


def test_the_exact_policy_never_takes_an_approximate_plan_or_record(qwen):
    run, cache, diff = _resume(qwen, budget=8, reuse="exact")
    # no checkpoint near: an exact replay from the prefix start, never the budget's tail
    assert run.plan.exact and run.plan.replay_from == 0 and run.plan.replay_bound == 0.0 and diff <= 1e-4
    # records written after an approximate resume are refused under the exact policy
    run, cache, _ = _resume(qwen, budget=8)
    exact = Validator(B, cache.layout, cache.validator.requirements, ReplayPolicy("exact"))
    second = _prompts(qwen.config.vocab_size)[1]
    plan = exact.plan(len(second) + 8, cache.index.match(second + [1] * 8), cache.table)
    assert plan.usable_tokens <= 112 and plan.exact
    assert any("approximate" in str(f) for f in plan.failures)


def test_approximate_records_never_reach_the_lower_tier(qwen):
    tier = MemoryTier()
    run, cache, _ = _resume(qwen, budget=8, lower=tier)
    approximate = {r.key for r in cache.table if not r.exact}
    assert approximate and not approximate & set(tier.rows)


@pytest.fixture(scope="module")
def mixed():
    """Every layer kind: GDN, sliding window, compressed-sparse (rate 4, indexer), heavily
    compressed (rate 16), full attention; window 8."""
    return _model(hcw_hybrid_dict(hidden=64))


def test_windows_and_compressors_replay_the_whole_prefix_exactly(mixed):
    run, _, diff = _resume(mixed, budget=10_000, branch_point=False)
    assert run.plan.replay_from == 0 and run.plan.usable_tokens == 112 and run.plan.exact
    assert diff <= 1e-4


@pytest.mark.parametrize("budget, allowed", [(0.25, 28), (40, 40)])
def test_a_replay_through_windows_and_compressors_is_labelled_and_budgeted(mixed, budget, allowed):
    run, cache, diff = _resume(mixed, budget)
    plan = run.plan
    assert plan.replay_from is not None and not plan.exact and plan.usable_tokens == 112
    # the window and the compressors' tails need 16 tokens (the rate-16 window) before the end
    assert 16 <= plan.replay_tokens <= allowed
    assert any("window" in note and "rebuilt" in note for note in plan.notes)
    rebuilt = next(o for o in plan.summary()["objects"] if "tail replay" in o["path"])
    assert {"recurrent", "window", "tail", "overlap", "index_tail"} <= set(rebuilt["kind"].split(","))
    assert torch.isfinite(run.logits).all() and 0 < diff
    written = [cache.table.get(n.key) for n in cache.index.match(_prompts(mixed.config.vocab_size)[1]).segments[7:]]
    assert written and all(not r.exact for r in written)


def test_a_budget_below_a_window_falls_back_to_exact(mixed):
    run, _, diff = _resume(mixed, budget=12)  # the rate-16 compressor's window does not fit in 12 tokens
    assert run.plan.replay_from is None and run.plan.exact and diff <= 1e-4


def test_windows_tails_and_overlaps_are_rebuilt_as_a_full_prefill_leaves_them():
    """With the V4-kind layers below the only GDN layer their inputs are exact during a replay, so
    what the replay rebuilds (window, tails, overlaps) and reads (entries, indexer keys) must equal
    a full prefill's state; only the GDN layer differs, and so the logits."""
    model = _model(hcw_hybrid_dict(hidden=64, layer_types=("sliding_attention", "compressed_sparse_attention",
                                                           "heavily_compressed_attention", "linear_attention")))
    run, _, diff = _resume(model, budget=0.25)
    assert run.plan.replay_from is not None and not run.plan.exact
    cold = Engine(model).start(_prompts(model.config.vocab_size)[1]).state
    for i in range(3):
        ours, ref = run.state.layers[i], cold.layers[i]
        assert ours.replay_end is None and ours.window.end == ref.window.end
        assert torch.allclose(ours.window.kv, ref.window.kv, atol=1e-5)
        for a, b in ((ours.compressor, ref.compressor), (ours.indexer, ref.indexer)):
            if b is None:
                continue
            assert torch.allclose(a.entries, b.entries, atol=1e-5)
            assert torch.allclose(a.tail_kv, b.tail_kv, atol=1e-5) and torch.allclose(a.tail_gate, b.tail_gate, atol=1e-5)
            if b.overlap_kv is not None:
                assert torch.allclose(a.overlap_kv, b.overlap_kv, atol=1e-5)
                assert torch.allclose(a.overlap_gate, b.overlap_gate, atol=1e-5)
    assert diff > 0  # the GDN layer above them restarted from zero


def test_a_recurrent_budget_never_trims_what_exact_reuse_needs(qwen):
    """Decay statistics are optional (their own cache group); trimming recurrent states under a
    group budget must leave exact reuse from the remaining checkpoints."""
    cfg = CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=2, group_budgets=(("recurrent", 60_000),))
    engine = Engine(qwen, cache=PrefixCache(qwen, cfg))
    prompt = _prompts(qwen.config.vocab_size)[0]
    engine.start(prompt).finish()
    run = engine.start(prompt + [3, 4, 5])
    assert run.plan.usable_tokens > 0 and not any("decay" in str(f) for f in run.plan.failures)
    assert (run.logits - Engine(qwen).start(prompt + [3, 4, 5]).logits).abs().max().item() <= 1e-4


def test_statistics_are_kept_only_for_the_cache_and_trimmed_as_segments_are_exported(qwen):
    engine = Engine(qwen)
    plain = engine.new_state()
    engine.prefill(list(range(100)), plain)
    gdn = [layer for layer in plain.layers if hasattr(layer, "tracking")]
    assert all(layer.stats_end == 0 for layer in gdn)  # no cache, no statistics
    cache = PrefixCache(qwen, CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=1))
    run = Engine(qwen, cache=cache).start(list(range(100)))
    for layer in (x for x in run.state.layers if hasattr(x, "tracking")):
        assert layer.stats_end == 100 and layer.stats_start == 96  # exported through the last boundary


def test_bad_budgets_and_policies_are_refused():
    with pytest.raises(ValueError, match="budget must be > 0"):
        CacheConfig(reuse="approximate", replay_budget=0)
    with pytest.raises(ValueError, match="needs a budget, a tolerance"):
        CacheConfig(reuse="approximate", replay_budget=None)
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        CacheConfig(reuse="approximate", replay_tolerance=-1.0)
    with pytest.raises(ValueError, match="reuse must be"):
        CacheConfig(reuse="sometimes")


# ---- the certificate ---------------------------------------------------------------------

def _trained_replayable(tmp_path_factory):
    """A GDN + full-attention hcw_hybrid after a few training steps (decays no longer random)."""
    from workbench.tiny.train import TrainConfig, train

    cfg = TrainConfig(hidden=64, seq_len=96, batch_size=4, steps=12, minutes=5, warmup=2, log_every=100, halvings=0,
                      layers=("linear_attention", "full_attention", "linear_attention", "full_attention"))
    _, model = train(cfg, tmp_path_factory.mktemp("trained"), progress=lambda line: None)
    return model.requires_grad_(False)


@pytest.fixture(scope="module", params=["random", "trained"])
def replayable(request, tmp_path_factory, qwen):
    return qwen if request.param == "random" else _trained_replayable(tmp_path_factory)


def _gdn_layers(model):
    return [i for i, blk in enumerate(model.layers) if hasattr(blk.mixer, "A_log")]


def test_the_recorded_norm_bound_holds_and_chunking_does_not_change_it(replayable):
    prefix = _prompts(replayable.config.vocab_size)[0][:100]
    engine = Engine(replayable)
    whole, chunked = engine.new_state().track_statistics(), engine.new_state().track_statistics()
    engine.prefill(prefix, whole)
    engine.prefill(prefix, chunked, chunk_size=7)
    decoded = engine.new_state().track_statistics()
    engine.prefill(prefix[:90], decoded)
    for token in prefix[90:]:
        engine.decode(token, decoded)
    for i in _gdn_layers(replayable):
        a, b, c = whole.layers[i], chunked.layers[i], decoded.layers[i]
        assert a.stats_end == b.stats_end == c.stats_end == 100
        assert torch.allclose(a.stats[:, :100], b.stats[:, :100], rtol=1e-4, atol=1e-6)
        assert torch.allclose(a.stats[:, :100], c.stats[:, :100], rtol=1e-4, atol=1e-6)
        true_norm = a.recurrent.flatten(2).norm(dim=-1)  # [B, H] Frobenius per head
        assert (true_norm <= a.stats[:, 99, :, 1] + 1e-6).all()


def test_the_bound_holds_for_every_layer_given_its_inputs(replayable):
    """Each GDN layer replayed from zero at s with its exact inputs: error <= the bound."""
    from engine.cache.replay import bounds

    prefix = _prompts(replayable.config.vocab_size)[0][:112]
    inputs = {}
    hooks = [replayable.layers[i].mixer.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.__setitem__(i, args[0])) for i in _gdn_layers(replayable)]
    engine = Engine(replayable)
    exact = engine.new_state().track_statistics()
    engine.prefill(prefix, exact)
    for h in hooks:
        h.remove()
    checked = 0
    for i in _gdn_layers(replayable):
        mixer, x = replayable.layers[i].mixer, inputs[i]
        bound = bounds(exact.layers[i].stats[:, :112])
        warm = mixer.kernel - 1
        for s in (1, 20, 64, 100, 111):
            fresh = mixer.new_state(1, replayable.dtype, replayable.device)
            with torch.inference_mode():
                mixer(x[:, max(0, s - warm):s], fresh, start=-1)
                fresh.recurrent = torch.zeros_like(fresh.recurrent)
                mixer(x[:, s:], fresh, start=-1)
            error = (fresh.recurrent - exact.layers[i].recurrent).flatten(2).norm(dim=-1).max().item()
            assert error <= bound[s].item() + 1e-6, (i, s, error, bound[s].item())
            checked += error > 0
    assert checked  # the replays were approximate, not trivially exact


def test_the_first_gdn_layer_is_certified_through_the_whole_model(replayable):
    from engine.cache.replay import bounds

    prefix = _prompts(replayable.config.vocab_size)[0][:112]
    engine = Engine(replayable)
    exact = engine.new_state().track_statistics()
    engine.prefill(prefix, exact)
    first = _gdn_layers(replayable)[0]
    bound = bounds(exact.layers[first].stats[:, :112])
    for s in (8, 40, 100):
        state = engine.new_state()
        engine.prefill(prefix, state)
        fresh = replayable.new_state()
        for i in _gdn_layers(replayable):
            state.layers[i] = fresh.layers[i]
        warm = replayable.layers[first].mixer.kernel - 1
        engine.replay(prefix[s - warm:], state, s - warm, {i: s for i in _gdn_layers(replayable)})
        error = (state.layers[first].recurrent - exact.layers[first].recurrent).flatten(2).norm(dim=-1).max().item()
        assert error <= bound[s].item() + 1e-6


def test_adaptive_replay_picks_the_shortest_replay_within_tolerance_in_every_layer(replayable):
    plans = {}
    for tolerance in (1e-1, 1e-3, 1e-6):
        cache = PrefixCache(replayable, CacheConfig(block_size=B, checkpoint_tail=0, checkpoint_every=100, reuse="approximate",
                                                    replay_budget=None, replay_tolerance=tolerance,
                                                    checkpoint_branch_point=False))
        engine = Engine(replayable, cache=cache)
        first, second = _prompts(replayable.config.vocab_size)
        engine.start(first).finish()
        run = engine.start(second)
        plans[tolerance] = run.plan
        assert run.plan.replay_from is not None and run.plan.replay_bound <= tolerance
        assert {layer for layer, _ in run.plan.replay_starts} == set(_gdn_layers(replayable))
        assert len({start for _, start in run.plan.replay_starts}) == 1  # one restart: the earliest any layer needs
        assert "error bound" in run.plan.summary()["objects"][1]["path"] or run.plan.exact
    # a tighter tolerance never replays less
    lengths = [plans[t].replay_tokens for t in (1e-1, 1e-3, 1e-6)]
    assert lengths == sorted(lengths)


def test_every_approximate_plan_reports_its_bound(qwen):
    run, _, _ = _resume(qwen, budget=16)
    assert not run.plan.exact and run.plan.replay_bound > 0
    assert run.plan.summary()["replay_bound"] == run.plan.replay_bound
    assert f"{run.plan.replay_bound:.2e}" in run.plan.objects[1].path


# ---- hcw bench replay ----------------------------------------------------------------------

def test_bench_replay_measures_every_policy_on_the_same_tasks(tmp_path):
    import json

    from typer.testing import CliRunner

    from engine.model.random_init import write_random_model
    from workbench.cli import app

    from safetensors.torch import load_file, save_file

    folder = write_random_model(tmp_path / "q", qwen3_5_text_dict(hidden=64, layers=4, attn_every=2), seed=2)
    # GDN layers that remember for hundreds of tokens (random decays forget within tens), as trained ones do
    weights = load_file(folder / "model.safetensors")
    save_file({k: torch.full_like(v, -6.0) if k.endswith("A_log") else v for k, v in weights.items()},
              folder / "model.safetensors")
    res = CliRunner().invoke(app, ["bench", "replay", "--model", str(folder), "--prefix-lengths", "400",
                                   "--budgets", "0.2,adaptive", "--tasks", "2", "--sketch-every", "1", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["policy"] for r in rows] == ["exact, checkpoints", "exact, none inside", "0.2", "0.2 + sketch/1",
                                           "adaptive (tol 0.001)", "adaptive (tol 0.001) + sketch/1"]
    kept, exact, fixed, sketched, adaptive, _ = rows
    # storage: checkpoints every 4 segments, none inside the context, or a sketch at every boundary
    assert exact["gdn_bytes_per_1k"] == fixed["gdn_bytes_per_1k"] == 0 < kept["gdn_bytes_per_1k"]
    assert 0 < sketched["gdn_bytes_per_1k"] < 4 * kept["gdn_bytes_per_1k"]
    assert sketched["seeded"] == 2 and fixed["seeded"] == 0 and sketched["replayed_tokens"] <= 0.2 * sketched["reused_tokens"]
    for row in (kept, exact):  # exact reuse: the full prefill's logits, so its tokens and states
        assert row["all_exact"] and row["top1_agreement"] == 1.0
        assert row["mean_kl"] <= 1e-6 and row["state_error"] <= 1e-4
    # with checkpoints it resumes at one; without, it replays the GDN layers over the whole match
    assert kept["reused_tokens"] > 0 and kept["replayed_tokens"] == 0
    assert kept["bytes_copied"] > 0  # its GDN snapshots at least (tests/test_hit_copies.py: the exact count)
    assert exact["reused_tokens"] > 0 and exact["replayed_tokens"] == exact["reused_tokens"]
    assert not fixed["all_exact"] and 0 < fixed["replayed_tokens"] <= 0.2 * fixed["reused_tokens"]
    # every GDN layer's error is reported; a replay from a sketch lands closer than one from zero
    assert set(fixed["layer_state_errors"]) == {"0", "2"} and 0 < fixed["state_error"] < 1
    assert sketched["state_error"] < 0.1 * fixed["state_error"] and sketched["max_bound"] < fixed["max_bound"]
    assert adaptive["max_bound"] <= 1e-3 and fixed["reused_tokens"] > 0
    res = CliRunner().invoke(app, ["bench", "replay", "--model", str(folder), "--budgets", "lots"])
    assert res.exit_code == 2 and "not a fraction" in res.stderr


def test_needle_tasks_put_the_needle_at_the_asked_depth():
    import random

    from engine.tokenizer import ByteTokenizer
    from workbench.tiny.data import RULER_KINDS, needle_task

    tok = ByteTokenizer()
    for kind in RULER_KINDS:
        positions = []
        for depth in (0.0, 0.5, 1.0):
            task = needle_task(random.Random(4), 2000, depth, kind)
            text = tok.decode(tok.apply_chat_template(task.context))
            assert task.answer in text and len(tok.encode(text)) > 1500
            positions.append(text.find(task.answer) / len(text))
        assert positions == sorted(positions) and positions[0] < 0.2 and positions[-1] > 0.8, (kind, positions)
    with pytest.raises(ValueError, match="unknown task kind"):
        needle_task(random.Random(0), 100, 0.5, "haystack")


def test_a_replay_runs_no_layer_after_the_last_one_it_rebuilds(qwen):
    """Layers after the last GDN layer keep nothing from a replay (full attention only reads its
    cache): the engine's replay stops before them, and the states it rebuilds are bit for bit
    those of a replay through the whole model."""
    from engine.cache.gdn_state import GDNState

    ids = torch.randint(0, qwen.config.vocab_size, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    kinds = [isinstance(s, GDNState) for s in qwen.new_state().layers]
    last = max(i for i, gdn in enumerate(kinds) if gdn)
    assert last < len(kinds) - 1  # the stack ends in full attention, as Qwen3.5's does
    ran: list[int] = []
    hooks = [blk.mixer.register_forward_pre_hook(lambda mod, args, i=i: ran.append(i))
             for i, blk in enumerate(qwen.layers)]
    try:
        engine = Engine(qwen)
        states = []
        for rebuild_only in (False, True):
            state = engine.new_state()
            engine.prefill(ids, state)
            for i, gdn in enumerate(kinds):
                if gdn:
                    state.layers[i].recurrent = torch.zeros_like(state.layers[i].recurrent)
            ran.clear()
            with torch.inference_mode():
                out = qwen(torch.tensor(ids[80:]), state, replay_from=80, rebuild_only=rebuild_only)
            assert (out is None) == rebuild_only
            assert max(ran) == (last if rebuild_only else len(kinds) - 1)
            states.append([t.clone() for i, gdn in enumerate(kinds) if gdn
                           for t in (state.layers[i].recurrent, state.layers[i].conv)])
    finally:
        for h in hooks:
            h.remove()
    assert all(torch.equal(a, b) for a, b in zip(*states))
    with pytest.raises(ValueError, match="rebuild_only"):
        qwen(torch.tensor(ids[:4]), None, rebuild_only=True)



@pytest.mark.parametrize("family", ["qwen3_5", "hcw_hybrid"])
def test_a_resume_that_replays_answers_the_same_with_the_early_stop_or_without(qwen, family, monkeypatch):
    """An approximate resume (Tail-Replay) through the engine, with the replay stopping after the
    last layer it rebuilds and with it forced through every layer: the same logits. hcw_hybrid's
    last rebuilt layer is a DeepSeek-V4 kind (windows, compressor tails), not a GDN layer."""
    model = qwen if family == "qwen3_5" else _model(hcw_hybrid_dict(hidden=64))
    run, _, _ = _resume(model, budget=0.5)
    assert run.plan.replay_from is not None
    forward = HybridModel.forward

    def every_layer(self, *args, rebuild_only=False, **kwargs):
        out = forward(self, *args, **kwargs)  # the whole stack, whatever the replay asked
        return None if rebuild_only else out

    monkeypatch.setattr(HybridModel, "forward", every_layer)
    again, _, _ = _resume(model, budget=0.5)
    assert again.plan.replay_from == run.plan.replay_from
    assert (again.logits - run.logits).abs().max().item() <= 1e-6
