"""hcw vs llama.cpp on the same weights: prefill and decode speed, second-turn time-to-first-token
(append, edit 64 back, edit 1K back, a fresh process) and the chained-edit correctness test.

A random Qwen3.5-architecture model (hidden 256, 8 layers, 3:1 GDN:attention, vocab 4096) is built
with transformers, converted to GGUF (`qwen35`, f32) by the converter shipped in llama-cpp-python's
sdist, and loaded by both engines; their last-token logits are compared before anything is timed.
Both run in this process with the same thread count, interleaved where timings are repeated.

Needs the optional extra and the unpacked sdist (for its converter and gguf-py); never runs in CI:

    pip install -e '.[bench-llamacpp]'         # builds llama-cpp-python from source (~15 min)
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsd
    tar xzf /tmp/llsd/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsd
    python benchmarks/vs_llamacpp.py --llama-src /tmp/llsd/llama_cpp_python-0.3.36
    python benchmarks/vs_llamacpp.py --llama-src ... --quick --no-write   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.llama_runner import LlamaRunner  # noqa: E402
from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model.random_init import qwen3_5_text_dict  # noqa: E402
from store.tier import DiskTier  # noqa: E402

VOCAB = 4096
THREADS = 2
BLOCK = 64


def build_hf(folder: Path, raw: dict | None = None, dtype: torch.dtype = torch.float32):
    """A random transformers model of the qwen3_5_text config `raw` (this script's by default),
    saved in `dtype` and returned in it."""
    import transformers as tf

    raw = dict(raw or qwen3_5_text_dict(hidden=256, layers=8, vocab=VOCAB, max_positions=65536))
    raw.pop("model_type")
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**raw)).eval().to(dtype)
    hf.save_pretrained(folder)
    return hf


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes: llama.cpp's BPE vocab must hold them (it
    looks up the newline token at load)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def convert(folder: Path, llama_src: Path, out: Path, outtype: str = "f32") -> None:
    """The sdist's converter writes the weights (`outtype`: its --outtype, f32, bf16 or q8_0); the
    random model has no tokenizer, so the vocab is a minimal byte-level one (both engines are fed
    token ids, never text)."""
    vendor = llama_src / "vendor" / "llama.cpp"
    for p in (vendor / "gguf-py", vendor):
        sys.path.insert(0, str(p))
    import gguf
    from conversion import get_model_class

    base = get_model_class("Qwen3_5ForCausalLM")

    class RandomQwen35(base):
        model_arch = base.model_arch
        no_mtp = True  # the random model has no multi-token-prediction head (the CLI's --no-mtp)

        def set_vocab(self):
            vocab = self.hparams["vocab_size"]
            tokens = _byte_tokens() + ["ĠĠ"]
            tokens += [f"<|unused{i}|>" for i in range(vocab - len(tokens))]
            types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.UNUSED] * (vocab - 257)
            self.gguf_writer.add_tokenizer_model("gpt2")
            self.gguf_writer.add_tokenizer_pre("qwen2")
            self.gguf_writer.add_token_list(tokens)
            self.gguf_writer.add_token_types(types)
            self.gguf_writer.add_token_merges(["Ġ Ġ"])

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    model = RandomQwen35(folder, ftype, out, eager=True)
    model.write()


def ours_decode(engine: Engine, prompt: list[int], steps: int) -> float:
    state = engine.new_state()
    tok = int(engine.prefill(prompt, state).argmax())
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(engine.decode(tok, state).argmax())
    return time.perf_counter() - t0


def cached_engine(model, db: Path) -> Engine:
    cfg = CacheConfig(block_size=BLOCK)
    return Engine(model, cache=PrefixCache(model, cfg, lower=DiskTier(db, layout_fingerprint(model, cfg))))


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def agreement(hf, ours, llama: LlamaRunner) -> dict:
    ids = [random.Random(1).randrange(VOCAB) for _ in range(300)]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
    mine = Engine(ours).start(ids).logits.double().numpy()
    theirs = llama.prefill(ids).astype(np.float64)
    return {"hcw_vs_transformers": float(np.abs(mine - ref).max()),
            "llamacpp_vs_transformers": float(np.abs(theirs - ref).max())}


def speed(ours, llama: LlamaRunner, lengths: list[int], decode_after: list[int], quick: bool) -> list[dict]:
    engine = Engine(ours)
    rng = random.Random(2)
    rows = []
    for n in lengths:
        ids = [rng.randrange(VOCAB) for _ in range(n)]
        reps = 1 if n > 8192 or quick else 3
        mine, theirs = [], []
        for _ in range(reps):
            theirs.append(timed(llama.prefill, ids)[0])
            mine.append(timed(lambda: engine.prefill(ids, engine.new_state(), chunk_size=n))[0])
        rows.append({"what": f"prefill {n // 1024}K", "llamacpp_tok_s": n / min(theirs), "hcw_tok_s": n / min(mine)})
        print(json.dumps(rows[-1]), flush=True)
    steps = 32 if quick else 128
    for n in decode_after:
        ids = [rng.randrange(VOCAB) for _ in range(n)]
        mine, theirs = [], []
        for _ in range(1 if quick else 3):
            llama.prefill(ids)
            theirs.append(llama.decode(steps))
            mine.append(ours_decode(engine, ids, steps))
        rows.append({"what": f"decode after {n // 1024}K", "llamacpp_tok_s": steps / min(theirs),
                     "hcw_tok_s": steps / min(mine)})
        print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["ratio"] = r["hcw_tok_s"] / r["llamacpp_tok_s"]
    return rows


def second_turn(ours, llama: LlamaRunner, n: int, folder: Path) -> list[dict]:
    """TTFT of a second request after an n-token first one, for each kind of change."""
    rng = random.Random(3)
    first = [rng.randrange(VOCAB) for _ in range(n)]

    def new(k):
        return [rng.randrange(VOCAB) for _ in range(k)]

    cases = {"append 64": (first + new(64), n), "edit 64 back": (first[:-64] + new(64), n - 64),
             "edit 1K back": (first[:-1024] + new(64), n - 1024)}
    rows = []
    db = folder / "second-turn.db"
    engine = cached_engine(ours, db)
    engine.start(first).finish()
    for what, (prompt, keep) in cases.items():
        llama.prefill(first)
        t_llama, (_, reused) = timed(llama.extend, prompt, keep)
        t_ours, run = timed(engine.start, prompt)
        rows.append({"what": what, "llamacpp_s": t_llama, "llamacpp_reused": reused, "hcw_s": t_ours,
                     "hcw_reused_tokens": run.plan.usable_tokens})
        print(json.dumps(rows[-1]), flush=True)
    prompt = first + new(64)
    engine.cache.lower.close()
    # a fresh process: nothing in memory; llama.cpp recomputes (its reset context is a new one's
    # state; loading the weights is not counted on either side), hcw resumes from its disk tier
    t_llama, _ = timed(llama.prefill, prompt)
    t_ours, run = timed(cached_engine(ours, db).start, prompt)
    rows.append({"what": "fresh process", "llamacpp_s": t_llama, "llamacpp_reused": False, "hcw_s": t_ours,
                 "hcw_reused_tokens": run.plan.usable_tokens})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def chain(steps: int = 20, seed: int = 0) -> list[tuple[list[int], int]]:
    """The chained edits: a 1,024-token prompt, then `steps` edits that each drop 1-79 tokens from
    the end and append 1-79 new ones; each entry is (prompt, tokens kept from the previous one)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(1024)]
    out = [(prompt, 0)]
    for _ in range(steps):
        keep = len(prompt) - rng.randint(1, 79)
        prompt = prompt[:keep] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 79))]
        out.append((prompt, keep))
    return out


