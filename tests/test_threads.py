"""engine.threads: releasing an idle OpenMP team is safe and torch keeps computing correctly."""

from __future__ import annotations

import threading

import torch

from engine.threads import _libgomp, release_idle_team


def test_releasing_the_idle_team_leaves_torch_correct_on_every_thread():
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    want = a @ a + a.sum()  # big enough to run in parallel and build this thread's team
    # released where torch runs on libgomp (Linux CPU builds); a no-op elsewhere
    assert release_idle_team() == (_libgomp() is not None)
    got = {}
    worker = threading.Thread(target=lambda: got.update(v=a @ a + a.sum()))
    worker.start()
    worker.join()
    assert torch.allclose(got["v"], want, rtol=1e-6, atol=1e-4)
    assert torch.allclose(a @ a + a.sum(), want, rtol=1e-6, atol=1e-4)  # this thread builds a new team on demand
    assert release_idle_team() == (_libgomp() is not None)
