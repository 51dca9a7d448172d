"""decode_batch (engine/batch_decode.py) against per-sequence Engine.decode.

Every test runs two identical sets of sequences: one advanced by `Engine.decode` a sequence at a
time (the reference), the other by `Engine.decode_batch`. Eight sequences of different lengths,
dense and paged KV, sequences crossing a KV page boundary during the steps, a prefix-cache hit
among cold states, and rows that join and leave between steps (the batch's order rotating too).
On the trained built-in models each path feeds itself its own greedy tokens, which must agree
over every step; on the random families both take the reference's tokens and the logits are
compared (a random model's MoE router or CSA indexer may flip a near-tie under other rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_reference as ref
from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.gdn_state import GDNState
from engine.cache.kv import KVState, PagedKVState
from engine.cache.prefix_cache import PrefixCache
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.random_init import hcw_hybrid_dict
from engine.model.v4_attention import V4Attention
from kernels.compressed_attention import attend_rows
from kernels import dispatch

STEPS = 20
# prompt lengths of the eight sequences: with 64-position pages, 60 and 62 cross a page boundary
# during the steps; with the cache's 16-position pages every sequence does
LENGTHS = (1, 7, 23, 60, 62, 97, 130, 150)
# sequence -> the step it joins the batch at, and the step it leaves at (not stepped from then on)
JOINS = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 3, 6: 6, 7: 6}
LEAVES = {1: 9, 4: 14}
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TRAINED = ("hcw-tiny", "hcw-tiny-qwen3.5")
RANDOM = {
    "qwen3_5": lambda folder: ref.save(ref.build("qwen3_5_text", seed=5), folder),
    "qwen3_next": lambda folder: ref.save(ref.build("qwen3_next", seed=5), folder),
    "deepseek_v4": lambda folder: ref.save(ref.build_v4(seed=5, layer_types=[SWA, CSA, HCA], sliding_window=16,
                                                        compress_rates={CSA: 4, HCA: 32}, index_topk=8), folder),
}
_MODELS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The models under test, loaded once for the module; each test sets its own KV layout."""
    def get(name: str):
        if name not in _MODELS:
            folder = name if name in TRAINED else RANDOM[name](tmp_path_factory.mktemp(name))
            _MODELS[name] = load_model(folder, device="cpu")
        return _MODELS[name]
    return get


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 256), (n,), generator=g).tolist() for n in LENGTHS]


def _active(step: int) -> list[int]:
    """The sequences in the batch at `step`, in an order that rotates from step to step."""
    rows = [i for i, j in JOINS.items() if j <= step and LEAVES.get(i, STEPS) > step]
    k = step % len(rows)
    return rows[k:] + rows[:k]


class Pair:
    """The same sequences twice: `ref` stepped by Engine.decode, `batch` by Engine.decode_batch."""

    def __init__(self, engine: Engine, ref_states, batch_states, logits):
        self.engine = engine
        self.ref, self.batch = ref_states, batch_states
        self.next_ref = [int(x.argmax()) for x in logits]
        self.next_batch = list(self.next_ref)
        self.tokens_ref: list[list[int]] = [[] for _ in ref_states]
        self.tokens_batch: list[list[int]] = [[] for _ in ref_states]

    def run(self, own_tokens: bool) -> float:
        """STEPS steps of the join/leave schedule; with `own_tokens` each path feeds its own greedy
        tokens, else both the reference's. Returns the largest logit difference relative to the
        reference's largest logit."""
        worst = 0.0
        for step in range(STEPS):
            rows = _active(step)
            want = torch.stack([self.engine.decode(self.next_ref[i], self.ref[i]) for i in rows])
            fed = [self.next_batch[i] if own_tokens else self.next_ref[i] for i in rows]
            got = self.engine.decode_batch(fed, [self.batch[i] for i in rows])
            assert got.shape == want.shape and got.dtype == want.dtype
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1)).item())
            for r, i in enumerate(rows):
                assert self.batch[i].seq_len == self.ref[i].seq_len, f"step {step}, sequence {i}"
                self.next_ref[i], self.next_batch[i] = int(want[r].argmax()), int(got[r].argmax())
                self.tokens_ref[i].append(self.next_ref[i])
                self.tokens_batch[i].append(self.next_batch[i])
        return worst


