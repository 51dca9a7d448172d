"""Chunked prefill against one-shot, through the discrete choices a prefill makes: the CSA
indexer's top-k entries and the MoE experts, recorded from the engine's own modules.

fp32 rounding depends on how a prompt is chunked, and not only where a path is chosen by row
count: the gated delta rule's chunk form rounds differently for every split that is not on its
64-token grid, and decode's recurrence differently again (kernels/gated_delta). So the inputs of a
choice differ in their last bits (~1e-7 of the scores) and a choice may flip where two candidates
nearly tie; no rule applied to the scores can prevent that, since any rule has a boundary that
rounding can straddle (rarely: one random chunking of a structured 240-token prompt in ~2,000
on the cache state machine's model). What chunking must never change: a choice without a near-tie; a tie that rounding
left exact (relu's zeros: a quarter to a third of the indexer's choices tie at the k-th place),
which goes to the earlier entry however the prompt was chunked; token-table (hash) routing; and,
where no choice changed, the logits beyond 1e-5.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

import hf_reference as ref
from engine import EngineConfig, load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.engine import Engine, SamplingParams
from engine.model.mlp import Router, SparseMoE, V4MoE
from engine.model.random_init import hcw_hybrid_dict, qwen3_5_text_dict, write_random_model
from engine.model.v4_attention import Indexer
from store.tier import DiskTier

LENGTH = 240
SPREAD = (3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 63, 64, 65, 70)  # 1 (decode steps) and 2 cost the most
# of the row's largest |score|: chunking moves a score ~1e-7 of it, rarely up to 1e-4
NEAR_TIE = 1e-3
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def _prompt(seed: int, vocab: int) -> list[int]:
    """Runs of one token, of zeros and of a few ids among random ones (what the cache state
    machine's prompts look like): structure makes near-ties far commoner than random ids do."""
    rnd = random.Random(seed)
    ids: list[int] = []
    while len(ids) < LENGTH:
        n, kind = rnd.randint(1, 40), rnd.randrange(4)
        one = rnd.randrange(vocab)
        ids += [rnd.randrange(vocab) if kind == 0 else 0 if kind == 1 else one if kind == 2
                else rnd.choice((0, 1, 2, vocab - 1)) for _ in range(n)]
    return ids[:LENGTH]


class Choices:
    """Every choice one prefill makes, per site, one row per position in order: (the scores the
    choice was made on, or None for token-table routing; the chosen ids). The ids are the
    engine's own: each indexer's `select` is wrapped, each MoE's experts hooked for the routing
    they are called with. A router's scores are recomputed from the experts' input, since only
    its choice leaves it; they decide only whether a difference was a near-tie."""

    def __init__(self, model):
        self.rows: dict[str, list[tuple[torch.Tensor | None, set[int]]]] = defaultdict(list)
        self._undo = []
        for name, mod in model.named_modules():
            if isinstance(mod, Indexer):
                mod.select = self._select(name, mod.select)
                self._undo.append(lambda mod=mod: mod.__dict__.pop("select"))
            elif isinstance(mod, (SparseMoE, V4MoE)):
                handle = mod.experts.register_forward_hook(self._routed(name, mod))
                self._undo.append(handle.remove)

    def close(self) -> None:
        for undo in self._undo:
            undo()

    def clear(self) -> None:
        self.rows.clear()

    def _select(self, site, select):
        def wrapped(scores, positions, stable=True):
            chosen = select(scores, positions, stable)
            for t in range(chosen.shape[1]):
                self.rows[site].append((scores[0, t].clone(), set(chosen[0, t].tolist()) - {-1}))
            return chosen
        return wrapped

    def _routed(self, site, moe):
        def hook(experts, args, out):
            flat, idx = args[0], args[1]
            scores = _router_scores(moe, flat)
            for t in range(idx.shape[0]):
                self.rows[site].append((None if scores is None else scores[t], set(idx[t].tolist())))
        return hook


def _router_scores(moe, flat: torch.Tensor) -> torch.Tensor | None:
    """What the router ranks the experts by (V4: f(logits) + bias; Qwen3-Next: softmax), or None
    for a token-table layer."""
    if isinstance(moe, SparseMoE):
        return torch.softmax(F.linear(flat, moe.gate.weight).float(), dim=-1)
    router: Router = moe.gate
    if router.hashed:
        return None
    logits = F.linear(flat, router.weight)
    scores = {"sqrtsoftplus": lambda: F.softplus(logits).sqrt(), "sigmoid": lambda: torch.sigmoid(logits)}.get(
        router.func, lambda: torch.softmax(logits, dim=-1))()
    return scores + router.bias


def _prefill(engine: Engine, choices: Choices, ids: list[int], chunk: int):
    choices.clear()
    logits = engine.prefill(ids, engine.new_state(), chunk_size=chunk)
    return logits, {site: list(rows) for site, rows in choices.rows.items()}


def _compare(one: dict, chunked: dict, where: str) -> int:
    """Assert that every difference between two runs' choices is a near-tie that rounding could
    flip; return how many choices differ."""
    assert one.keys() == chunked.keys()
    changed = 0
    for site in one:
        assert len(one[site]) == len(chunked[site]) == LENGTH, (where, site)
        for t, ((s0, c0), (s1, c1)) in enumerate(zip(one[site], chunked[site])):
            if c0 == c1:
                continue
            changed += 1
            at = f"{where}, {site}, position {t}: {sorted(c0)} one-shot, {sorted(c1)} chunked"
            assert s0 is not None, f"{at}: token-table routing changed"
            kth = min(s0[e].item() for e in c0)
            scale = s0[torch.isfinite(s0)].abs().max().item()
            for e in c0 ^ c1:
                assert abs(s0[e].item() - kth) <= NEAR_TIE * scale, f"{at}: entry {e} was no near-tie"
            for a in c0 - c1:
                for b in c1 - c0:
                    assert not (s0[a] == s0[b] and s1[a] == s1[b]), f"{at}: an exact tie ({a}, {b}) decided differently"
    return changed


def _exact_ties(rows: dict) -> int:
    """Choices in a run whose k-th and (k+1)-th scores are bitwise equal."""
    ties = 0
    for site_rows in rows.values():
        for scores, chosen in site_rows:
            if scores is not None and len(chosen) and torch.isfinite(scores).sum() > len(chosen):
                top = scores.sort(descending=True).values
                ties += bool(top[len(chosen) - 1] == top[len(chosen)])
    return ties


def _mixed(tmp):
    # the cache state machine's model (tests/test_cache_state_machine.py)
    return load_model(write_random_model(tmp / "mixed", hcw_hybrid_dict(vocab=61), seed=6, byte_tokenizer=False),
                      device="cpu")


def _v4(tmp):
    # hash-routed, then score-routed MoE layers under sliding, CSA and HCA attention
    hf = ref.build_v4(seed=5, layer_types=[SWA, CSA, HCA], sliding_window=8, compress_rates={CSA: 4, HCA: 16},
                      index_topk=4)
    return load_model(ref.save(hf, tmp / "v4"), device="cpu")


def _qwen3_next(tmp):
    raw = qwen3_5_text_dict(hidden=64, layers=4, vocab=97)
    raw.update(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)
    return load_model(write_random_model(tmp / "qwen3-next", raw, seed=3, byte_tokenizer=False), device="cpu")


# chunk sizes for the first prompt; the second takes SPREAD
MODELS = {"mixed": (_mixed, 61, tuple(range(1, 71))), "deepseek-v4": (_v4, 97, (1, 2, *SPREAD)),
          "qwen3-next-moe": (_qwen3_next, 97, (1, 2, *SPREAD))}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunking_changes_a_choice_only_at_a_near_tie(name, tmp_path):
    make, vocab, chunks = MODELS[name]
    model = make(tmp_path)
    engine = Engine(model)
    choices = Choices(model)
    try:
        ties = flips = 0
        for seed, sizes in ((0, chunks), (1, SPREAD)):
            ids = _prompt(seed, vocab)
            one_logits, one = _prefill(engine, choices, ids, LENGTH)
            assert one, "no choice was recorded"
            ties += _exact_ties(one)
            for chunk in sizes:
                logits, chunked = _prefill(engine, choices, ids, chunk)
                changed = _compare(one, chunked, f"prompt {seed}, chunks of {chunk}")
                flips += changed
                if not changed:
                    assert (logits - one_logits).abs().max().item() <= 1e-5, f"prompt {seed}, chunks of {chunk}"
    finally:
        choices.close()
    if name != "qwen3-next-moe":  # softmax routing scores do not tie exactly
        assert ties > 0, "no exact tie at the k-th place: the tie rule was not exercised"


# ---- bit-exact mode (EngineConfig.deterministic): one token a step, so nothing depends on chunking ----
DETERMINISTIC_PIECES = (3, 8, 17, 64, 70)

def _pieces(engine: Engine, choices: Choices, ids: list[int], piece: int):
    """`ids` prefilled as the caller's pieces of `piece` tokens, each asked in chunks of `piece`."""
    choices.clear()
    state = engine.new_state()
    for lo in range(0, len(ids), piece):
        logits = engine.prefill(ids[lo:lo + piece], state, chunk_size=piece)
    return logits, {site: list(rows) for site, rows in choices.rows.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deterministic_prefill_makes_every_choice_on_the_same_bits_however_the_caller_splits_it(name, tmp_path):
    """The caller's pieces of 3-70 tokens, each asked in chunks of its size (which bit-exact mode
    overrides): every score and choice, and the logits, equal to the bit. Bit-exact mode prefills a
    token a step whatever the pieces, so a few sizes (below, at and across the blocks and the
    compress rates) say what all do: each of the 240 steps costs ~80 ms on the V4 model."""
    make, vocab, _ = MODELS[name]
    model = make(tmp_path)
    engine = Engine(model, EngineConfig(deterministic=True))
    choices = Choices(model)
    try:
        ids = _prompt(0, vocab)
        one_logits, one = _pieces(engine, choices, ids, LENGTH)
        assert one and all(len(rows) == LENGTH for rows in one.values())
        for piece in DETERMINISTIC_PIECES:
            logits, chunked = _pieces(engine, choices, ids, piece)
            assert torch.equal(logits, one_logits), f"pieces of {piece}"
            for site in one:
                for t, ((s0, c0), (s1, c1)) in enumerate(zip(one[site], chunked[site])):
                    assert c0 == c1, f"pieces of {piece}, {site}, position {t}: {sorted(c0)} / {sorted(c1)}"
                    assert (s0 is None and s1 is None) or torch.equal(s0, s1), (piece, site, t)
    finally:
        choices.close()


def _det_cache(model, lower=None):
    return PrefixCache(model, CacheConfig(block_size=8, checkpoint_every=2, checkpoint_tail=0, deterministic=True),
                       lower=lower)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deterministic_reuse_gives_a_cold_prefills_logits_bit_for_bit(name, tmp_path):
    """Wherever the cached prefix ended (a turn's end, a decoded token, a segment boundary), from
    the device tier, from disk in a new cache, and after an exact Tail-Replay of the GDN states."""
    make, vocab, _ = MODELS[name]
    model = make(tmp_path)
    det = EngineConfig(deterministic=True)
    ids = _prompt(2, vocab)[:150]
    tier = DiskTier(tmp_path / "det.db", layout_fingerprint(model, _det_cache(model).config))
    used = []
    for cut in (1, 7, 8, 37, 64, 70, 99):
        engine = Engine(model, cache=_det_cache(model, lower=tier))
        gen = engine.generate(ids[:cut], SamplingParams(max_new_tokens=3, greedy=True))
        prompt = ids[:cut] + gen.token_ids + ids[cut:]
        cold = Engine(model, det).start(prompt).logits
        for label, eng in (("device", engine), ("disk", Engine(model, cache=_det_cache(model, lower=tier)))):
            run = eng.start(prompt)
            run.finish()
            assert torch.equal(run.logits, cold), (cut, label, run.plan.summary())
            used.append(run.plan.usable_tokens)
    assert max(used) >= 96  # hits, not misses
    tier.close()
    if name != "deepseek-v4":  # no GDN snapshot kept but at the prompt's end: rebuilt by a replay from zero
        cache = PrefixCache(model, CacheConfig(block_size=16, checkpoint_tail=0, checkpoint_every=100,
                                               checkpoint_branch_point=False, reuse="approximate",
                                               replay_budget=10_000, deterministic=True))
        engine = Engine(model, cache=cache)
        engine.start(ids[:150]).finish()
        second = ids[:120] + _prompt(3, vocab)[:20]
        run = engine.start(second)
        run.finish()
        assert run.plan.replay_from == 0 and run.plan.exact and run.plan.usable_tokens >= 112, run.plan.summary()
        assert torch.equal(run.logits, Engine(model, det).start(second).logits)


def test_a_deterministic_cache_and_a_batched_one_never_share_states(tmp_path):
    model = _mixed(tmp_path)
    batched, det = CacheConfig(block_size=8), CacheConfig(block_size=8, deterministic=True)
    assert layout_fingerprint(model, batched) != layout_fingerprint(model, det)
    with pytest.raises(ValueError, match="deterministic"):
        Engine(model, EngineConfig(deterministic=False), cache=PrefixCache(model, det))
    assert Engine(model, cache=PrefixCache(model, det)).config.deterministic  # taken from the cache


def test_hcw_generate_deterministic_reports_it_and_decodes_as_the_engine_does(tmp_path):
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    folder = write_random_model(tmp_path / "byte", qwen3_5_text_dict(hidden=64, layers=4), seed=1)
    ids = _prompt(4, 200)[:90]
    res = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, ids)),
                                   "--max-new-tokens", "6", "--greedy", "--deterministic", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    from engine.tokenizer import load_tokenizer

    model = load_model(folder, device="cpu")
    stops = load_tokenizer(folder, model.config.extra).eos_ids
    want = Engine(model, EngineConfig(deterministic=True)).generate(
        ids, SamplingParams(max_new_tokens=6, greedy=True, stop_ids=stops))
    assert report["deterministic"] is True and report["token_ids"] == want.token_ids


def test_hcw_chat_deterministic_reuses_only_its_own_states(tmp_path):
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    db = tmp_path / "c.db"

    def turn(*extra):
        res = CliRunner().invoke(app, ["chat", "--db", str(db), "--plain", "--json", "--max-new-tokens", "3", *extra],
                                 input="hello there\n")
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.splitlines()[0])

    assert turn("--deterministic")["cached_tokens"] == 0
    again = turn("--deterministic")  # a new conversation: the system prompt's segment is cached
    assert again["cached_tokens"] >= 64 and again["exact"]
    assert turn()["cached_tokens"] == 0  # batched arithmetic: another fingerprint, nothing shared
    assert turn()["cached_tokens"] >= 64
