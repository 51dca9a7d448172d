"""Recall accuracy of a model on the synthetic tasks, by context length (RULER-style string match:
the greedy answer must start with the stated value)."""

from __future__ import annotations

import random

from engine.engine import Engine, SamplingParams
from engine.tokenizer import ByteTokenizer
from workbench.tiny.data import make_example


def recall_accuracy(model, lengths=(1024,), n: int = 20, kinds=("kv", "multikey", "variables"),
                    seed: int = 1234) -> dict[int, dict[str, float]]:
    tok = ByteTokenizer()
    engine = Engine(model)
    out: dict[int, dict[str, float]] = {}
    for length in lengths:
        rng = random.Random(seed + length)
        scores = {}
        for kind in kinds:
            hits = 0
            for _ in range(n):
                ex = make_example(rng, length, tok, kind)
                prompt = [i for i, m in zip(ex.ids, ex.loss_mask) if not m]
                gen = engine.generate(prompt, SamplingParams(max_new_tokens=len(ex.answer) + 2, greedy=True,
                                                             stop_ids=tok.eos_ids))
                hits += tok.decode(gen.token_ids).strip().startswith(ex.answer)
            scores[kind] = hits / n
        out[length] = scores
    return out


def needle_accuracy(model, lengths=(1024,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), n: int = 4,
                    kinds=("single", "multikey", "variables"), seed: int = 99, progress=None) -> list[dict]:
    """RULER-style needles (workbench.tiny.data.needle_task) by context length and needle depth:
    one row per (length, depth) with the share answered right over n tasks (kinds in turn)."""
    from workbench.tiny.data import needle_task

    tok = ByteTokenizer()
    engine = Engine(model)
    rows = []
    for length in lengths:
        rng = random.Random(seed + length)
        for depth in depths:
            hits = 0
            for i in range(n):
                task = needle_task(rng, length, depth, kinds[i % len(kinds)])
                prompt = tok.apply_chat_template(task.context + [{"role": "user", "content": task.question}])
                gen = engine.generate(prompt, SamplingParams(max_new_tokens=len(task.answer) + 2, greedy=True,
                                                             stop_ids=tok.eos_ids))
                hits += tok.decode(gen.token_ids).strip().startswith(task.answer)
            rows.append({"length": length, "depth": depth, "accuracy": hits / n, "n": n,
                         "prompt_tokens": len(prompt)})
            if progress is not None:
                progress(rows[-1])
    return rows
