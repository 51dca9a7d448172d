"""Triton kernels vs their torch references on CUDA, at the shapes of a Qwen3.5-9B / DeepSeek-V4
layer, and the engine's prefill / decode tokens/s in bf16 with the kernels on (paged KV, and dense
KV read by scaled_dot_product_attention) and forced off (HCW_KERNELS=reference). Writes its section of docs/BENCHMARKS.md. Needs a GPU: run through
benchmarks/gpu_check.sh; `--quick` on CPU only checks the script runs (interpreter, tiny shapes,
no timings written).

    python benchmarks/kernels.py            # on a CUDA machine
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402


def _time(fn, reps: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def kernel_rows(device: str, quick: bool) -> list[str]:
    from kernels.compressed_attention import reference as attend_ref
    from kernels.compressed_attention.triton_attend import attend
    from kernels.compressor import reference as pool_ref
    from kernels.compressor.triton_pool import pool
    from kernels.gated_delta import reference as gdn_ref
    from kernels.gated_delta.triton_chunk import chunk_gated_delta
    from kernels.gated_delta.triton_recurrent import recurrent_gated_delta
    from kernels.indexer import reference as idx_ref
    from kernels.indexer.triton_score import score
    from kernels.paged_attention import reference as paged_ref
    from kernels.paged_attention.triton_decode import paged_decode
    from kernels.segments import reference as seg_ref
    from kernels.segments.triton_copy import gather

    bf16 = torch.bfloat16
    s = 1 if quick else 0  # quick: tiny shapes (the interpreter), no meaningful timings
    hk, hv, d = (1, 2, 8) if s else (16, 32, 128)
    q = torch.nn.functional.normalize(torch.randn(1, 1, hk, d, device=device), dim=-1).to(bf16)
    k = torch.nn.functional.normalize(torch.randn(1, 1, hk, d, device=device), dim=-1).to(bf16)
    v = torch.randn(1, 1, hv, d, device=device, dtype=bf16)
    g, beta = -torch.rand(1, 1, hv, device=device), torch.rand(1, 1, hv, device=device, dtype=bf16)
    state = torch.randn(1, hv, d, d, device=device)
    n, w, dc = (3, 8, 16) if s else (8192, 8, 512)
    kv, gate = torch.randn(1, n, w, dc, device=device, dtype=bf16), torch.randn(1, n, w, dc, device=device, dtype=bf16)
    t, h, di, ne = (2, 2, 8, 5) if s else (512, 64, 128, 8192)
    qi = torch.randn(1, t, h, di, device=device, dtype=bf16)
    keys = torch.randn(1, ne, di, device=device, dtype=bf16)
    wi = torch.randn(1, t, h, device=device)
    pos = torch.arange(4 * ne - t, 4 * ne, device=device)
    # paged decode: 8 sequences of 8K (16 when quick) positions in 64-position blocks, pool shuffled
    nb, hq, hkv, bs, dh, ctx = (2, 4, 2, 4, 16, 9) if s else (8, 32, 8, 64, 128, 8192)
    per = -(-ctx // bs)
    k_pool = torch.randn(nb * per, hkv, bs, dh, device=device, dtype=bf16)
    v_pool = torch.randn(nb * per, hkv, bs, dh, device=device, dtype=bf16)
    table = torch.randperm(nb * per, device=device).view(nb, per).int()
    lens = torch.full((nb,), ctx, dtype=torch.int32, device=device)
    qd = torch.randn(nb, hq, dh, device=device, dtype=bf16)
    tc = 24 if s else 4096  # chunked GDN prefill: one sequence of tc tokens at the recurrent step's head shapes
    qc = torch.nn.functional.normalize(torch.randn(1, tc, hk, d, device=device), dim=-1).to(bf16)
    kc = torch.nn.functional.normalize(torch.randn(1, tc, hk, d, device=device), dim=-1).to(bf16)
    vc = torch.randn(1, tc, hv, d, device=device, dtype=bf16)
    gc, bc = -torch.rand(1, tc, hv, device=device) * 0.1, torch.rand(1, tc, hv, device=device, dtype=bf16)
    # V4 CSA attention: queries over a 128-key window and the indexer's top-k of the compressed entries
    ta, ha, da, na, ka = (3, 2, 16, 6, 2) if s else (512, 64, 512, 2048, 512)
    qa = torch.randn(1, ta, ha, da, device=device, dtype=bf16)
    keys_a = torch.randn(1, ta + 127, da, device=device, dtype=bf16)
    ents = torch.randn(1, na, da, device=device, dtype=bf16)
    start_a = 4 * na - ta
    sel = torch.stack([torch.randperm(na, device=device)[:ka] for _ in range(ta)])[None]
    sink_a = torch.zeros(ha, device=device)
    attend_args = (qa, start_a, keys_a, start_a - 127, 128, ents, 4, sel, sink_a, da ** -0.5)
    cases = [
        ("GDN recurrent step (Hv 32, 128x128)", lambda: recurrent_gated_delta(q, k, v, g, beta, state),
         lambda: gdn_ref.recurrent_gated_delta(q, k, v, g, beta, state)),
        ("GDN chunked prefill (4,096 tokens, Hv 32, 128x128)", lambda: chunk_gated_delta(qc, kc, vc, gc, bc, state),
         lambda: gdn_ref.chunk_gated_delta(qc, kc, vc, gc, bc, state)),
        ("compressor pooling (8,192 entries x 8 x 512)", lambda: pool(kv, gate), lambda: pool_ref.pool(kv, gate)),
        ("indexer scores (512 queries x 64 heads x 8,192 entries)", lambda: score(qi, keys, wi, pos, 4),
         lambda: idx_ref.score(qi, keys, wi, pos, 4)),
        ("V4 CSA attention (512 queries x 64 heads x 512, window 128, top-512 of 2,048 entries)",
         lambda: attend(*attend_args), lambda: attend_ref.attend(*attend_args)),
        ("segment gather (one 8K sequence's blocks out of the pool)", lambda: gather(k_pool, table[0].contiguous()),
         lambda: seg_ref.gather(k_pool, table[0])),
        ("paged decode attention (8 x 8K positions, 32 q / 8 kv heads x 128, 64-position blocks)",
         lambda: paged_decode(qd, k_pool, v_pool, table, lens), lambda: paged_ref.paged_decode(qd, k_pool, v_pool, table, lens)),
    ]
    rows = ["| kernel | Triton µs | reference µs | speed-up |", "|---|---:|---:|---:|"]
    for name, kernel, ref in cases:
        a, b = _time(kernel, 1 if s else 50), _time(ref, 1 if s else 50)
        rows.append(f"| {name} | {a * 1e6:.0f} | {b * 1e6:.0f} | {b / a:.1f}× |")
    return rows


def engine_rows(lengths: tuple[int, ...]) -> list[str]:
    import tempfile

    from engine import EngineConfig, load_model
    from engine.engine import Engine
    from engine.model.random_init import qwen3_5_text_dict, write_random_model

    folder = write_random_model(Path(tempfile.mkdtemp()) / "q", qwen3_5_text_dict(hidden=1024, layers=16,
                                                                                  max_positions=65536))
    model = load_model(folder, dtype="bf16", device="cuda")
    rows = ["| kernels | KV layout | prompt | prefill tok/s | decode tok/s |", "|---|---|---:|---:|---:|"]
    # decode captured as a CUDA graph (EngineConfig.static, HCW_STATIC=1), the engine's default on
    # CUDA (Triton everywhere, paged KV), the same with full attention on scaled_dot_product_attention
    # over one dense buffer, and the torch reference
    for label, mode, layout, static in (("Triton + CUDA graph", "auto", "paged", True),
                                        ("Triton", "auto", "paged", False),
                                        ("Triton (GDN) + SDPA", "auto", "dense", False),
                                        ("reference", "reference", "dense", False)):
        config = EngineConfig(dtype=model.dtype, device="cuda", kernels=mode, kv_layout=layout, static=static)
        for n in lengths:
            ids = torch.randint(0, 263, (n,)).tolist()
            engine = Engine(model, config)
            prefill = _time(lambda: engine.start(ids), 1)
            state = engine.start(ids).state
            decode = _time(lambda: engine.decode(1, state), 32)
            rows.append(f"| {label} | {layout} | {n} | {n / prefill:.0f} | {1 / decode:.0f} |")
    return rows


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("benchmarks/kernels.py measures on a GPU (run it through benchmarks/gpu_check.sh); "
                 "--quick checks it on CPU through the interpreter")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    lines = kernel_rows("cuda" if cuda else "cpu", quick=not cuda)
    if cuda:
        lines += ["", "**Engine, bf16** (Qwen3.5-style random weights, hidden 1024 x 16 layers):", ""]
        lines += engine_rows((2048,) if args.quick else (8192, 32768))
    text = "\n".join(lines)
    print(text)
    if cuda and not args.no_write:
        write_section("kernels", f"Triton kernels on {torch.cuda.get_device_name()} (`benchmarks/kernels.py`)", text)


if __name__ == "__main__":
    main()
