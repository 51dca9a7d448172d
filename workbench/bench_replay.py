"""`hcw bench replay`: Tail-Replay's quality and TTFT against a full prefill, by prefix length and
replay budget, on RULER-style needle tasks (workbench.tiny.data.needle_task).

For each task the context is cached by an earlier request that asked something else, with GDN
checkpoints only past the context (none inside it), so a resume at the context's end must rebuild
the GDN states by replay: of the whole context from its start (exact: the exact policy replays
over the cached KV rather than recompute) or of a tail (approximate, within the budget). Every policy is measured on the same tasks in one process: fidelity against the full
prefill (top-1 agreement and mean KL over the next 64 greedy tokens, teacher-forced; each GDN
layer's relative state error), task accuracy (the greedy answer is the needle's value), TTFT,
tokens replayed and the certified bound. An exact policy that keeps GDN checkpoints every 4
segments shows what storing them buys.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import dataclass

import torch

from engine import EngineConfig, load_model
from engine.cache.config import CacheConfig, Reuse
from engine.cache.prefix_cache import PrefixCache
from engine.cache.states import Kind
from engine.engine import Engine
from engine.model.loader import resolve_model
from engine.tokenizer import load_tokenizer
from workbench.progress import Steps
from workbench.tiny.data import RULER_KINDS, needle_task


@dataclass(frozen=True)
class Budget:
    label: str
    reuse: str  # exact | approximate
    budget: float | None
    tolerance: float | None
    checkpoint_every: int = 1 << 30  # GDN checkpoints only past the context, unless a policy keeps them
    sketch_every: int = 0  # int8 GDN sketches every K segments of the context (a replay may restart from one)


def parse_budgets(text: str, tolerance: float, sketch_every: int = 0) -> list[Budget]:
    """'0.01,0.05,512,adaptive' -> policies; two exact policies are always measured first: with
    checkpoints every 4 segments (what storing GDN states everywhere buys) and without any inside
    the context (a resume recomputes it). With `sketch_every`, each approximate policy a second
    time with int8 GDN sketches kept every that many segments."""
    if sketch_every < 0:
        raise ValueError("--sketch-every must be >= 0")
    out = [Budget("exact, checkpoints", "exact", None, None, checkpoint_every=4),
           Budget("exact, none inside", "exact", None, None)]
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "adaptive":
            out.append(Budget(f"adaptive (tol {tolerance:g})", "approximate", None, tolerance))
            if sketch_every:
                out.append(Budget(f"adaptive (tol {tolerance:g}) + sketch/{sketch_every}", "approximate", None,
                                  tolerance, sketch_every=sketch_every))
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--budgets: {item!r} is not a fraction, a token count or 'adaptive'") from None
        if value <= 0:
            raise ValueError(f"--budgets: {item!r} must be > 0")
        label = f"{value:g}" if value < 1 else f"{int(value)} tokens"
        out.append(Budget(label, "approximate", value, None))
        if sketch_every:
            out.append(Budget(f"{label} + sketch/{sketch_every}", "approximate", value, None, sketch_every=sketch_every))
    return out


FOLLOW = 64  # greedy tokens after the prompt over which fidelity is measured


def _continue(model, logits: torch.Tensor, state, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] next-token logits along `tokens` (teacher-forced) from a copy of
    `state` whose last logits are `logits`: row i predicts tokens[i]."""
    rows = [logits.float()]
    if len(tokens) > 1:
        ids = torch.tensor(tokens[:-1], dtype=torch.long, device=model.device)
        with torch.inference_mode():
            rows += list(model(ids, copy.deepcopy(state))[0].float())
    return torch.stack(rows)


def _answers(model, run, answer: list[int]) -> bool:
    """Greedy decoding from `run` would produce `answer`: every teacher-forced argmax matches."""
    return bool((_continue(model, run.logits, run.state, answer).argmax(-1).cpu() == torch.tensor(answer)).all())


def _greedy(model, logits: torch.Tensor, state, n: int) -> list[int]:
    state = copy.deepcopy(state)
    out = [int(logits.argmax())]
    with torch.inference_mode():
        while len(out) < n:
            out.append(int(model(torch.tensor([[out[-1]]], device=model.device), state)[0, -1].argmax()))
    return out


def _state_errors(ours, ref) -> dict[int, float]:
    """Per GDN layer: |S - S_full| / |S_full| of the recurrent state after the prompt."""
    out = {}
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers)):
        if hasattr(b, "recurrent"):
            out[i] = float((a.recurrent.float() - b.recurrent.float()).norm() / b.recurrent.float().norm().clamp(min=1e-30))
    return out


