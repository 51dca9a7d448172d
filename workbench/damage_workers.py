"""`run_cases`: damage cases run in worker processes (`python -m workbench.damage worker`), each
killed and replaced when a case passes its time limit (a "hang") or the process dies (a "crash")."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from workbench.damage_runner import Runner
from workbench.damage_spec import Spec


def run_cases(pristine: Path, specs: list[Spec], workers: int = 1, timeout_s: float = 60.0,
              progress=None, scratch: Path | None = None) -> list[dict]:
    """Every case in a worker process (`python -m workbench.damage worker`) that is killed and
    replaced when a case passes `timeout_s` (a "hang") or the process dies (a "crash")."""
    scratch = Path(scratch or Path(pristine).parent / "workers")
    results: list[dict | None] = [None] * len(specs)
    todo = iter(range(len(specs)))
    lock = threading.Lock()
    done = [0]

    def serve(w: int) -> None:
        worker = None
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                if worker is None:
                    worker = _Worker(pristine, scratch / f"w{w}")
                results[i] = worker.run(specs[i], timeout_s)
                if worker.dead:
                    worker = None
                with lock:
                    done[0] += 1
                    if progress is not None:
                        progress(done[0], len(specs), results[i])
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


class _Worker:
    def __init__(self, pristine: Path, scratch: Path):
        scratch.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        self.log = open(scratch / "worker.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "workbench.damage", "worker", str(pristine), str(scratch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=root,
                                     env=env, text=True, bufsize=1)
        self.dead = False
        self.started = False

    def run(self, spec: Spec, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(asdict(spec)) + "\n")
        self.proc.stdin.flush()
        # the first case also waits for the worker to start (imports, the model)
        limit = time.monotonic() + timeout_s + (0 if self.started else 120)
        while time.monotonic() < limit:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, limit - time.monotonic()))
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:  # the worker died under the case
                self.close()
                return _lost(spec, "crash", f"the worker process died (exit {self.proc.poll()})")
            self.started = True
            return json.loads(line)
        self.close()
        return _lost(spec, "hang", f"no result within {timeout_s:.0f} s")

    def close(self) -> None:
        self.dead = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def _lost(spec: Spec, outcome: str, why: str) -> dict:
    return {**asdict(spec), "hit": spec.table or "-", "scope": "-", "detail": f"seed {spec.seed}", "chat": outcome,
            "verify": "-", "verify_missed": False, "message": why, "verify_text": "", "outcome": outcome, "ms": 0.0}


def worker_main(pristine: str, scratch: str) -> None:
    """The worker: a spec per line on stdin, a result per line on the original stdout (anything
    else printed goes to stderr)."""
    import torch

    torch.set_num_threads(1)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    runner = Runner(Path(pristine), Path(scratch))
    for line in sys.stdin:
        spec = Spec(**json.loads(line))
        try:
            result = runner.run(spec)
        except Exception:  # noqa: BLE001 - the damage engine itself failed: reported, never counted as the code's
            result = {**_lost(spec, "harness", traceback.format_exc(limit=-4)), "outcome": "harness"}
        proto.write(json.dumps(result) + "\n")
