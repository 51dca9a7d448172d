"""Triton kernels against their torch references, on CPU through Triton's interpreter (conftest
sets TRITON_INTERPRET=1 without a GPU), at small odd shapes, with every output allocation poisoned
with NaN so an element a kernel does not write fails the comparison; and the dispatch."""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from kernels import dispatch
from kernels.gated_delta import recurrent_gated_delta
from kernels.gated_delta import reference
from kernels.gated_delta.triton_recurrent import recurrent_gated_delta as triton_recurrent

# on a GPU machine the kernels run compiled on CUDA tensors; without one, through the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(dispatch, "poison_empty", True)


def _inputs(b, t, hk, hv, dk, dv, dtype, seed=0, state=True):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, generator=g_), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, hk, dk, generator=g_), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=g_)
    g = -torch.rand(b, t, hv, generator=g_) * 2
    beta = torch.rand(b, t, hv, generator=g_)
    s0 = torch.randn(b, hv, dk, dv, generator=g_).to(DEVICE) if state else None
    return [x.to(DEVICE, dtype) for x in (q, k, v)] + [g.to(DEVICE), beta.to(DEVICE, dtype), s0]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("b, t, hk, hv, dk, dv", [(1, 1, 1, 1, 8, 8), (2, 5, 2, 6, 12, 20), (1, 3, 3, 3, 16, 40),
                                                  (2, 1, 1, 4, 32, 33)])
@pytest.mark.parametrize("state", [True, False])
def test_recurrent_gdn_kernel_matches_the_reference(b, t, hk, hv, dk, dv, state):
    args = _inputs(b, t, hk, hv, dk, dv, torch.float32, state=state)
    o, s = triton_recurrent(*args, block_v=16)
    o_ref, s_ref = reference.recurrent_gated_delta(*args)
    assert not torch.isnan(o).any() and not torch.isnan(s).any()  # every element written
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    assert o.dtype == o_ref.dtype and s.dtype == torch.float32


def test_recurrent_gdn_kernel_in_bf16_keeps_a_float32_state():
    args = _inputs(2, 4, 2, 4, 16, 24, torch.bfloat16)
    o, s = triton_recurrent(*args)
    o_ref, s_ref = reference.recurrent_gated_delta(*args)
    assert o.dtype == torch.bfloat16 and _rel(o, o_ref) < 2e-2 and _rel(s, s_ref) < 1e-5


def test_the_launcher_refuses_what_the_kernel_cannot_read():
    q, k, v, g, beta, s0 = _inputs(1, 2, 1, 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="not contiguous"):
        triton_recurrent(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), g, beta, s0)
    with pytest.raises(ValueError, match="initial_state: dtype"):
        triton_recurrent(q, k, v, g, beta, s0.double())
    with pytest.raises(ValueError, match="shape"):
        triton_recurrent(q, k, v, g[:, :1], beta, s0)
    with pytest.raises(ValueError, match="multiple"):
        triton_recurrent(*_inputs(1, 2, 2, 3, 8, 8, torch.float32))  # 3 value heads over 2 key heads


@pytest.mark.skipif(DEVICE == "cuda", reason="dispatch on CPU tensors; on CUDA the kernel runs by default")
def test_dispatch_runs_the_reference_on_cpu_and_triton_when_forced(monkeypatch):
    args = _inputs(1, 2, 1, 2, 8, 8, torch.float32)
    calls = []
    monkeypatch.setattr(reference, "recurrent_gated_delta", lambda *a: calls.append("reference") or ("r", None))
    assert recurrent_gated_delta(*args)[0] == "r" and calls == ["reference"]
    dispatch.select("triton")  # on CPU: the interpreter
    o, _ = recurrent_gated_delta(args[0], args[1], args[2].transpose(1, 2).contiguous().transpose(1, 2), *args[3:])
    assert o.shape == args[2].shape and calls == ["reference"]  # non-contiguous views are made dense first
    with pytest.raises(ValueError, match="HCW_KERNELS"):
        EngineConfig.from_env({"HCW_KERNELS": "sometimes"})
    with pytest.raises(ValueError, match="sometimes"):
        dispatch.select("sometimes")


