"""Dense vs paged full-attention KV on the CPU (`kv_layout`): what the paged layout costs a prefill
and a decode step on the built-in models, where a paged decode token reads its keys and values in
place through the block table (kernels/native/paged_decode.c) and a dense one runs SDPA over one
buffer. The two layouts run interleaved in one process, their order alternating by round, so each
round's ratio compares the same machine load; the table shows medians over rounds. The CPU default
(`kv_layout` "auto") is paged where this costs <= 3% in both.

    python benchmarks/kv_layout_cpu.py
    python benchmarks/kv_layout_cpu.py --quick --no-write
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.engine import Engine  # noqa: E402

MODELS = ("hcw-tiny-qwen3.5", "hcw-tiny")
LAYOUTS = ("dense", "paged")
HEADER = ("| model | context | prefill dense ms | prefill paged ms | paged vs dense | decode dense tok/s | "
          "decode paged tok/s | paged vs dense (step time) |\n|---|---:|---:|---:|---:|---:|---:|---:|")


class Row(NamedTuple):
    text: str  # the table's line
    model: str
    context: int
    cost: float  # the larger of paged's prefill and decode costs over dense (0.03: 3% slower)


def _prefill(engine: Engine, ids: list[int]):
    """(seconds for the prefill of `ids` on a fresh state, the state)."""
    state = engine.new_state()
    t0 = time.perf_counter()
    engine.prefill(ids, state)
    return time.perf_counter() - t0, state


def _decode(engine: Engine, state, steps: int) -> float:
    """Seconds per decode step, `steps` of them on `state`."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode(7, state)
    return (time.perf_counter() - t0) / steps


def _interleaved(rounds: int, run) -> dict[str, list[float]]:
    """`run(layout)`'s seconds per round for each layout, their order alternating by round."""
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for r in range(rounds):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            times[layout].append(run(layout))
    return times


def _summary(times: dict[str, list[float]]) -> tuple[float, float, float]:
    """(median dense seconds, median paged seconds, median of each round's paged/dense ratio - 1)."""
    ratio = statistics.median(p / d for d, p in zip(times["dense"], times["paged"]))
    return statistics.median(times["dense"]), statistics.median(times["paged"]), ratio - 1


def _rows(name: str, config, lengths: tuple[int, ...], rounds: int, steps: int) -> list[Row]:
    model = load_model(name)
    engine = Engine(model, dataclasses.replace(config, kv_layout=None))  # the layout set on the model per run
    rows = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        states = {}

        def prefill(layout: str) -> float:
            model.use_kv_layout(layout)  # (a state keeps the layout it was made in)
            seconds, states[layout] = _prefill(engine, ids)
            return seconds

        for layout in LAYOUTS:  # first calls pay one-off costs (kernel builds, pool growth)
            prefill(layout)
            _decode(engine, states[layout], 4)
        pre = _summary(_interleaved(rounds, prefill))
        # decode in short rounds on the two prefilled states, alternating: a slow spell of the
        # machine lands on both layouts' rounds alike
        dec = _summary(_interleaved(3 * rounds, lambda layout: _decode(engine, states[layout], steps)))
        rows.append(Row(f"| {name} | {n:,} | {1000 * pre[0]:,.0f} | {1000 * pre[1]:,.0f} | {pre[2]:+.1%} | "
                        f"{1 / dec[0]:,.1f} | {1 / dec[1]:,.1f} | {dec[2]:+.1%} |", name, n, max(pre[2], dec[2])))
        print(rows[-1].text, flush=True)
    return rows


def main() -> None:
    args = parse_args()
    lengths, rounds, steps = ((1024,), 3, 8) if args.quick else ((1024, 4096), 7, 16)
    print(HEADER, flush=True)
    with torch.inference_mode():
        rows = [row for name in MODELS for row in _rows(name, args.engine, lengths, rounds, steps)]
    worst = max(rows, key=lambda row: row.cost)
    verdict = (f"Paged costs at most {worst.cost:+.1%} ({worst.model} at {worst.context:,}): "
               + ("within 3% everywhere, so paged can be the CPU default." if worst.cost <= 0.03 else
                  "past 3%, so the CPU default stays dense."))
    intro = (f"The built-in models in fp32 on 2 threads: a prompt of `context` tokens prefilled in the engine's "
             f"chunks ({rounds} rounds), then decode on the two prefilled states in {3 * rounds} rounds of {steps} "
             "steps; dense and paged KV (page 64) interleaved, order alternating; medians over rounds; `paged vs "
             "dense` is the median of each round's paged/dense time ratio (+: paged slower). The CPU default is "
             "paged where both cost <= 3%. SDPA spreads a sequence's key-value heads over the threads (hcw-tiny "
             "has two, hcw-tiny-qwen3.5 one); the C decode kernel also cuts a pair of 1,024 positions or more "
             "into partitions of 512 (split-K).")
    body = "\n".join([intro, "", HEADER, *(row.text for row in rows), "", verdict])
    print("\n" + verdict)
    if not args.no_write:
        write_section("kv-layout-cpu", "Dense vs paged KV on the CPU (`benchmarks/kv_layout_cpu.py`)", body)


if __name__ == "__main__":
    main()
