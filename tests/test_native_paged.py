"""The C paged decode kernel (kernels/native/paged_decode.c) against the torch reference
(kernels/paged_attention/reference.py), and a paged model's decode against the dense layout's.

The tests run with HCW_NATIVE=1 (a machine where the kernel cannot be built fails them instead of
testing the reference twice) and with launcher outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv import PagedKVState
from engine.config import ModelConfig
from engine.model.hybrid import HybridModel
from engine.model.random_init import hcw_hybrid_dict, init_random, qwen3_5_text_dict
from engine.threads import intra_op_threads
from kernels import dispatch
from kernels.native import paged_decode as native_paged
from kernels.paged_attention import reference


pytestmark = pytest.mark.usefixtures("native_required")


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def _inputs(batch, heads, kv_heads, head_dim, page, lengths, dtype, seed=42):
    """Pools of random blocks, and tables whose rows name blocks out of order, the second row
    sharing the first row's first blocks (a prefix-cache hit's table)."""
    g = torch.Generator().manual_seed(seed)
    need = max(-(-n // page) for n in lengths)
    n_blocks = batch * need + 3
    k_pool, v_pool = (torch.randn(n_blocks, kv_heads, page, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    table = torch.stack([torch.randperm(n_blocks, generator=g)[:need + 1] for _ in range(batch)]).int()
    if batch > 1:
        table[1, :need // 2] = table[0, :need // 2]
    return q, k_pool, v_pool, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 12], ids=["d64", "d12-scalar"])
@pytest.mark.parametrize("lengths", [[1], [63], [500], [100, 37, 129]], ids=["len1", "len63", "len500", "three-seqs"])
def test_the_kernel_matches_the_reference(dtype, tol, heads, kv_heads, head_dim, lengths):
    """Odd lengths (1; 63 and 100 end mid-block; 500 over eight blocks), several sequences with
    tables of their own, out of order and sharing blocks."""
    args = _inputs(len(lengths), heads, kv_heads, head_dim, 64, lengths, dtype)
    with torch.no_grad():
        assert native_paged.applies(*args)
        got = native_paged.paged_decode(*args)
        expected = reference.paged_decode(*args)
    assert got.dtype is dtype and got.shape == expected.shape
    assert not got.isnan().any()
    assert _rel(got, expected) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 100])
def test_the_block_size_does_not_change_the_bits(dtype, window):
    """The same keys and values in pools of 8, 16, 64 and 128 positions a block (a prefix cache's pool
    and an engine's): the same output to the bit, also split into partitions (1,100 positions) and
    under a window, so a bit-exact hit equals a cold prefill whichever pool either ran in."""
    g = torch.Generator().manual_seed(5)
    lengths = [1100, 77, 64]
    n = max(lengths)
    keys, values = (torch.randn(3, 2, n, 16, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(3, 4, 16, generator=g).to(dtype)
    outs = []
    for page in (8, 16, 64, 128):
        blocks = -(-n // page)
        # each sequence's blocks out of order in one pool: [3 * blocks, 2, page, 16]
        order = torch.randperm(3 * blocks, generator=g)
        pools = [torch.zeros(3 * blocks, 2, page, 16, dtype=dtype) for _ in range(2)]
        for src, pool in zip((keys, values), pools):
            padded = torch.nn.functional.pad(src, (0, 0, 0, blocks * page - n))  # [3, 2, blocks * page, 16]
            pool[order] = padded.unflatten(2, (blocks, page)).permute(0, 2, 1, 3, 4).reshape(3 * blocks, 2, page, 16)
        table = order.view(3, blocks).int()
        args = (q, *pools, table, torch.tensor(lengths, dtype=torch.int32))
        with torch.no_grad():
            assert native_paged.applies(*args)
            outs.append(native_paged.paged_decode(*args, window=window))
    assert not outs[0].isnan().any()
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("window", [1, 37, 64, 600], ids=["w1", "w37", "w64", "w600-past-the-start"])
@pytest.mark.parametrize("page", [16, 64], ids=["page16", "page64"])
def test_a_sliding_window_attends_to_its_last_positions_only(window, page):
    args = _inputs(3, 4, 2, 32, page, [500, 63, 130], torch.float32, seed=7)
    with torch.no_grad():
        got = native_paged.paged_decode(*args, window=window)
        expected = reference.paged_decode(*args, window=window)
    assert _rel(got, expected) <= 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2), (6, 3)], ids=["gqa2", "gqa4", "gqa2-kv3"])
@pytest.mark.parametrize("window", [None, 101], ids=["full", "w101"])
def test_the_thread_count_does_not_change_the_result(dtype, tol, heads, kv_heads, window):
    """Three sequences of odd lengths (ending mid-block, sharing blocks) over GQA groups: each
    (sequence, key-value head) pair is computed whole by one thread, so any split of the pairs gives
    the one-thread result to the bit (an output a thread skipped stays NaN)."""
    args = _inputs(3, heads, kv_heads, 32, 16, [501, 63, 130], dtype, seed=5)
    assert _thread_count_problems(args, window, tol, items=3 * kv_heads) == []


def _thread_count_problems(args, window, tol, items) -> list[str]:
    """What is wrong, if anything, with the one-thread result (NaN left, far from the reference's)
    and with each other thread count's (its team's size, a result not equal to the one-thread one);
    `items`: the pieces of work the threads share (pairs or partitions)."""
    q, k_pool, _, _, lengths = args
    problems = []
    with torch.no_grad():
        one = native_paged.paged_decode(*args, window=window, threads=1)
        if one.isnan().any():
            problems.append("one thread left NaN")
        if not _rel(one, reference.paged_decode(*args, window=window)) <= tol:
            problems.append("one thread is far from the reference")
        for threads in (2, 3, items + 1):
            team = native_paged.team(q, k_pool, lengths, window, threads)
            if team != min(threads, items):
                problems.append(f"{threads} threads asked: a team of {team}")
            if not torch.equal(native_paged.paged_decode(*args, window=window, threads=threads), one):
                problems.append(f"{threads} threads: not the one-thread result")
    return problems


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 1), (8, 2)], ids=["one-kv-head", "gqa4"])
@pytest.mark.parametrize("lengths, window", [([3001], None), ([1024, 1023], None), ([2049, 70, 1500], None),
                                             ([3001, 1600], 1500), ([3001], 1023)],
                         ids=["len3001", "len1024-at-the-split", "three-seqs", "w1500", "w1023-whole"])
def test_a_long_pair_split_into_partitions_is_the_same_on_any_thread_count(dtype, tol, heads, kv_heads, lengths,
                                                                           window):
    """A pair attending to 1,024 positions or more is cut into partitions of 512 from its first
    attended position (the last one shorter; 1,023 stays whole), merged in order: odd lengths,
    windows, a split pair beside whole ones. Every thread count gives the one-thread result to the
    bit, which is the reference's within tolerance (an output nobody wrote stays NaN)."""
    attended = [min(n, window or n) for n in lengths]
    items = kv_heads * sum(-(-n // 512) if n >= 1024 else 1 for n in attended)
    args = _inputs(len(lengths), heads, kv_heads, 64, 64, lengths, dtype, seed=9)
    assert _thread_count_problems(args, window, tol, items) == []


def test_a_split_sequence_gives_the_same_bits_alone_and_in_a_batch():
    """The partitions depend on a sequence's own length only: its output does not change with the
    sequences beside it (nor with how many pairs there are to share the threads)."""
    q, k_pool, v_pool, table, lengths = _inputs(3, 4, 2, 64, 64, [2500, 40, 1100], torch.float32, seed=4)
    with torch.no_grad():
        batch = native_paged.paged_decode(q, k_pool, v_pool, table, lengths, threads=2)
        for i in range(3):
            alone = native_paged.paged_decode(q[i:i + 1], k_pool, v_pool, table[i:i + 1].contiguous(),
                                              lengths[i:i + 1], threads=2)
            assert torch.equal(alone[0], batch[i])


def test_peaked_scores_merge_across_partitions():
    """Scores spread over hundreds: a partition whose maximum lies far below another's weighs
    (almost) nothing in the merge, as the reference's one softmax."""
    q, k_pool, v_pool, table, lengths = _inputs(1, 2, 1, 64, 64, [2600], torch.float32, seed=6)
    k_pool[:, :, :, :] *= 0.1
    first = table[0, 0]
    k_pool[first] *= 40.0  # the first partition's scores far above the rest
    with torch.no_grad():
        for scale in (0.05, 3.0):
            got = native_paged.paged_decode(q * 4, k_pool, v_pool, table, lengths, scale=scale, threads=2)
            expected = reference.paged_decode(q * 4, k_pool, v_pool, table, lengths, scale=scale)
            assert _rel(got, expected) <= 1e-5


def test_the_threads_are_torchs_count_and_a_small_call_keeps_one():
    q, k_pool, _, _, lengths = args = _inputs(2, 4, 2, 32, 16, [300, 211], torch.float32)
    assert native_paged.team(q, k_pool, lengths) == min(torch.get_num_threads(), 4)
    with intra_op_threads(1):
        assert native_paged.team(q, k_pool, lengths) == 1
    short = torch.tensor([1, 2], dtype=torch.int32)
    assert native_paged.team(q, k_pool, short, threads=4) == 1  # microseconds of work: not shared
    assert native_paged.team(q, k_pool, lengths, window=1, threads=4) == 1
    with torch.no_grad():
        assert torch.equal(native_paged.paged_decode(*args[:4], short, threads=4),
                           native_paged.paged_decode(*args[:4], short, threads=1))


def test_a_given_scale_and_peaked_scores():
    """Scores spread over hundreds (the softmax's tail below float32's smallest normal)."""
    q, k_pool, v_pool, table, lengths = _inputs(2, 4, 2, 32, 64, [300, 211], torch.float32, seed=3)
    with torch.no_grad():
        for scale in (0.05, 3.0):
            got = native_paged.paged_decode(q * 4, k_pool, v_pool, table, lengths, scale=scale)
            expected = reference.paged_decode(q * 4, k_pool, v_pool, table, lengths, scale=scale)
            assert _rel(got, expected) <= 1e-5


def test_a_bad_table_or_length_is_refused_before_anything_is_read():
    q, k_pool, v_pool, table, lengths = _inputs(2, 4, 2, 16, 16, [40, 20], torch.float32)
    with torch.no_grad():
        bad = table.clone()
        bad[1, 1] = k_pool.shape[0]  # past the pool, in a block the length reaches
        with pytest.raises(ValueError, match="not in the pool"):
            native_paged.paged_decode(q, k_pool, v_pool, bad, lengths)
        bad[1, 1], bad[1, 2] = table[1, 1], -1  # a negative id past the length: never read
        native_paged.paged_decode(q, k_pool, v_pool, bad, lengths)
        with pytest.raises(ValueError, match="more blocks than the table"):
            native_paged.paged_decode(q, k_pool, v_pool, table, torch.tensor([40, table.shape[1] * 16 + 1],
                                                                             dtype=torch.int32))
        with pytest.raises(ValueError, match="shapes disagree"):
            native_paged.paged_decode(q, k_pool, v_pool[:, :, :, :8].contiguous(), table, lengths)


def test_other_dtypes_layouts_and_forced_paths_stay_on_the_reference():
    args = _inputs(1, 4, 2, 16, 16, [20], torch.float32)
    q, k_pool, v_pool, table, lengths = args
    with torch.no_grad():
        assert native_paged.applies(*args)
        assert not native_paged.applies(q.half(), k_pool.half(), v_pool.half(), table, lengths)
        assert not native_paged.applies(q, k_pool.bfloat16(), v_pool.bfloat16(), table, lengths)
        assert not native_paged.applies(q, k_pool, v_pool, table.long(), lengths)
        assert not native_paged.applies(q.transpose(0, 1), k_pool, v_pool, table, lengths)
        assert not native_paged.applies(q[:, :3], k_pool, v_pool, table, lengths)  # 3 heads over 2
        dispatch.select("reference")
        assert not native_paged.applies(*args)
        dispatch.select("auto")
    assert not native_paged.applies(*args)  # autograd on


MODELS = {
    "qwen3.5": lambda: qwen3_5_text_dict(hidden=128, layers=4),  # 2 query heads over 1, head dim 64
    "hcw_hybrid": lambda: hcw_hybrid_dict(hidden=128, window=16),  # 4 over 2, head dim 32
}


@pytest.mark.parametrize("family", list(MODELS))
def test_paged_decode_gives_the_dense_layouts_logits(family, monkeypatch):
    """A prefill ending mid-block, then decode steps across two block boundaries (page 64): every
    step's logits with paged KV, its attention through the kernel, equal the dense layout's."""
    model = init_random(HybridModel(ModelConfig.from_dict(MODELS[family]())), 0).eval()
    ids = torch.randint(0, 263, (1, 150), generator=torch.Generator().manual_seed(11))
    calls = []
    real = native_paged.paged_decode
    monkeypatch.setattr(native_paged, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = {}
    with torch.no_grad():
        for layout in ("dense", "paged"):
            model.use_kv_layout(layout)
            state = model.new_state()
            steps = [model(ids[:, :50], state)] + [model(ids[:, i:i + 1], state) for i in range(50, ids.shape[1])]
            logits[layout] = torch.cat(steps, dim=1)
            assert any(isinstance(s, PagedKVState) for s in state.layers) == (layout == "paged")
    n_attention = sum(t == "full_attention" for t in model.config.layer_types)
    assert len(calls) == n_attention * (ids.shape[1] - 50)
    assert (logits["paged"] - logits["dense"]).abs().max().item() <= 1e-5
