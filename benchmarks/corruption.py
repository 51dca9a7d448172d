"""Thousands of single-bit flips in a saved session: every one must be detected and recomputed,
never reused. Writes its row to docs/BENCHMARKS.md.

    python benchmarks/corruption.py            # 2,000 flips
    python benchmarks/corruption.py --quick --no-write
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model.random_init import hcw_hybrid_dict, write_random_model  # noqa: E402
from store.tier import DiskTier  # noqa: E402
from workbench.corruption import flip_trials  # noqa: E402


def main() -> None:
    args = parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hcw-flips-"))
    model = load_model(write_random_model(folder / "m", hcw_hybrid_dict(vocab=97), seed=7, byte_tokenizer=False))
    prompt = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = CacheConfig(block_size=16, checkpoint_every=1)
    db = folder / "flips.db"
    Engine(model, cache=PrefixCache(model, cfg, lower=DiskTier(db, layout_fingerprint(model, cfg)))).start(
        prompt).finish()
    r = flip_trials(model, db, prompt, trials=200 if args.quick else 2000, block_size=16, seed=1)
    print(r)
    text = (f"{r['trials']} single-bit flips at random offsets of random blobs of a saved session (hcw_hybrid, "
            "every layer kind; 6 segments), each followed by a resume from the database alone:\n\n"
            "| flips | detected | recomputed, exact | wrong reuses | failure reasons |\n|---:|---:|---:|---:|---|\n"
            f"| {r['trials']} | {r['detected']} | {r['trials'] - r['wrong_reuse']} | {r['wrong_reuse']} | "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(r['reasons'].items()))} |")
    if not args.no_write:
        write_section("corruption", "Disk corruption drill (`benchmarks/corruption.py`)", text)


if __name__ == "__main__":
    main()
