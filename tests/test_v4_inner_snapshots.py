"""Checkpoints without prefill stops for DeepSeek-V4-kind layers (issue 25 item 1): a V4 layer keeps
its window, its compressors' open tails and CSA overlaps (main and indexer) at each boundary the
cache marks inside a forward pass, sliced from the pass's own projections, so a prefill of any
family runs in the chunks it runs without a cache.

What a kept snapshot must equal, to the bit, is what a pass ending at that boundary leaves, given
the same layer inputs and projections that round alike. Two things round by chunking and are not
the snapshots' bookkeeping: a projection's arithmetic is picked by its row count (one row, MKL's
few-row paths, oneDNN past engine/model/direct.py's ONEDNN_MIN_MACS), so the bit-for-bit tests run
products that round every row alike (`_rowwise`); and across two whole prefills the layers' inputs
differ in their last bits (the gated delta rule, attention and MoE round by chunking:
test_chunk_invariance), so there the snapshots agree up to fp32 rounding, and to the bit once each
layer is run again, stopping at every kept boundary, on the inputs the chunked prefill gave it."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import hf_reference as ref
from test_inner_snapshots import _counting
from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.states import Kind, ModelState
from engine.config import ModelConfig
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.model import direct
from engine.model.hybrid import HybridModel
from engine.model.random_init import hcw_hybrid_dict, init_random
from engine.model.v4_attention import V4Attention

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# blocks of 16, 18 and 64 leave HCA tails partial at some boundaries, 18 CSA's too; 24 divides both rates
CSA_RATE, HCA_RATE = 4, 12
SNAPSHOTS = {Kind.WINDOW, Kind.TAIL, Kind.OVERLAP, Kind.INDEX_TAIL, Kind.INDEX_OVERLAP}
PER_SEGMENT = {Kind.COMPRESSED, Kind.INDEX_KEYS}


def _hybrid(window: int = 8) -> HybridModel:
    raw = hcw_hybrid_dict(hidden=64, window=window, csa_rate=CSA_RATE, hca_rate=HCA_RATE)
    return init_random(HybridModel(ModelConfig.from_dict(raw)), 1).eval()


_V4: dict = {}


def _deepseek_v4(tmp_path_factory) -> HybridModel:
    if "model" not in _V4:
        hf = ref.build_v4(seed=2, layer_types=[SWA, CSA, HCA], sliding_window=8,
                          compress_rates={CSA: CSA_RATE, HCA: HCA_RATE}, index_topk=4)
        _V4["model"] = load_model(ref.save(hf, tmp_path_factory.mktemp("deepseek_v4")), device="cpu")
    return _V4["model"]


@pytest.fixture(params=["hcw_hybrid", "deepseek_v4"])
def model(request, tmp_path_factory):
    return _hybrid() if request.param == "hcw_hybrid" else _deepseek_v4(tmp_path_factory)


class _RowwiseLinear(direct.Linear):
    """x @ w.T summed per row in one order whatever the row count (each output's products reduced
    along w's contiguous rows), so a pass of 2 rows and one of 200 give a position the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.unsqueeze(-2) * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias


@contextmanager
def _rowwise(model):
    """The V4 layers' projections as `_RowwiseLinear` for the block (the rest of the model as it is)."""
    linears = [mod for _, mixer in _v4_layers(model) for mod in mixer.modules() if type(mod) is direct.Linear]
    for mod in linears:
        mod.__class__ = _RowwiseLinear
    try:
        yield
    finally:
        for mod in linears:
            mod.__class__ = direct.Linear


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tensors(data) -> tuple[torch.Tensor, ...]:
    return data if isinstance(data, tuple) else (data,)


def _assert_equal(got, want, where) -> None:
    got, want = _tensors(got), _tensors(want)
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (where, g.shape, w.shape)
        assert torch.equal(g, w), (where, (g - w).abs().max().item())


def _assert_close(got, want, tol: float, where) -> None:
    got, want = _tensors(got), _tensors(want)
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=0, atol=tol), where


def _v4_layers(model) -> list[tuple[int, V4Attention]]:
    return [(i, blk.mixer) for i, blk in enumerate(model.layers) if isinstance(blk.mixer, V4Attention)]