def _cold_pair(engine: Engine, prompts: list[list[int]]) -> Pair:
    ref_states, batch_states, logits = [], [], []
    for p in prompts:
        a, b = engine.new_state(), engine.new_state()
        logits.append(engine.prefill(p, a))
        engine.prefill(p, b)
        ref_states.append(a)
        batch_states.append(b)
    return Pair(engine, ref_states, batch_states, logits)


def _hit_pair(model, prompts: list[list[int]]) -> tuple[Pair, object]:
    """Sequence 6 resumed from a prefix-cache hit (its twin a fork of the hit), the others cold;
    the cache's 16-position blocks are the paged states' pages."""
    cache = PrefixCache(model, CacheConfig(block_size=16, checkpoint_every=1))
    engine = Engine(model, cache=cache)
    with torch.inference_mode():
        engine.start(prompts[6] + [3] * 40).finish()
        pair = _cold_pair(engine, prompts)
        run = engine.start(prompts[6])
        run.finish()
    assert run.plan.usable_tokens >= 128, "the prompt's prefix was not reused"
    pair.ref[6], pair.batch[6] = run.state, copy.deepcopy(run.state)
    pair.next_ref[6] = pair.next_batch[6] = int(run.logits.argmax())
    return pair, run.plan


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("name", TRAINED)
def test_trained_models_batched_greedy_tokens_equal_per_sequence_decode(name, layout, models):
    model = models(name)
    model.use_kv_layout(layout)
    pair, plan = _hit_pair(model, _prompts(model.config.vocab_size))
    kv = [s for s in pair.batch[0].layers if isinstance(s, (KVState, PagedKVState))]
    assert kv and all(isinstance(s, PagedKVState if layout == "paged" else KVState) for s in kv)
    worst = pair.run(own_tokens=True)
    assert worst <= 1e-5, f"logits differ by {worst:.2e} of the largest"
    assert pair.tokens_batch == pair.tokens_ref
    assert [len(t) for t in pair.tokens_ref] == [STEPS - JOINS[i] - (STEPS - LEAVES.get(i, STEPS))
                                                 for i in range(len(LENGTHS))]
    assert [s.seq_len for s in pair.batch] == [s.seq_len for s in pair.ref]
    # the hit's GDN layers record the decay statistics the cache certifies replays with
    gdn = [(a, b) for a, b in zip(pair.ref[6].layers, pair.batch[6].layers) if isinstance(a, GDNState)]
    assert gdn and all(b.tracking for _, b in gdn)
    for a, b in gdn:
        assert a.stats_end == b.stats_end == pair.ref[6].seq_len
        assert torch.allclose(a.stats, b.stats, rtol=1e-4, atol=1e-6) and torch.allclose(a.norm, b.norm, rtol=1e-4)


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("family", sorted(RANDOM))
def test_random_families_batched_logits_equal_per_sequence_decode(family, layout, models):
    model = models(family)
    model.use_kv_layout(layout)
    model.use_kv_page(64)
    _assert_cold_rows_match(model, seed=1)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v4"])
def test_the_torch_paths_batch_too(family, models):
    """HCW_KERNELS=reference: no native kernel, every row's core on the torch path."""
    dispatch.select("reference")
    model = models(family)
    model.use_kv_layout("dense")
    _assert_cold_rows_match(model, seed=3)


