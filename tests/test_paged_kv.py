"""The paged KV layout (engine/cache/kv.py PagedKVState): full attention's keys and values in
blocks of a pool read through a block table by the paged-attention kernels. It must hold exactly
what the dense buffer holds, give the same logits through the model (the torch reference on CPU,
the Triton kernels through the interpreter), and look the same to the prefix cache."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.cache.kv import PAGE, KVState, PagedKVState, kv_layout
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.engine import Engine, SamplingParams
from engine.model.hybrid import HybridModel
from engine.model.random_init import init_random, qwen3_5_text_dict


def _filled(chunks, b=2, h=3, d=8):
    """The same keys and values appended in `chunks` to a dense and a paged state."""
    dense = KVState.empty(b, h, d, torch.float32, "cpu", capacity=4)
    paged = PagedKVState.empty(b, h, d, torch.float32, "cpu", capacity=4)
    g = torch.Generator().manual_seed(sum(chunks))
    for n in chunks:
        k, v = torch.randn(2, b, h, n, d, generator=g)
        dense.append(k, v)
        paged.append(k, v)
    return dense, paged


@pytest.mark.parametrize("chunks", [[1] * 70, [63, 1, 1, 70], [PAGE], [200, 3], [5, PAGE * 3 + 7, 1]])
def test_a_paged_state_holds_what_the_dense_one_holds(chunks):
    dense, paged = _filled(chunks)
    n = sum(chunks)
    assert paged.length == dense.length == n and paged.lengths.tolist() == [n, n]
    for lo, hi in ((0, n), (0, 1), (n - 1, n), (PAGE - 3, min(n, PAGE + 5)), (n // 3, n // 2 + 1)):
        if lo >= hi:
            continue
        got, want = paged.export(lo, hi)["kv"].data, dense.export(lo, hi)["kv"].data
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (lo, hi)
    assert all(torch.equal(a, b) for a, b in zip(paged.read(n), dense.read(n)))
    assert paged.nbytes() == dense.nbytes()
    assert paged.objects(0, n) == dense.objects(0, n)
    with pytest.raises(IndexError):
        paged.read(n + 1)


def test_the_block_table_names_each_sequences_blocks_in_order_and_survives_growth():
    """Sequence b's j-th block is pool block runs[j] + b: the table says so, and a pool that grows
    keeps every block where it was (the kernels are handed the table, not this rule)."""
    _, paged = _filled([PAGE * 2 + 1])
    assert paged.table.dtype == torch.int32 and paged.table.shape == (2, 3)
    assert paged.table.tolist() == [[r + b for r in paged.runs] for b in range(2)]
    for b in range(2):
        for j in range(3):
            block = int(paged.table[b, j])
            want = paged.export(j * PAGE, min((j + 1) * PAGE, paged.length))["kv"].data[0][b]
            assert torch.equal(paged.k_pool[block, :, : want.shape[1]], want)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("n", [100, PAGE, 2 * PAGE + 1])
def test_assemble_and_export_move_whole_blocks_through_the_segment_kernels(monkeypatch, kernels, n):
    """Segments that are not views of the pool arrive (assemble: copied into blocks of its own) and
    leave (export of a range that is no whole block: one gather through kernels.segments, the
    torch reference or Triton, the interpreter on CPU, then cut)."""
    dense, paged = _filled([n])
    dispatch.select(kernels)
    pieces = [paged.export(lo, min(lo + 16, n))["kv"].data for lo in range(0, n, 16)]
    rebuilt = paged.assemble(n - 1, {"kv": pieces})  # the pieces may run past seq_len
    assert isinstance(rebuilt, PagedKVState) and rebuilt.length == n - 1 and rebuilt.lengths.tolist() == [n - 1] * 2
    assert all(torch.equal(a, b[:, :, :n - 1]) for a, b in zip(rebuilt.read(n - 1), dense.read(n)))
    got = rebuilt.export(PAGE // 2, n - 1)["kv"].data
    assert all(torch.equal(a, b) for a, b in zip(got, dense.export(PAGE // 2, n - 1)["kv"].data))
    pools = {rebuilt.k_pool.untyped_storage().data_ptr(), rebuilt.v_pool.untyped_storage().data_ptr()}
    assert all(t.untyped_storage().data_ptr() not in pools for t in got)  # copies, never views of the pool


def test_kv_layout_is_paged_unless_asked_and_refuses_a_bad_value():
    assert kv_layout("auto", "cpu") == "paged" and kv_layout("auto", "cuda") == "paged"
    assert EngineConfig.from_env({}).kv_layout is None  # unset: the model's own (auto)
    assert kv_layout(EngineConfig.from_env({"HCW_KV": "dense"}).kv_layout, "cpu") == "dense"
    with pytest.raises(ValueError, match="HCW_KV"):
        EngineConfig.from_env({"HCW_KV": "pagd"})


def _qwen(hidden=128, layers=4):  # 2 query heads over 1 key-value head: GQA
    return init_random(HybridModel(ModelConfig.from_dict(qwen3_5_text_dict(hidden=hidden, layers=layers))), 0).eval()


def _run(model, ids, split):
    """Chunked prefill to `split`, then one token at a time: every position's logits."""
    state = model.new_state()
    steps = [model(ids[:, :split], state)] + [model(ids[:, i:i + 1], state) for i in range(split, ids.shape[1])]
    return torch.cat(steps, dim=1), state


