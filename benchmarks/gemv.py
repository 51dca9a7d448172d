"""One row against a bf16 weight at Qwen3.5-0.8B's decode shapes: kernels/native/gemv.c against
torch's F.linear, in GB/s of weight bytes read (a decode step's projections are bound by them).
The two run interleaved, their order alternating by round, so each round compares the same
machine load; the table shows medians. Prints only (docs/BENCHMARKS.md is not written).

    python benchmarks/gemv.py
    python benchmarks/gemv.py --threads 2 --rounds 5
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

from kernels import dispatch  # noqa: E402
from kernels.native import gemv as native_gemv  # noqa: E402

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


def measure(n: int, k: int, threads: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of torch and the kernel (x bf16 and x fp32) for a [1, k] x [k, n] product."""
    torch.set_num_threads(threads)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(1, k).to(torch.bfloat16)
    xf = x.float()
    runs = {"torch": lambda: F.linear(x, w), "kernel": lambda: native_gemv.gemv(x, w),
            "kernel x fp32": lambda: native_gemv.gemv(xf, w)}
    reps = max(3, min(200, int(2e9 / (n * k * 2) * 0.2)))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(_seconds(runs[name], reps))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dispatch.select(native="1")
    print(f"AVX-512 BF16 dot products: {native_gemv.dot_instructions()}")
    print("| shape | threads | torch GB/s | kernel GB/s (x bf16) | kernel GB/s (x fp32) | kernel vs torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, k in SHAPES:
        for threads in args.threads:
            s = measure(n, k, threads, args.rounds)
            gb = n * k * 2 / 1e9
            print(f"| {name} [1,{k}]x[{k},{n}] | {threads} | {gb / s['torch']:.1f} | {gb / s['kernel']:.1f} | "
                  f"{gb / s['kernel x fp32']:.1f} | {s['torch'] / s['kernel']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
