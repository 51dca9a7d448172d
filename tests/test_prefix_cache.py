"""Reuse never changes the output: multi-turn chats with branches and resumes, on every family,
give the logits of a full prefill; every missing state is routed, named and recomputed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_reference as ref
from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.prefix_index import PrefixIndex, segment_hash
from engine.engine import Engine, SamplingParams

B = 16
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _hybrid(folder):
    from engine.model.random_init import hcw_hybrid_dict, write_random_model

    return write_random_model(folder, hcw_hybrid_dict(vocab=97), seed=4, byte_tokenizer=False)


def _families():
    return {
        "hcw_hybrid": _hybrid,
        "qwen3_5": lambda: ref.build("qwen3_5_text", seed=2),
        "qwen3_next": lambda: ref.build("qwen3_next", seed=2),
        "deepseek_v4": lambda: ref.build_v4(seed=2, layer_types=[SWA, CSA, HCA], sliding_window=8,
                                           compress_rates={CSA: 4, HCA: 32}, index_topk=4),
    }


_LOADED: dict = {}


def _load(family, tmp_path_factory):
    if family not in _LOADED:
        folder = tmp_path_factory.mktemp(family)
        build = _families()[family]
        built = build(folder) if family == "hcw_hybrid" else ref.save(build(), folder)
        _LOADED[family] = load_model(built, device="cpu")
    return _LOADED[family]


@pytest.fixture(scope="module", params=sorted(_families()))
def model(request, tmp_path_factory):
    return _load(request.param, tmp_path_factory)


# the state kinds each family keeps, and so the drills that apply to it
KINDS = {
    "qwen3_5": ["kv", "recurrent", "conv"],
    "qwen3_next": ["kv", "recurrent", "conv"],
    "deepseek_v4": ["window", "compressed", "tail", "overlap", "index_keys", "index_tail", "index_overlap"],
    "hcw_hybrid": ["kv", "recurrent", "conv", "window", "compressed", "tail", "overlap", "index_keys", "index_tail",
                   "index_overlap"],
}


def _cold_logits(model, prompt):
    """The oracle: one stateful prefill from nothing."""
    return Engine(model).start(prompt).logits


def _turn(engine, prompt, new_tokens=12):
    run = engine.start(prompt)
    assert (run.logits - _cold_logits(engine.model, prompt)).abs().max().item() <= 1e-4
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, greedy=True))
    return run.plan, gen


def test_multi_turn_chat_with_branches_and_resumes_is_exact(model):
    engine = Engine(model, cache=PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=2)))
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731

    turn1 = rand(70)
    plan, gen1 = _turn(engine, turn1)
    assert plan.logical_tokens == 0
    # turn 2 continues turn 1: its prompt starts with everything turn 1 fed through the model
    turn2 = turn1 + gen1.token_ids + rand(25)
    plan, gen2 = _turn(engine, turn2)
    assert plan.usable_tokens >= 64 and plan.exact
    # a branch: edit turn 2's new text; the shared prefix is reused up to a kept checkpoint
    branch = turn1 + gen1.token_ids + rand(30)
    plan, _ = _turn(engine, branch)
    assert plan.usable_tokens >= 64
    # resume the first branch after the other one
    turn3 = turn2 + gen2.token_ids + rand(10)
    plan, _ = _turn(engine, turn3)
    assert plan.usable_tokens >= len(turn2) // B * B - 2 * B
    metrics = engine.metrics()
    assert metrics["hits"] >= 3 and metrics["usable_hit_tokens"] > 0


def _warm(model, length=90, **cfg):
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1, **cfg))
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.start(prompt).finish()
    return engine, prompt


def _records(engine, prompt):
    return [engine.cache.table.get(node.key) for node in engine.cache.index.match(prompt).segments]


def test_a_plain_hit_reuses_every_whole_segment(model):
    engine, prompt = _warm(model)
    run = engine.start(prompt + [5, 6, 7])
    assert run.plan.usable_tokens == len(prompt) // B * B
    assert not run.plan.degraded or run.plan.logical_tokens > run.plan.usable_tokens
    assert (run.logits - _cold_logits(model, prompt + [5, 6, 7])).abs().max().item() <= 1e-4


def _drill(model, predicate, expect_kind):
    """Remove the pieces `predicate(segment_index, layer, kind)` selects, then check the hit is
    still exact, the plan names the kind and its path, and the event is not silent."""
    engine, prompt = _warm(model)
    for rec in _records(engine, prompt):
        engine.cache.table.drop(rec.key, lambda layer, kind, p, j=rec.index: predicate(j, layer, kind))
    query = prompt + [9, 9, 9]
    run = engine.start(query)
    assert (run.logits - _cold_logits(model, query)).abs().max().item() <= 1e-4
    event = engine.cache.events[-1]
    recovered = {o.kind: o for o in run.plan.objects if o.action.value == "recover"}
    assert expect_kind in recovered, run.plan.summary()
    assert recovered[expect_kind].path and recovered[expect_kind].reason
    assert event.outcome in ("degraded", "recomputed") and event.reasons
    return run.plan


def test_the_drill_list_covers_every_kind_each_family_keeps(model):
    from engine.cache.validation import OPTIONAL_KINDS

    kinds = {kind for pieces in PrefixCache(model, CacheConfig(block_size=B)).template_pieces for kind in pieces}
    assert kinds - OPTIONAL_KINDS == set(KINDS[model.config.model_type.replace("_text", "")])
    # GDN layers also keep decay statistics, which only approximate reuse needs
    assert ("decay" in kinds) == ("recurrent" in kinds)


@pytest.mark.parametrize("family, kind", [(f, k) for f, kinds in sorted(KINDS.items()) for k in kinds])
def test_every_missing_state_kind_is_routed_and_the_output_stays_exact(family, kind, tmp_path_factory):
    model = _load(family, tmp_path_factory)
    per_segment = kind in ("kv", "compressed", "index_keys")
    # per-segment kinds: drop segment 2's slice; snapshots: drop the last two boundaries' copies
    plan = _drill(model, lambda j, layer, k: k == kind and (j == 2 if per_segment else j >= 3), kind)
    assert plan.usable_tokens == (2 * B if per_segment else 3 * B)


def test_version_change_between_check_and_use_replans(model, monkeypatch):
    engine, prompt = _warm(model)
    cache = engine.cache
    fired = []

    def bump(plan):
        if not fired:
            fired.append(True)
            rec = cache.table.get(plan.keys[-1])
            rec.version += 1  # as a concurrent writer would
    monkeypatch.setattr(cache, "before_use", bump)
    run = engine.start(prompt + [1])
    assert cache.metrics.replans == 1 and "changed between check and use" in cache.events[-1].replan_reason
    assert (run.logits - _cold_logits(model, prompt + [1])).abs().max().item() <= 1e-4


def test_a_buffer_compute_cannot_take_fails_layer_4_and_is_recomputed(model):
    engine, prompt = _warm(model)
    rec = _records(engine, prompt)[-1]
    key, piece = next((k, p) for k, p in rec.pieces.items() if not p.per_segment and p.data is not None)
    first = piece.data[0] if isinstance(piece.data, tuple) else piece.data
    wrong = first.to(torch.float64)  # e.g. a snapshot decoded from disk in the wrong dtype
    rec.pieces[key] = replace(piece, data=(wrong, *piece.data[1:]) if isinstance(piece.data, tuple) else wrong)
    run = engine.start(prompt + [2])
    assert engine.cache.metrics.validation_failures["layer 4"] >= 1
    assert "layer 4" in engine.cache.events[-1].replan_reason
    assert run.plan.usable_tokens < len(prompt) // B * B
    assert (run.logits - _cold_logits(model, prompt + [2])).abs().max().item() <= 1e-4


def test_eviction_under_budget_never_takes_pinned_segments(model):
    engine, prompt = _warm(model)
    table = engine.cache.table
    keys = [r.key for r in _records(engine, prompt)]
    table.pin(keys[:2])
    table.set_budget(1)
    assert all(k in table for k in keys[:2]) and not any(k in table for k in keys[2:])
    table.unpin(keys[:2])
    run = engine.start(prompt + [3])
    assert run.plan.usable_tokens == 0 or run.plan.usable_tokens <= 2 * B
    assert (run.logits - _cold_logits(model, prompt + [3])).abs().max().item() <= 1e-4


def test_the_policy_changes_on_a_running_cache_and_rollback_drops_what_came_after(model):
    engine, prompt = _warm(model)
    keep = engine.cache.mark()
    engine.cache.set_policy("off")
    assert engine.start(prompt + [4]).plan.usable_tokens == 0
    engine.cache.set_policy("exact")
    longer = prompt + list(range(40))
    run = engine.start(longer)
    run.finish()
    assert run.plan.usable_tokens == len(prompt) // B * B and len(list(engine.cache.table)) > len(keep)
    assert engine.cache.rollback(keep) > 0 and engine.cache.mark() == keep
    assert engine.start(longer).plan.usable_tokens == len(prompt) // B * B  # the longer prompt's segments are gone
    # an exact recompute from the start adds checkpoints to segments that were there: rolled back too
    engine.cache.rollback(keep)
    records = _records(engine, prompt)
    for rec in records[1:]:
        engine.cache.table.drop(rec.key, lambda layer, kind, p: not p.per_segment)
    bare = engine.cache.mark()
    engine.start(prompt + [7]).finish()
    assert engine.cache.mark() != bare
    engine.cache.rollback(bare)
    assert engine.cache.mark() == bare
    with pytest.raises(ValueError, match="reuse must be"):
        engine.cache.set_policy("sometimes")


def test_reuse_off_never_reuses(model):
    engine, prompt = _warm(model, reuse="off")
    assert engine.start(prompt + [4]).plan.usable_tokens == 0


def test_forced_hash_collisions_are_caught_by_token_comparison():
    weak = lambda parent, fp, data: bytes([sum(data) % 2]) * 16  # noqa: E731  (1 bit of hash)
    index = PrefixIndex(4, b"fp", hash_fn=weak)
    assert index.insert(b"\0" * 16, 0, [1, 2, 3, 4]) is not None
    # [2, 2, 3, 3] hashes like [1, 2, 3, 4]: a hit by hash, refused by tokens
    match = index.match([2, 2, 3, 3, 7])
    assert match.segments == [] and match.collisions == 1
    assert index.insert(b"\0" * 16, 0, [2, 2, 3, 3]) is None and index.collisions == 2
    assert index.match([1, 2, 3, 4, 7]).segments[0].tokens == (1, 2, 3, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=26), min_size=1, max_size=6))
def test_a_match_after_other_matches_is_a_fresh_index_match(queries):
    """match() takes the keys of the segments a request shares with the last one matched from it:
    whatever came before, each result is the one a fresh index gives (and the hash is never
    skipped for a segment that differs)."""
    def filled():
        index = PrefixIndex(4, b"fp")
        parent = b"\0" * 16
        for j, seg in enumerate(([1, 2, 3, 0], [0, 1, 2, 3], [3, 3, 3, 3], [2, 2, 2, 2])):
            parent = index.insert(parent, j, seg).key
        index.insert(index.keys_for([1, 2, 3, 0])[-1], 1, [1, 1, 1, 1])  # a branch
        return index
    reused = filled()
    for tokens in queries + [[1, 2, 3, 0, 0, 1, 2, 3, 3, 3, 3, 3], [1, 2, 3, 0, 1, 1, 1, 1, 0]]:
        got, expected = reused.match(tokens), filled().match(tokens)
        assert [n.key for n in got.segments] == [n.key for n in expected.segments]
        assert got.logical_tokens == expected.logical_tokens and got.collisions == expected.collisions
    # a match that stops half way (here the hash raises) leaves the kept keys true to their bytes
    budget = {"calls": None}

    def flaky(parent, fp, data):  # the same hash, failing once its budget of calls is spent
        if budget["calls"] is not None:
            budget["calls"] -= 1
            if budget["calls"] < 0:
                raise RuntimeError("interrupted")
        return segment_hash(parent, fp, data)
    reused.hash_fn = flaky
    reused.match([1, 2, 3, 0, 1, 1, 1, 1, 0])
    budget["calls"] = 1
    with pytest.raises(RuntimeError):  # shares the first segment with the last match; fails at the third
        reused.match([1, 2, 3, 0, 0, 1, 2, 3, 3, 3, 3, 3, 2, 2, 2, 2])
    budget["calls"] = None
    for tokens in ([1, 2, 3, 0, 1, 1, 1, 1, 0], [1, 2, 3, 0, 0, 1, 2, 3, 3, 3, 3, 3, 2, 2, 2, 2]):
        assert [n.key for n in reused.match(tokens).segments] == [n.key for n in filled().match(tokens).segments]
    weak = lambda parent, fp, data: b"\1" * 16  # noqa: E731  (a new hash: the kept keys no longer apply)
    reused.hash_fn = weak
    assert reused.match([1, 2, 3, 0, 0, 1, 2, 3]).segments == []


# B = 16; the V4 fixtures use window 8 and compress rates 4 and 32: lengths around each of them
@pytest.mark.parametrize("length", sorted({1, B - 1, B, B + 1, 2 * B, 2 * B + 1, 3 * B + 5, 3, 4, 5, 7, 8, 9,
                                           31, 32, 33, 63, 64, 65}))
def test_boundary_matrix_usable_length(model, length):
    engine, prompt = _warm(model, length=max(length, 1))
    # a prompt equal to the cached one leaves its last token to compute; one token more reuses all
    # whole segments: snapshots at each kept boundary carry the open windows' tails, so the
    # compress rates and the window never cut the usable length
    same = engine.start(prompt)
    longer = engine.start(prompt + [1])
    assert same.plan.usable_tokens == (length - 1) // B * B
    assert longer.plan.usable_tokens == length // B * B
    assert (longer.logits - _cold_logits(model, prompt + [1])).abs().max().item() <= 1e-4


def test_a_window_snapshot_from_another_boundary_is_caught_not_used(model):
    engine, prompt = _warm(model)
    records = _records(engine, prompt)
    last, earlier = records[-1], records[-2]
    moved = [k for k, p in earlier.pieces.items() if not p.per_segment]
    for key in moved:  # every snapshot of the last boundary replaced by the one before it
        last.pieces[key] = earlier.pieces[key]
    run = engine.start(prompt + [8])
    assert "layer 1" in engine.cache.events[-1].replan_reason
    assert run.plan.usable_tokens < len(prompt) // B * B
    assert (run.logits - _cold_logits(model, prompt + [8])).abs().max().item() <= 1e-4


def test_every_drill_on_every_family_is_exact_named_and_never_silent(model):
    from engine.cache.faults import DRILLS, run_drills

    reports = {r.drill: r for r in run_drills(model, prompt_len=80, block_size=B)}
    assert set(reports) == set(DRILLS)
    for r in reports.values():
        assert not r.silent and r.max_logit_diff <= 1e-4, r.as_dict()
        # a version bump re-plans and a topology change runs eager: the cached state itself is fine
        if r.applies and r.drill not in ("bump_version", "change_topology"):
            assert r.outcome in ("degraded", "recomputed") and r.paths and r.reasons, r.as_dict()
    assert reports["bump_version"].reasons  # re-planned, and said so
    assert any("rule 4" in r for r in reports["change_topology"].reasons)
    assert any("injected read error" in r for r in reports["fail_lower_read"].reasons)
    assert any("timeout" in r for r in reports["delay_lower_read"].reasons)
    assert reports["fail_lower_read"].usable_tokens == 0
    gdn = "linear_attention" in model.config.layer_types
    assert reports["drop_gdn_checkpoint"].applies == gdn
    assert reports["evict_compressed"].applies == ("compressed_sparse_attention" in model.config.layer_types
                                                   or "heavily_compressed_attention" in model.config.layer_types)


def test_hcw_drill_cli_reports_json_and_exit_code(tmp_path):
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    folder = _hybrid(tmp_path / "mixed")
    res = CliRunner().invoke(app, ["drill", "--model", str(folder), "--json", "--prompt-len", "64"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["silent_errors"] == 0 and len(report["drills"]) == 11
    assert all(d["applies"] for d in report["drills"])
    bad = CliRunner().invoke(app, ["drill", "--model", str(folder), "--drill", "nope"])
    assert bad.exit_code == 2 and "unknown drill" in bad.stderr


def test_admission_cap_turns_excess_recovering_hits_into_recompute(model):
    engine, prompt = _warm(model)
    cache = engine.cache
    cache.admission.max_pending = 1

    def damage():  # every hit now needs recovery (a request that recovers also repairs the cache)
        for rec in _records(engine, prompt)[-2:]:
            cache.table.drop(rec.key, lambda layer, kind, p: not p.per_segment)
    damage()
    held = engine.start(prompt + [1])  # admitted: its writer holds the ticket until finish()
    assert held.plan.usable_tokens > 0 and len(cache.admission.pending) == 1
    damage()
    refused = engine.start(prompt + [2])
    assert refused.plan.usable_tokens == 0 and cache.admission.refused == 1
    assert any("rule 1" in r for r in cache.events[-1].reasons)
    assert (refused.logits - _cold_logits(model, prompt + [2])).abs().max().item() <= 1e-4
    held.finish()
    assert engine.start(prompt + [3]).plan.usable_tokens > 0


def test_shadow_verification_and_recovery_latency_are_measured(model):
    engine, prompt = _warm(model, shadow_fraction=1.0)
    for rec in _records(engine, prompt)[-2:]:
        engine.cache.table.drop(rec.key, lambda layer, kind, p: not p.per_segment)
    engine.start(prompt + [4]).finish()
    m = engine.metrics()
    assert m["shadow"]["checks"] == 1 and m["shadow"]["mismatches"] == 0
    assert sum(h["count"] for h in m["recovery_ms"].values()) >= 1
    assert m["degraded_hits"] == 1 and m["usable_hit_tokens"] < m["logical_hit_tokens"]


def test_topology_guard_and_admission_units():
    from engine.cache.rules import AdmissionControl, TopologyGuard

    guard = TopologyGuard()
    assert guard.check(b"a")  # not frozen: eager anyway
    guard.freeze(b"a")
    assert guard.check(b"a") and not guard.check(b"b") and guard.mismatches == 1
    with pytest.raises(ValueError):
        AdmissionControl(max_pending=0)


def test_over_the_device_budget_records_go_to_host_and_come_back_exact(model):
    engine, prompt = _warm(model, host_budget_bytes=64 << 20)
    table = engine.cache.table
    table.set_budget(1)  # nothing fits on the device: everything unpinned is demoted
    assert table.demotions > 0 and table.used == 0 and all(r.tier == "host" for r in table)
    table.budget = 64 << 20
    run = engine.start(prompt + [6])
    assert run.plan.usable_tokens == len(prompt) // B * B
    assert (run.logits - _cold_logits(model, prompt + [6])).abs().max().item() <= 1e-4
    assert table.host_used == sum(r.nbytes() for r in table if r.tier == "host")


def test_evicted_records_spill_to_the_lower_tier_and_come_back_exact(model):
    from engine.cache.faults import MemoryTier

    lower = MemoryTier()
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1), lower=lower)
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.start(prompt).finish()
    lower.rows.clear()  # forget the end-of-turn save: only the spill can bring them back
    cache.persisted.clear()
    cache.table.set_budget(1)  # no host tier: every record leaves memory
    assert len(list(cache.table)) == 0 and cache.metrics.spills > 0 and lower.rows
    cache.table.budget = 64 << 20
    run = engine.start(prompt + [5])
    assert run.plan.usable_tokens == len(prompt) // B * B and cache.metrics.lower_fetches > 0
    assert (run.logits - _cold_logits(model, prompt + [5])).abs().max().item() <= 1e-4


def test_a_resent_prompt_resumes_at_its_own_last_segment_after_decoding_moved_on(model):
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=4))
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.generate(prompt, SamplingParams(max_new_tokens=20, greedy=True))  # decoding crosses boundary 96
    run = engine.start(prompt[:-1] + [7])  # the same conversation, its last user token edited
    assert run.plan.usable_tokens == 80  # the prompt-end checkpoint survived the request's end
    assert (run.logits - _cold_logits(model, prompt[:-1] + [7])).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tail", [3, 0])
def test_an_edit_near_the_end_of_a_long_prompt_resumes_at_the_boundary_before_it(model, tail):
    """A new question after a long document: the last `checkpoint_tail` boundaries before the
    prompt's end keep their snapshots, so the edit replays at most one segment; without the dense
    tail it goes back to the last every-K boundary."""
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=4, checkpoint_tail=tail,
                                           checkpoint_tail_min=160, checkpoint_branch_point=False))
    engine = Engine(model, cache=cache)
    g = torch.Generator().manual_seed(3)
    document = torch.randint(0, 97, (160,), generator=g).tolist()
    engine.start(document).finish()
    for back in (10, 20, 40):  # edits 10, 20 and 40 tokens before the end, each from the original
        edited = document[:-back] + torch.randint(0, 97, (8,), generator=g).tolist()
        run = engine.start(edited)
        kept = (len(document) - back) // B * B
        assert run.plan.usable_tokens == (kept if tail and kept >= len(document) - tail * B else kept // (4 * B) * 4 * B)
        assert run.plan.exact
        assert (run.logits - _cold_logits(model, edited)).abs().max().item() <= 1e-4
        run.finish()


def test_no_tail_and_no_request_ends_keep_no_snapshot_before_the_prompt_end(model):
    """checkpoint_tail=0 keeps nothing of its own: with request ends and branch points off too and
    K past the prompt, no boundary keeps its snapshots and a resume that may only start at a
    checkpoint recomputes (the simulated vLLM-style baseline of benchmarks/cache_reuse.py relies on
    it); by default the exact plan replays the GDN layers from the start over the cached KV."""
    prompt = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    for replay in (False, True):
        cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=100, checkpoint_tail=0,
                                               checkpoint_request_end=False, checkpoint_branch_point=False,
                                               exact_replay=replay))
        engine = Engine(model, cache=cache)
        engine.start(prompt).finish()
        run = engine.start(prompt + [4, 5])
        if not replay:
            assert run.plan.usable_tokens == 0 and run.plan.replay_from is None
        elif cache.validator.exact_replayable:  # GDN layers and full-attention KV: the whole match replayed
            assert run.plan.usable_tokens == 80 and run.plan.replay_from == 0 and run.plan.exact
            assert run.plan.replay_bound == 0.0 and not any("budget" in n for n in run.plan.notes)
        assert (run.logits - _cold_logits(model, prompt + [4, 5])).abs().max().item() <= 1e-4


def test_a_short_prompt_part_gets_no_dense_tail(model):
    """Below checkpoint_tail_min computed prompt tokens the tail's extra prefill stops would cost
    more than they save: an edit near the end resumes at the every-K boundary."""
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=4, checkpoint_tail=3,
                                           checkpoint_tail_min=161, checkpoint_branch_point=False))
    engine = Engine(model, cache=cache)
    document = torch.randint(0, 97, (160,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.start(document).finish()
    run = engine.start(document[:-10] + [1, 2, 3])
    assert run.plan.usable_tokens == 128  # not 144: 160 computed tokens are under the minimum


def test_checkpoint_tail_and_replay_cost_settings_are_checked():
    with pytest.raises(ValueError, match="checkpoint_tail"):
        CacheConfig(checkpoint_tail=-1)
    with pytest.raises(ValueError, match="checkpoint_tail_min"):
        CacheConfig(checkpoint_tail_min=-1)
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="exact_replay_cost"):
            CacheConfig(exact_replay_cost=bad)


def test_the_exact_plan_replays_only_when_the_checkpoint_leaves_more_to_recompute(model):
    """A checkpoint close to the end of the match is resumed at; one far from it (here at the
    start: none at all) is replayed past, exactly, by replaying the whole match; the replay counts
    against the recovery budget and leaves a checkpoint where it ended, so a resend replays nothing."""
    prompt = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    usable = {}
    for every in (4, 5, 100):  # checkpoints at 192; at 80 and 160; none inside the 192-token match
        cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=every, checkpoint_tail=0,
                                               checkpoint_request_end=False, checkpoint_branch_point=False))
        engine = Engine(model, cache=cache)
        engine.start(prompt).finish()
        run = engine.start(prompt + [4])
        usable[every] = run.plan.usable_tokens, run.plan.replay_from
        assert run.plan.exact and (run.logits - _cold_logits(model, prompt + [4])).abs().max().item() <= 1e-4
        assert cache.admission.recovery_tokens(run.plan) >= run.plan.replay_tokens
        run.finish()
        again = engine.start(prompt + [4])
        assert again.plan.replay_from is None and again.plan.usable_tokens == usable[every][0]
        again.finish()
    assert usable[4] == (192, None)  # the every-4 checkpoint at 192 reaches the end of the match
    assert usable[5] == (160, None)  # 2 of 12 segments to recompute: less than any replay of all 12
    if cache.validator.exact_replayable:
        assert usable[100] == (192, 0)
    else:  # no GDN layer (DeepSeek-V4), or windows and compressors to rebuild beside them (hcw_hybrid,
        # where such a replay is slower than a prefill): the resume is at the last snapshot
        assert usable[100][1] is None and usable[100][0] < 192


def test_an_exact_replay_needs_no_decay_statistics(model):
    """Records without the GDN decay statistics (their group's budget is 0) still replay exactly."""
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=100, checkpoint_tail=0,
                                           checkpoint_request_end=False, checkpoint_branch_point=False,
                                           group_budgets=(("statistics", 0),)))
    engine = Engine(model, cache=cache)
    prompt = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(8)).tolist()
    engine.start(prompt).finish()
    assert not any(kind == "decay" for rec in cache.table for _, kind in rec.pieces)
    run = engine.start(prompt + [4])
    assert run.plan.exact and (run.logits - _cold_logits(model, prompt + [4])).abs().max().item() <= 1e-4
    assert (run.plan.replay_from == 0) == cache.validator.exact_replayable