def test_a_qwen_model_gives_the_same_logits_with_paged_kv(monkeypatch):
    """Prefill chunks and decode steps that cross block boundaries (PAGE = 64): the paged layout
    through the torch reference gives the dense layout's logits."""
    model = _qwen()
    ids = torch.randint(0, 263, (1, 140), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.use_kv_layout("dense")
        expected, dense_state = _run(model, ids, 60)
        model.use_kv_layout("paged")
        got, paged_state = _run(model, ids, 60)
    assert any(isinstance(s, PagedKVState) for s in paged_state.layers)
    assert not any(isinstance(s, PagedKVState) for s in dense_state.layers)
    assert (got - expected).abs().max().item() <= 1e-5


def test_pieces_read_one_kv_heads_runs_in_place_and_gather_the_rest():
    """One sequence with one key-value head: its runs of consecutive blocks as views of the pool
    (a gap between runs: two pieces); more heads or sequences, or runs too short: one copy."""
    pool = PagedKVState.empty(1, 1, 8, torch.float32, "cpu").pool
    state, other = PagedKVState(pool, 1), PagedKVState(pool, 1)
    g = torch.Generator().manual_seed(0)
    for s, n in ((state, 6 * PAGE), (other, PAGE), (state, 2 * PAGE + 5)):  # the other's block between: two runs
        s.append(*torch.randn(2, 1, 1, n, 8, generator=g))
    n = state.length - 3
    pieces = state.pieces(n)
    assert state.runs == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert [p[0].shape[2] for p in pieces] == [6 * PAGE, 2 * PAGE + 2]
    assert all(p[0].untyped_storage().data_ptr() == pool.k.untyped_storage().data_ptr() for p in pieces)
    k, v = state.read(n)
    assert torch.equal(torch.cat([p[0] for p in pieces], 2), k) and torch.equal(torch.cat([p[1] for p in pieces], 2), v)
    assert state.pieces(0) == []
    with pytest.raises(IndexError):
        state.pieces(state.length + 1)
    dense, paged = _filled([PAGE * 3 + 7])  # two sequences, three heads
    (k, v), = paged.pieces(PAGE * 2 + 1)
    assert k.untyped_storage().data_ptr() != paged.k_pool.untyped_storage().data_ptr()
    assert torch.equal(k, dense.read(PAGE * 2 + 1)[0]) and torch.equal(v, dense.read(PAGE * 2 + 1)[1])
    short = PagedKVState(pool, 1)
    for _ in range(3):  # runs of one block each, between the other state's
        for s in (short, other):
            s.append(*torch.randn(2, 1, 1, PAGE, 8, generator=g))
    assert len(short.pieces(3 * PAGE)) == 1


def test_a_chunked_paged_prefill_attends_its_own_keys_and_the_held_blocks_in_place(monkeypatch):
    """Prefill chunks through the blocked CPU attention (its thresholds lowered, blocks small): a
    chunk attends to its own keys as computed and to the held positions read out of the pool,
    nothing gathered for one sequence with one key-value head, and the logits are the dense
    layout's."""
    from engine.model import cpu_attention

    monkeypatch.setattr(cpu_attention, "MIN_PAIRS", 0)
    monkeypatch.setattr(cpu_attention, "Q_BLOCK", 48)
    monkeypatch.setattr(cpu_attention, "K_BLOCK", 40)
    model = _qwen()
    assert model.config.num_key_value_heads == 1
    ids = torch.randint(0, 263, (1, 330), generator=torch.Generator().manual_seed(8))
    gathered = []
    real = PagedKVState._dense
    monkeypatch.setattr(PagedKVState, "_dense", lambda self, lo, hi: gathered.append(hi - lo) or real(self, lo, hi))
    logits = {}
    with torch.no_grad():
        for layout in ("dense", "paged"):
            model.use_kv_layout(layout)
            state = model.new_state()
            logits[layout] = torch.cat([model(ids[:, lo:lo + 110], state) for lo in range(0, 330, 110)], dim=1)
    assert gathered == []
    assert (logits["paged"] - logits["dense"]).abs().max().item() <= 1e-5


def test_paged_kv_with_the_triton_kernels_forced_gives_the_same_logits(monkeypatch):
    """The engine's paged path with Triton forced (the interpreter on CPU): prefill kernel for the
    chunk, decode kernel for the steps, across a block boundary."""
    model = _qwen(hidden=32, layers=4)
    ids = torch.randint(0, 263, (1, 68), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.use_kv_layout("dense")
        expected, _ = _run(model, ids, 62)
        model.use_kv_layout("paged")
        dispatch.select("triton")
        got, _ = _run(model, ids, 62)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_prefix_cache_hits_with_paged_kv_are_exact(monkeypatch, kernels):
    """Segments exported from paged states and assembled back into them (through the segment
    kernels): each turn's hit gives a cold prefill's logits, and generation continues from it."""
    model = _qwen()
    model.use_kv_layout("paged")  # before the cache is made: it assembles states of its model's layout
    engine = Engine(model, EngineConfig(kernels=kernels),
                    cache=PrefixCache(model, CacheConfig(block_size=16, checkpoint_every=1)))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 263, (90,), generator=g).tolist()
    with torch.no_grad():
        gen = engine.generate(prompt, SamplingParams(max_new_tokens=8, greedy=True))
        follow = prompt + gen.token_ids + torch.randint(0, 263, (20,), generator=g).tolist()
        run = engine.start(follow)
        cold = Engine(model).start(follow)
    assert run.plan.usable_tokens >= 80 and run.plan.exact
    assert any(isinstance(s, PagedKVState) for s in run.state.layers)
    assert (run.logits - cold.logits).abs().max().item() <= 1e-4


def test_a_replay_over_a_paged_state_reads_its_keys_in_place_and_writes_nothing(monkeypatch):
    """Tail-Replay runs positions the state already holds: full attention reads the cached keys
    through the table as far as the chunk (no dense copy of the prefix), the same logits as the
    dense layout's replay, and the pool unchanged."""
    model = _qwen()
    ids = torch.randint(0, 263, (1, 150), generator=torch.Generator().manual_seed(8))
    out = {}
    with torch.no_grad():
        for layout in ("dense", "paged"):
            model.use_kv_layout(layout)
            state = model.new_state()
            model(ids, state)
            kv = [i for i, s in enumerate(state.layers) if hasattr(s, "read")]
            before = [state.layers[i].read(150) for i in kv]
            replayed = model(ids[:, 70:130], state, replay_from=70)
            assert state.seq_len == 150
            assert all(torch.equal(a, b) for i, old in zip(kv, before) for a, b in zip(state.layers[i].read(150), old))
            out[layout] = replayed
    assert (out["paged"] - out["dense"]).abs().max().item() <= 1e-5


def test_the_engine_trusts_the_table_it_built_and_direct_calls_are_still_checked(monkeypatch):
    """Checking a table's values reads them back from the device (a sync per layer per step on a
    GPU): the engine's paged path skips it, a direct call of the kernel does not."""
    import kernels.paged_attention.triton_decode as paged

    def refuse(*args):
        raise AssertionError("the table's values were read back")

    model = _qwen(hidden=128, layers=4)
    ids = torch.randint(0, 263, (1, 66), generator=torch.Generator().manual_seed(2))
    model.use_kv_layout("paged")
    dispatch.select("triton")
    monkeypatch.setattr(paged, "_check_table", refuse)
    with torch.no_grad():
        state = model.new_state()
        model(ids[:, :64], state)
        model(ids[:, 64:66], state)
        layer = next(s for s in state.layers if isinstance(s, PagedKVState))
        q = torch.randn(1, 2, layer.k_pool.shape[3])
        with pytest.raises(AssertionError, match="read back"):
            paged.paged_decode(q, layer.k_pool, layer.v_pool, layer.table, layer.lengths)


def test_an_assembled_dense_kv_state_takes_the_next_tokens_without_copying_the_prefix():
    from engine.cache.kv import KVState

    parts = [(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)) for _ in range(40)]
    state = KVState.empty(1, 2, 8, torch.float32, "cpu").assemble(640, {"kv": parts})
    assert state.length == 640 and state.k.shape[2] >= 640 + 80  # room for the request's new tokens
    k_all, v_all = torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2)
    before = state.k.data_ptr()
    k, v = state.append(torch.ones(1, 2, 64, 8), torch.ones(1, 2, 64, 8))
    assert state.k.data_ptr() == before  # no regrow: the 640 restored positions were not copied again
    assert torch.equal(k[:, :, :640], k_all) and torch.equal(v[:, :, :640], v_all) and k.shape[2] == 704


def test_assembling_pieces_of_the_wrong_total_length_is_refused():
    # a cat into a view of the wrong length would only warn and scramble heads and positions;
    # the restore treats the ValueError as pieces that do not assemble and re-plans
    from engine.cache.kv import KVState

    empty = KVState.empty(1, 2, 8, torch.float32, "cpu")
    for lengths in ([16, 16, 8], [16, 16, 20]):
        parts = [(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)) for n in lengths]
        with pytest.raises(ValueError, match="positions"):
            empty.assemble(48, {"kv": parts})
