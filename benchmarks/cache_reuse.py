"""Prefix reuse on multi-turn chat traces: token hit rate, *usable* hit rate and time-to-first-
token against no cache, for hcw's checkpoint policy and two policies simulated in hcw itself:

    vLLM-style    recurrent/boundary state only at large aligned blocks (every 528 tokens, as for
                  Qwen3.5), no request-end or branch-point checkpoints
    SGLang-style  boundary state only at request ends

Every turn's logits are compared with a cold prefill: a silent error would be counted. The last
table is the per-hit validation cost (index match + plan) against one decode step.

    python benchmarks/cache_reuse.py            # writes its section of docs/BENCHMARKS.md
    python benchmarks/cache_reuse.py --quick --no-write
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402
from engine import load_model  # noqa: E402
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache  # noqa: E402
from engine.engine import Engine, SamplingParams  # noqa: E402
from engine.model.random_init import hcw_hybrid_dict, qwen3_5_text_dict, write_random_model  # noqa: E402

BLOCK = 16
POLICIES = {
    "hcw (every 4 segments + request ends + branch points + the last 3 before a 4K+ prompt's end; "
    "else an exact replay from the start)": dict(checkpoint_every=4),
    # the baselines resume at their checkpoints only: neither engine replays GDN layers over cached KV
    "vLLM-style (aligned blocks of 528 tokens only)": dict(checkpoint_every=528 // BLOCK, checkpoint_request_end=False,
                                                           checkpoint_branch_point=False, checkpoint_tail=0,
                                                           exact_replay=False),
    "SGLang-style (request ends only)": dict(checkpoint_every=1 << 30, checkpoint_branch_point=False,
                                             checkpoint_tail=0, exact_replay=False),
}


def trace(vocab: int, conversations: int, turns: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) requests: a shared system prompt, growing turns, and edits that
    branch an earlier turn. Generated tokens are appended by the runner."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(300)]
    out = []
    for c in range(conversations):
        out.append((c, system + [rng.randrange(vocab) for _ in range(rng.randint(30, 90))]))
        for t in range(1, turns):
            user = [rng.randrange(vocab) for _ in range(rng.randint(20, 80))]
            out.append((c, user if t % 3 else [-1] + user))  # -1: edit the previous turn instead of extending it
    return out


class PolicyRun:
    """One policy's pass over a trace (None: no cache), a request at a time (`step`), so that
    several policies can take the same request in turns: their times then come from the same
    minute of this machine, whose speed drifts by up to 20% over a minute."""

    def __init__(self, model, policy: dict | None, check: bool):
        self.cache = PrefixCache(model, CacheConfig(block_size=BLOCK, **policy)) if policy is not None else None
        self.engine = Engine(model, cache=self.cache)
        self.cold = Engine(model)
        self.check = check
        self.history: dict[int, list[int]] = {}
        self.previous: dict[int, list[int]] = {}
        self.prompt_tokens = 0
        self.ttft = 0.0
        self.silent = 0

    def step(self, conv: int, text: list[int]) -> None:
        if conv not in self.history:
            prompt = text
        elif text[0] == -1:  # an edit: resend the previous prompt's context with new text
            prompt = self.previous[conv] + text[1:]
        else:
            self.previous[conv] = self.history[conv]
            prompt = self.history[conv] + text
        gen = self.engine.generate(prompt, SamplingParams(max_new_tokens=16, greedy=True))
        self.ttft += gen.timings.prompt_ms / 1000
        if self.check:
            self.silent += (gen.prompt_logits - self.cold.start(prompt).logits).abs().max().item() > 1e-4
        self.history[conv] = prompt + gen.token_ids
        self.previous.setdefault(conv, prompt)
        self.prompt_tokens += len(prompt)

    def result(self) -> dict:
        m = self.engine.metrics() if self.cache is not None else {}
        return {"prompt_tokens": self.prompt_tokens, "ttft_s": self.ttft, "silent": self.silent,
                "logical": m.get("logical_hit_tokens", 0) / self.prompt_tokens,
                "usable": m.get("usable_hit_tokens", 0) / self.prompt_tokens,
                "degraded_rate": m.get("degraded_hit_rate", 0.0)}


def run_policies(model, requests, policies: list[dict | None], check: bool) -> list[dict]:
    """Each policy's `PolicyRun` over the trace, the policies taking each request in turns, the
    order turned from request to request (a request runs slower or faster after some others)."""
    runs = [PolicyRun(model, policy, check) for policy in policies]
    for i, (conv, text) in enumerate(requests):
        for run in runs[i % len(runs):] + runs[:i % len(runs)]:
            run.step(conv, text)
    return [run.result() for run in runs]


def validation_overhead(model, requests) -> dict:
    cache = PrefixCache(model, CacheConfig(block_size=BLOCK))
    engine = Engine(model, cache=cache)
    prompt = [t for _, text in requests[:4] for t in text if t >= 0][:600]
    engine.start(prompt).finish()
    query = prompt + [1]
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        match = cache.index.match(query)
        cache.validator.plan(len(query), match, cache.table)
    per_hit = (time.perf_counter() - t0) / n
    run = Engine(model).start(query)
    tok = int(run.logits.argmax())
    for _ in range(3):
        Engine(model).decode(tok, run.state)
    t0 = time.perf_counter()
    for _ in range(20):
        engine.decode(tok, run.state)
    per_step = (time.perf_counter() - t0) / 20
    return {"segments": len(match.segments), "validate_ms": 1000 * per_hit, "decode_step_ms": 1000 * per_step,
            "ratio": per_hit / per_step}


def main() -> None:
    args = parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hcw-reuse-"))
    models = {
        "Qwen3.5-style (hidden 256, 8 layers, 3:1 GDN:attention)":
            write_random_model(folder / "qwen", qwen3_5_text_dict(hidden=256, layers=8, vocab=4096), byte_tokenizer=False),
        "hcw_hybrid (every layer kind, hidden 64)":
            write_random_model(folder / "mixed", hcw_hybrid_dict(hidden=64, vocab=4096, window=32, hca_rate=64),
                               byte_tokenizer=False),
    }
    convs, turns = (2, 4) if args.quick else (4, 7)
    lines = [f"Block size {BLOCK}; {convs} conversations x {turns} turns sharing a 300-token system prompt; every",
             "third turn edits the previous one (a branch); 16 generated tokens per turn; fp32 CPU. Hit rates are",
             "shares of all prompt tokens; TTFT is the summed time to first token, relative to no cache; the policies",
             "and no cache take each request in turns (the order turned each request), so their times come from the",
             "same minute of this noisy VM. Every turn is checked against a cold prefill. TTFT includes recording",
             "each turn's checkpoints (the state at every kept boundary, taken inside the forward pass; cached KV",
             "blocks shared, not copied), which hcw keeps more of than the SGLang-style policy: that buys its",
             "higher usable hit rate.", ""]
    for name, path in models.items():
        model = load_model(path, device="cpu")
        requests = trace(4096, convs, turns)
        # no cache first, checked like the others (its check costs the same outside the timing)
        base, *results = run_policies(model, requests, [None, *POLICIES.values()], check=True)
        lines += [f"**{name}**", "", "| policy | token hit rate | usable hit rate | degraded hits | TTFT vs no cache | "
                  "silent errors |", "|---|---:|---:|---:|---:|---:|"]
        for label, r in zip(POLICIES, results):
            print(name, label, json.dumps(r), flush=True)
            lines.append(f"| {label} | {r['logical']:.1%} | {r['usable']:.1%} | {r['degraded_rate']:.1%} | "
                         f"{r['ttft_s'] / base['ttft_s']:.2f}x | {r['silent']} |")
        v = validation_overhead(model, requests)
        print(name, "validation", json.dumps(v), flush=True)
        lines += ["", f"Validation per hit (index match + four-layer plan, {v['segments']} segments): "
                  f"{v['validate_ms']:.3f} ms = {v['ratio']:.1%} of one decode step ({v['decode_step_ms']:.2f} ms).", ""]
    if not args.no_write:
        write_section("cache-reuse", "Prefix reuse on chat traces (`benchmarks/cache_reuse.py`)", "\n".join(lines))


if __name__ == "__main__":
    main()
