"""The C decode kernel (kernels/native) against the torch path it replaces, and how it is built.

The kernel tests run with HCW_NATIVE=1: a machine where it cannot be built fails them instead of
quietly testing the torch path twice."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import dispatch

import kernels.native as native
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.gdn_state import GDNState
from engine.cache.kv import KVState, PagedKVState
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine import Engine, SamplingParams
from engine.model.attention import GatedAttention
from engine.model.gdn import GatedDeltaNet
from engine.model.hybrid import HybridModel
from engine.model.norm import RMSNorm
from engine.model.random_init import init_random, qwen3_5_text_dict
from kernels.native import attn_decode
from kernels.native import gdn_decode as native_decode
from kernels.native import rms_norm as native_norm


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _required(monkeypatch, tmp_path_factory):
    dispatch.select(native="1")
    monkeypatch.setenv("HCW_NATIVE_CACHE", str(tmp_path_factory.getbasetemp() / "native"))
    dispatch.select("auto")


def _gdn(n_k, n_v, dk, dv, kernel=4, hidden=48, seed=0):
    cfg = ModelConfig.from_dict({**qwen3_5_text_dict(hidden=hidden, layers=1), "linear_num_key_heads": n_k,
                                 "linear_num_value_heads": n_v, "linear_key_head_dim": dk,
                                 "linear_value_head_dim": dv, "linear_conv_kernel_dim": kernel,
                                 "layer_types": ["linear_attention"]})
    layer = GatedDeltaNet(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        layer.A_log.copy_(torch.empty(n_v).uniform_(0.5, 8, generator=g).log())
        layer.dt_bias.copy_(torch.randn(n_v, generator=g))
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(dv, generator=g))
    return layer.eval()


def _steps(layer, xs, state, monkeypatch, path):
    if path == "torch":
        dispatch.select("reference")
    else:
        dispatch.select("auto")
    outs = [layer(xs[:, i:i + 1], state, 5 + i) for i in range(xs.shape[1])]
    return torch.cat(outs, 1)


def _both_paths(layer, xs, states, monkeypatch):
    """(the torch path's steps on states[0], the kernel's on states[1], how many kernel calls)."""
    expected = _steps(layer, xs, states[0], monkeypatch, "torch")
    calls = []
    real = native_decode.decode_step
    monkeypatch.setattr(native_decode, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return expected, _steps(layer, xs, states[1], monkeypatch, "native"), len(calls)


@pytest.mark.parametrize("n_k, n_v, dk, dv, kernel, batch", [
    (2, 4, 16, 8, 4, 1),  # value heads grouped over key heads
    (3, 3, 32, 32, 4, 2),  # one value head per key head, two sequences
    (1, 2, 8, 24, 2, 1),  # a two-tap conv: the window keeps one input
    (2, 2, 8, 8, 1, 1),  # a one-tap conv: no window at all
])
def test_decode_steps_match_the_torch_path(n_k, n_v, dk, dv, kernel, batch, monkeypatch):
    layer = _gdn(n_k, n_v, dk, dv, kernel)
    xs = torch.randn(batch, 12, 48)
    with torch.no_grad():
        states = []
        for _ in range(2):
            s = layer.new_state(batch, torch.float32, "cpu")
            s.tracking = True
            layer(torch.randn(batch, 5, 48, generator=torch.Generator().manual_seed(1)), s, 0)  # a prefilled window
            states.append(s)
        expected, got, calls = _both_paths(layer, xs, states, monkeypatch)
    assert calls == xs.shape[1]
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())
    ref, nat = states
    assert (nat.recurrent - ref.recurrent).abs().max().item() <= 1e-5 * ref.recurrent.abs().max().item()
    assert torch.equal(nat.conv, ref.conv)
    # the decay statistics the cache's certified replay reads: log-decay and the norm bound
    assert nat.stats_end == ref.stats_end == 5 + xs.shape[1]
    assert torch.allclose(nat.stats, ref.stats, rtol=1e-5, atol=1e-7)
    assert torch.allclose(nat.norm, ref.norm, rtol=1e-5)


@pytest.mark.parametrize("rows", [False, True])
def test_a_gdn_decode_token_split_over_threads_is_the_same_to_the_bit(rows, monkeypatch):
    """A large state's value heads are split over torch's threads (PARALLEL_MIN): each head is one
    thread's, so outputs, states and statistics equal the one-thread token's bit for bit, for the
    batched rows entry too. The layer has a real model's heads (16 of 128 x 128), long enough work
    for the two threads to overlap, so scratch shared between them shows (a race can be made
    likely, not certain)."""
    layer = _gdn(4, 16, 128, 128, 4)
    prefill = layer.new_state(2, torch.float32, "cpu")
    with torch.no_grad():
        layer(torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1)), prefill, 0)
        proj = layer.project(torch.randn(2, 1, 48, generator=torch.Generator().manual_seed(3)))
    args = (layer.conv1d.weight.detach(), layer._neg_a().detach(), layer.dt_bias.detach(),
            layer.norm.weight.detach(), layer.n_k, 1e-6, layer.norm.eps)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    def step():
        if rows:
            got = native_decode.decode_rows(proj, list(prefill.conv.split(1)), list(prefill.recurrent.split(1)), *args)
            return got.out, torch.cat(got.conv), torch.cat(got.recurrent), got.g, got.bv
        got = native_decode.decode_step(proj, prefill.conv, prefill.recurrent, *args)
        return got.out, got.conv, got.recurrent, got.g, got.bv

    try:
        monkeypatch.setattr(native_decode, "PARALLEL_MIN", 1 << 40)
        assert native_decode._threads(16 * 128 * 128) == 1
        one = step()
        monkeypatch.undo()
        assert native_decode._threads(16 * 128 * 128) == 2
        splits = [step() for _ in range(8)]  # repeated: each run a chance for a race to show
    finally:
        torch.set_num_threads(threads)
    for split in splits:
        for a, b in zip(one, split):
            assert torch.equal(a, b)
    assert one[0].abs().sum() > 0


def test_a_bf16_layers_decode_steps_take_the_kernel_in_float32(monkeypatch):
    """A bf16 model's decode token runs the C kernel on float32 copies of its projected row and conv
    window (the parameters' float32 copies kept): within bf16 rounding of the torch path, which
    rounds after each op; its output and conv window stay bf16, the recurrent state float32; the
    decay statistics as the torch path records them."""
    layer = _gdn(2, 4, 16, 8, 4).to(torch.bfloat16)
    xs = torch.randn(1, 12, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        states = []
        for _ in range(2):
            s = layer.new_state(1, torch.bfloat16, "cpu")
            s.tracking = True
            layer(torch.randn(1, 5, 48, generator=torch.Generator().manual_seed(1)).bfloat16(), s, 0)
            states.append(s)
        assert native_decode.applies_upcast(torch.empty(1, 1, 8, dtype=torch.bfloat16), states[0].conv,
                                            states[0].recurrent)
        expected, got, calls = _both_paths(layer, xs, states, monkeypatch)
    assert calls == xs.shape[1]
    ref, nat = states
    assert got.dtype is torch.bfloat16 and nat.conv.dtype is torch.bfloat16 and nat.recurrent.dtype is torch.float32
    assert (got.float() - expected.float()).norm() / expected.float().norm() <= 2e-2
    assert (nat.recurrent - ref.recurrent).norm() / ref.recurrent.norm() <= 2e-2
    assert (nat.conv.float() - ref.conv.float()).abs().max() <= 2e-2 * ref.conv.float().abs().max()
    assert nat.stats_end == ref.stats_end == 5 + xs.shape[1]
    assert torch.allclose(nat.stats, ref.stats, rtol=2e-2, atol=1e-3)
    with torch.no_grad():  # a changed weight: the kernel's float32 copies follow it
        layer.norm.weight.mul_(2)
        one = xs[:, :1]
        again, changed, _ = _both_paths(layer, one, states, monkeypatch)
    assert (changed.float() - again.float()).norm() / again.float().norm() <= 2e-2


def test_decode_rows_is_each_sequences_decode_step_to_the_bit():
    """The batched step's one call for sequences with states of their own (kernels/native
    gdn_decode_rows) against one decode_step a sequence: the same outputs, states and statistics
    to the bit; the given tensors are not written; a strided conv window (the torch path's) is
    read right; through the layer, statistics are recorded for the tracking sequences only."""
    layer = _gdn(2, 4, 16, 8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        states = []
        for i, n in enumerate((5, 1, 9)):
            s = layer.new_state(1, torch.float32, "cpu")
            s.tracking = i != 1
            layer(torch.randn(1, n, 48, generator=g), s, 0)
            states.append(s)
        dispatch.select("reference")  # a torch decode token: its conv window is a strided view
        layer(torch.randn(1, 1, 48, generator=g), states[0], 5)
        dispatch.select("auto")
        assert not states[0].conv.is_contiguous()
        twins = copy.deepcopy(states)
        held = [(s.conv.clone(), s.recurrent.clone()) for s in states]
        proj = layer.project(torch.randn(3, 1, 48, generator=g))
        args = (layer.conv1d.weight, layer._neg_a(), layer.dt_bias, layer.norm.weight, layer.n_k, 1e-6, layer.norm.eps)
        rows = native_decode.decode_rows(proj, [s.conv for s in states], [s.recurrent for s in states], *args)
        for i, s in enumerate(states):
            one = native_decode.decode_step(proj[i:i + 1], s.conv, s.recurrent, *args)
            assert torch.equal(rows.out[i:i + 1], one.out)
            assert torch.equal(rows.conv[i], one.conv) and torch.equal(rows.recurrent[i], one.recurrent)
            assert torch.equal(rows.g[i:i + 1], one.g) and torch.equal(rows.bv[i:i + 1], one.bv)
            assert torch.equal(s.conv, held[i][0]) and torch.equal(s.recurrent, held[i][1])
        got = layer.core_rows(proj, states, [6, 1, 9])
        want = torch.cat([layer.core(proj[i:i + 1], s, p) for i, (s, p) in enumerate(zip(twins, (6, 1, 9)))])
    assert torch.equal(got, want)
    for s, t in zip(states, twins):
        assert torch.equal(s.conv, t.conv) and torch.equal(s.recurrent, t.recurrent)
        assert s.stats_end == t.stats_end and torch.equal(s.stats, t.stats) and torch.equal(s.norm, t.norm)
    assert [s.stats_end for s in states] == [7, 0, 10]
    with pytest.raises(ValueError, match="one shape"):
        native_decode.decode_rows(proj[:2], [states[0].conv, states[1].conv[:, :-1]],
                                  [states[0].recurrent, states[1].recurrent], *args)


def test_old_state_tensors_are_not_written(monkeypatch):
    """A decode must not write the tensors it was given: a cached snapshot may share them."""
    layer = _gdn(2, 4, 16, 8)
    state = layer.new_state(1, torch.float32, "cpu")
    with torch.no_grad():
        layer(torch.randn(1, 7, 48), state, 0)
        conv, rec = state.conv.contiguous(), state.recurrent
        state.conv = conv
        held = conv.clone(), rec.clone()
        layer(torch.randn(1, 1, 48), state, 7)
    assert torch.equal(conv, held[0]) and torch.equal(rec, held[1])
    assert state.recurrent.data_ptr() != rec.data_ptr() and state.conv.data_ptr() != conv.data_ptr()


def test_outputs_are_float32_whatever_the_default_dtype(monkeypatch):
    """The kernels write float32: their outputs are allocated as such, not in the default dtype."""
    gdn, attn = _gdn(2, 4, 16, 8), _attention(4, 2, 16, 0.25)
    gdn_state, kv = gdn.new_state(1, torch.float32, "cpu"), attn.new_state(1, torch.float32, "cpu")
    x = torch.randn(1, 3, 48)
    with torch.no_grad():
        gdn(x[:, :2], gdn_state, 0)
        attn(x[:, :2], kv, 0)
        dispatch.select("reference")
        expected = gdn(x[:, 2:], copy.deepcopy(gdn_state), 2), attn(x[:, 2:], copy.deepcopy(kv), 2)
        dispatch.select("auto")
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = gdn(x[:, 2:], gdn_state, 2), attn(x[:, 2:], kv, 2)
        finally:
            torch.set_default_dtype(before)
    for a, b in zip(got, expected):
        assert a.dtype is torch.float32 and (a - b).abs().max().item() <= 1e-5


def test_a_model_decodes_the_same_on_either_path(monkeypatch):
    """Greedy tokens and every step's logits, through the engine, with the kernel and without."""
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=128, layers=4))), 0).eval()
    engine = Engine(model)
    prompt = list(range(3, 40))
    params = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)
    dispatch.select("reference")
    expected = engine.generate(prompt, params)
    dispatch.select("auto")
    calls = []
    real = native_decode.decode_step
    monkeypatch.setattr(native_decode, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = engine.generate(prompt, params)
    assert got.token_ids == expected.token_ids
    assert len(calls) == 3 * 23  # three GDN layers, every generated token but the last
    with torch.inference_mode():
        logits = []
        for path in ("reference", "auto"):
            dispatch.select(path)
            state = engine.new_state()
            engine.prefill(prompt, state)
            logits.append(torch.stack([engine.decode(t, state) for t in expected.token_ids]))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5


def test_a_resumed_turn_decodes_the_same_on_either_path(monkeypatch):
    """A second turn restored from the prefix cache (assembled KV buffers, GDN snapshots) decodes
    through all three kernels and gives the torch path's tokens."""
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=128, layers=4))), 0).eval()
    params = SamplingParams(max_new_tokens=16, greedy=True, ignore_eos=True)
    first, second = list(range(3, 60)), list(range(3, 60)) + [7, 9, 11, 13]
    calls = {"gdn": 0, "attn": 0, "norm": 0}
    for module, name in ((native_decode, "decode_step"), (attn_decode, "prepare"), (native_norm, "rms_norm")):
        real = getattr(module, name)
        key = {"decode_step": "gdn", "prepare": "attn", "rms_norm": "norm"}[name]
        monkeypatch.setattr(module, name, lambda *a, _r=real, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1) or _r(*a, **k))
    answers = {}
    for path in ("reference", "auto"):
        dispatch.select(path)
        engine = Engine(model, cache=PrefixCache(model, CacheConfig(block_size=16)))
        engine.generate(first, params)
        again = engine.generate(second, params)
        assert again.timings.cache_n >= 48  # the second turn was restored, not recomputed
        answers[path] = again.token_ids
    assert answers["auto"] == answers["reference"]
    assert calls["gdn"] == 2 * 3 * 15 and calls["attn"] == 2 * 1 * 15 and calls["norm"] > 2 * 15 * 8


