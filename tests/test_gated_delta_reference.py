"""The chunked gated delta rule equals the token-by-token recurrence it is derived from."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta.reference import chunk_gated_delta, recurrent_gated_delta


def _inputs(t, hk=2, hv=4, dk=8, dv=12, b=2, seed=42):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, generator=g), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = -torch.rand(b, t, hv, generator=g) * 2  # log decay in (-2, 0]
    beta = torch.rand(b, t, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("t", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_equals_recurrent(t, chunk):
    q, k, v, g, beta, s0 = _inputs(t)
    o_ref, s_ref = recurrent_gated_delta(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta(q, k, v, g, beta, s0, chunk_size=chunk)
    assert (o - o_ref).abs().max().item() <= 1e-4
    assert (s - s_ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("block_chunks", [1, 3])
def test_blocked_scan_equals_recurrent(block_chunks):
    # blocks of 1 and 3 chunks of 16: 300 tokens cross several block boundaries and end mid-block
    q, k, v, g, beta, s0 = _inputs(300)
    o_ref, s_ref = recurrent_gated_delta(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta(q, k, v, g, beta, s0, chunk_size=16, block_chunks=block_chunks)
    assert (o - o_ref).abs().max().item() <= 1e-4
    assert (s - s_ref).abs().max().item() <= 1e-4


def test_state_hand_off_splits_a_sequence_anywhere():
    q, k, v, g, beta, _ = _inputs(97, hk=1, hv=1)
    o_all, s_all = chunk_gated_delta(q, k, v, g, beta)
    o1, s1 = chunk_gated_delta(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40])
    o2, s2 = chunk_gated_delta(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], s1)
    assert (torch.cat([o1, o2], 1) - o_all).abs().max().item() <= 1e-4
    assert (s2 - s_all).abs().max().item() <= 1e-4


def test_zero_beta_keeps_the_state_and_decay_shrinks_it():
    q, k, v, g, beta, s0 = _inputs(10)
    _, s = recurrent_gated_delta(q, k, v, g, torch.zeros_like(beta), s0)
    total = g.sum(1)  # [B, Hv]
    assert torch.allclose(s, s0 * total.exp()[..., None, None], atol=1e-5)