def _assert_cold_rows_match(model, seed: int) -> None:
    """Cold rows of different lengths: batched logits within 1e-5 of the largest of per-sequence decode's."""
    with torch.inference_mode():
        pair = _cold_pair(Engine(model), _prompts(model.config.vocab_size, seed=seed))
    worst = pair.run(own_tokens=False)
    assert worst <= 1e-5, f"logits differ by {worst:.2e} of the largest"


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v4"])
def test_random_families_with_a_cache_hit_among_cold_rows(family, models):
    model = models(family)
    model.use_kv_layout("paged")
    pair, _ = _hit_pair(model, _prompts(model.config.vocab_size, seed=2))
    worst = pair.run(own_tokens=False)
    assert worst <= 1e-5, f"logits differ by {worst:.2e} of the largest"


@pytest.mark.parametrize("kind, topk", [(SWA, 0), (HCA, 0), (CSA, 3)])
def test_v4_rows_attend_over_gathered_keys_as_each_row_does_alone(kind, topk):
    """V4 attention's batched step gathers each row's visible keys (`_visible`) and attends once
    (`attend_rows`): against one `attend` a row, positions before and after the window fills, a
    CSA choice with -1s and an entry the query cannot see yet."""
    cfg = ModelConfig.from_dict(hcw_hybrid_dict(hidden=64, layer_types=(kind,), window=8, csa_rate=4, hca_rate=4,
                                                index_topk=max(topk, 1)))
    layer = V4Attention(cfg, kind)
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(layer.n_heads))
    g = torch.Generator().manual_seed(7)
    rows, want = [], []
    for position in (0, 3, 8, 13, 30):
        held = min(position, layer.window - 1)  # the window a state keeps before this token
        keys = torch.randn(1, held + 1, layer.head_dim, generator=g)
        entries = torch.randn(1, (position + 1) // 4 + 1, layer.head_dim, generator=g) if kind != SWA else None
        selected = None
        if kind == CSA:
            pick = torch.randperm(entries.shape[1], generator=g)[:topk].tolist() + [-1] * topk
            selected = torch.tensor(pick[:topk])[None, None]
        q = torch.randn(1, 1, layer.n_heads, layer.head_dim, generator=g)
        seen = (keys, position - held, entries, selected)
        want.append(layer._attend(q, torch.tensor([position]), *seen)[0, 0])
        rows.append((q[0, 0], layer._visible(*seen, position)))
    lengths = torch.tensor([k.shape[0] for _, k in rows])
    got = attend_rows(torch.stack([q for q, _ in rows]), torch.nn.utils.rnn.pad_sequence([k for _, k in rows], True),
                      lengths, layer.attn_sink, layer.head_dim ** -0.5)
    assert (got - torch.stack(want)).abs().max().item() <= 1e-6
    if kind == HCA:
        assert lengths.tolist() == [1, 4 + 1, 8 + 2, 8 + 3, 8 + 7]  # the window's keys, then every closed entry


@pytest.mark.parametrize("name", TRAINED)
def test_one_sequence_is_the_single_decode_bit_for_bit(name, models):
    model = models(name)
    model.use_kv_layout("dense")
    engine = Engine(model)
    with torch.inference_mode():
        a, b = engine.new_state(), engine.new_state()
        engine.prefill(list(range(40)), a)
        engine.prefill(list(range(40)), b)
        token = 5
        for _ in range(5):
            want = engine.decode(token, a)
            got = engine.decode_batch([token], [b])
            assert got.shape == (1, model.config.vocab_size) and torch.equal(got[0], want)
            token = int(want.argmax())
    assert a.seq_len == b.seq_len == 45


def test_refuses_what_is_no_step(models):
    model = models("hcw-tiny-qwen3.5")
    model.use_kv_layout("dense")
    engine = Engine(model)
    a, b = engine.new_state(), engine.new_state()
    with pytest.raises(ValueError, match="2 tokens for 1 states"):
        engine.decode_batch([1, 2], [a])
    with pytest.raises(ValueError, match="appears twice"):
        engine.decode_batch([1, 2], [a, a])
    with pytest.raises(ValueError, match="no sequence"):
        engine.decode_batch([], [])
    assert a.seq_len == b.seq_len == 0
