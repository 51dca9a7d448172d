"""Bit-flip drill for the disk tier: flip one random bit of one stored blob, resume from the
database alone, and check the result against a cold prefill. Used by the tests (hundreds of flips)
and benchmarks/corruption.py (thousands)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.engine import Engine
from store.tier import DiskTier


def flip_trials(model, db: Path, prompt: list[int], trials: int, block_size: int = 16, seed: int = 0) -> dict:
    """`prompt` must already be saved in `db`. Returns counts: detected, wrong reuses, max diff."""
    cfg = CacheConfig(block_size=block_size, checkpoint_every=1)
    layout = layout_fingerprint(model, cfg)
    query = prompt + [1]
    cold = Engine(model).start(query).logits
    con = sqlite3.connect(db)
    rows = con.execute("SELECT id, length(data) FROM blobs WHERE length(data) > 0").fetchall()
    rng = random.Random(seed)
    out = {"trials": trials, "detected": 0, "wrong_reuse": 0, "max_diff": 0.0, "reasons": {}}
    try:
        for _ in range(trials):
            blob_id, length = rng.choice(rows)
            offset, bit = rng.randrange(length), 1 << rng.randrange(8)
            (data,) = con.execute("SELECT data FROM blobs WHERE id = ?", [blob_id]).fetchone()
            flipped = bytearray(data)
            flipped[offset] ^= bit
            con.execute("UPDATE blobs SET data = ? WHERE id = ?", [bytes(flipped), blob_id])
            con.commit()
            tier = DiskTier(db, layout)
            try:
                run = Engine(model, cache=PrefixCache(model, cfg, lower=tier)).start(query)
                diff = (run.logits - cold).abs().max().item()
                out["max_diff"] = max(out["max_diff"], diff)
                out["wrong_reuse"] += diff > 1e-4
                out["detected"] += bool(tier.failures)
                for reason, n in tier.failures.items():
                    out["reasons"][reason] = out["reasons"].get(reason, 0) + n
            finally:
                tier.close()
                con.execute("UPDATE blobs SET data = ? WHERE id = ?", [data, blob_id])
                con.commit()
    finally:
        con.close()
    return out
