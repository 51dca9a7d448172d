"""hcw vs transformers on the same random weights: prefill and decode speed, peak memory, and the
bytes of per-sequence state by state object.

Both implementations run in this process on the same weights, interleaved, so the ratios hold on
a noisy machine even when the absolute numbers do not. Peak memory is measured two ways: the peak
of bytes held in live tensors during the prefill (the profiler's allocation events: what the
implementation needs, deterministic, the CPU analogue of `torch.cuda.max_memory_allocated`), and
the growth of the resident set over the loaded model in a fresh child process, which adds what
glibc's heap keeps back after frees and varies by tens of MiB between identical runs.

    python benchmarks/engine_speed.py                       # every family; rewrites docs/BENCHMARKS.md sections
    python benchmarks/engine_speed.py --family deepseek_v4  # one family
    python benchmarks/engine_speed.py --quick --no-write    # a smoke run
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model.random_init import qwen3_5_text_dict  # noqa: E402

VOCAB = 4096


def _qwen_config():
    import transformers as tf

    raw = qwen3_5_text_dict(hidden=256, layers=8, vocab=VOCAB)
    raw.pop("model_type")
    return tf.Qwen3_5TextConfig(**raw)


def _v4_config():
    import transformers as tf

    csa, hca, swa = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
    return tf.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, head_dim=64, q_lora_rank=128, n_routed_experts=8, num_experts_per_tok=2,
        sliding_window=128, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=64,
        compress_rates={csa: 4, hca: 128}, layer_types=[swa, csa, hca, csa, hca, csa, hca, swa],
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, max_position_embeddings=65536,
        partial_rotary_factor=0.25, hc_mult=4)


@dataclass(frozen=True)
class Family:
    key: str
    title: str
    describe: str
    hf_class: str
    make_config: Callable
    lengths: tuple[int, ...]


FAMILIES = {
    "qwen3_5": Family("qwen3_5", "Qwen3.5-style hybrid",
                      "Qwen3.5-style, hidden 256, 8 layers, 3:1 GDN:attention, vocab 4096; transformers runs "
                      "`Qwen3_5ForCausalLM` (sdpa attention, torch GDN path)",
                      "Qwen3_5ForCausalLM", _qwen_config, (1024, 4096, 16384)),
    "deepseek_v4": Family("deepseek_v4", "DeepSeek-V4-style",
                          "DeepSeek-V4-style, hidden 256, 8 layers (2 sliding, 3 CSA m=4, 3 HCA m=128), window 128, "
                          "index top-64, 4 hyper-connection streams, 8 experts, vocab 4096; transformers runs "
                          "`DeepseekV4ForCausalLM` (eager, its only path)",
                          "DeepseekV4ForCausalLM", _v4_config, (1024, 4096)),
}


def build_pair(family: Family, folder: Path):
    """A random transformers model of `family`, saved to `folder`, and hcw's load of it."""
    import transformers as tf

    torch.manual_seed(0)
    hf = getattr(tf, family.hf_class)(family.make_config()).eval()
    if not (folder / "config.json").exists():
        hf.save_pretrained(folder)
    return hf, load_model(folder, dtype="fp32", device="cpu")


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


def _peak_child(impl: str, family: str, folder: str, length: int, queue) -> None:
    import psutil

    torch.set_num_threads(2)
    if impl == "transformers":
        import transformers as tf

        model = getattr(tf, FAMILIES[family].hf_class).from_pretrained(folder).eval()
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


def tensor_peak(run: Callable[[torch.Tensor], object], ids: torch.Tensor) -> int:
    """Peak bytes held in live tensors while `run(ids)` executes, above what was held before it."""
    from torch.profiler import ProfilerActivity, profile

    run(ids[:64])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(ids)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        raise RuntimeError("the profiler recorded no allocations")
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


def peak_growth(impl: str, family: Family, folder: Path, length: int, runs: int = 3) -> int:
    """The least of `runs` fresh children's peak growth: the allocator's and thread pools' own
    variation (tens of MiB between identical runs) only ever adds to the prefill's need."""
    ctx = mp.get_context("spawn")
    values = []
    for _ in range(runs):
        q = ctx.Queue()
        p = ctx.Process(target=_peak_child, args=(impl, family.key, str(folder), length, q))
        p.start()
        values.append(q.get())
        p.join()
    return min(values)