def chained_edits(ours, gguf_path: Path, folder: Path) -> dict:
    """Each engine's every step against its own full prefill of the same prompt."""
    edits = chain()
    rollback, plain = LlamaRunner(gguf_path, 4096, rollback=64), LlamaRunner(gguf_path, 4096)
    engine = cached_engine(ours, folder / "chain.db")
    llama_wrong = llama_reused = hcw_wrong = hcw_reused = 0
    rollback.prefill(edits[0][0])
    engine.start(edits[0][0]).finish()
    for prompt, keep in edits[1:]:
        logits, reused = rollback.extend(prompt, keep)
        llama_reused += reused
        llama_wrong += float(np.abs(logits - plain.prefill(prompt)).max()) > 1e-3
        run = engine.start(prompt)
        run.finish()
        hcw_reused += run.plan.usable_tokens > 0
        hcw_wrong += (run.logits - Engine(ours).start(prompt).logits).abs().max().item() > 1e-4
    return {"steps": len(edits) - 1, "llamacpp_reused": llama_reused, "llamacpp_wrong": llama_wrong,
            "hcw_reused": hcw_reused, "hcw_wrong": hcw_wrong}


def tables(check: dict, rows: list[dict], turns: list[dict], edits: dict) -> str:
    lines = [
        "A random Qwen3.5-architecture model (hidden 256, 8 layers, 3:1 GDN:attention, vocab 4096), built "
        "with transformers and converted to GGUF `qwen35` (f32) by the converter in llama-cpp-python "
        f"{_llama_version()}'s sdist; both engines in one process, fp32, CPU, {THREADS} threads, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}. Last-token logits against "
        f"transformers: hcw {check['hcw_vs_transformers']:.1e}, llama.cpp {check['llamacpp_vs_transformers']:.1e}.",
        "",
        "| measurement | llama.cpp tok/s | hcw tok/s | hcw / llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['what']} | {r['llamacpp_tok_s']:.0f} | {r['hcw_tok_s']:.0f} | {r['ratio']:.2f}x |" for r in rows]
    lines += ["", "Second turn after an 8K first turn (time to first token; hcw with its prefix cache and disk "
              "tier, llama.cpp holding its context's state):", "",
              "| second request | llama.cpp ms | llama.cpp reused state | hcw ms | hcw reused tokens | llama.cpp / hcw |",
              "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {t['what']} | {1000 * t['llamacpp_s']:.0f} | {'yes' if t['llamacpp_reused'] else 'no'} | "
              f"{1000 * t['hcw_s']:.0f} | {t['hcw_reused_tokens']} | {t['llamacpp_s'] / t['hcw_s']:.1f}x |" for t in turns]
    lines += ["", f"Chained edits ({edits['steps']} steps from a 1,024-token prompt, each dropping 1-79 tokens and "
              "appending 1-79; every step compared with the same engine's full prefill): llama.cpp with its "
              f"experimental recurrent rollback (`n_rs_seq = 64`) reused state on {edits['llamacpp_reused']} "
              f"steps and was wrong on **{edits['llamacpp_wrong']}**; hcw reused on {edits['hcw_reused']} and was "
              f"wrong on **{edits['hcw_wrong']}**."]
    return "\n".join(lines)


