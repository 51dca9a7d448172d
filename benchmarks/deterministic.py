"""What bit-exact mode costs (EngineConfig.deterministic, `--deterministic`): prefill one token a
step against the default batched prefill, and decode both ways, in one process, on the built-in
models and a random model with every layer kind. Also how far the default's logits are from
bit-exact ones: a cache hit's result under the default arithmetic against a cold prefill.

    python benchmarks/deterministic.py
    python benchmarks/deterministic.py --quick --no-write
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import EngineConfig, load_model  # noqa: E402
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache  # noqa: E402
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.model.random_init import hcw_hybrid_dict, write_random_model  # noqa: E402


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name: str, model, prompt: int, runs: int) -> str:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=g).tolist()
    engines = {det: Engine(model, EngineConfig(deterministic=det)) for det in (False, True)}
    pre, dec = {}, {}
    for det, e in engines.items():  # interleaved below; warm-ups first (the first calls pay one-off costs)
        for _ in range(2):
            e.prefill(ids, e.new_state())
            state = e.new_state()
            e.prefill(ids[:16], state)
            for t in ids[16:48]:
                e.decode(t, state)
    for _ in range(runs):
        for det, e in engines.items():
            pre.setdefault(det, []).append(_median(lambda: e.prefill(ids, e.new_state()), 1))
            state = e.new_state()
            e.prefill(ids[:16], state)
            dec.setdefault(det, []).append(_median(lambda: [e.decode(t, state) for t in ids[16:48]], 1) / 32)
    p0, p1 = statistics.median(pre[False]), statistics.median(pre[True])
    d0, d1 = statistics.median(dec[False]), statistics.median(dec[True])
    # the default arithmetic's distance from bit-exact: a hit after a turn that ended mid-segment
    diffs = []
    for det in (False, True):
        cache = PrefixCache(model, CacheConfig(block_size=16, deterministic=det))
        e = Engine(model, cache=cache)
        e.generate(ids[:prompt // 2 + 5], SamplingParams(max_new_tokens=3, greedy=True))
        run = e.start(ids)
        run.finish()
        cold = Engine(model, EngineConfig(deterministic=det)).start(ids).logits
        diffs.append((run.logits - cold).abs().max().item())
    return (f"| {name} | {prompt} | {prompt / p0:,.0f} | {prompt / p1:,.0f} | {p1 / p0:.1f}× | "
            f"{1 / d0:,.0f} | {1 / d1:,.0f} | {diffs[0]:.1e} | {diffs[1]:.0e} |")


def main() -> None:
    args = parse_args()
    runs = 2 if args.quick else 5
    prompt = 128 if args.quick else 512
    mixed = write_random_model(Path(tempfile.mkdtemp(prefix="hcw-det-")) / "mixed", hcw_hybrid_dict(hidden=256),
                               seed=3)
    rows = [_row(name, load_model(folder, device="cpu"), prompt, runs)
            for name, folder in (("hcw-tiny", "hcw-tiny"), ("hcw-tiny-qwen3.5", "hcw-tiny-qwen3.5"),
                                 ("random hcw_hybrid, width 256", mixed))]
    body = "\n".join([
        f"Prefill of a {prompt}-token prompt and decode (32 steps after 16 tokens), batched (the default) and "
        f"deterministic (one token a step), each the median of {runs} interleaved runs in one process, 2 threads. "
        "The last two columns: the largest logit difference between a cache hit (after a turn that ended "
        "mid-segment and 3 decoded tokens) and a cold prefill of the same prompt under the same arithmetic.",
        "",
        "| model | prompt | batched prefill tok/s | deterministic prefill tok/s | prefill cost | batched decode "
        "tok/s | deterministic decode tok/s | hit vs cold, batched | hit vs cold, deterministic |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section("deterministic", "Bit-exact mode (`benchmarks/deterministic.py`)", body)


if __name__ == "__main__":
    main()
