"""`hcw bench replay`: Tail-Replay's quality and TTFT against a full prefill, by prefix length and
replay budget, on RULER-style needle tasks (workbench.tiny.data.needle_task).

For each task the context is cached by an earlier request that asked something else, with GDN
checkpoints only past the context (none inside it), so a resume at the context's end must either
recompute from the start (exact) or rebuild the GDN states by replay (approximate, within the
budget). Every policy is measured on the same tasks in one process: accuracy (the greedy answer
starts with the needle's value), agreement with the full prefill's answer, TTFT, tokens replayed
and the certified bound.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from engine import load_model
from engine.cache.prefix_cache import CacheConfig, PrefixCache
from engine.engine import Engine, SamplingParams
from engine.model.loader import resolve_model
from engine.tokenizer import load_tokenizer
from workbench.tiny.data import RULER_KINDS, needle_task


@dataclass(frozen=True)
class Budget:
    label: str
    reuse: str  # exact | approximate
    budget: float | None
    tolerance: float | None


def parse_budgets(text: str, tolerance: float) -> list[Budget]:
    """'0.01,0.05,512,adaptive' -> policies; the exact policy is always measured first."""
    out = [Budget("exact", "exact", None, None)]
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "adaptive":
            out.append(Budget(f"adaptive (tol {tolerance:g})", "approximate", None, tolerance))
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--budgets: {item!r} is not a fraction, a token count or 'adaptive'") from None
        if value <= 0:
            raise ValueError(f"--budgets: {item!r} must be > 0")
        out.append(Budget(f"{value:g}" if value < 1 else f"{int(value)} tokens", "approximate", value, None))
    return out


def run_bench(model: str, lengths: list[int], budgets: list[Budget], tasks: int = 4, seed: int = 0,
              block_size: int = 64, progress=None) -> dict:
    folder = resolve_model(model)
    m = load_model(folder)
    tok = load_tokenizer(folder, m.config.extra)
    if tok is None:
        raise ValueError(f"{model} has no tokenizer; the needle tasks are text")
    params = SamplingParams(max_new_tokens=6, greedy=True, stop_ids=tok.eos_ids)
    Engine(m).generate(tok.encode("warm-up"), params)  # first-call costs stay out of the timings
    rows = []
    for length in lengths:
        rng = random.Random(seed + length)
        cases = [needle_task(rng, length, i / max(1, tasks - 1), RULER_KINDS[i % len(RULER_KINDS)]) for i in range(tasks)]
        per_policy: dict[str, list[dict]] = {b.label: [] for b in budgets}
        full = []
        for case in cases:
            # the earlier request's own turn is long enough (> 2 segments) that its checkpoints all
            # lie past the shared context
            warm = tok.apply_chat_template(case.context + [{"role": "user", "content": "Did you note it? " * 12},
                                                           {"role": "assistant", "content": "Yes."}],
                                           add_generation_prompt=False)
            asked = tok.apply_chat_template(case.context + [{"role": "user", "content": case.question}])
            ref = Engine(m).generate(asked, params)
            full_ms = ref.timings.prompt_ms
            ref_text = tok.decode(ref.token_ids).strip()
            full.append({"ttft_ms": full_ms, "correct": ref_text.startswith(case.answer)})
            for b in budgets:
                cfg = CacheConfig(block_size=block_size, checkpoint_every=1 << 30, checkpoint_branch_point=False,
                                  reuse=b.reuse, replay_budget=b.budget if b.reuse == "approximate" else 0.05,
                                  replay_tolerance=b.tolerance)
                engine = Engine(m, cache=PrefixCache(m, cfg))
                engine.start(warm).finish()
                gen = engine.generate(asked, params)
                text = tok.decode(gen.token_ids).strip()
                per_policy[b.label].append({
                    "ttft_ms": gen.timings.prompt_ms, "correct": text.startswith(case.answer),
                    "agrees": text == ref_text, "exact": gen.plan.exact, "reused": gen.plan.usable_tokens,
                    "replayed": gen.plan.replay_tokens, "bound": gen.plan.replay_bound})
        full_acc = sum(f["correct"] for f in full) / len(full)
        full_ttft = statistics.median(f["ttft_ms"] for f in full)
        for b in budgets:
            runs = per_policy[b.label]
            acc = sum(r["correct"] for r in runs) / len(runs)
            ttft = statistics.median(r["ttft_ms"] for r in runs)
            row = {"prefix_tokens": length, "policy": b.label, "accuracy": acc, "full_prefill_accuracy": full_acc,
                   "quality_retained": acc / full_acc if full_acc else None,
                   "agreement": sum(r["agrees"] for r in runs) / len(runs),
                   "ttft_ms": ttft, "full_prefill_ttft_ms": full_ttft, "ttft_speedup": full_ttft / ttft if ttft else None,
                   "replayed_tokens": statistics.mean(r["replayed"] for r in runs),
                   "reused_tokens": statistics.mean(r["reused"] for r in runs),
                   "max_bound": max(r["bound"] for r in runs), "all_exact": all(r["exact"] for r in runs)}
            rows.append(row)
            if progress is not None:
                progress(_line(row))
    return {"model": str(model), "tasks_per_length": tasks, "rows": rows,
            "replayable": _replayable(m)}


def _replayable(model) -> bool:
    return PrefixCache(model, CacheConfig(reuse="approximate")).validator.replayable


def _line(row: dict) -> str:
    q = "-" if row["quality_retained"] is None else f"{row['quality_retained']:.0%}"
    return (f"{row['prefix_tokens']:>6} {row['policy']:<22} acc {row['accuracy']:.0%} (full {row['full_prefill_accuracy']:.0%}, "
            f"kept {q}) agree {row['agreement']:.0%} TTFT {row['ttft_ms']:.0f} ms "
            f"({row['ttft_speedup']:.1f}x) replayed {row['replayed_tokens']:.0f} bound {row['max_bound']:.1e}"
            f"{' exact' if row['all_exact'] else ''}")


def markdown(report: dict) -> str:
    lines = [f"Model `{report['model']}`, {report['tasks_per_length']} needle tasks per length "
             f"(single / multi-key / multi-value / variable tracking, depths spread 0..1). "
             + ("" if report["replayable"] else "**This model has layers with windows or compressed tails, which "
                "Tail-Replay does not rebuild yet: every approximate budget falls back to exact.** "),
             "", "| prefix | policy | accuracy | full prefill | quality kept | agrees with full | TTFT speed-up | "
             "replayed tokens | max bound | exact |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        q = "-" if r["quality_retained"] is None else f"{r['quality_retained']:.0%}"
        lines.append(f"| {r['prefix_tokens']} | {r['policy']} | {r['accuracy']:.0%} | {r['full_prefill_accuracy']:.0%} | "
                     f"{q} | {r['agreement']:.0%} | {r['ttft_speedup']:.1f}× | {r['replayed_tokens']:.0f} | "
                     f"{r['max_bound']:.1e} | {'yes' if r['all_exact'] else 'no'} |")
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """Quality kept and TTFT speed-up by policy, one line per prefix length (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for length in sorted({r["prefix_tokens"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["prefix_tokens"] == length]
        labels = [r["policy"] for r in rows]
        axes[0].plot(labels, [r["agreement"] for r in rows], marker="o", label=f"{length} tokens")
        axes[1].plot(labels, [r["ttft_speedup"] for r in rows], marker="o", label=f"{length} tokens")
    axes[0].set_title("answers equal to a full prefill's")
    axes[1].set_title("TTFT speed-up over a full prefill")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