def run_bench(model: str, lengths: list[int], budgets: list[Budget], tasks: int = 4, seed: int = 0,
              block_size: int = 64, progress=None, counter: Steps | None = None,
              engine: EngineConfig | None = None) -> dict:
    """`progress`: called with each row's line as it is measured; `counter`: counts the tasks,
    len(lengths) * tasks of them (`workbench.progress`); `engine`: what the engines run with."""
    counter = counter or Steps()
    folder = resolve_model(model)
    m = load_model(folder, dtype=engine.dtype if engine is not None else "fp32")
    config = engine.bind(m) if engine is not None else None
    tok = load_tokenizer(folder, m.config.extra)
    if tok is None:
        raise ValueError(f"{model} has no tokenizer; the needle tasks are text")
    Engine(m, config).start(tok.encode("warm-up"))  # first-call costs stay out of the timings
    rows = []
    for length in lengths:
        rng = random.Random(seed + length)
        cases = [needle_task(rng, length, i / max(1, tasks - 1), RULER_KINDS[i % len(RULER_KINDS)]) for i in range(tasks)]
        per_policy: dict[str, list[dict]] = {b.label: [] for b in budgets}
        full = []
        for n, case in enumerate(cases):
            counter.doing(f"{length} tokens: task {n + 1} of {len(cases)}")
            # the earlier request's own turn is long enough (> 2 segments) that its checkpoints all
            # lie past the shared context
            warm = tok.apply_chat_template(case.context + [{"role": "user", "content": "Did you note it? " * 12},
                                                           {"role": "assistant", "content": "Yes."}],
                                           add_generation_prompt=False)
            asked = tok.apply_chat_template(case.context + [{"role": "user", "content": case.question}])
            answer = tok.encode(case.answer)
            t0 = time.perf_counter()
            ref = Engine(m, config).start(asked)
            full_ms = 1000 * (time.perf_counter() - t0)
            follow = _greedy(m, ref.logits, ref.state, FOLLOW)
            ref_logits = _continue(m, ref.logits, ref.state, follow)
            ref_correct = _answers(m, ref, answer)
            full.append({"ttft_ms": full_ms, "correct": ref_correct})
            # the context is cached once per checkpoint setting; each policy then resumes from it,
            # and the cache is rolled back to that before the next one (records and checkpoints)
            warmed: dict[tuple[int, int], tuple[Engine, dict, int]] = {}
            for b in budgets:
                setting = (b.checkpoint_every, b.sketch_every)
                if setting not in warmed:
                    cfg = CacheConfig(block_size=block_size, checkpoint_every=b.checkpoint_every,
                                      checkpoint_branch_point=False, checkpoint_tail=0, sketch_every=b.sketch_every)
                    engine = Engine(m, config, cache=PrefixCache(m, cfg))
                    engine.start(warm).finish()
                    warmed[setting] = engine, engine.cache.mark(), _gdn_bytes(engine.cache, asked)
                engine, keep, gdn_bytes = warmed[setting]
                engine.cache.set_policy(b.reuse, b.budget if b.reuse == Reuse.APPROXIMATE else 0.05, b.tolerance)
                copied = engine.cache.metrics.bytes_copied
                t0 = time.perf_counter()
                run = engine.start(asked)
                ttft = 1000 * (time.perf_counter() - t0)
                copied = engine.cache.metrics.bytes_copied - copied
                run.finish()
                engine.cache.rollback(keep)
                logits = _continue(m, run.logits, run.state, follow)
                kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                                reduction="none").sum(-1)
                errors = _state_errors(run.state, ref.state)
                per_policy[b.label].append({
                    "ttft_ms": ttft,
                    "correct": _answers(m, run, answer),
                    "top1": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                    "kl": float(kl.mean()), "state_error": max(errors.values(), default=0.0), "layer_errors": errors,
                    "exact": run.plan.exact, "reused": run.plan.usable_tokens,
                    "replayed": run.plan.replay_tokens, "bound": run.plan.replay_bound,
                    "seeded": run.plan.replay_seed is not None, "gdn_bytes_per_1k": gdn_bytes,
                    "bytes_copied": copied})
            counter.done()
        full_acc = sum(f["correct"] for f in full) / len(full)
        full_ttft = statistics.median(f["ttft_ms"] for f in full)
        for b in budgets:
            runs = per_policy[b.label]
            acc = sum(r["correct"] for r in runs) / len(runs)
            ttft = statistics.median(r["ttft_ms"] for r in runs)
            layers = sorted({i for r in runs for i in r["layer_errors"]})
            row = {"prefix_tokens": length, "policy": b.label, "accuracy": acc, "full_prefill_accuracy": full_acc,
                   "quality_retained": acc / full_acc if full_acc else None,
                   "top1_agreement": statistics.mean(r["top1"] for r in runs),
                   "mean_kl": statistics.mean(r["kl"] for r in runs),
                   "state_error": statistics.mean(r["state_error"] for r in runs),
                   "layer_state_errors": {i: statistics.mean(r["layer_errors"][i] for r in runs) for i in layers},
                   "ttft_ms": ttft, "full_prefill_ttft_ms": full_ttft, "ttft_speedup": full_ttft / ttft if ttft else None,
                   "replayed_tokens": statistics.mean(r["replayed"] for r in runs),
                   "reused_tokens": statistics.mean(r["reused"] for r in runs),
                   "max_bound": max(r["bound"] for r in runs), "all_exact": all(r["exact"] for r in runs),
                   "seeded": sum(r["seeded"] for r in runs),
                   "gdn_bytes_per_1k": statistics.mean(r["gdn_bytes_per_1k"] for r in runs),
                   "bytes_copied": statistics.mean(r["bytes_copied"] for r in runs)}
            rows.append(row)
            if progress is not None:
                progress(_line(row))
    return {"model": str(model), "tasks_per_length": tasks, "follow_tokens": FOLLOW, "rows": rows,
            "replayable": _replayable(m)}


