"""Aggregate decode throughput of N independent sequences: one `Engine.decode_batch` step for all
N (engine/batch_decode.py) against N sequential `Engine.decode` calls, on the built-in models.

Each sequence has its own prompt (64 to 512 tokens) and state; both ways feed every sequence its
own greedy token. The two ways run interleaved in one process, their order alternating by round,
and each figure is the median over rounds, so the ratios compare the same machine load. Ratios are
aggregate tokens/s over one stream's (N = 1, `Engine.decode`): the server's goal is >= 3 at N = 8.

    python benchmarks/batch_decode.py
    python benchmarks/batch_decode.py --quick --json
"""

from __future__ import annotations

import argparse
import json
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
from engine.cache.states import ModelState  # noqa: E402
from engine.engine import Engine  # noqa: E402

MODELS = ("hcw-tiny-qwen3.5", "hcw-tiny")
ROWS = (1, 4, 8)
HEADER = ("| model | N | sequential tok/s | batched tok/s | sequential / one stream | batched / one stream |\n"
          "|---|---:|---:|---:|---:|---:|")


class Row(NamedTuple):
    model: str
    n: int
    sequential: float  # aggregate tokens/s of N sequential Engine.decode calls a step
    batched: float  # aggregate tokens/s of one decode_batch call a step
    one_stream: float  # tokens/s of one sequence through Engine.decode

    def as_dict(self) -> dict:
        return {**self._asdict(), "sequential_ratio": self.sequential / self.one_stream,
                "batched_ratio": self.batched / self.one_stream}

    def line(self) -> str:
        return (f"| {self.model} | {self.n} | {self.sequential:.0f} | {self.batched:.0f} | "
                f"{self.sequential / self.one_stream:.2f} | {self.batched / self.one_stream:.2f} |")


def _lengths(n: int) -> list[int]:
    """n prompt lengths spread over 64..512."""
    return [64 + (512 - 64) * i // max(n - 1, 1) for i in range(n)]


def _start(engine: Engine, n: int, seed: int) -> tuple[list[ModelState], list[int]]:
    """n prefilled states and each one's first greedy token."""
    g = torch.Generator().manual_seed(seed)
    states, tokens = [], []
    for length in _lengths(n):
        state = engine.new_state()
        logits = engine.prefill(torch.randint(0, 256, (length,), generator=g).tolist(), state)
        states.append(state)
        tokens.append(int(logits.argmax()))
    return states, tokens


def _sequential(engine: Engine, states: list[ModelState], tokens: list[int], steps: int) -> float:
    """Seconds per step, each step one Engine.decode per sequence."""
    t0 = time.perf_counter()
    for _ in range(steps):
        for i, state in enumerate(states):
            tokens[i] = int(engine.decode(tokens[i], state).argmax())
    return (time.perf_counter() - t0) / steps


def _batched(engine: Engine, states: list[ModelState], tokens: list[int], steps: int) -> float:
    """Seconds per step, each step one decode_batch over every sequence."""
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens[:] = engine.decode_batch(tokens, states).argmax(-1).tolist()
    return (time.perf_counter() - t0) / steps


def measure(name: str, rounds: int, steps: int) -> list[Row]:
    engine = Engine(load_model(name, device="cpu"))
    runs = {n: {way: _start(engine, n, seed=n) for way in ("sequential", "batched")} for n in ROWS}
    ways = {"sequential": _sequential, "batched": _batched}
    seconds = {(n, way): [] for n in ROWS for way in ways}
    with torch.inference_mode():
        for n in ROWS:  # a warm-up step each: kernels built, workspaces allocated
            for way, run in ways.items():
                run(engine, *runs[n][way], 1)
        for r in range(rounds):
            for n in ROWS:
                for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    seconds[n, way].append(ways[way](engine, *runs[n][way], steps))
    per_s = {key: n / statistics.median(s) for key, s in seconds.items() for n in [key[0]]}
    one = per_s[1, "sequential"]
    return [Row(name, n, per_s[n, "sequential"], per_s[n, "batched"], one) for n in ROWS]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parse_args(parser)
    rounds, steps = (3, 8) if args.quick else (7, 24)
    rows = [row for name in MODELS for row in measure(name, rounds, steps)]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rounds": rounds, "steps": steps,
                          "rows": [row.as_dict() for row in rows]}, indent=2))
        return
    body = "\n".join([
        f"Prompts of 64-512 tokens, greedy; medians of {rounds} interleaved rounds of {steps} steps, "
        f"{torch.get_num_threads()} threads. A ratio is aggregate tokens/s over one stream's "
        "(N = 1 through `Engine.decode`); the server's goal is >= 3 at N = 8.", "", HEADER,
        *(row.line() for row in rows)])
    print(body)
    if not args.no_write:
        write_section("batch-decode", "Batched decode of N sequences (`benchmarks/batch_decode.py`)", body)


if __name__ == "__main__":
    main()
