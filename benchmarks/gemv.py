"""One row against a bf16 weight at Qwen3.5-0.8B's decode shapes: kernels/native/gemv.c against
torch's F.linear, in GB/s of weight bytes read (a decode step's projections are bound by them).
The two run interleaved, their order alternating by round, so each round compares the same
machine load; the table shows medians. Prints only (docs/BENCHMARKS.md is not written).

With --int8 (`--dtype int8`'s weights, kernels/q8): the int8 kernel (gemv_q8.c) against the bf16
one at the same shapes; a prefill's product (256 rows) through the float32 weight against the int8
reference's dequantise-a-block-and-multiply at three block sizes; and a decode step of a trained
tiny model loaded in fp32, bf16 and int8.

    python benchmarks/gemv.py
    python benchmarks/gemv.py --threads 2 --rounds 5
    python benchmarks/gemv.py --int8 --threads 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import dispatch, q8  # noqa: E402
from kernels.native import gemv as native_gemv  # noqa: E402
from kernels.native import gemv_q8 as native_q8  # noqa: E402

# (name, N, K): the MLP's gate and up fused, its down projection, the tied LM head (~500 MB)
SHAPES = (("gate+up", 3584 * 2, 1024), ("down", 1024, 3584), ("lm head", 248_320, 1024))


def _seconds(fn, reps: int) -> float:
    """Median seconds of one call over `reps` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved(runs: dict, reps: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each run, the runs interleaved, their order alternating by round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(_seconds(runs[name], reps))
    return {name: statistics.median(t) for name, t in times.items()}


def measure(n: int, k: int, threads: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of torch and the kernel (x bf16 and x fp32) for a [1, k] x [k, n] product."""
    torch.set_num_threads(threads)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    xf = x.float()
    runs = {"torch": lambda: F.linear(x, w), "kernel": lambda: native_gemv.gemv(x, w),
            "kernel x fp32": lambda: native_gemv.gemv(xf, w)}
    return _interleaved(runs, max(3, min(200, int(2e9 / (n * k * 2) * 0.2))), rounds)


def measure_int8(n: int, k: int, threads: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of the bf16 kernel and the int8 one (x fp32 for both)."""
    torch.set_num_threads(threads)
    w = torch.randn(n, k)
    wb, (q, scales), x = w.to(torch.bfloat16), q8.quantise(w), torch.randn(1, k)
    runs = {"bf16": lambda: native_gemv.gemv(x, wb), "int8": lambda: native_q8.gemv_q8(x, q, scales)}
    return _interleaved(runs, max(3, min(200, int(2e9 / (n * k * 2) * 0.2))), rounds)


def measure_prefill(rows: int, n: int, k: int, threads: int, rounds: int) -> dict[str, float]:
    """Median seconds of a [rows, k] x [k, n] product: the float32 weight (the engine's oneDNN
    path) and the int8 reference at 2, 8 and 32 MB blocks of dequantised rows."""
    from engine.model.direct import linear

    torch.set_num_threads(threads)
    w = torch.randn(n, k)
    (q, scales), x = q8.quantise(w), torch.randn(1, rows, k)

    def blocks(mb: int):
        def run():
            q8.reference.BLOCK_BYTES = mb << 20
            q8.linear(x, q, scales, product=linear)
        return run

    saved = q8.reference.BLOCK_BYTES
    runs = {"fp32": lambda: linear(x, w), **{f"int8 {mb} MB": blocks(mb) for mb in (2, 8, 32)}}
    try:
        return _interleaved(runs, 3, rounds)
    finally:
        q8.reference.BLOCK_BYTES = saved


def measure_decode(model: str, threads: int, rounds: int, steps: int = 64) -> dict[str, float]:
    """Median seconds of a decode step (after a 256-token prefill) of `model` in fp32, bf16, int8."""
    from engine.engine import Engine
    from engine.model.loader import load_model

    torch.set_num_threads(threads)
    engines = {d: Engine(load_model(model, dtype=d, device="cpu")) for d in ("fp32", "bf16", "int8")}
    states = {}
    for d, engine in engines.items():
        states[d] = engine.new_state()
        engine.prefill([i % 256 for i in range(256)], states[d])

    def step(d: str):
        return lambda: engines[d].decode(65, states[d])

    return _interleaved({d: step(d) for d in engines}, steps, rounds)


def _table(header: str, shapes, threads: list[int], row) -> None:
    """A markdown table: `header`, then row(name, n, k, threads) for each shape and thread count."""
    print(header)
    print("|---|" + "---:|" * (header.count("|") - 2))
    for name, n, k in shapes:
        for t in threads:
            print(row(name, n, k, t), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--int8", action="store_true", help="the int8 weights' tables instead")
    parser.add_argument("--model", default="hcw-tiny-qwen3.5", help="--int8: the model whose decode step is timed")
    args = parser.parse_args()
    dispatch.select(native="1")
    if args.int8:
        int8_tables(args)
        return
    print(f"AVX-512 BF16 dot products: {native_gemv.dot_instructions()}")

    def row(name: str, n: int, k: int, threads: int) -> str:
        s = measure(n, k, threads, args.rounds)
        gb = n * k * 2 / 1e9
        return (f"| {name} [1,{k}]x[{k},{n}] | {threads} | {gb / s['torch']:.1f} | {gb / s['kernel']:.1f} | "
                f"{gb / s['kernel x fp32']:.1f} | {s['torch'] / s['kernel']:.2f}x |")

    _table("| shape | threads | torch GB/s | kernel GB/s (x bf16) | kernel GB/s (x fp32) | kernel vs torch |",
           SHAPES, args.threads, row)


def int8_tables(args) -> None:
    print(f"int8 kernel path: {native_q8.path()}")

    def gemv_row(name: str, n: int, k: int, threads: int) -> str:
        s = measure_int8(n, k, threads, args.rounds)
        gb = (n * k + 4 * n * q8.groups(k)) / 1e9
        return (f"| {name} [1,{k}]x[{k},{n}] | {threads} | {1e3 * s['bf16']:.3f} | {1e3 * s['int8']:.3f} | "
                f"{gb / s['int8']:.1f} | {s['bf16'] / s['int8']:.2f}x |")

    def prefill_row(name: str, n: int, k: int, threads: int) -> str:
        s = measure_prefill(256, n, k, threads, args.rounds)
        return (f"| {name} [{k},{n}] | {threads} | {1e3 * s['fp32']:.1f} | "
                + " | ".join(f"{1e3 * s[f'int8 {mb} MB']:.1f}" for mb in (2, 8, 32)) + " |")

    def decode_row(name: str, n: int, k: int, threads: int) -> str:
        s = measure_decode(args.model, threads, args.rounds)
        return f"| after 256 tokens | {threads} | {1e3 * s['fp32']:.2f} | {1e3 * s['bf16']:.2f} | {1e3 * s['int8']:.2f} |"

    _table("| shape | threads | bf16 kernel ms | int8 kernel ms | int8 GB/s (its bytes) | int8 vs bf16 |",
           SHAPES, args.threads, gemv_row)
    _table("\n| prefill [256,k]x[k,n] | threads | fp32 weight ms | int8, 2 MB blocks | 8 MB | 32 MB |",
           SHAPES[:2], args.threads, prefill_row)
    _table(f"\n| decode step, {args.model} | threads | fp32 ms | bf16 ms | int8 ms |", [(args.model, 0, 0)],
           args.threads, decode_row)


if __name__ == "__main__":
    main()