def _attention(heads, kv_heads, head_dim, partial, bias=False, seed=0):
    cfg = ModelConfig.from_dict({**qwen3_5_text_dict(hidden=48, layers=1), "num_attention_heads": heads,
                                 "num_key_value_heads": kv_heads, "head_dim": head_dim, "attention_bias": bias,
                                 "layer_types": ["full_attention"],
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": partial}})
    layer = GatedAttention(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    layer.kv_choice = "dense"  # a dense buffer (the paged layout's kernel: tests/test_native_paged.py)
    return layer.eval()


@pytest.mark.parametrize("heads, kv_heads, head_dim, partial, bias, batch, prefill", [
    (4, 2, 16, 0.25, False, 1, 9),  # grouped query heads, partial rotation (Qwen3.5)
    (2, 2, 8, 1.0, True, 2, 5),  # one query head per key head, all channels rotated, biases, two sequences
    (3, 1, 12, 0.0, False, 1, 250),  # no rotation; the steps cross the buffer's first growth (256)
])
def test_attention_decode_steps_match_the_torch_path(heads, kv_heads, head_dim, partial, bias, batch, prefill,
                                                     monkeypatch):
    layer = _attention(heads, kv_heads, head_dim, partial, bias)
    assert layer.rotary.rotary_dim == int(head_dim * partial)
    warm = torch.randn(batch, prefill, 48, generator=torch.Generator().manual_seed(1))
    xs = torch.randn(batch, 12, 48)
    results = {}
    calls = []
    real = attn_decode.prepare
    monkeypatch.setattr(attn_decode, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        for path in ("reference", "auto"):
            dispatch.select(path)
            state = layer.new_state(batch, torch.float32, "cpu")
            assert type(state) is KVState
            layer(warm, state, 0)
            outs = [layer(xs[:, i:i + 1], state, prefill + i) for i in range(xs.shape[1])]
            results[path] = torch.cat(outs, 1), state
    assert len(calls) == xs.shape[1]
    (expected, ref), (got, nat) = results["reference"], results["auto"]
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert ref.length == nat.length == prefill + xs.shape[1]
    assert (nat.k[:, :, :nat.length] - ref.k[:, :, :ref.length]).abs().max().item() <= 1e-5
    assert torch.equal(nat.v[:, :, :nat.length], ref.v[:, :, :ref.length])


@pytest.mark.parametrize("kv_choice, prefill", [("dense", 9), ("paged", 9), ("paged", 60)])
def test_a_bf16_attention_layers_decode_steps_take_the_kernel_in_float32(kv_choice, prefill, monkeypatch):
    """A bf16 model's decode token runs the C kernel on a float32 copy of its projected row, the key
    and value rounded once into the bf16 buffers (dense, or paged blocks, the steps crossing a
    block's end at 60 + 12): within bf16 rounding of the torch path, which rounds after each op;
    the values, copied and not computed, are the same bits."""
    layer = _attention(4, 2, 16, 0.25).to(torch.bfloat16)
    layer.kv_choice = kv_choice
    warm = torch.randn(1, prefill, 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    xs = torch.randn(1, 12, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    calls, results = [], {}
    real = attn_decode.prepare
    monkeypatch.setattr(attn_decode, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        for path in ("reference", "auto"):
            dispatch.select(path)
            state = layer.new_state(1, torch.bfloat16, "cpu", page=64)
            assert type(state) is (KVState if kv_choice == "dense" else PagedKVState)
            layer(warm, state, 0)
            outs = [layer(xs[:, i:i + 1], state, prefill + i) for i in range(xs.shape[1])]
            results[path] = torch.cat(outs, 1), state.read(prefill + xs.shape[1])
    assert len(calls) == xs.shape[1]
    (expected, (ref_k, ref_v)), (got, (nat_k, nat_v)) = results["reference"], results["auto"]
    assert got.dtype is torch.bfloat16 and nat_k.dtype is torch.bfloat16
    assert (got.float() - expected.float()).norm() / expected.float().norm() <= 2e-2
    assert (nat_k.float() - ref_k.float()).abs().max() <= 2e-2 * ref_k.float().abs().max()
    assert torch.equal(nat_v, ref_v)


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 40)])
def test_rms_norm_and_the_fused_residual_add_match_the_torch_path(unit_offset, shape, monkeypatch):
    norm = RMSNorm(shape[-1], 1e-6, unit_offset=unit_offset)
    with torch.no_grad():
        norm.weight.copy_(0.3 * torch.randn(shape[-1]) + (0.0 if unit_offset else 1.0))
    x, delta = 3 * torch.randn(shape), torch.randn(shape)
    calls = []
    real = native_norm.rms_norm
    monkeypatch.setattr(native_norm, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        dispatch.select("reference")
        expected, (expected_sum, expected_sum_norm) = norm(x), norm.add_forward(x, delta)
        dispatch.select("auto")
        got, (got_sum, got_sum_norm) = norm(x), norm.add_forward(x, delta)
    assert len(calls) == 2
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_sum, expected_sum)
    assert torch.allclose(got_sum_norm, expected_sum_norm, rtol=1e-5, atol=1e-6)


def test_rms_norm_leaves_large_inputs_and_autograd_to_torch(monkeypatch):
    norm = RMSNorm(64, 1e-6, unit_offset=True)
    calls = []
    monkeypatch.setattr(native_norm, "rms_norm", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        assert norm(torch.randn(1, native_norm.MAX_ELEMENTS // 64 + 1, 64)).shape == (1, 257, 64)
    x = torch.randn(1, 1, 64)
    norm(x).sum().backward()  # grad enabled: the torch path, so the weight gets its gradient
    assert calls == [] and norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def test_shapes_that_disagree_are_refused():
    attn = _attention(4, 2, 16, 0.25)
    state = attn.new_state(1, torch.float32, "cpu")
    proj = torch.randn(1, 1, attn.qkv_proj.out_features)
    cos, sin = attn.rotary.rows(0, 16, torch.float32, "cpu")
    args = (attn.q_norm.scale(), attn.k_norm.scale(), cos, sin, attn.rotary.rotary_dim, state.k, state.v)
    with pytest.raises(ValueError, match="shapes disagree"):
        attn_decode.prepare(proj, *args, 0, 3, 1e-6)  # 3 query heads over 2 key-value heads
    with pytest.raises(ValueError, match="shapes disagree"):
        attn_decode.prepare(proj, *args, state.k.shape[2], 4, 1e-6)  # no room at the position
    with pytest.raises(IndexError, match="capacity"):
        state.written(state.k.shape[2] + 1)
    layer = _gdn(2, 4, 16, 8)
    state = layer.new_state(1, torch.float32, "cpu")
    proj = torch.randn(1, 1, layer.in_proj.out_features + 1)
    with pytest.raises(ValueError, match="shapes disagree"):
        native_decode.decode_step(proj, state.conv, state.recurrent, layer.conv1d.weight.detach(),
                                  -layer.A_log.detach().exp(), layer.dt_bias.detach(), layer.norm.weight.detach(),
                                  layer.n_k, 1e-6, 1e-6)


def test_other_dtypes_and_forced_paths_stay_on_torch(monkeypatch):
    state = GDNState.zeros(1, 8, 4, 2, 2, 2, torch.float32, "cpu")
    kv = KVState.empty(1, 2, 8, torch.float32, "cpu")
    proj, qkv = torch.randn(1, 1, 16), torch.randn(1, 1, 64)
    assert not native_decode.applies(proj, state.conv, state.recurrent)  # autograd on: no backward in C
    assert not attn_decode.applies(qkv, kv.k, kv.v)
    with torch.no_grad():
        assert native_decode.applies(proj, state.conv, state.recurrent)
        assert not native_decode.applies(proj.bfloat16(), state.conv.bfloat16(), state.recurrent)
        assert not native_decode.applies(torch.randn(1, 2, 16), state.conv, state.recurrent)  # a chunk, not a token
        assert attn_decode.applies(qkv, kv.k, kv.v)
        assert not attn_decode.applies(qkv.bfloat16(), kv.k.bfloat16(), kv.v.bfloat16())
        assert not attn_decode.applies(qkv, kv.k.transpose(2, 3), kv.v.transpose(2, 3))
        assert native_norm.applies(qkv) and not native_norm.applies(qkv.view(8, 8).t())
        dispatch.select("reference")
        assert not native_decode.applies(proj, state.conv, state.recurrent)
        assert not attn_decode.applies(qkv, kv.k, kv.v)
        assert not native_norm.applies(qkv)


def test_a_build_is_kept_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("HCW_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library("gdn_decode") is not None
    built = list(tmp_path.glob("gdn_decode-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.part"))
    stamp = built[0].stat().st_mtime_ns
    compiled = []
    monkeypatch.setattr(native, "_compile", lambda *a: compiled.append(a))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library("gdn_decode") is not None
    assert compiled == [] and built[0].stat().st_mtime_ns == stamp


@pytest.mark.parametrize("name, cc, message", [
    ("gdn_decode", "false", "building the gdn_decode kernel failed"),  # a compiler that always fails
    ("no_such_kernel", None, "source cannot be read"),  # a source that is not installed
])
def test_a_kernel_that_cannot_be_built_falls_back_or_raises_when_required(name, cc, message, monkeypatch,
                                                                           tmp_path, caplog):
    monkeypatch.setenv("HCW_NATIVE_CACHE", str(tmp_path))
    if cc is not None:
        monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.raises(native.NativeUnavailable, match=name):
        native.library(name)
    dispatch.select(native="auto")
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.library(name) is None
    assert message in caplog.text
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.part"))


def test_a_damaged_build_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("HCW_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library("rms_norm") is not None
    (built,) = tmp_path.glob("rms_norm-*.so")
    built.unlink()  # (a new file: this process has the old one mapped)
    built.write_bytes(b"not a shared object")
    # another process: this one's loader would hand back the library it already holds by that name
    load = ("from kernels import dispatch; dispatch.select(native='1'); import kernels.native as n; "
            "assert n.library('rms_norm').hcw_rms_norm")
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "building it again" in done.stderr and built.read_bytes()[:4] == b"\x7fELF"


def test_native_off_and_a_bad_setting(monkeypatch):
    dispatch.select(native="0")
    monkeypatch.setattr(native, "_loaded", {})
    assert native.library("gdn_decode") is None
    with pytest.raises(ValueError, match="HCW_NATIVE"):
        EngineConfig.from_env({"HCW_NATIVE": "yes"})
    with pytest.raises(ValueError, match="yes"):
        dispatch.select(native="yes")


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_decay_statistics_match_the_torch_path(batch, monkeypatch):
    """A cached prefill's decay statistics (GDNState.record over a chunk) from the C scan against the
    torch path's logcumsumexp: the same rows within float rounding, chunk after chunk and then a
    decode token, from a start with a norm already carried; strong decays (g down to -60 a token,
    where exp(-cumsum) alone would overflow) included. The scan writes the rows and a new norm,
    never the old norm tensor."""
    from kernels.native import decay_scan

    scans = []
    real = decay_scan.decay_scan
    monkeypatch.setattr(decay_scan, "decay_scan", lambda *a: scans.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    states = [GDNState.zeros(batch, 8, 4, 3, 2, 2, torch.float32, "cpu") for _ in range(2)]
    for s in states:
        s.tracking = True
        s.norm = torch.full((batch, 3), 0.5, dtype=torch.float64)
    start = 0
    for t in (37, 64, 200, 1):
        g = -torch.rand(batch, t, 3, generator=gen) * torch.tensor([0.5, 4.0, 60.0])
        x = torch.rand(batch, t, 3, generator=gen) * 3
        for s, path in zip(states, ("auto", "reference")):
            dispatch.select(path)
            old = s.norm
            before = old.clone()
            with torch.no_grad():
                s.record(start, g, x)
            assert torch.equal(old, before)
        start += t
    c, ref = states
    assert len(scans) == 3  # the three chunks in C; the decode token takes the torch recurrence
    assert c.stats_end == ref.stats_end == start
    assert torch.allclose(c.stats[:, :start], ref.stats[:, :start], rtol=1e-6, atol=0)
    assert torch.allclose(c.norm, ref.norm, rtol=1e-12, atol=0)
    assert torch.equal(c.stats[:, :start, :, 0], ref.stats[:, :start, :, 0])


def test_the_decay_scan_leaves_other_inputs_to_torch():
    from kernels.native import decay_scan

    g, x, norm = -torch.rand(1, 9, 3), torch.rand(1, 9, 3), torch.zeros(1, 3, dtype=torch.float64)
    rows = torch.zeros(1, 9, 3, 2)
    with torch.no_grad():
        assert decay_scan.applies(g, x, norm, rows)
        assert not decay_scan.applies(g.double(), x, norm, rows)
        assert not decay_scan.applies(g, x, norm.float(), rows)
        assert not decay_scan.applies(g.transpose(1, 2).contiguous().transpose(1, 2), x, norm, rows)
        assert not decay_scan.applies(g, x, norm, torch.zeros(1, 9, 3, 3))
        assert not decay_scan.applies(g[:0], x[:0], norm[:0], rows[:0])  # no rows at all
        dispatch.select("reference")
        assert not decay_scan.applies(g, x, norm, rows)