@pytest.mark.parametrize("b, n, w, d", [(1, 1, 4, 8), (2, 3, 8, 20), (1, 5, 3, 70), (2, 0, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_pooling_kernel_matches_the_reference(b, n, w, d, dtype):
    from kernels.compressor import reference as ref
    from kernels.compressor.triton_pool import pool

    g_ = torch.Generator().manual_seed(1)
    kv = torch.randn(b, n, w, d, generator=g_).to(DEVICE, dtype)
    gate = torch.randn(b, n, w, d, generator=g_).to(DEVICE, dtype)
    if n and w % 2 == 0:
        gate[:, 0, : w // 2] = float("-inf")  # an overlapping window with no previous half
    out, expected = pool(kv, gate, block_d=16), ref.pool(kv, gate)
    assert out.shape == expected.shape == (b, n, d) and not torch.isnan(out).any()
    if n:
        assert _rel(out, expected) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("b, t, h, di, n, rate", [(1, 1, 1, 8, 3, 4), (2, 5, 3, 12, 9, 4), (1, 7, 2, 16, 40, 2)])
def test_indexer_scoring_kernel_matches_the_reference(b, t, h, di, n, rate):
    from kernels.indexer import reference as ref
    from kernels.indexer.triton_score import score

    g_ = torch.Generator().manual_seed(2)
    q = torch.randn(b, t, h, di, generator=g_).to(DEVICE)
    keys = torch.randn(b, n, di, generator=g_).to(DEVICE)
    weights = torch.randn(b, t, h, generator=g_).to(DEVICE)
    positions = torch.arange(n * rate - t - 2, n * rate - 2, device=DEVICE)  # some entries still open for early queries
    out, expected = score(q, keys, weights, positions, rate, block_n=8), ref.score(q, keys, weights, positions, rate)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isinf(out), torch.isinf(expected)) and torch.isinf(expected).any()
    finite = torch.isfinite(expected)
    assert _rel(out[finite], expected[finite]) < 1e-5


def test_a_v4_model_gives_the_same_logits_with_the_kernels_forced(monkeypatch):
    """The engine's compressor and indexer go through the dispatch: forcing Triton (the
    interpreter, on CPU) changes nothing but rounding."""
    from engine.config import ModelConfig
    from engine.model.hybrid import HybridModel
    from engine.model.random_init import hcw_hybrid_dict, init_random

    model = init_random(HybridModel(ModelConfig.from_dict(hcw_hybrid_dict(hidden=64))), 0).eval()
    ids = torch.randint(0, 263, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids)
        dispatch.select("triton")
        forced = model(ids)
    assert (forced - expected).abs().max().item() <= 1e-4


def _paged(b, h, hkv, bs, d, lengths, dtype=torch.float32, seed=4):
    """A pool holding each sequence's keys and values in blocks scattered in shuffled order, its
    block tables, and the same keys and values laid out densely ([B][Hkv, n, D]) for the oracle."""
    g_ = torch.Generator().manual_seed(seed)
    counts = [-(-n // bs) for n in lengths]
    pool_blocks = sum(counts) + 3  # some blocks belong to nobody
    k_pool = torch.randn(pool_blocks, hkv, bs, d, generator=g_)
    v_pool = torch.randn(pool_blocks, hkv, bs, d, generator=g_)
    order = torch.randperm(pool_blocks, generator=g_)
    table = torch.full((b, max(counts)), 10_000, dtype=torch.int32)  # unused entries point nowhere
    dense, at = [], 0
    for i, c in enumerate(counts):
        table[i, :c] = order[at:at + c].int()
        at += c
        blocks = table[i, :c].long()
        dense.append((k_pool[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :lengths[i]],
                      v_pool[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :lengths[i]]))
    q = torch.randn(b, h, d, generator=g_)
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), k_pool.to(dtype=dtype, **to), v_pool.to(dtype=dtype, **to), table.to(**to),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE), dense)


@pytest.mark.parametrize("window", [None, 1, 5])
def test_paged_attention_reference_equals_dense_attention(window):
    """The oracle itself: gathering a sequence's blocks through its table is plain attention over
    its positions (scaled_dot_product_attention, GQA, the sliding window as a mask)."""
    from kernels.paged_attention import reference as ref

    q, k_pool, v_pool, table, lengths, dense = _paged(3, 6, 2, 4, 16, [1, 9, 16])
    out = ref.paged_decode(q, k_pool, v_pool, table, lengths, window)
    for i, (k, v) in enumerate(dense):
        n = k.shape[1]
        allowed = torch.arange(n, device=k.device) >= (0 if window is None else n - window)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], k, v, attn_mask=allowed[None, None], enable_gqa=True)[:, 0]
        assert _rel(out[i], expected) < 1e-5