def test_shadow_verification_catches_what_validation_cannot_and_answers_cold(model):
    engine, prompt = _warm(model, shadow_fraction=1.0)
    # damage the *values* of a per-segment piece the resume uses: same shape, dtype and position,
    # so every check passes
    rec = _records(engine, prompt)[0]

    def size(p):
        return sum(t.numel() for t in (p.data if isinstance(p.data, tuple) else (p.data,)))
    key = max((k for k, p in rec.pieces.items() if p.per_segment), key=lambda k: size(rec.pieces[k]))
    piece = rec.pieces[key]
    data = piece.data
    rec.pieces[key] = replace(piece, data=(data[0] + 1.0, *data[1:]) if isinstance(data, tuple) else data + 1.0)
    query = prompt + [3]
    run = engine.start(query)
    m = engine.metrics()["shadow"]
    assert m["checks"] == 1 and m["mismatches"] == 1
    assert (run.logits - _cold_logits(model, query)).abs().max().item() <= 1e-4
    assert rec.key not in engine.cache.table  # the damaged records are gone


def test_ordinary_requests_do_not_count_against_the_recovery_cap(model):
    engine, prompt = _warm(model)
    cache = engine.cache
    cache.admission.max_pending = 1
    open_runs = [engine.start(prompt + [i]) for i in range(3)]  # clean hits, none needs recovery
    assert all(r.plan.usable_tokens > 0 for r in open_runs) and cache.admission.refused == 0
    for r in open_runs:
        r.finish()
    assert not cache.admission.pending


