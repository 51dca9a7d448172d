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


def test_generate_caps_threads_for_the_decode_steps_only(tmp_path, monkeypatch):
    from engine import load_model
    from engine.engine import Engine, SamplingParams
    from engine.model.random_init import hcw_hybrid_dict, write_random_model

    model = load_model(write_random_model(tmp_path / "m", hcw_hybrid_dict(hidden=64), seed=1))
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {"prefill": [], "decode": []}
        prefill_steps = engine.prefill_steps  # (what prefill and start run, a chunk at a time)

        def watched(*args, **kw):
            seen["prefill"].append(torch.get_num_threads())
            return prefill_steps(*args, **kw)

        monkeypatch.setattr(engine, "prefill_steps", watched)
        capped = engine.generate(list(range(40)), params, on_token=lambda t: seen["decode"].append(torch.get_num_threads()),
                                 decode_threads=1)
        assert seen["prefill"] and set(seen["prefill"]) == {2} and set(seen["decode"]) == {1}
        assert torch.get_num_threads() == 2  # restored
        assert capped.token_ids == engine.generate(list(range(40)), params).token_ids
    finally:
        torch.set_num_threads(before)


def test_a_ui_keeps_a_core_and_explicit_settings_are_kept(monkeypatch):
    import os

    import pytest

    from engine.threads import threads_beside_ui
    from workbench.session import ChatOptions

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads_beside_ui() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
        assert threads_beside_ui() == 1  # never zero
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="decode_threads"):
        ChatOptions.of(decode_threads=0)