@pytest.mark.parametrize("b, h, hkv, bs, d, lengths", [(1, 1, 1, 4, 8, [1]), (3, 6, 2, 4, 12, [5, 1, 17]),
                                                       (2, 4, 4, 8, 20, [8, 23]), (2, 8, 1, 2, 33, [3, 9])])
@pytest.mark.parametrize("window", [None, 3])
def test_paged_decode_kernel_matches_the_reference(b, h, hkv, bs, d, lengths, window):
    from kernels.paged_attention import reference as ref
    from kernels.paged_attention.triton_decode import paged_decode

    q, k_pool, v_pool, table, n, _ = _paged(b, h, hkv, bs, d, lengths)
    out, expected = paged_decode(q, k_pool, v_pool, table, n, window), ref.paged_decode(q, k_pool, v_pool, table, n, window)
    assert not torch.isnan(out).any() and _rel(out, expected) < 1e-5


def test_paged_decode_kernel_in_bf16_and_its_refusals():
    from kernels.paged_attention import reference as ref
    from kernels.paged_attention.triton_decode import paged_decode

    q, k_pool, v_pool, table, n, _ = _paged(2, 4, 2, 4, 16, [7, 12], dtype=torch.bfloat16)
    assert _rel(paged_decode(q, k_pool, v_pool, table, n), ref.paged_decode(q, k_pool, v_pool, table, n)) < 2e-2
    with pytest.raises(ValueError, match="dtype"):
        paged_decode(q, k_pool.float(), v_pool, table, n)
    with pytest.raises(ValueError, match="lengths: dtype"):
        paged_decode(q, k_pool, v_pool, table, n.long())
    with pytest.raises(ValueError, match="not contiguous"):
        paged_decode(q, k_pool.transpose(1, 2).contiguous().transpose(1, 2), v_pool, table, n)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(q[:, :3].contiguous(), k_pool, v_pool, table, n)


@pytest.mark.parametrize("b, t, hk, hv, dk, dv", [(1, 1, 1, 1, 8, 8), (2, 37, 2, 4, 12, 20), (1, 70, 1, 2, 16, 33),
                                                  (1, 16, 2, 2, 32, 16)])
@pytest.mark.parametrize("state", [True, False])
def test_chunked_gdn_kernel_matches_the_reference(b, t, hk, hv, dk, dv, state):
    from kernels.gated_delta.triton_chunk import chunk_gated_delta

    args = _inputs(b, t, hk, hv, dk, dv, torch.float32, seed=5, state=state)
    for chunk, block_v in ((16, 16), (32, 32)):  # dv 20 and 33 span two and three value blocks
        o, s = chunk_gated_delta(*args, chunk_size=chunk, block_v=block_v)
        o_ref, s_ref = reference.chunk_gated_delta(*args)
        assert not torch.isnan(o).any() and not torch.isnan(s).any()  # every element written
        assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
        assert o.dtype == o_ref.dtype and s.dtype == torch.float32