@pytest.mark.parametrize("window", [8, 40], ids=["window-8", "window-40"])
@pytest.mark.parametrize("kind", [SWA, CSA, HCA])
def test_a_layer_keeps_what_a_pass_ending_at_each_mark_leaves(kind, window):
    """One pass with marks against the same inputs run in passes that stop at each mark: every
    snapshot kind equal to the bit at every mark, and every segment's compressed entries and index
    keys the same entries (up to the pooling's rounding over another number of windows); over
    marks where the tail is empty and partial, the window partial (a 40-token window at 16) and
    full, and the overlap from the pass or from before it (a CSA window that closed before the
    pass began). A pass that begins after `lead` tokens starts from a state holding a window, a
    tail and an overlap of its own."""
    model = _hybrid(window)
    layer = next(mixer for _, mixer in _v4_layers(model) if mixer.kind == kind)
    x = torch.randn(1, 200, 64, generator=torch.Generator().manual_seed(7))
    rates = [c.rate for c in (layer.compressor, layer.indexer and layer.indexer.compressor) if c is not None]
    seen = set()
    for lead, block in ((5, 16), (5, 24), (5, 64), (16, 18), (13, 18)):
        marks = [p for p in range(block, 200, block) if p > lead]
        with torch.no_grad(), _rowwise(model):
            whole = layer.new_state(1, torch.float32, "cpu")
            layer(x[:, :lead], whole, 0)
            whole.mark(tuple(marks))
            layer(x[:, lead:], whole, lead)
            stopped = layer.new_state(1, torch.float32, "cpu")
            layer(x[:, :lead], stopped, 0)
            for lo, hi in zip([lead, *marks], marks):
                layer(x[:, lo:hi], stopped, lo)
                want = stopped.export(hi - block, hi)
                got = whole.export(hi - block, hi)
                assert got.keys() == want.keys() and SNAPSHOTS & set(want)
                for k, piece in want.items():
                    if k in SNAPSHOTS:
                        _assert_equal(got[k].data, piece.data, (lead, block, hi, k))
                    else:  # pooled over another number of windows: rounds by chunking, as ever
                        _assert_close(got[k].data, piece.data, 1e-6, (lead, block, hi, k))
                seen.add("window full" if stopped.window.kv.shape[1] == window - 1 else "window partial")
                for m in rates:
                    seen.add("tail empty" if hi % m == 0 else "tail partial")
                    if kind == CSA and hi // m * m == lead // m * m:
                        seen.add("overlap from before the pass")
    assert "window full" in seen and ("window partial" in seen) == (window > 16)
    assert ("overlap from before the pass" in seen) == (kind == CSA)
    assert ({"tail empty", "tail partial"} <= seen) == (kind != SWA)


def _record(model, prompt, block: int, chunk: int, inside: bool = True, **cache) -> PrefixCache:
    cache = PrefixCache(model, CacheConfig(block_size=block, checkpoint_every=2, checkpoint_tail=2,
                                           checkpoint_tail_min=64, **cache))
    with pytest.MonkeyPatch.context() as patch:
        if not inside:  # the stopping prefill: every state says it cannot keep snapshots inside
            patch.setattr(ModelState, "snapshots_inside", property(lambda self: False))
        Engine(model, EngineConfig(prefill_chunk_size=chunk), cache=cache).start(prompt).finish()
    return cache


def _snapshots(cache: PrefixCache, prompt, layers: set[int]) -> dict[int, dict]:
    """Segment end -> the V4 layers' recorded snapshot pieces, for every matched segment that has them."""
    out = {}
    for view in cache.segments_of(prompt):
        pieces = {key: p.data for key, p in view.record.pieces.items() if key[0] in layers and key[1] in SNAPSHOTS}
        if pieces:
            out[(view.index + 1) * cache.block_size] = pieces
    return out


def test_a_prefill_with_a_cache_runs_in_the_chunks_it_runs_without(model, monkeypatch):
    """No chunk ends at a kept boundary any more, on either family (before, every kept boundary
    ended one), and the kept boundaries are those the stopping prefill keeps."""
    prompt = _prompt(300, model.config.vocab_size)
    assert model.new_state().snapshots_inside
    sizes = _counting(model, monkeypatch)
    with torch.no_grad():
        Engine(model, EngineConfig(prefill_chunk_size=128)).start(prompt)
        without = list(sizes)
        sizes.clear()
        inside = _record(model, prompt, block=16, chunk=128)
        with_cache = list(sizes)
        sizes.clear()
        stopped = _record(model, prompt, block=16, chunk=128, inside=False)
    assert without == with_cache == [128, 128, 44]
    assert len(sizes) > 3 and sum(sizes) == 300  # the stopping prefill's chunks, for contrast
    layers = {i for i, _ in _v4_layers(model)}
    got, want = _snapshots(inside, prompt, layers), _snapshots(stopped, prompt, layers)
    assert len(got) >= 5 and got.keys() == want.keys()
    assert any(end % 128 for end in got)  # boundaries inside a pass, not only at its ends