def _gdn_bytes(cache: PrefixCache, prompt: list[int]) -> float:
    """Bytes of GDN state (checkpoints and sketches) the cache keeps inside the matched prefix of
    `prompt`, per 1,000 of its tokens: what a policy's storage costs beside the KV."""
    segments = cache.segments_of(prompt)
    held = sum(p.nbytes() for view in segments if view.record is not None
               for (_, kind), p in view.record.pieces.items() if kind in (Kind.RECURRENT, Kind.CONV, Kind.SKETCH))
    return 1000 * held / max(1, len(segments) * cache.block_size)


def _replayable(model) -> bool:
    return PrefixCache(model, CacheConfig(reuse="approximate")).validator.replayable


def _line(row: dict) -> str:
    q = "-" if row["quality_retained"] is None else f"{row['quality_retained']:.0%}"
    return (f"{row['prefix_tokens']:>6} {row['policy']:<22} acc {row['accuracy']:.0%} (full {row['full_prefill_accuracy']:.0%}, "
            f"kept {q}) top-1 {row['top1_agreement']:.1%} KL {row['mean_kl']:.1e} state err {row['state_error']:.1e} "
            f"TTFT {row['ttft_ms']:.0f} ms "
            f"({row['ttft_speedup']:.1f}x) replayed {row['replayed_tokens']:.0f} bound {row['max_bound']:.1e}"
            f"{' exact' if row['all_exact'] else ''} copied {row['bytes_copied'] / 2**20:.2f} MiB")


def markdown(report: dict) -> str:
    lines = [f"Model `{report['model']}`, {report['tasks_per_length']} needle tasks per length "
             f"(single / multi-key / multi-value / variable tracking, depths spread 0..1); fidelity over the "
             f"{report['follow_tokens']} greedy tokens a full prefill produces after the question (top-1 agreement, "
             "mean KL(full ‖ reuse)), the GDN states' relative error after the prompt (mean over tasks of the worst "
             "layer), task accuracy (the needle's value, greedy) and its retention against the full prefill. "
             "`+ sketch/N`: the same policy with int8 sketches of the GDN states kept every N segments of the "
             "context, which a replay may restart from. GDN state kept: the bytes of GDN checkpoints and sketches "
             "inside the context per 1K of its tokens (the KV beside them is the same for every policy). Copied per "
             "hit: the bytes assembling the hit's state copied (a paged layout maps cached KV blocks instead). "
             + ("" if report["replayable"] else "**This model cannot be tail-replayed (no GDN layers, or a state "
                "kind a replay cannot rebuild): every approximate budget falls back to exact.** "),
             "", "| prefix | policy | top-1 agreement | mean KL | state error | accuracy | full prefill | retained | "
             "TTFT speed-up | replayed tokens | max bound | exact | GDN state kept / 1K tokens | copied per hit |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in report["rows"]:
        q = "-" if r["quality_retained"] is None else f"{r['quality_retained']:.0%}"
        lines.append(f"| {r['prefix_tokens']} | {r['policy']} | {r['top1_agreement']:.1%} | {r['mean_kl']:.1e} | "
                     f"{r['state_error']:.1e} | {r['accuracy']:.0%} | {r['full_prefill_accuracy']:.0%} | {q} | "
                     f"{r['ttft_speedup']:.1f}× | {r['replayed_tokens']:.0f} | {r['max_bound']:.1e} | "
                     f"{'yes' if r['all_exact'] else 'no'} | {r['gdn_bytes_per_1k'] / 1024:.1f} KiB | "
                     f"{r['bytes_copied'] / 2**20:.2f} MiB |")
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
        axes[0].plot(labels, [r["top1_agreement"] for r in rows], marker="o", label=f"{length} tokens")
        axes[1].plot(labels, [r["ttft_speedup"] for r in rows], marker="o", label=f"{length} tokens")
    axes[0].set_title(f"top-1 agreement with a full prefill ({report['follow_tokens']} tokens)")
    axes[1].set_title("TTFT speed-up over a full prefill")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