def _llama_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", type=Path, required=True, help="the unpacked llama-cpp-python sdist")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parse_args(ap)
    folder = Path(tempfile.mkdtemp(prefix="hcw-vs-llamacpp-"))
    hf = build_hf(folder / "hf")
    gguf_path = folder / "model-f32.gguf"
    convert(folder / "hf", args.llama_src, gguf_path)
    ours = load_model(folder / "hf", dtype="fp32", device="cpu")
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    llama = LlamaRunner(gguf_path, max(lengths) + 256)
    check = agreement(hf, ours, llama)
    print(json.dumps(check), flush=True)
    if max(check.values()) > 1e-3:
        raise SystemExit(f"the engines disagree with transformers before anything is timed: {check}")
    del hf
    rows = speed(ours, llama, lengths, [1024] if args.quick else [1024, 16384], args.quick)
    turns = second_turn(ours, llama, 2048 if args.quick else 8192, folder)
    edits = chained_edits(ours, gguf_path, folder)
    print(json.dumps(edits), flush=True)
    if args.json:
        print(json.dumps({"agreement": check, "speed": rows, "second_turn": turns, "chained_edits": edits}))
    if not args.no_write:
        write_section("vs-llamacpp", "hcw vs llama.cpp on the same weights (`benchmarks/vs_llamacpp.py`)",
                      tables(check, rows, turns, edits))


if __name__ == "__main__":
    main()
