"""Handing torch compute to another thread without halving its speed.

torch's CPU build runs intra-op parallelism on OpenMP (libgomp), and libgomp keeps an idle thread
team for every thread that has run a parallel region. When the main thread has loaded a model (its
team stays) and a worker thread then computes (a second team), the process holds more OpenMP
threads than cores, and libgomp cuts its spin-waiting a thousandfold: every op's hand-off goes
through the kernel. Measured on 2 cores with hcw-tiny: ~100 tokens/s in the workbench's worker
thread against ~210 on the main thread; releasing the main thread's idle team before the worker
starts brings the worker to ~215 (benchmarks/tui_responsiveness.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path

import torch

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's own libgomp (the one its ops run on), or None on builds without it."""
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_idle_team() -> bool:
    """Free the calling thread's idle OpenMP team (OpenMP 5 `omp_pause_resource_all`, soft: libgomp
    frees the caller's pool; a later parallel op here builds a new one). Call it on the thread that
    hands its torch work to another, when it is not inside a torch op. True if released."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """torch's intra-op threads capped at `n` inside the block (None: left as they are), for the
    calling thread. torch keeps the count process-wide and a thread adopts it when it first runs
    a torch op: one that starts inside the block keeps the cap afterwards (threads already
    running do not see it). Not for two threads at once."""
    before = torch.get_num_threads()
    if n is None or n >= before:
        yield
        return
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_beside_ui() -> int:
    """Intra-op threads for decoding while a UI draws (in this process or, as `hcw chat` runs, in
    another): one core left to the UI. On 2 cores a UI thread at ~7% of a core cost a 2-thread
    decode ~14% of its speed (each op waits for both threads, one of which the UI has preempted)
    and a 1-thread decode ~9%, while alone the two ran at the same speed: a one-token step of these
    models is too small to share (benchmarks/tui_responsiveness.py). Beside a process running the
    app's streaming load, hcw-tiny decoded at 407 tok/s on one thread and 352 on two. Measured on
    2 cores; on more, one thread fewer than the cores costs a decode at most that thread's share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores - 1))
