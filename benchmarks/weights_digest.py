"""What hashing every byte of the weights costs a model's start (issue 22: a 1.5 GB model may
start no more than ~0.5 s slower). A random Qwen3.5-architecture model of ~1.5 GB (fp32) is
written once; then, in one process: the whole load (`load_model`) with the digest cache empty and
with it warm, and the digest alone both ways, as shares of the load.

    python benchmarks/weights_digest.py            # ~1.5 GB model
    python benchmarks/weights_digest.py --quick --no-write
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.model import weights_digest  # noqa: E402
from engine.model.random_init import qwen3_5_text_dict, write_random_model  # noqa: E402


def _timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="hcw-digest-"))
    os.environ["HCW_DIGEST_CACHE"] = str(work / "digests.json")
    hidden, layers, vocab = (256, 4, 4096) if args.quick else (1024, 24, 32000)
    folder = write_random_model(work / "m", qwen3_5_text_dict(hidden=hidden, layers=layers, vocab=vocab), seed=0,
                                byte_tokenizer=False)
    files = sorted(folder.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    cache = weights_digest.cache_path()
    runs = 2 if args.quick else 3
    load_model(folder, device="cpu")  # the page cache warm, like a second start

    def cold_load():
        cache.unlink(missing_ok=True)
        load_model(folder, device="cpu")

    def cold_digest():
        cache.unlink(missing_ok=True)
        weights_digest.files_digest(files)

    cold, warm = [], []
    for _ in range(runs):  # interleaved: the machine's drift falls on both alike
        cold += _timed(cold_load, 1)
        warm += _timed(lambda: load_model(folder, device="cpu"), 1)
    digest_cold = _timed(cold_digest, runs)
    weights_digest.files_digest(files)
    digest_warm = _timed(lambda: weights_digest.files_digest(files), runs * 10)
    med = statistics.median
    rows = [("load, digest cache empty (first start)", med(cold)), ("load, digest cache warm", med(warm)),
            ("digest alone, cache empty: xxh3-128 over every byte", med(digest_cold)),
            ("digest alone, cache warm: stat + header hash", med(digest_warm))]
    rate = size / med(digest_cold) / 2**30
    text = (f"A random Qwen3.5-architecture model, {size / 2**30:.2f} GiB of fp32 safetensors (hidden {hidden}, "
            f"{layers} layers), files in the page cache; medians of {runs} runs (the warm digest of {runs * 10}), "
            "one process.\n\n| step | seconds | share of a warm load |\n|---|---:|---:|\n"
            + "\n".join(f"| {name} | {t:.4f} | {t / med(warm):.1%} |" for name, t in rows)
            + f"\n\nEvery start after a model's first: +{1000 * med(digest_warm):.1f} ms (goal: <= ~0.5 s for "
            f"1.5 GB: {'met' if med(digest_warm) <= 0.5 else 'not met'}). The first start hashes every byte: "
            f"+{med(digest_cold):.2f} s at {rate:.1f} GiB/s ({1.5e9 / 2**30 / rate:.2f} s for 1.5 GB at that rate).")
    print(text)
    if not args.no_write:
        write_section("weights-digest", "Weights digest at start (`benchmarks/weights_digest.py`)", text)


if __name__ == "__main__":
    main()
