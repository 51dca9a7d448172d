"""hcw vs transformers on the same random Qwen3.5-style weights: prefill and decode speed, peak memory.

Both implementations run in this process on the same weights, interleaved, so the ratios hold on
a noisy machine even when the absolute numbers do not. Peak memory is measured in a fresh child
process per (implementation, length): the growth of the resident set over the loaded model.

    python benchmarks/engine_speed.py            # writes the engine section of docs/BENCHMARKS.md
    python benchmarks/engine_speed.py --quick    # 1K/4K only, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.model.random_init import qwen3_5_text_dict  # noqa: E402

VOCAB = 4096


def build_pair(folder: Path):
    """A random transformers Qwen3.5 (hidden 256, 8 layers, 3:1 GDN:attention), saved, loaded by hcw."""
    import transformers as tf

    raw = qwen3_5_text_dict(hidden=256, layers=8, vocab=VOCAB)
    raw.pop("model_type")
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**raw)).eval()
    if not (folder / "config.json").exists():
        hf.save_pretrained(folder)
    ours = load_model(folder, dtype="fp32", device="cpu")
    return hf, ours


@torch.inference_mode()
def hf_prefill(hf, ids):
    return hf(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits


def ours_prefill(engine, ids):
    return engine.prefill(ids.tolist(), engine.new_state(), chunk_size=len(ids))


@torch.inference_mode()
def hf_decode(hf, prompt, steps):
    out = hf(input_ids=prompt[None], use_cache=True, logits_to_keep=1)
    cache, tok = out.cache, out.logits[0, -1].argmax()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(input_ids=tok.view(1, 1), cache=cache, use_cache=True)
        cache, tok = out.cache, out.logits[0, -1].argmax()
    return time.perf_counter() - t0


def ours_decode(engine, prompt, steps):
    state = engine.new_state()
    tok = int(engine.prefill(prompt.tolist(), state).argmax())
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(engine.decode(tok, state).argmax())
    return time.perf_counter() - t0


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak_child(impl: str, folder: str, length: int, queue) -> None:
    import psutil

    torch.set_num_threads(2)
    if impl == "transformers":
        import transformers as tf

        model = tf.Qwen3_5ForCausalLM.from_pretrained(folder).eval()
        run = lambda ids: hf_prefill(model, ids)  # noqa: E731
    else:
        engine = Engine(load_model(folder, dtype="fp32", device="cpu"))
        run = lambda ids: ours_prefill(engine, ids)  # noqa: E731
    ids = torch.randint(0, VOCAB, (length,))
    run(ids[:64])
    base = psutil.Process().memory_info().rss
    # reset the kernel's peak-RSS mark so the loading peak is not counted
    Path("/proc/self/clear_refs").write_text("5")
    run(ids)
    queue.put(_vm_hwm() - base)


def peak_growth(impl: str, folder: Path, length: int) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(impl, str(folder), length, q))
    p.start()
    value = q.get()
    p.join()
    return value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    folder = Path(tempfile.mkdtemp(prefix="hcw-bench-"))
    hf, ours = build_pair(folder)
    engine = Engine(ours)

    rows = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,))
        reps = 2 if n > 8192 else 5
        hf_prefill(hf, ids[:256]), ours_prefill(engine, ids[:256])  # warm-up
        hf_t, our_t = [], []
        for _ in range(reps):  # interleaved so drift hits both sides alike
            hf_t.append(timed(hf_prefill, hf, ids))
            our_t.append(timed(ours_prefill, engine, ids))
        # the minimum of interleaved runs: the least-disturbed run of each side on a shared machine
        h, o = min(hf_t), min(our_t)
        rows.append({"what": f"prefill {n // 1024}K", "transformers_tok_s": n / h, "hcw_tok_s": n / o, "speedup": h / o})
        print(json.dumps(rows[-1]), flush=True)

    steps = 32 if args.quick else 128
    prompt = torch.randint(0, VOCAB, (512,))
    hf_d, our_d = [], []
    for _ in range(3):
        hf_d.append(hf_decode(hf, prompt, steps))
        our_d.append(ours_decode(engine, prompt, steps))
    h, o = min(hf_d), min(our_d)
    rows.append({"what": f"decode ({steps} tokens after 512)", "transformers_tok_s": steps / h,
                 "hcw_tok_s": steps / o, "speedup": h / o})
    print(json.dumps(rows[-1]), flush=True)

    mem = []
    for n in lengths[1:]:
        hm, om = peak_growth("transformers", folder, n), peak_growth("hcw", folder, n)
        mem.append({"what": f"prefill {n // 1024}K peak growth", "transformers_mib": hm / 2**20,
                    "hcw_mib": om / 2**20, "ratio": om / hm if hm else float("nan")})
        print(json.dumps(mem[-1]), flush=True)

    if args.no_write:
        return
    lines = [
        "Same random weights (Qwen3.5-style, hidden 256, 8 layers, 3:1 GDN:attention, vocab 4096), fp32, CPU,",
        f"2 threads, {platform.processor() or platform.machine()}, torch {torch.__version__}. transformers runs its own",
        "pure-torch path (`Qwen3_5ForCausalLM`, sdpa attention, `logits_to_keep=1` for prefill, its cache for decode).",
        "Each row is the best of several interleaved runs of both sides in one process; absolute tokens/s",
        "move with the machine's load, the ratios much less.",
        "",
        "| measurement | transformers tok/s | hcw tok/s | hcw speed-up |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['transformers_tok_s']:.0f} | {r['hcw_tok_s']:.0f} | {r['speedup']:.2f}x |" for r in rows]
    lines += ["", "| peak memory (growth over the loaded model) | transformers MiB | hcw MiB | hcw / transformers |",
              "|---|---:|---:|---:|"]
    lines += [f"| {m['what']} | {m['transformers_mib']:.0f} | {m['hcw_mib']:.0f} | {m['ratio']:.2f} |" for m in mem]
    write_section("engine", "Engine vs transformers (`benchmarks/engine_speed.py`)", "\n".join(lines))


if __name__ == "__main__":
    main()