def speed_and_memory(family: Family, quick: bool):
    lengths = family.lengths[:2] if quick else family.lengths
    folder = Path(tempfile.mkdtemp(prefix=f"hcw-bench-{family.key}-"))
    hf, ours = build_pair(family, folder)
    engine = Engine(ours)
    rows = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,))
        reps = 2 if n > 8192 or quick else 5
        hf_prefill(hf, ids[:256]), ours_prefill(engine, ids[:256])  # warm-up
        hf_t, our_t = [], []
        for _ in range(reps):  # interleaved so drift hits both sides alike
            hf_t.append(timed(hf_prefill, hf, ids))
            our_t.append(timed(ours_prefill, engine, ids))
        # the minimum of interleaved runs: the least-disturbed run of each side on a shared machine
        h, o = min(hf_t), min(our_t)
        rows.append({"what": f"prefill {n // 1024}K", "transformers_tok_s": n / h, "hcw_tok_s": n / o, "speedup": h / o})
        print(family.key, json.dumps(rows[-1]), flush=True)

    steps = 32 if quick else 128
    prompt = torch.randint(0, VOCAB, (512,))
    hf_d, our_d = [], []
    for _ in range(5):
        hf_d.append(hf_decode(hf, prompt, steps))
        our_d.append(ours_decode(engine, prompt, steps))
    h, o = min(hf_d), min(our_d)
    rows.append({"what": f"decode ({steps} tokens after 512)", "transformers_tok_s": steps / h,
                 "hcw_tok_s": steps / o, "speedup": h / o})
    print(family.key, json.dumps(rows[-1]), flush=True)

    mem = []
    for n in lengths[1:]:
        runs = 1 if quick else 3
        ids = torch.randint(0, VOCAB, (n,))
        ht = tensor_peak(lambda x: hf_prefill(hf, x), ids)
        ot = tensor_peak(lambda x: ours_prefill(engine, x), ids)
        hm, om = peak_growth("transformers", family, folder, n, runs), peak_growth("hcw", family, folder, n, runs)
        mem.append({"what": f"prefill {n // 1024}K", "transformers_tensor_mib": ht / 2**20, "hcw_tensor_mib": ot / 2**20,
                    "tensor_ratio": ot / ht, "transformers_rss_mib": hm / 2**20, "hcw_rss_mib": om / 2**20,
                    "rss_ratio": om / hm if hm else float("nan")})
        print(family.key, json.dumps(mem[-1]), flush=True)
    return rows, mem, ours


def state_bytes(model, marks: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Bytes per context token of each state object kind, read off the real state at each mark."""
    engine = Engine(model)
    state = engine.new_state()
    out = {}
    done = 0
    for mark in marks:
        engine.prefill(torch.randint(0, VOCAB, (mark - done,)).tolist(), state, chunk_size=1024)
        done = mark
        by_kind: dict[str, int] = collections.defaultdict(int)
        for obj in state.objects():
            by_kind[obj.kind] += obj.nbytes
        out[mark] = {k: v / mark for k, v in sorted(by_kind.items())}
        print("state bytes", mark, json.dumps(out[mark]), flush=True)
    return out


def _speed_table(family: Family, rows: list[dict], mem: list[dict]) -> str:
    lines = [
        f"Same random weights ({family.describe}), fp32, CPU, 2 threads, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}. Prefill: `logits_to_keep=1` for",
        "transformers, one chunk for hcw; decode: each side's own cache. Each row is the best of several",
        "interleaved runs of both sides in one process; absolute tokens/s move with the machine's load, the",
        "ratios much less.",
        "",
        "| measurement | transformers tok/s | hcw tok/s | hcw speed-up |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['transformers_tok_s']:.0f} | {r['hcw_tok_s']:.0f} | {r['speedup']:.2f}x |" for r in rows]
    lines += ["", "Peak memory of the prefill. Tensors: the peak of bytes held in live tensors (the profiler's",
              "allocation events; deterministic). RSS: the growth of the resident set over the loaded model in a",
              "fresh process, least of 3; it adds what glibc's heap keeps after frees and moves by tens of MiB",
              "between identical runs.",
              "", "| prefill | transformers tensors MiB | hcw tensors MiB | hcw / transformers "
              "| transformers RSS MiB | hcw RSS MiB | hcw / transformers |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {m['what']} | {m['transformers_tensor_mib']:.0f} | {m['hcw_tensor_mib']:.0f} | {m['tensor_ratio']:.2f} "
              f"| {m['transformers_rss_mib']:.0f} | {m['hcw_rss_mib']:.0f} | {m['rss_ratio']:.2f} |" for m in mem]
    return "\n".join(lines)


def _bytes_table(family: Family, per_mark: dict[int, dict[str, float]]) -> str:
    kinds = sorted({k for d in per_mark.values() for k in d})
    marks = sorted(per_mark)
    lines = [f"{family.describe.split(';')[0]}, fp32: bytes of per-sequence state per context token, summed over",
             "layers, read from the state objects after a chunked prefill to each length.",
             "", "| state object | " + " | ".join(f"{m // 1024}K ctx, B/token" for m in marks) + " |",
             "|---|" + "---:|" * len(marks)]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{per_mark[m].get(k, 0):.1f}" for m in marks) + " |")
    lines.append("| **total** | " + " | ".join(f"{sum(per_mark[m].values()):.1f}" for m in marks) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["all", *FAMILIES], default="all")
    args = parse_args(ap)
    marks = (1024, 4096) if args.quick else (1024, 8192, 32768)
    for key in FAMILIES if args.family == "all" else [args.family]:
        family = FAMILIES[key]
        rows, mem, ours = speed_and_memory(family, args.quick)
        per_mark = state_bytes(ours, marks)
        if not args.no_write:
            write_section(f"engine-{key}", f"{family.title}: hcw vs transformers (`benchmarks/engine_speed.py`)",
                          _speed_table(family, rows, mem))
            write_section(f"state-bytes-{key}", f"{family.title}: state bytes per token by state object "
                          "(`benchmarks/engine_speed.py`)", _bytes_table(family, per_mark))


if __name__ == "__main__":
    main()
