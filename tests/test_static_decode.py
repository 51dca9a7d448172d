"""Static decode (engine/static_decode.py): the step a CUDA graph captures, with tensor positions,
a reserved paged KV pool and GDN states updated in place. On CPU it runs uncaptured, so these tests
compare it with the ordinary decode; the capture itself is tested on CUDA only."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.gdn_state import GDNState
from engine.cache.kv import PagedKVState
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine import Engine, SamplingParams
from engine.model.hybrid import HybridModel
from engine.model.random_init import hcw_hybrid_dict, init_random, qwen3_5_text_dict
from engine.static_decode import StaticDecoder, StaticUnsupported

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _qwen(hidden=128, layers=4, device="cpu"):  # 2 query heads over 1 key-value head: GQA
    model = HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=hidden, layers=layers)))
    return init_random(model, 0).eval().to(device)


def _ids(n, seed=3, device="cpu"):
    return torch.randint(0, 263, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def _eager(model, ids, prefill, track=False):
    state = model.new_state()
    if track:
        state.track_statistics()
    out = [model(ids[:, :prefill], state)[:, -1]]
    out += [model(ids[:, i:i + 1], state)[:, -1] for i in range(prefill, ids.shape[1])]
    return out, state


def test_static_steps_give_the_ordinary_decode_logits_across_blocks_and_a_rebuild():
    """From a dense-KV prefill (moved into a pool), across 64-position blocks, up to the capacity
    and on with a new decoder: every step's logits are the ordinary decode's."""
    model = _qwen()
    ids = _ids(200)
    with torch.no_grad():
        expected, _ = _eager(model, ids, 60)
        state = model.new_state()
        got = [model(ids[:, :60], state)[:, -1]]
        decoder = StaticDecoder(model, state, capacity=128)
        assert any(isinstance(layer, PagedKVState) for layer in state.layers)
        for i in range(60, 128):
            got.append(decoder.step(int(ids[0, i])))
        assert not decoder.fits(state)
        with pytest.raises(IndexError, match="capacity"):
            decoder.step(0)
        decoder = StaticDecoder(model, state)
        got += [decoder.step(int(ids[0, i])) for i in range(128, 200)]
    assert len(got) == len(expected) and state.seq_len == 200
    assert max((a - b).abs().max().item() for a, b in zip(got, expected)) <= 1e-5


def test_static_steps_record_the_same_gdn_statistics():
    """A state the cache records keeps per-token decay statistics; the static step writes them to
    a fixed buffer and the decoder appends them: the same statistics and norm bound as eagerly."""
    model = _qwen()
    ids = _ids(90)
    with torch.no_grad():
        _, expected = _eager(model, ids, 30, track=True)
        state = model.new_state().track_statistics()
        model(ids[:, :30], state)
        decoder = StaticDecoder(model, state)
        for i in range(30, 90):
            decoder.step(int(ids[0, i]))
    for a, b in zip(state.layers, expected.layers):
        if isinstance(a, GDNState):
            used = a.stats_end - a.stats_start
            assert (a.stats_start, a.stats_end) == (b.stats_start, b.stats_end) == (0, 90)
            assert torch.allclose(a.stats[:, :used], b.stats[:, :used], rtol=1e-6, atol=1e-7)
            assert torch.allclose(a.norm, b.norm, rtol=1e-9)


def test_static_steps_with_the_triton_kernels_forced(monkeypatch):
    """The step's kernels through Triton (the interpreter on CPU): paged decode at a tensor
    position, the GDN recurrent step writing into the state in place."""
    model = _qwen(hidden=32)
    ids = _ids(70)
    with torch.no_grad():
        expected, _ = _eager(model, ids, 62)
        dispatch.select("triton")
        state = model.new_state()
        got = [model(ids[:, :62], state)[:, -1]]
        decoder = StaticDecoder(model, state)
        got += [decoder.step(int(ids[0, i])) for i in range(62, 70)]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected)) <= 1e-4


def test_the_engine_decodes_statically_when_asked_and_the_cache_stays_exact(monkeypatch):
    """EngineConfig.static (HCW_STATIC=1): the engine's decode goes through a StaticDecoder (re-made when a turn's prefill
    moved past its capacity); the tokens are the ordinary ones and the segments it recorded give
    an exact hit."""
    model = _qwen()
    prompt = _ids(70)[0].tolist()
    params = SamplingParams(max_new_tokens=24, greedy=True)
    with torch.no_grad():
        plain = Engine(model).generate(prompt, params).token_ids
        engine = Engine(model, EngineConfig(static=True),
                        cache=PrefixCache(model, CacheConfig(block_size=16, checkpoint_every=1)))
        gen = engine.generate(prompt, params)
        decoder = gen.state.extra.get("static")
        assert isinstance(decoder, StaticDecoder) and gen.token_ids == plain
        assert decoder.fingerprint()[0] == engine.cache.topology  # rule 4's fingerprint, frozen with the buffers
        follow = prompt + gen.token_ids + _ids(10, seed=4)[0].tolist()
        run = engine.start(follow)
        cold = Engine(model).start(follow)
    assert run.plan.exact and run.plan.usable_tokens >= 80
    assert (run.logits - cold.logits).abs().max().item() <= 1e-4


def test_a_model_the_static_step_does_not_cover_decodes_as_usual(monkeypatch):
    model = init_random(HybridModel(ModelConfig.from_dict(hcw_hybrid_dict(hidden=64))), 1).eval()
    prompt = _ids(30)[0].tolist()
    with torch.no_grad():
        gen = Engine(model, EngineConfig(static=True)).generate(prompt, SamplingParams(max_new_tokens=4, greedy=True))
    assert gen.state.extra["static"] is False and len(gen.token_ids) == 4


def test_the_topology_fingerprint_sees_every_moved_buffer_and_the_statistics_switch(monkeypatch):
    """What the guard compares before replaying a captured step: a prefill that replaces a GDN
    state, a state that starts recording statistics, or RoPE tables rebuilt longer (they are the
    model's, shared by every state) all change it."""
    model = _qwen()
    ids = _ids(40)
    with torch.no_grad():
        state = model.new_state()
        model(ids[:, :30], state)
        decoder = StaticDecoder(model, state, capacity=64)
        decoder.step(int(ids[0, 30]))
        before = decoder.fingerprint()
        assert decoder.fingerprint() == before  # nothing moved
        model(ids[:, 31:35], state)  # a turn's prefill on the same state: GDN states are new tensors
        assert decoder.fingerprint() != before
        moved = decoder.fingerprint()
        state.track_statistics()
        tracked = decoder.fingerprint()
        assert tracked != moved
        attention = next(blk.mixer for blk in model.layers if hasattr(blk.mixer, "rotary"))
        held = next(iter(attention.rotary._tables.values()))[0].shape[0]
        attention.rotary.reserve(held + 1, attention.head_dim, model.dtype, model.device)
        assert decoder.fingerprint() != tracked  # the shared RoPE tables were rebuilt (found in review)
    assert EngineConfig.from_env({"HCW_STATIC": "1"}).static and not EngineConfig.from_env({}).static
    with pytest.raises(ValueError, match="HCW_STATIC"):
        EngineConfig.from_env({"HCW_STATIC": "2"})


def test_models_whose_step_reads_values_back_are_not_taken():
    """A mixture of experts routes by reading the router's choice back (bincount, tolist), which a
    captured step cannot do: such a model is refused up front, like other layer kinds."""
    raw = qwen3_5_text_dict(hidden=64, layers=4)
    raw.update(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, decoder_sparse_step=1)
    model = init_random(HybridModel(ModelConfig.from_dict(raw)), 0).eval()
    state = model.new_state()
    with torch.no_grad():
        model(_ids(10), state)
    with pytest.raises(StaticUnsupported, match="mixture-of-experts"):
        StaticDecoder(model, state)


def test_a_model_that_starts_with_full_attention_on_a_dense_state(monkeypatch):
    """(Found in review: the batch size was read off the first layer as if it were a GDN state.)"""
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=128, layers=2, attn_every=2)
                                                          | {"layer_types": ["full_attention", "linear_attention"]})), 0).eval()
    model.use_kv_layout("dense")
    ids = _ids(80)
    with torch.no_grad():
        expected, _ = _eager(model, ids, 60)
        state = model.new_state()
        got = [model(ids[:, :60], state)[:, -1]]
        decoder = StaticDecoder(model, state)
        got += [decoder.step(int(ids[0, i])) for i in range(60, 80)]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected)) <= 1e-5