def test_a_cache_group_over_its_budget_loses_only_its_own_pieces(model):
    from engine.cache.recovery import group_of

    engine, prompt = _warm(model)
    table = engine.cache.table
    group, used = max(table.group_used.items(), key=lambda kv: kv[1])
    limit = used // 3
    others = {g: u for g, u in table.group_used.items() if g != group}
    table.group_budgets = {group: limit}
    table.enforce_budget()
    assert 0 < table.group_drops and table.group_used[group] <= limit
    assert {g: u for g, u in table.group_used.items() if g != group} == others  # nobody else paid
    for g in table.group_used:
        assert table.group_used[g] == sum(p.nbytes() for r in table for (_, k), p in r.pieces.items()
                                          if group_of(k) == g)
    run = engine.start(prompt + [4])
    assert (run.logits - _cold_logits(model, prompt + [4])).abs().max().item() <= 1e-4


def test_unknown_cache_groups_are_refused():
    with pytest.raises(ValueError, match="unknown cache groups"):
        CacheConfig(group_budgets=(("bogus", 1),))


def test_a_held_segment_evicted_by_the_fetch_itself_is_fetched_too():
    """The fetch decides segment by segment whether memory holds it: putting an earlier fetched
    segment may evict a later one that was held (found in review: a fetch planned up front
    skipped it and the resume fell back to segment 1)."""
    from engine.cache.faults import MemoryTier

    model = _small_qwen()
    cache = PrefixCache(model, CacheConfig(block_size=16), lower=MemoryTier())
    engine = Engine(model, cache=cache)
    g = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(0, 263, (96,), generator=g).tolist() for _ in range(2))
    engine.start(prompt).finish()
    engine.start(other).finish()  # both on the lower tier
    mine = [n.key for n in cache.index.match(prompt).segments]
    for key in mine:
        if key != mine[3]:
            cache.table.remove(key)
    cache.table.get(mine[3]).last_access_step = 0  # held, but the first to go
    cache.table.set_budget(cache.table.used)  # any fetched segment evicts something
    plan, _, _ = cache.lookup(prompt + [1, 2])
    assert plan.usable_tokens == 96 and mine[3] in cache.table.records


