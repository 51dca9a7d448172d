"""The blocked CPU attention (`engine.model.cpu_attention`): the same causal softmax attention as
torch's kernel for square prefills, chunks against a longer cache, grouped heads and batches, with
blocks small enough that every path (the masked diagonal block, several visible key blocks,
a short last query block) runs; taken only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.engine import Engine
from engine.model import cpu_attention
from engine.model.hybrid import HybridModel
from engine.config import ModelConfig
from engine.model.random_init import init_random, qwen3_5_text_dict

pytestmark = pytest.mark.skipif(not cpu_attention.ONEDNN, reason="this torch build has no oneDNN linear")


def _reference(q, k, v):
    t, n = q.shape[2], k.shape[2]
    visible = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(cpu_attention, "Q_BLOCK", 48)
    monkeypatch.setattr(cpu_attention, "K_BLOCK", 40)


@pytest.mark.parametrize("t, n, heads, kv_heads, batch", [
    (200, 200, 4, 2, 1),   # a square prefill: query blocks of 48 (the last one short), grouped heads
    (70, 333, 4, 4, 2),    # a chunk after 263 cached positions, no grouping, two sequences
    (97, 500, 6, 2, 1),    # three query heads per KV head
    (1, 50, 2, 1, 1),      # one query
])
def test_it_computes_what_torch_computes(small_blocks, t, n, heads, kv_heads, batch):
    g = torch.Generator().manual_seed(t + n)
    q = torch.randn(batch, heads, t, 32, generator=g) * 3  # large scores: a wide softmax range
    k = torch.randn(batch, kv_heads, n, 32, generator=g)
    v = torch.randn(batch, kv_heads, n, 32, generator=g)
    with torch.inference_mode():
        got = cpu_attention.causal_attention(q, k, v)
    assert got.shape == q.shape
    assert (got - _reference(q, k, v)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("splits", [[80], [40, 40], [33, 1, 46], [17, 63]], ids=["one-block-piece", "two-blocks",
                                                                                "odd-pieces", "across-a-block"])
def test_held_positions_given_as_pieces_attend_as_one_buffer(small_blocks, splits):
    """A chunk's own keys after held ones given as pieces (a paged state's runs of blocks): the
    same attention as one dense buffer, to the bit where the pieces end on key blocks (K_BLOCK 40)."""
    g = torch.Generator().manual_seed(len(splits))
    held, t = sum(splits), 70
    q = torch.randn(1, 4, t, 32, generator=g) * 3
    k, v = torch.randn(2, 1, 2, held + t, 32, generator=g)
    cuts = torch.tensor([0, *splits]).cumsum(0).tolist()
    pieces = [(k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    with torch.inference_mode():
        whole = cpu_attention.causal_attention(q, k, v)
        got = cpu_attention.causal_attention(q, k[:, :, held:], v[:, :, held:], pieces)
    if all(n % 40 == 0 for n in splits):
        assert torch.equal(got, whole)
    assert (got - _reference(q, k, v)).abs().max().item() <= 1e-5


def test_a_masked_position_never_contributes(small_blocks):
    # a huge value at a position only later queries may see: any leak into earlier rows shows
    q, k = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    v = torch.zeros(1, 2, 96, 16)
    v[:, :, 60] = 1e30
    with torch.inference_mode():
        out = cpu_attention.causal_attention(q, k, v)
    assert out[:, :, :60].abs().max().item() == 0.0 and out[:, :, 60:].abs().max().item() > 0


def test_it_applies_to_long_cpu_fp32_products_outside_autograd_only():
    q, k = torch.randn(1, 4, 1024, 64), torch.randn(1, 2, 1024, 64)
    with torch.inference_mode():
        assert cpu_attention.applies(q, k)
        assert not cpu_attention.applies(q[:, :, :32], k)  # few queries
        assert not cpu_attention.applies(q[:, :, :256], k[:, :, :256])  # few pairs
        assert cpu_attention.applies(q[:, :, :256], k[:, :, :256], held=2048)  # few new keys after many held
        assert not cpu_attention.applies(q.bfloat16(), k.bfloat16())
    assert not cpu_attention.applies(q, k)  # autograd on: training keeps torch's kernel


def test_a_prefill_through_it_gives_the_logits_of_torchs_kernel(monkeypatch, small_blocks):
    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4, attn_every=2))), 0).eval()
    model.use_kv_layout("dense")  # (the paged layout's chunks: tests/test_paged_kv.py)
    ids = torch.randint(0, model.config.vocab_size, (230,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(cpu_attention, "MIN_PAIRS", 0)
    monkeypatch.setattr(cpu_attention, "MIN_QUERIES", 1)
    engine = Engine(model)
    calls = []
    original = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a: calls.append(1) or original(*a))
    state = engine.new_state()
    blocked = torch.cat([engine.prefill(ids[:150], state, chunk_size=150)[None], engine.prefill(ids[150:], state)[None]])
    assert calls  # the blocked kernel ran, for the square first chunk and the second against the cache
    monkeypatch.setattr(cpu_attention, "applies", lambda q, k: False)
    state = engine.new_state()
    plain = torch.cat([engine.prefill(ids[:150], state, chunk_size=150)[None], engine.prefill(ids[150:], state)[None]])
    assert (blocked - plain).abs().max().item() <= 1e-4


def test_more_queries_than_keys_or_uneven_groups_are_refused():
    with pytest.raises(ValueError):
        cpu_attention.causal_attention(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError):
        cpu_attention.causal_attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
