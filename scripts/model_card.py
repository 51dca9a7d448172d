"""Measure hcw-tiny for docs/MODEL_CARD.md: the loss curve (PNG) from the training log, recall
accuracy on the training tasks by context length, and RULER-style needles by length and depth
(PNG). Writes the measurements block of the model card and the plots under docs/img/.

    python scripts/model_card.py [--model hcw-tiny] [--lengths 1024,4096,16384,32768] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from engine import load_model
from engine.model.loader import resolve_model
from workbench.tiny.evaluate import needle_accuracy, recall_accuracy

DOCS = Path(__file__).resolve().parents[1] / "docs"


def plot_loss(log: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in log.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([e["step"] for e in entries], [e["loss"] for e in entries], lw=1.2, color="black", label="all answers")
    for kind in sorted({k for e in entries for k in e.get("loss_by_kind", {})}):
        mine = [e for e in entries if kind in e.get("loss_by_kind", {})]
        ax.plot([e["step"] for e in mine], [e["loss_by_kind"][kind] for e in mine], lw=0.6, alpha=0.7, label=kind)
    ax.legend(fontsize=7, ncol=5, loc="upper right")
    for seq in sorted({e.get("seq_len") for e in entries if e.get("seq_len")}):
        first = next(e["step"] for e in entries if e.get("seq_len") == seq)
        ax.axvline(first, color="grey", ls=":", lw=0.8)
        ax.text(first, ax.get_ylim()[1] * 0.95, f" {seq}", fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("answer loss (nats/token)")
    ax.set_title("hcw-tiny training (dotted: sequence length of the curriculum)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_needles(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        ax.plot([r["depth"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=f"{length} tokens")
    ax.set_xlabel("needle depth (0 = start of context)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    ax.set_title("hcw-tiny: RULER-style needles by length and depth")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="hcw-tiny")
    parser.add_argument("--lengths", default="1024,4096,16384,32768")
    parser.add_argument("--quick", action="store_true", help="fewer tasks")
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = resolve_model(args.model)
    model = load_model(folder)
    lengths = [int(x) for x in args.lengths.split(",")]
    img = DOCS / "img"
    img.mkdir(parents=True, exist_ok=True)
    plot_loss(folder / "training_log.jsonl", img / "hcw_tiny_loss.png")
    t0 = time.perf_counter()
    recall = {}
    for length in lengths:
        n = 4 if args.quick else max(4, 40 * 1024 // length)
        recall.update(recall_accuracy(model, (length,), n=n))
        print(length, recall[length], f"{time.perf_counter() - t0:.0f}s", flush=True)
    needles = []
    for length in lengths:  # fewer tasks where each costs a long prefill
        needles += needle_accuracy(model, (length,), n=2 if args.quick or length > 8192 else 4,
                                   progress=lambda row: print(row, f"{time.perf_counter() - t0:.0f}s", flush=True))
    plot_needles(needles, img / "hcw_tiny_needles.png")
    summary = json.loads((folder / "training_summary.json").read_text())
    body = [f"Measured with `python scripts/model_card.py` ({time.perf_counter() - t0:.0f} s on this machine's CPU).",
            "", "**Training run**: " + f"{summary['steps']} steps in {summary['seconds'] / 60:.0f} min, "
            f"{summary['params']:,} parameters, final answer loss {summary['final_loss']:.3f}.",
            "", "![loss](img/hcw_tiny_loss.png)", "",
            "**Recall on the training tasks** (greedy answer starts with the stated value; the facts sit "
            "anywhere in the context):", "", "| context tokens | key-value chat | multi-key | variable chain | tasks each |",
            "|---:|---:|---:|---:|---:|"]
    for length in lengths:
        r = recall[length]
        n = 4 if args.quick else max(4, 40 * 1024 // length)
        body.append(f"| {length} | {r['kv']:.0%} | {r['multikey']:.0%} | {r['variables']:.0%} | {n} |")
    body += ["", "**RULER-style needles by depth** (single / multi-key / variable tracking in turn; 4 tasks per "
             "cell up to 8K tokens, 2 beyond):", "",
             "| context tokens | " + " | ".join(f"depth {d:g}" for d in sorted({r['depth'] for r in needles})) + " |",
             "|---:|" + "---:|" * len({r['depth'] for r in needles})]
    for length in lengths:
        body.append(f"| {length} | " + " | ".join(f"{r['accuracy']:.0%}" for r in needles if r["length"] == length) + " |")
    body += ["", "![needles](img/hcw_tiny_needles.png)"]
    card = DOCS / "MODEL_CARD.md"
    text = card.read_text() if card.exists() else "# hcw-tiny\n\n<!-- measurements -->\n<!-- /measurements -->\n"
    block = "<!-- measurements -->\n" + "\n".join(body) + "\n<!-- /measurements -->"
    card.write_text(re.sub(r"<!-- measurements -->.*?<!-- /measurements -->", lambda _: block, text, flags=re.S))
    print("\n".join(body))


if __name__ == "__main__":
    main()