def test_chunked_gdn_kernel_in_bf16_and_its_refusals():
    from kernels.gated_delta.triton_chunk import chunk_gated_delta

    args = _inputs(2, 21, 1, 2, 16, 16, torch.bfloat16, seed=6)
    o, s = chunk_gated_delta(*args)
    o_ref, s_ref = reference.chunk_gated_delta(*args)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert _rel(o, o_ref) < 2e-2 and _rel(s, s_ref) < 2e-2
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta(*args, chunk_size=8)
    q, k, v, g, beta, s0 = _inputs(1, 4, 2, 3, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta(q, k, v, g, beta, s0)


def test_a_qwen_model_gives_the_same_logits_with_the_gdn_kernels_forced(monkeypatch):
    """The GDN layers' chunked prefill and recurrent decode go through the dispatch: forcing
    Triton (the interpreter, on CPU) changes nothing but rounding, with and without state."""
    from engine.config import ModelConfig
    from engine.model.hybrid import HybridModel
    from engine.model.random_init import init_random, qwen3_5_text_dict

    model = init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=64, layers=4))), 0).eval()
    ids = torch.randint(0, 263, (1, 40), generator=torch.Generator().manual_seed(7))

    def run():
        state = model.new_state()
        steps = [model(ids[:, :37], state, last_only=True)] + [model(ids[:, i:i + 1], state) for i in range(37, 40)]
        return model(ids), torch.cat(steps, dim=1)

    def kept():  # the states a prefill keeps at marked positions inside its pass (the cache's snapshots)
        state = model.new_state()
        state.mark((9, 16, 30))
        model(ids[:, :37], state, last_only=True)
        return [t for layer in state.layers if hasattr(layer, "kept") for p in (9, 16, 30) for t in layer.kept[p]]

    with torch.no_grad():
        expected, expected_kept = run(), kept()
        dispatch.select("triton")
        forced, forced_kept = run(), kept()
    for a, b in zip(forced, expected):
        assert (a - b).abs().max().item() <= 1e-4
    assert len(forced_kept) == len(expected_kept) == 3 * 3 * 2  # 3 GDN layers, 3 positions, (recurrent, conv)
    for a, b in zip(forced_kept, expected_kept):
        assert (a - b).abs().max().item() <= 1e-4


@pytest.mark.parametrize("block", [(2, 4, 8), (3, 5), (1,), (2, 700)])  # 1,400 elements: two spans per block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_segment_gather_and_scatter_kernels_match_the_reference(block, dtype):
    from kernels.segments import reference as ref
    from kernels.segments.triton_copy import gather, scatter

    g_ = torch.Generator().manual_seed(8)
    pool = (torch.randn(9, *block, generator=g_) * 100).to(DEVICE, dtype)
    ids = torch.tensor([7, 0, 3, 3, 8], dtype=torch.int32, device=DEVICE)  # a gather may repeat a block
    out = gather(pool, ids)
    assert torch.equal(out, ref.gather(pool, ids))
    if dtype.is_floating_point:
        assert not torch.isnan(out).any()
    slots = torch.tensor([5, 1, 8], dtype=torch.int32, device=DEVICE)
    rows = (torch.randn(3, *block, generator=g_) * 100).to(DEVICE, dtype)
    got = scatter(pool.clone(), slots, rows)
    assert torch.equal(got, ref.scatter(pool.clone(), slots, rows))
    assert torch.equal(got[slots.long()], rows) and torch.equal(got[2], pool[2])  # the rest untouched