@pytest.mark.parametrize("block", [16, 18, 24, 64])
def test_every_kept_snapshot_is_the_one_a_stopping_prefill_takes(model, block):
    """Inside against stopped, whole prefills: the same boundaries and kinds, each piece up to
    fp32 rounding (the layers' inputs differ by chunking). Then each V4 layer run again on the
    inputs the chunked prefill gave it, stopping at every kept boundary, as the stopping prefill
    does: what the cache recorded equals that to the bit, for every snapshot kind."""
    prompt = _prompt(300, model.config.vocab_size, seed=block)
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [mixer.register_forward_pre_hook(lambda mod, args, i=i: inputs.setdefault(i, []).append(args[0]))
             for i, mixer in _v4_layers(model)]
    try:
        with torch.no_grad(), _rowwise(model):
            inside = _record(model, prompt, block, chunk=100)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        stopped = _record(model, prompt, block, chunk=100, inside=False)
    layers = set(inputs)
    got, want = _snapshots(inside, prompt, layers), _snapshots(stopped, prompt, layers)
    assert len(got) >= 3 and got.keys() == want.keys()
    assert any(end % 100 for end in got)
    for end, pieces in want.items():
        assert got[end].keys() == pieces.keys()
        for key, data in pieces.items():
            _assert_close(got[end][key], data, 1e-5, (end, key))

    kinds = set()
    cuts = sorted({*got, *range(100, 300, 100)})  # the stops, and the chunked prefill's own ends
    for i, mixer in _v4_layers(model):
        x = torch.cat(inputs[i], dim=1)
        assert x.shape[1] == 300
        state = mixer.new_state(1, x.dtype, "cpu")
        with torch.no_grad(), _rowwise(model):
            for lo, hi in zip([0, *cuts], cuts):
                mixer(x[:, lo:hi], state, lo)
                if hi in got:
                    for kind, piece in state.export(hi - block, hi).items():
                        if not piece.per_segment:
                            _assert_equal(got[hi][(i, kind)], piece.data, (block, hi, i, kind))
                            kinds.add(kind)
    assert kinds == SNAPSHOTS


def test_per_segment_pieces_of_segments_inside_a_pass_are_the_stopping_prefills(model):
    """Compressed entries and index keys are slices by position, for segments whose entries close
    inside the pass too (block 24 against rate 12: two entries a segment; block 18 against rate 4:
    four or five): each segment's equal to the stopping prefill's up to rounding, of the length
    the windows closing in it give."""
    prompt = _prompt(250, model.config.vocab_size, seed=3)
    layers = {i: mixer for i, mixer in _v4_layers(model)}
    for block in (18, 24):
        with torch.no_grad():
            inside = _record(model, prompt, block, chunk=1024)
            stopped = _record(model, prompt, block, chunk=1024, inside=False)
        views = inside.segments_of(prompt)
        assert len(views) == 250 // block
        for view, other in zip(views, stopped.segments_of(prompt)):
            lo, hi = view.index * block, (view.index + 1) * block
            for (i, kind), piece in view.record.pieces.items():
                if kind not in PER_SEGMENT:
                    continue
                comp = layers[i].compressor if kind == Kind.COMPRESSED else layers[i].indexer.compressor
                assert piece.data.shape[1] == hi // comp.rate - lo // comp.rate, (block, hi, i, kind)
                _assert_close(piece.data, other.record.pieces[(i, kind)].data, 1e-5, (block, hi, i, kind))


@pytest.mark.parametrize("block", [16, 18])
def test_a_hit_on_a_checkpoint_kept_inside_a_pass_is_exact(model, block):
    """A prompt prefilled in one pass (every checkpoint kept inside it), then an edit just after
    a kept boundary where a tail is partial (16 against rate 12, 18 against 4): the resume starts
    there, and its logits equal a cold prefill's within the exactness tests' tolerance."""
    vocab = model.config.vocab_size
    prompt = _prompt(300, vocab)
    with torch.no_grad():
        cache = _record(model, prompt, block, chunk=1024, exact_replay=False)
        kept = _snapshots(cache, prompt, {i for i, _ in _v4_layers(model)})
        resume = max(end for end in kept if end < 250 and any(end % m for m in (CSA_RATE, HCA_RATE)))
        edited = prompt[:resume + 1] + _prompt(40, vocab, seed=3)
        run = Engine(model, EngineConfig(prefill_chunk_size=1024), cache=cache).start(edited)
        cold = Engine(model).start(edited)
    assert run.plan.exact and run.plan.usable_tokens == resume
    assert (run.logits - cold.logits).abs().max().item() <= 1e-4