def test_statistics_that_do_not_continue_are_not_recorded_as_the_ordinary_decode_does():
    """A state that starts recording after its prefill has no statistics to continue: the ordinary
    decode records nothing for it, nor may the static step (found in review)."""
    model = _qwen()
    ids = _ids(50)
    ends = []
    with torch.no_grad():
        for static in (False, True):
            state = model.new_state()
            model(ids[:, :40], state)
            state.track_statistics()
            decoder = StaticDecoder(model, state) if static else None
            for i in range(40, 50):
                decoder.step(int(ids[0, i])) if static else model(ids[:, i:i + 1], state)
            ends.append([(s.stats_end, s.norm.clone()) for s in state.layers if isinstance(s, GDNState)])
    for (end_a, norm_a), (end_b, norm_b) in zip(*ends):
        assert end_a == end_b == 0 and torch.equal(norm_a, norm_b)


@cuda
def test_on_cuda_the_step_is_captured_once_and_recaptured_when_buffers_move():
    model = _qwen(hidden=128, layers=4, device="cuda")
    ids = _ids(160, device="cuda")
    with torch.no_grad():
        expected, _ = _eager(model, ids, 60)  # [0]: after the prompt, [j]: after the token at 59 + j
        state = model.new_state()
        got = [model(ids[:, :60], state)[:, -1]]
        decoder = StaticDecoder(model, state)
        got += [decoder.step(int(ids[0, i])) for i in range(60, 120)]
        assert decoder.captures == 1 and decoder.graph is not None
        got.append(model(ids[:, 120:130], state)[:, -1])  # a new turn's prefill: the GDN states move
        got += [decoder.step(int(ids[0, i])) for i in range(130, 160)]
        assert decoder.captures == 2 and decoder.guard.mismatches >= 1
    reference = expected[:61] + [expected[70]] + expected[71:]
    assert len(got) == len(reference)
    assert max((a - b).abs().max().item() for a, b in zip(got, reference)) <= 2e-3