def test_segment_kernels_refuse_bad_ids():
    from kernels.segments.triton_copy import gather, scatter

    pool = torch.zeros(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        gather(pool, torch.tensor([0, 4], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gather(pool, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="named twice"):
        scatter(pool, torch.tensor([1, 1], dtype=torch.int32, device=DEVICE), torch.ones(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="blocks: shape"):
        scatter(pool, torch.tensor([1], dtype=torch.int32, device=DEVICE), torch.ones(2, 3, device=DEVICE))


def _v4_attend_inputs(b, t, h, d, q_start, key_start, n, rate, k_sel, dtype=torch.float32, seed=9):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g_)
    keys = torch.randn(b, q_start + t - key_start, d, generator=g_)
    entries = torch.randn(b, n, d, generator=g_) if n else None
    selected = None
    if k_sel:  # distinct ids per query, some -1, some not yet visible
        selected = torch.stack([torch.stack([torch.randperm(n + 2, generator=g_)[:k_sel] - 1 for _ in range(t)])
                                for _ in range(b)])
    sink = torch.randn(h, generator=g_)
    cast = [x if x is None else x.to(DEVICE, dtype) for x in (q, keys, entries)]
    return (*cast, None if selected is None else selected.to(DEVICE), sink.to(DEVICE))


@pytest.mark.parametrize("b, t, h, d, q_start, key_start, window, n, rate, k_sel", [
    (1, 1, 1, 8, 0, 0, 4, 0, 4, 0),          # sliding only, first token
    (2, 9, 3, 20, 0, 0, 4, 0, 4, 0),         # sliding only, a prefill longer than the window
    (2, 7, 2, 16, 30, 27, 4, 8, 4, 0),       # HCA: every visible entry; window keys from the state
    (1, 5, 4, 24, 61, 58, 4, 16, 4, 5),      # CSA: the top-5 ids, some -1 or not yet visible
    (1, 4, 2, 16, 70, 67, 4, 17, 4, 13),     # CSA: 13 ids, read 8 at a time
    (2, 40, 2, 12, 0, 0, 8, 10, 4, 3),       # CSA prefill: early queries see no entry yet
    (1, 3, 2, 16, 100, 98, 3, 1, 64, 0),     # HCA with one closed entry
])
def test_compressed_attention_kernel_matches_the_reference(b, t, h, d, q_start, key_start, window, n, rate, k_sel):
    from kernels.compressed_attention import reference as ref
    from kernels.compressed_attention.triton_attend import attend

    q, keys, entries, selected, sink = _v4_attend_inputs(b, t, h, d, q_start, key_start, n, rate, k_sel)
    args = (q, q_start, keys, key_start, window, entries, rate, selected, sink, d ** -0.5)
    out, expected = attend(*args, block=8), ref.attend(*args)
    assert not torch.isnan(out).any() and _rel(out, expected) < 1e-5


def test_compressed_attention_kernel_in_bf16_and_its_refusals():
    from kernels.compressed_attention import reference as ref
    from kernels.compressed_attention.triton_attend import attend

    q, keys, entries, selected, sink = _v4_attend_inputs(2, 6, 2, 16, 40, 37, 12, 4, 4, dtype=torch.bfloat16)
    args = (q, 40, keys, 37, 4, entries, 4, selected, sink, 0.25)
    assert _rel(attend(*args), ref.attend(*args)) < 2e-2
    with pytest.raises(ValueError, match="do not reach"):
        attend(q, 40, keys[:, :-1].contiguous(), 37, 4, entries, 4, selected, sink, 0.25)  # the last query lacks its key
    with pytest.raises(ValueError, match="sink: dtype"):
        attend(q, 40, keys, 37, 4, entries, 4, selected, sink.bfloat16(), 0.25)
    with pytest.raises(ValueError, match="entries: dtype"):
        attend(q, 40, keys, 37, 4, entries.float(), 4, selected, sink, 0.25)


def test_a_v4_model_decodes_the_same_with_the_kernels_forced(monkeypatch):
    """Window state, compressor and indexer state and the compressed attention kernel together:
    a stateful prefill and decode with Triton forced (the interpreter) gives the reference's logits."""
    from engine.config import ModelConfig
    from engine.model.hybrid import HybridModel
    from engine.model.random_init import hcw_hybrid_dict, init_random

    model = init_random(HybridModel(ModelConfig.from_dict(hcw_hybrid_dict(hidden=64))), 1).eval()
    ids = torch.randint(0, 263, (1, 44), generator=torch.Generator().manual_seed(4))

    def run():
        state = model.new_state()
        steps = [model(ids[:, :37], state, last_only=True)] + [model(ids[:, i:i + 1], state) for i in range(37, 44)]
        return torch.cat(steps, dim=1)

    with torch.no_grad():
        expected = run()
        dispatch.select("triton")
        forced = run()
    assert (forced - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("window", [None, 6])
def test_paged_prefill_reference_equals_dense_causal_attention_and_decode(window):
    """The prefill oracle: a chunk at the end of each sequence attends causally (and within the
    window), as scaled_dot_product_attention over the dense positions does; its last query is decode."""
    from kernels.paged_attention import reference as ref

    t = 5
    q, k_pool, v_pool, table, lengths, dense = _paged(2, 4, 2, 4, 16, [7, 13])
    qc = torch.randn(2, t, 4, 16, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = ref.paged_prefill(qc, k_pool, v_pool, table, lengths, window)
    for i, (k, v) in enumerate(dense):
        n = k.shape[1]
        q_pos, k_pos = torch.arange(n - t, n, device=k.device), torch.arange(n, device=k.device)
        allowed = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - (window or n))
        expected = torch.nn.functional.scaled_dot_product_attention(
            qc[i].transpose(0, 1), k, v, attn_mask=allowed[None], enable_gqa=True).transpose(0, 1)
        assert _rel(out[i], expected) < 1e-5
    last = ref.paged_decode(qc[:, -1].contiguous(), k_pool, v_pool, table, lengths, window)
    assert _rel(out[:, -1], last) < 1e-6


@pytest.mark.parametrize("b, t, h, hkv, bs, d, lengths", [(1, 1, 1, 1, 16, 8, [1]), (2, 21, 4, 2, 16, 12, [21, 70]),
                                                          (2, 5, 6, 3, 32, 33, [40, 5])])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_prefill_kernel_matches_the_reference(b, t, h, hkv, bs, d, lengths, window):
    from kernels.paged_attention import reference as ref
    from kernels.paged_attention.triton_decode import paged_prefill

    _, k_pool, v_pool, table, n, _ = _paged(b, h, hkv, bs, d, lengths)
    q = torch.randn(b, t, h, d, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    out = paged_prefill(q, k_pool, v_pool, table, n, window)
    assert not torch.isnan(out).any() and _rel(out, ref.paged_prefill(q, k_pool, v_pool, table, n, window)) < 1e-5
    with pytest.raises(ValueError, match="hold the chunk"):
        paged_prefill(torch.zeros(b, max(lengths) + 1, h, d, device=DEVICE), k_pool, v_pool, table, n)
    with pytest.raises(ValueError, match="block ids must lie"):
        paged_prefill(q, k_pool, v_pool, torch.full_like(table, k_pool.shape[0]), n, window)
    with pytest.raises(ValueError, match="blocks, the table has"):
        paged_prefill(q, k_pool, v_pool, table, n + bs * table.shape[1], window)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_states_at_cuts_are_those_of_calls_that_end_there(kernels):
    """chunk_gated_delta_at yields the state after each cut: what a call ending there returns (what
    a prefill stopping at a segment boundary gets) up to rounding, from one pass whose output and
    final state are the uncut call's to the bit, the reference's scan and the Triton kernel alike."""
    from kernels.gated_delta import chunk_gated_delta, chunk_gated_delta_at

    dispatch.select(kernels)
    q, k, v, g, beta, s0 = _inputs(1, 53, 2, 4, 16, 16, torch.float32, seed=9)
    cuts = [5, 16, 40]
    o, final, states = chunk_gated_delta_at(q, k, v, g, beta, s0, cuts)
    state = s0
    for lo, hi in zip([0, *cuts], cuts):
        _, state = chunk_gated_delta(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        assert _rel(states[cuts.index(hi)], state) < 1e-5
    assert len(states) == 3
    whole_o, whole_s = chunk_gated_delta(q, k, v, g, beta, s0)
    assert torch.equal(o, whole_o) and torch.equal(final, whole_s)
    assert chunk_gated_delta_at(q, k, v, g, beta, s0)[2] == []
    for bad in ([0], [53], [16, 5], [7, 7]):
        with pytest.raises(ValueError, match="cuts"):
            chunk_gated_delta_at(q, k, v, g, beta, s0, bad)


@pytest.mark.parametrize("cuts", [[1, 2, 15, 16, 17, 31, 32, 45], [33], [9, 47]])
def test_triton_kernel_emits_states_inside_its_chunks(cuts):
    """The Triton kernel keeps the state at any cut from inside the program that carries it: several
    in one of its 16-token chunks, at a chunk's first and last token, one token in; on two batch
    rows, a value block narrower than Dv and grouped key heads. Its output and final state are the
    uncut kernel's to the bit; a state at a chunk's last token is the carried state itself."""
    from kernels.gated_delta import reference as ref
    from kernels.gated_delta.triton_chunk import chunk_gated_delta, chunk_gated_delta_emitting

    q, k, v, g, beta, s0 = _inputs(2, 47, 1, 2, 16, 40, torch.float32, seed=13)
    o, final, states = chunk_gated_delta_emitting(q, k, v, g, beta, s0, cuts, block_v=16)
    whole_o, whole_s = chunk_gated_delta(q, k, v, g, beta, s0, block_v=16)
    assert torch.equal(o, whole_o) and torch.equal(final, whole_s) and len(states) == len(cuts)
    # each its own tensor: the cache keeps some snapshots and drops others
    assert len({s.untyped_storage().data_ptr() for s in states}) == len(states)
    for cut, got in zip(cuts, states):
        _, want = ref.chunk_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-5, cut
        if cut % 16 == 0:  # the state the kernel carries into the next chunk
            head = (x[:, :cut].contiguous() for x in (q, k, v, g, beta))
            _, carried = chunk_gated_delta(*head, s0, block_v=16)
            assert torch.equal(got, carried)


@pytest.mark.parametrize("cuts", [[10, 74, 202], [1, 16, 63, 64, 65, 130], [229]])
def test_cuts_anywhere_come_from_one_scan_on_the_uncut_grid(cuts):
    """Cuts anywhere (inside a chunk, at its last token, at its first, one token in): one scan on
    the chunk grid an uncut call runs, so its output and final state are that call's to the bit,
    and each state is a call's that ends there, up to rounding."""
    from kernels.gated_delta import chunk_gated_delta, chunk_gated_delta_at
    from kernels.gated_delta import reference as ref

    q, k, v, g, beta, s0 = _inputs(1, 230, 2, 4, 16, 16, torch.float32, seed=11)
    calls = []
    real = ref._chunk_block
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ref, "_chunk_block", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        o, final, states = chunk_gated_delta_at(q, k, v, g, beta, s0, cuts)
    assert len(calls) == 1 and len(states) == len(cuts)  # one scan of 4 chunks, whatever the cuts
    state = s0
    for lo, hi, got in zip([0, *cuts], cuts, states):
        _, state = chunk_gated_delta(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        assert _rel(got, state) < 1e-5
    whole_o, whole_s = chunk_gated_delta(q, k, v, g, beta, s0)
    assert torch.equal(o, whole_o) and torch.equal(final, whole_s)
