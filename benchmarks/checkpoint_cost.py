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
HEADER = ("| prompt | boundaries | no cache ms | snapshots inside ms | vs none | middle half of rounds | "
          "cache's own work ms | stopped at each ms | vs none |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # the built-in Qwen3.5-style model: 3 GDN layers to 1 of full attention


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


def _paired(model, config, ids: list[int], cache_first: bool) -> tuple[float, float]:
    """Seconds for a prefill of `ids` without a cache and one with a fresh cache keeping snapshots
    inside the pass, run a chunk at a time in turns (`Engine.start_steps`), each chunk timed: the
    two ways' chunks of the same tokens run within a few hundred ms of each other, so the
    machine's drift (up to 20% over a minute here) cancels far better than between whole runs."""
    engines = {False: Engine(model, config), True: Engine(model, config, cache=PrefixCache(model, CacheConfig(checkpoint_every=1)))}
    gc.collect()
    spent = {False: 0.0, True: 0.0}
    steps = {c: e.start_steps(ids) for c, e in engines.items()}
    started = {}
    order = (True, False) if cache_first else (False, True)
    while len(started) < 2:
        for c in order:
            if c in started:
                continue
            t0 = time.perf_counter()
            try:
                next(steps[c])
            except StopIteration as done:
                done.value.finish()
                started[c] = done.value
            spent[c] += time.perf_counter() - t0
    return spent[False], spent[True]


def _row(model, config, n: int, rounds: int, stopped_rounds: int) -> str:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    ways = {"none": (False, False), "inside": (True, False), "stopped": (True, True)}
    for cache, stop in ways.values():  # first calls pay one-off costs
        _prefill(model, config, ids, cache, stop)
    times = {name: [] for name in ways}
    spent = []  # per run with snapshots inside: seconds in the cache's own work (_Bookkeeping)
    for r in range(rounds):
        # the two ways the goal compares run a chunk each in turns, who goes first turned each
        # round (a run is also slower or faster after some ways than after its own: allocator state)
        with _Bookkeeping() as book:
            none, inside = _paired(model, config, ids, cache_first=r % 2 == 1)
        times["none"].append(none)
        times["inside"].append(inside)
        spent.append(book.seconds)
        if r < stopped_rounds:
            times["stopped"].append(_prefill(model, config, ids, *ways["stopped"]))
    t = {name: statistics.median(v) for name, v in times.items()}
    # each round's ratio to that round's run without a cache, then their median: the drift cancels
    per_round = {name: [a / b for a, b in zip(times[name], times["none"])] for name in ways}
    ratio = {name: statistics.median(v) for name, v in per_round.items()}
    q1, _, q3 = statistics.quantiles(per_round["inside"], n=4)
    own = statistics.median(spent)
    segments = n // 64
    return (f"| {n} | {segments} | {1000 * t['none']:,.0f} | {1000 * t['inside']:,.0f} | "
            f"{ratio['inside']:.3f}× | {q1:.3f}–{q3:.3f}× | {1000 * own:,.0f} ({100 * own / t['none']:.1f}%) | "
            f"{1000 * t['stopped']:,.0f} | {ratio['stopped']:.3f}× |")


class _Bookkeeping:
    """Seconds spent in what only a prefill that keeps snapshots does: the writer's records of the
    segments (`capture_stops`), the GDN layers' kept states (`_keep`) and decay statistics
    (`record`), and the chunk kernel's states at the cuts beyond its plain run (not counted: the
    difference is the cut products inside it). Methods wrapped for the `with` block only."""

    def __enter__(self):
        from engine.cache import gdn_state, writer
        from engine.model import gdn

        self.seconds = 0.0
        self._real = [(cls, name, getattr(cls, name)) for cls, name in
                      ((writer.RequestWriter, "capture_stops"), (gdn.GatedDeltaNet, "_keep"),
                       (gdn_state.GDNState, "record"))]
        for cls, name, real in self._real:
            setattr(cls, name, self._timed(real))
        return self

    def _timed(self, real):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call

    def __exit__(self, *exc) -> None:
        for cls, name, real in self._real:
            setattr(cls, name, real)


def main() -> None:
    args = parse_args()
    # (rounds, rounds with the stopped way too) per length: the stopped way only shows the old cost
    plan = {1024: (3, 3)} if args.quick else {4096: (31, 5), 16384: (11, 3)}
    model = load_model(MODEL)
    config = args.engine.bind(model)
    with torch.inference_mode():
        rows = [_row(model, config, n, *plan[n]) for n in plan]
    counts = ", ".join(f"{r} at {n:,}" for n, (r, _) in plan.items())
    intro = (f"{MODEL}, a prompt prefilled in the engine's 2,048-token chunks: without a cache, with a cache "
             "keeping GDN snapshots at every 64-token boundary (`checkpoint_every=1`) taken inside the pass, and "
             "the same with the prefill stopped at each boundary instead. One process, 2 threads, garbage "
             f"collected before each run; rounds ({counts}) run the first two ways a chunk each in turns (who goes "
             "first turned each round), and the stopped way whole in the first few. Times are medians; `vs none` is the median of each round's ratio to "
             "its run without a cache, beside the middle half of those ratios (this VM's noise). `cache's own "
             "work` is the median time inside the writer's records, the GDN layers' kept states and their decay "
             "statistics, and its share of the run without a cache. Goal (issue 25): a snapshot at every "
             "boundary costs <= 5% more than none.")
    body = "\n".join([intro, "", HEADER, *rows])
    print(body)
    if not args.no_write:
        write_section("checkpoint-cost", "What checkpoints cost a prefill (`benchmarks/checkpoint_cost.py`)", body)


if __name__ == "__main__":
    main()
