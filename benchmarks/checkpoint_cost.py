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
          "control: none vs none | cache's own work ms, at least | stopped at each, vs none |\n"
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


def _paired(model, config, ids: list[int], caches: tuple[bool, bool]) -> tuple[float, float]:
    """Seconds for two prefills of `ids`, each without a cache (False) or with a fresh cache
    keeping snapshots inside the pass (True), run a chunk at a time in turns (`Engine.start_steps`,
    the first of `caches` first), each chunk timed: the two ways' chunks of the same tokens run
    within a few hundred ms of each other, so the machine's drift (up to 20% over a minute here)
    cancels far better than between whole runs. (Both states take their blocks from the layers'
    one pool of 64-position blocks, in turns, as two requests of one server would.)"""
    engines = [Engine(model, config, cache=PrefixCache(model, CacheConfig(checkpoint_every=1)) if c else None)
               for c in caches]
    gc.collect()
    spent = [0.0, 0.0]
    steps = [e.start_steps(ids) for e in engines]
    done: set[int] = set()
    while len(done) < 2:
        for i in (0, 1):
            if i in done:
                continue
            t0 = time.perf_counter()
            try:
                next(steps[i])
            except StopIteration as finished:
                finished.value.finish()
                done.add(i)
            spent[i] += time.perf_counter() - t0
    return spent[0], spent[1]


def _row(model, config, n: int, rounds: int, stopped_rounds: int) -> str:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for cache, stop in ((False, False), (True, False), (True, True)):  # first calls pay one-off costs
        _prefill(model, config, ids, cache, stop)
    none, inside, control, stopped = [], [], [], []  # per round: seconds, or a ratio (control, stopped)
    spent = []  # per round: seconds in the cache's own work (_Bookkeeping)
    for r in range(rounds):
        # the pair the goal compares, and a control pair of two prefills without a cache run the
        # same way (what the method itself reads where there is no difference); who goes first,
        # and which pair, turned each round (a run is faster or slower after some ways: allocator state)
        flip = r % 2 == 1
        for pair in (("test", "control") if r % 4 < 2 else ("control", "test")):
            if pair == "control":
                a, b = _paired(model, config, ids, (False, False))
                control.append(a / b if flip else b / a)
                continue
            with _Bookkeeping() as book:
                if flip:
                    cached, plain = _paired(model, config, ids, (True, False))
                else:
                    plain, cached = _paired(model, config, ids, (False, True))
            none.append(plain)
            inside.append(cached)
            spent.append(book.seconds)
        if r < stopped_rounds:  # the way before: whole runs, next to a whole run without a cache
            order = ((False, False), (True, True)) if flip else ((True, True), (False, False))
            t = {way: _prefill(model, config, ids, *way) for way in order}
            stopped.append(t[(True, True)] / t[(False, False)])
    ratios = [a / b for a, b in zip(inside, none)]
    ratio, base = statistics.median(ratios), statistics.median(control)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    own = statistics.median(spent)
    segments = n // 64
    return (f"| {n} | {segments} | {1000 * statistics.median(none):,.0f} | {1000 * statistics.median(inside):,.0f} | "
            f"{ratio:.3f}× | {q1:.3f}–{q3:.3f}× | {base:.3f}× | {1000 * own:,.0f} ({100 * own / statistics.median(none):.1f}%) | "
            f"{statistics.median(stopped):.3f}× |")


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
             "the same with the prefill stopped at each boundary instead (the way before). One process, 2 threads, "
             f"garbage collected before each pair. Each round ({counts}) runs the first two ways a chunk each in "
             "turns, and a control pair of two prefills without a cache the same way; who goes first turns each "
             "round. `vs none` is the median of the rounds' ratios, beside the middle half of them (this VM's "
             "noise); the control's median says what the method reads where nothing differs. Times are medians. "
             "`cache's own work` is the median time inside the writer's records, the GDN layers' kept states "
             "and their decay statistics (a lower bound: the statistics' inputs, the lookup and the finish are "
             "not in it), and its share of the run without a cache. The stopped way runs whole, in the first "
             "rounds, next to a whole run without a cache. Goal (issue 25): a snapshot at every boundary costs "
             "<= 5% more than none.")
    body = "\n".join([intro, "", HEADER, *rows])
    print(body)
    if not args.no_write:
        write_section("checkpoint-cost", "What checkpoints cost a prefill (`benchmarks/checkpoint_cost.py`)", body)


if __name__ == "__main__":
    main()