def test_a_fetch_reads_each_segment_once_even_when_its_own_puts_evict_others(tmp_path):
    """Segments memory held when a read-ahead batch was planned but lost to the fetch's own puts
    are read alone; the batch is not read again (found in review: 183 rows read for 64)."""
    from engine.cache.prefix_cache import layout_fingerprint
    from store.tier import DiskTier

    model = _small_qwen()
    cfg = CacheConfig(block_size=16)
    tier = DiskTier(tmp_path / "amp.db", layout_fingerprint(model, cfg))
    cache = PrefixCache(model, cfg, lower=tier)
    prompt = torch.randint(0, 263, (16 * 64,), generator=torch.Generator().manual_seed(3)).tolist()
    Engine(model, cache=cache).start(prompt).finish()
    mine = [n.key for n in cache.index.match(prompt).segments]
    for j, key in enumerate(mine):  # every other segment held, and each the first to go
        if j % 2 == 0:
            cache.table.remove(key)
        else:
            cache.table.get(key).last_access_step = 0
    cache.table.set_budget(cache.table.used)
    asked = []
    rows = tier._rows
    tier._rows = lambda keys: asked.extend(keys) or rows(keys)
    cache.lookup(prompt + [1, 2])
    assert cache.metrics.lower_fetches == len(asked) == len(set(asked)) == 64
    tier.close()


def _small_qwen():
    """A small random Qwen3.5-style model (GDN and attention layers) for fetch tests."""
    from engine.config import ModelConfig
    from engine.model.hybrid import HybridModel
    from engine.model.random_init import init_random, qwen3_5_text_dict

    return init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0)
