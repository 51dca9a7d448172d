"""Start-to-prompt time (issue 23: `echo /quit | hcw chat --plain` within 2.0 s on hcw-tiny on an idle
machine): the whole command, a fresh workbench file each run, against `python -c "import torch"`
(what no hcw start can avoid) run interleaved in the same process; and, inside one start, what each
stage spends (imports, model load, weights digest, opening and indexing the file).

    python benchmarks/startup.py
    python benchmarks/startup.py --quick --no-write
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import parse_args, write_section  # noqa: E402

STAGES = r"""
import time, sys
t = time.perf_counter(); marks = []
def mark(name):
    global t
    now = time.perf_counter(); marks.append((name, now - t)); t = now
import torch; mark("import torch")
import workbench.cli, workbench.session, workbench.plain; mark("import hcw")
from engine import load_model; m = load_model("hcw-tiny"); mark("build and load the model")
from workbench.session import ChatOptions, ChatSession
s = ChatSession(ChatOptions.of(db=sys.argv[1]), model=m); mark("open the file, index it, new conversation")
s.close(); mark("close")
print(";".join(f"{n}={v}" for n, v in marks))
"""


def _run(cmd: list[str], stdin: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, input=stdin, text=True, capture_output=True, check=True, cwd=ROOT)
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    runs = 3 if args.quick else 9
    work = Path(tempfile.mkdtemp(prefix="hcw-startup-"))
    os.environ.setdefault("HCW_DIGEST_CACHE", str(work / "digests.json"))
    hcw = str(Path(sys.executable).with_name("hcw"))
    _run([hcw, "chat", "--plain", "--db", str(work / "warm.db")], "/quit\n")  # digest cached, files in page cache
    chat, torch_only, stages = [], [], []
    for i in range(runs):
        torch_only.append(_run([sys.executable, "-c", "import torch"]))
        chat.append(_run([hcw, "chat", "--plain", "--db", str(work / f"c{i}.db")], "/quit\n"))
        out = subprocess.run([sys.executable, "-c", STAGES, str(work / f"s{i}.db")], capture_output=True, text=True,
                             check=True, cwd=ROOT).stdout.strip()
        stages.append(dict((k, float(v)) for k, v in (p.split("=") for p in out.split(";"))))
    c, t = statistics.median(chat), statistics.median(torch_only)
    rows = [f"| `echo /quit \\| hcw chat --plain` (hcw-tiny, a new file) | {c:.2f} s | {c / t:.2f}× |",
            f"| `python -c \"import torch\"` | {t:.2f} s | 1.00× |"]
    stage_rows = [f"| {name} | {statistics.median(s[name] for s in stages):.3f} s |" for name in stages[0]]
    body = "\n".join([
        f"Medians of {runs} runs, interleaved, on this machine ({os.cpu_count()} cores; other work may run beside "
        "it: the ratio to importing torch is the steadier figure). Goal: ≤ 2.0 s on an idle machine.",
        "", "| command | start to exit | vs importing torch |", "|---|---:|---:|", *rows,
        "", "Inside one start (a script doing what `hcw chat` does, stage by stage):", "",
        "| stage | median |", "|---|---:|", *stage_rows,
    ])
    print(body)
    if not args.no_write:
        write_section("startup", "Start-to-prompt time (`benchmarks/startup.py`)", body)


if __name__ == "__main__":
    main()
