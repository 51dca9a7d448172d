"""What keeping checkpoints costs a prefill (issue 25): a prompt prefilled with no cache, with a
cache that keeps a GDN snapshot at every boundary taken inside the forward pass (the engine's
way for every layer kind), and the same with the prefill stopped at every such boundary (the way
before), interleaved in one process. Goal: every boundary's snapshots cost a prefill <= 5% more
than none, at 4K and 16K.

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --quick --no-write
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.cache.config import CacheConfig  # noqa: E402
from engine.cache.prefix_cache import PrefixCache  # noqa: E402
from engine.cache.states import ModelState  # noqa: E402
from engine.engine import Engine  # noqa: E402

MODEL = "hcw-tiny-qwen3.5"
HEADER = ("| prompt | boundaries | no cache ms | snapshots inside ms | vs none | stopped at each ms | vs none |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")  # the built-in Qwen3.5-style model: 3 GDN layers to 1 of full attention


def _prefill(model, config, ids: list[int], cache: bool, stop: bool) -> float:
    """Seconds for one prefill of `ids` (a fresh cache each time: every boundary is new)."""
    engine = Engine(model, config, cache=PrefixCache(model, CacheConfig(checkpoint_every=1)) if cache else None)
    real = ModelState.snapshots_inside
    if stop:  # as before: no layer keeps a snapshot inside a pass, so each boundary ends a chunk
        ModelState.snapshots_inside = property(lambda self: False)
    # the previous run's cache is garbage with reference cycles: collected here, not inside the
    # timed prefill (where it took up to 0.3 s of a 16K one)
    gc.collect()
    try:
        t0 = time.perf_counter()
        engine.start(ids).finish()
        return time.perf_counter() - t0
    finally:
        ModelState.snapshots_inside = real


def _row(model, config, n: int, runs: int) -> str:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    ways = {"none": (False, False), "inside": (True, False), "stopped": (True, True)}
    for cache, stop in ways.values():  # first calls pay one-off costs
        _prefill(model, config, ids, cache, stop)
    times = {name: [] for name in ways}
    names = list(ways)
    for r in range(runs):
        # the order turns each round: a run is measurably slower or faster after some other ways
        # than after its own (allocator state), so no way always follows the same one
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_prefill(model, config, ids, *ways[name]))
    t = {name: statistics.median(v) for name, v in times.items()}
    # each round's ratio to that round's run without a cache, then their median: the machine's
    # drift over the rounds cancels
    ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["none"])) for name in ways}
    segments = n // 64
    return (f"| {n} | {segments} | {1000 * t['none']:,.0f} | {1000 * t['inside']:,.0f} | "
            f"{ratio['inside']:.3f}× | {1000 * t['stopped']:,.0f} | {ratio['stopped']:.3f}× |")


def main() -> None:
    args = parse_args()
    lengths, runs = ((1024,), 3) if args.quick else ((4096, 16384), 9)
    model = load_model(MODEL)
    config = args.engine.bind(model)
    with torch.inference_mode():
        rows = [_row(model, config, n, runs) for n in lengths]
    intro = (f"{MODEL}, a prompt prefilled in the engine's 2,048-token chunks: without a cache, with a cache "
             "keeping GDN snapshots at every 64-token boundary (`checkpoint_every=1`) taken inside the pass, and "
             f"the same with the prefill stopped at each boundary instead; {runs} rounds in one process, 2 threads, the "
             "order turned each round, garbage collected before each run; times are medians, ratios the median of each round's ratio to its run without "
             "a cache. Goal (issue 25): a snapshot at every boundary costs <= 5% more than none.")
    body = "\n".join([intro, "", HEADER, *rows])
    print(body)
    if not args.no_write:
        write_section("checkpoint-cost", "What checkpoints cost a prefill (`benchmarks/checkpoint_cost.py`)", body)


if __name__ == "__main__":
    main()
