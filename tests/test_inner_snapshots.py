"""Checkpoints without prefill stops (issue 25 item 1): a Gated DeltaNet layer keeps its state at
each boundary the cache asks for inside one forward pass, so a Qwen3.5-style prefill runs in the
chunks it would run without a cache (DeepSeek-V4-kind layers: tests/test_v4_inner_snapshots.py)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.states import Kind, ModelState
from engine.config import ModelConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict


def _qwen():
    return init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0).eval()


def _prompt(n, seed=0):
    return torch.randint(0, 263, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _counting(model, monkeypatch) -> list[int]:
    """The token count of every forward pass the model runs."""
    sizes = []
    real = type(model).forward

    def forward(self, input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[-1])
        return real(self, input_ids, *args, **kwargs)
    monkeypatch.setattr(type(model), "forward", forward)
    return sizes


def _checkpoints(cache: PrefixCache, prompt) -> dict[int, dict]:
    """Segment end -> its recorded GDN snapshot pieces, for every matched segment that has them."""
    out = {}
    for view in cache.segments_of(prompt):
        pieces = {key: p.data for key, p in view.record.pieces.items() if key[1] in (Kind.RECURRENT, Kind.CONV)}
        if pieces:
            out[(view.index + 1) * cache.block_size] = pieces
    return out


def _record(model, prompt, chunk, inside=True):
    cache = PrefixCache(model, CacheConfig(block_size=16, checkpoint_every=2, checkpoint_tail=2, checkpoint_tail_min=64))
    with pytest.MonkeyPatch.context() as patch:
        if not inside:  # the stopping prefill of before: every state says it cannot keep snapshots inside
            patch.setattr(ModelState, "snapshots_inside", property(lambda self: False))
        Engine(model, EngineConfig(prefill_chunk_size=chunk), cache=cache).start(prompt).finish()
    return cache


def test_a_qwen_prefill_runs_in_its_own_chunks_and_keeps_every_checkpoint(monkeypatch):
    """One forward pass per chunk with the cache as without it, and the checkpoints it keeps are
    the stopping prefill's: the same boundaries, the same states up to rounding (the projections
    of a longer pass, and the scan's front padding, round differently)."""
    model = _qwen()
    prompt = _prompt(300)
    sizes = _counting(model, monkeypatch)
    with torch.no_grad():
        inside = _record(model, prompt, chunk=128)
    assert sizes == [128, 128, 44]  # no pass cut at a boundary
    with torch.no_grad():
        stopped = _record(model, prompt, chunk=128, inside=False)
    got, want = _checkpoints(inside, prompt), _checkpoints(stopped, prompt)
    assert len(got) >= 5 and got.keys() == want.keys()
    for end, pieces in want.items():
        assert got[end].keys() == pieces.keys()
        for key, data in pieces.items():
            assert (got[end][key] - data).abs().max().item() <= 1e-5, (end, key)


def test_a_hit_on_inner_checkpoints_is_exact_and_resumes_where_the_old_one_did():
    model = _qwen()
    prompt = _prompt(300)
    with torch.no_grad():
        cache = _record(model, prompt, chunk=1024)
        engine = Engine(model, EngineConfig(prefill_chunk_size=1024), cache=cache)
        edited = prompt[:200] + _prompt(40, seed=3)  # an edit: resume at the last checkpoint before 200
        run = engine.start(edited)
        cold = Engine(model).start(edited)
    assert run.plan.exact and run.plan.usable_tokens == 192  # boundary 192 = 12 segments: every 2nd kept
    assert (run.logits - cold.logits).abs().max().item() <= 1e-4


def test_the_conv_state_kept_inside_is_the_last_inputs_before_the_boundary(monkeypatch):
    """Also at a boundary fewer than K-1 tokens into the pass, where part of the window is the
    conv state the pass started from: the kept window is the pass's own projected inputs before
    the boundary (to the bit), which a pass that ended there computes too (up to the projection's
    rounding over another number of rows)."""
    model = _qwen()
    layer = next(blk.mixer for blk in model.layers if hasattr(blk.mixer, "conv1d"))
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = layer.new_state(1, torch.float32, "cpu")
        layer(x[:, :9], whole, 0)
        before = whole.conv.clone()
        whole.mark((10, 30))
        layer(x[:, 9:], whole, 9)
        qkv = layer.in_proj.split(layer.in_proj(x[:, 9:]))[0]  # the pass's conv inputs
        inputs = torch.cat([before.transpose(1, 2), qkv], dim=1)
        states = {}
        for end in (10, 30):
            one = layer.new_state(1, torch.float32, "cpu")
            layer(x[:, :9], one, 0)
            layer(x[:, 9:end], one, 9)
            states[end] = one
    for end in (10, 30):
        recurrent, conv = whole.kept[end]
        k = end - 9  # the boundary's offset into the pass
        assert torch.equal(conv, inputs[:, k:k + layer.kernel - 1].transpose(1, 2))
        assert (conv - states[end].conv).abs().max().item() <= 1e-6
        assert (recurrent - states[end].recurrent).abs().max().item() <= 1e-5


@pytest.mark.parametrize("seg", [16, 24, 64])
def test_a_run_of_segments_exports_the_pieces_each_segment_exports_alone(seg):
    """The writer exports all the boundaries a forward pass crossed in one call per layer
    (GDNState.export_segments): the same decay statistics to the bit, contiguous, the same
    snapshots and sketches where asked, and the same statistics left to export after."""
    import copy

    from engine.cache.gdn_state import GDNState

    gen = torch.Generator().manual_seed(seg)
    state = GDNState.zeros(2, 12, 4, 3, 8, 8, torch.float32, "cpu")
    state.tracking = True
    n = 4 * seg
    g = -torch.rand(2, n + 5, 3, generator=gen)
    x = torch.rand(2, n + 5, 3, generator=gen)
    state.record(0, g, x)
    state.recurrent.normal_(generator=gen)
    alone, run = copy.deepcopy(state), copy.deepcopy(state)
    bounds = [(j * seg, (j + 1) * seg) for j in range(4)]
    snaps, sketches = [False, True, False, True], [False, False, False, True]
    want = [alone.export(lo, hi, s, k) for (lo, hi), s, k in zip(bounds, snaps, sketches)]
    got = run.export_segments(bounds, snaps, sketches)
    assert [list(p) for p in got] == [list(p) for p in want]
    for w, h in zip(want, got):
        assert torch.equal(h[Kind.DECAY].data, w[Kind.DECAY].data) and h[Kind.DECAY].data.is_contiguous()
        assert h[Kind.DECAY].data.shape == (2, seg // math.gcd(16, seg), 3, 2)
        for kind in set(w) - {Kind.DECAY}:
            a, b = w[kind].data, h[kind].data
            assert all(torch.equal(u, v) for u, v in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
    assert (run.stats_start, run.stats_end) == (alone.stats_start, alone.stats_end) == (n, n + 5)
