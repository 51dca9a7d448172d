"""The chained-edit test llama.cpp's recurrent rollback fails (7 wrong of 20): a 1,024-token prompt
and 20 chained random edits (each drops 1-79 tokens from the end and appends 1-79 new ones) on one
engine; every step's logits are compared with a full prefill. Halfway the process "restarts": a
new cache over the same disk tier continues the chain. hcw must be wrong 0 times and serve most
steps by reuse; on Qwen3.5, DeepSeek-V4, a random hcw_hybrid and the shipped hcw-tiny."""

from __future__ import annotations

import random

import pytest
import torch

import hf_reference as ref
from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.engine import Engine
from engine.model.loader import resolve_model
from engine.model.random_init import hcw_hybrid_dict, write_random_model
from store.tier import DiskTier

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
BLOCK = 64


def _models():
    return {
        "qwen3_5": lambda folder: ref.save(ref.build("qwen3_5_text", seed=5), folder),
        "deepseek_v4": lambda folder: ref.save(ref.build_v4(seed=5, layer_types=[SWA, CSA, HCA], sliding_window=16,
                                                            compress_rates={CSA: 4, HCA: 32}, index_topk=8), folder),
        "hcw_hybrid": lambda folder: write_random_model(folder, hcw_hybrid_dict(hidden=64, window=16), seed=5),
        "hcw-tiny": lambda folder: resolve_model("hcw-tiny"),  # the shipped, trained weights
    }


@pytest.fixture(scope="module", params=sorted(_models()))
def model(request, tmp_path_factory):
    folder = _models()[request.param](tmp_path_factory.mktemp(request.param))
    return load_model(folder, device="cpu")


def chained_edits(model, db_path, steps: int = 20, seed: int = 0, restart_at: int | None = 10):
    """Run the chain; returns (max logit difference per step, reused tokens per step)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(1024)]
    cfg = CacheConfig(block_size=BLOCK)

    def new_engine():
        return Engine(model, cache=PrefixCache(model, cfg, lower=DiskTier(db_path, layout_fingerprint(model, cfg))))

    engine = new_engine()
    engine.start(prompt).finish()
    diffs, reused = [], []
    for step in range(steps):
        if step == restart_at:
            engine.cache.lower.close()
            engine = new_engine()  # nothing in memory: the chain continues from disk
        prompt = prompt[:len(prompt) - rng.randint(1, 79)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 79))]
        run = engine.start(prompt)
        run.finish()
        cold = Engine(model).start(prompt).logits
        diffs.append((run.logits - cold).abs().max().item())
        reused.append(run.plan.usable_tokens)
    return diffs, reused


def test_twenty_chained_edits_are_all_exact_and_mostly_reused(model, tmp_path):
    diffs, reused = chained_edits(model, tmp_path / "chain.db")
    wrong = [i for i, d in enumerate(diffs) if d > 1e-4]
    assert wrong == [], diffs
    served = sum(r > 0 for r in reused)
    assert served >= 14, reused  # llama.cpp's rollback served 14 of 20, 7 of them wrong
    assert reused[10] > 0  # the first step after the restart came from disk
    assert torch.isfinite(torch.tensor(diffs)).all()
