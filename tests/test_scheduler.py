"""engine/scheduler.py: requests decoded together give what each gives alone, join and leave the
batch at step boundaries, free their slot when cancelled, and reuse the cache exactly."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.faults import drop_gdn_checkpoint
from engine.cache.prefix_cache import PrefixCache
from engine.engine import Cancelled, Engine, Generation, PromptError, SamplingParams
from engine.engine_config import EngineConfig
from engine.model.random_init import qwen3_5_text_dict, write_random_model
from engine.scheduler import QueueFull, Request, Scheduler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_random_model(tmp_path_factory.mktemp("m") / "qwen", qwen3_5_text_dict(hidden=64, layers=4), seed=3)
    return load_model(folder)


def cached_engine(model, **cache) -> Engine:
    return Engine(model, cache=PrefixCache(model, CacheConfig(block_size=16, **cache)))


def run_all(scheduler: Scheduler, requests: list[Request], timeout: float = 120) -> list[Generation | BaseException]:
    """Submit every request at once and wait for each one's result."""
    results: dict[int, Generation | BaseException] = {}
    done = threading.Event()

    def finish(i):
        def on_done(result):
            results[i] = result
            if len(results) == len(requests):
                done.set()
        return on_done

    for i, r in enumerate(requests):
        r.on_done = finish(i)
        scheduler.submit(r)
    scheduler.start()
    assert done.wait(timeout), f"only {len(results)} of {len(requests)} requests finished"
    scheduler.stop()
    return [results[i] for i in range(len(requests))]


def prompts(n: int, shared: int = 40, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (shared,), generator=g).tolist()
    return [base + torch.randint(0, 256, (5 + 9 * i,), generator=g).tolist() for i in range(n)]


def test_a_batch_of_requests_gives_what_each_gives_alone(model):
    params = [SamplingParams(max_new_tokens=6 + 3 * i, greedy=True, ignore_eos=True) for i in range(5)]
    ps = prompts(5)
    alone = [Engine(model).generate(p, sp) for p, sp in zip(ps, params)]
    scheduler = Scheduler(cached_engine(model), max_batch=8)
    sizes = []
    scheduler.on_step = lambda s: sizes.append(s.batch_size)
    got = run_all(scheduler, [Request(p, sp) for p, sp in zip(ps, params)])
    for a, g in zip(alone, got):
        assert g.token_ids == a.token_ids
        assert g.stop_reason == "length"
        assert g.timings.predicted_n == len(a.token_ids)
        torch.testing.assert_close(g.prompt_logits, a.prompt_logits, rtol=1e-4, atol=1e-4)
    # decoded together: one step advances every running request (they join one prefill a turn),
    # so the steps are about the longest answer's, not the sum of all of them
    assert max(sizes) >= 3  # the first, 6 tokens long, may leave before the fifth joins
    assert scheduler.steps <= max(sp.max_new_tokens for sp in params) + 2 * len(params)


def test_sampled_requests_are_reproducible_by_seed(model):
    sp = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    p = prompts(1)[0]
    alone = Engine(model).generate(p, sp)
    got = run_all(Scheduler(Engine(model), max_batch=4), [Request(p, sp), Request(prompts(2)[1], sp)])
    assert got[0].token_ids == alone.token_ids


def test_greedy_and_sampled_requests_in_one_batch_give_what_each_gives_alone(model):
    """A step takes every row's argmax at once: a greedy row's token is its own row's, and a sampled
    row still draws from its own logits with its own generator."""
    ps = prompts(4)
    params = [SamplingParams(max_new_tokens=9, greedy=True, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=9, temperature=0.9, seed=20 + i, ignore_eos=True) for i in range(4)]
    alone = [Engine(model).generate(p, sp).token_ids for p, sp in zip(ps, params)]
    sizes = []
    scheduler = Scheduler(Engine(model), max_batch=4)
    scheduler.on_step = lambda s: sizes.append(s.batch_size)
    got = run_all(scheduler, [Request(p, sp) for p, sp in zip(ps, params)])
    assert [g.token_ids for g in got] == alone
    assert max(sizes) == 4


def test_requests_join_and_leave_at_step_boundaries(model):
    """Past max_batch, a request waits; it joins when one leaves, and the running batch never
    holds more than max_batch."""
    sizes = []
    scheduler = Scheduler(Engine(model), max_batch=2)
    scheduler.on_step = lambda s: sizes.append(s.batch_size)
    ps = prompts(4)
    got = run_all(scheduler, [Request(p, SamplingParams(max_new_tokens=4 + 4 * (i % 2), greedy=True, ignore_eos=True))
                              for i, p in enumerate(ps)])
    assert [len(g.token_ids) for g in got] == [4, 8, 4, 8]
    assert max(sizes) == 2 and 1 in sizes
    for p, g, n in zip(ps, got, [4, 8, 4, 8]):
        assert g.token_ids == Engine(model).generate(p, SamplingParams(max_new_tokens=n, greedy=True,
                                                                        ignore_eos=True)).token_ids


def test_a_cancelled_request_leaves_the_batch_and_frees_its_slot(model):
    started = threading.Event()
    scheduler = Scheduler(Engine(model), max_batch=1)
    sizes = []
    scheduler.on_step = lambda s: sizes.append(s.batch_size)
    long = Request(prompts(1)[0], SamplingParams(max_new_tokens=10_000, greedy=True, ignore_eos=True))
    long.on_token = lambda t: started.set()
    short = Request(prompts(2)[1], SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True))
    results = {}
    both = threading.Event()
    for name, r in (("long", long), ("short", short)):
        r.on_done = lambda res, name=name: (results.__setitem__(name, res), len(results) == 2 and both.set())
        scheduler.submit(r)
    scheduler.start()
    assert started.wait(60)
    long.cancel()
    assert both.wait(120)
    scheduler.stop()
    assert results["long"].stop_reason == "cancelled" and len(results["long"].token_ids) < 10_000
    assert len(results["short"].token_ids) == 3  # it got the slot the cancelled one left
    assert scheduler.batch_size == 0


def test_a_hit_reuses_the_cache_and_gives_the_cold_logits(model):
    engine = cached_engine(model)
    shared = prompts(1, shared=70)[0][:70]
    first = run_all(Scheduler(engine), [Request(shared + [1, 2, 3], SamplingParams(max_new_tokens=2, greedy=True))])[0]
    assert first.lookup.outcome == "miss"
    second = run_all(Scheduler(engine), [Request(shared + [9, 8], SamplingParams(max_new_tokens=5, greedy=True,
                                                                                 ignore_eos=True))])[0]
    assert second.timings.cache_n == 64 and second.lookup.outcome == "hit"
    cold = Engine(model).generate(shared + [9, 8], SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True))
    torch.testing.assert_close(second.prompt_logits, cold.prompt_logits, rtol=1e-4, atol=1e-4)
    assert second.token_ids == cold.token_ids


def test_admission_cap_counts_every_running_request(model):
    """Rule 1 under concurrency: a reuse that needed recovery holds its admission ticket until it
    leaves the batch, so the cap bounds the batch's, and a reuse past it is recomputed instead."""
    engine = cached_engine(model, max_pending_recoveries=1)
    warm = [prompts(1, shared=70, seed=s)[0] for s in (1, 2)]  # two prefixes that share nothing
    run_all(Scheduler(engine), [Request(p, SamplingParams(max_new_tokens=1, greedy=True)) for p in warm])
    for p in warm:  # their GDN states gone: a hit on either must recover them
        drop_gdn_checkpoint(engine.cache, [v.record for v in engine.cache.segments_of(p)])
    asked = [p[:70] + [5, 6, 7] for p in warm]
    sp = SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True)
    got = run_all(Scheduler(engine, max_batch=4), [Request(p, sp) for p in asked])
    first, second = (g.lookup for g in got)
    assert any(o.action.value == "recover" for o in first.plan.objects)
    assert "admission cap" in second.replan_reason and second.plan.usable_tokens == 0
    for p, g in zip(asked, got):
        assert g.token_ids == Engine(model).generate(p, sp).token_ids
    assert engine.cache.admission.pending == {}  # every ticket back when its request left


def test_a_bad_prompt_and_a_full_queue_are_refused_at_submit(model):
    scheduler = Scheduler(Engine(model), max_queue=1)
    with pytest.raises(PromptError):
        scheduler.submit(Request([], SamplingParams()))
    with pytest.raises(PromptError):
        scheduler.submit(Request([10**6], SamplingParams()))
    scheduler.submit(Request([1, 2, 3], SamplingParams()))
    with pytest.raises(QueueFull):
        scheduler.submit(Request([1, 2, 3], SamplingParams()))
    assert scheduler.queue_depth == 1


def test_stopping_fails_what_waits(model):
    scheduler = Scheduler(Engine(model), max_batch=1)
    results = []
    r = Request([1, 2, 3], SamplingParams(max_new_tokens=2, greedy=True), on_done=results.append)
    scheduler.submit(r)
    scheduler._stop.set()  # stopped before it ever ran
    scheduler._thread.start()
    scheduler._thread.join(10)
    assert len(results) == 1 and isinstance(results[0], Cancelled)


def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once(model):
    scheduler = Scheduler(Engine(model), max_batch=1)
    started = threading.Event()
    long = Request(prompts(1)[0], SamplingParams(max_new_tokens=10_000, greedy=True, ignore_eos=True),
                   on_token=lambda t: started.set())
    told = []
    waiting = Request(prompts(2)[1], SamplingParams(max_new_tokens=3), on_done=told.append)
    scheduler.submit(long)
    scheduler.submit(waiting)
    scheduler.start()
    assert started.wait(60)
    waiting.cancel()
    for _ in range(400):
        if told:
            break
        threading.Event().wait(0.01)
    assert scheduler.queue_depth == 0 and isinstance(told[0], Cancelled)
    assert scheduler.batch_size == 1  # while the long one still runs
    long.cancel()
    scheduler.stop()


def test_a_callback_that_raises_does_not_stop_the_engine_thread(model, capsys):
    def bad(result):
        raise ValueError("a caller's bug")

    sp = SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True)
    scheduler = Scheduler(Engine(model))
    scheduler.submit(Request(prompts(1)[0], sp, on_done=bad))
    got = run_all(scheduler, [Request(prompts(2)[1], sp)])
    assert len(got[0].token_ids) == 3 and scheduler.failure is None
    assert "on_done raised ValueError: a caller's bug" in capsys.readouterr().err


def test_a_caller_stop_ends_the_request_with_reason_stop(model):
    seen = []
    r = Request(prompts(1)[0], SamplingParams(max_new_tokens=50, greedy=True, ignore_eos=True))
    r.on_token = lambda t: (seen.append(t), len(seen) == 3 and r.cancel("stop"))
    got = run_all(Scheduler(Engine(model)), [r])[0]
    assert got.stop_reason == "stop" and len(got.token_ids) == 3


def test_a_long_prompt_is_prefilled_between_the_running_requests_steps(model):
    """Chunked prefill: while a 200-token prompt is prefilled 16 tokens at a time, a running
    request keeps getting tokens, one per chunk; both answers equal their single-request runs."""
    engine = Engine(model, EngineConfig(prefill_chunk_size=16))
    order = []
    running = Request(prompts(1)[0], SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True),
                      on_token=lambda t: order.append("run"))
    long_prompt = prompts(1, shared=200, seed=9)[0]
    joined = Request(long_prompt, SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True),
                     on_token=lambda t: order.append("long"))
    scheduler = Scheduler(engine, max_batch=4)
    scheduler.submit(running)
    results = {}
    done = threading.Event()
    for name, r in (("run", running), ("long", joined)):
        r.on_done = lambda res, name=name: (results.__setitem__(name, res), len(results) == 2 and done.set())
    scheduler.start()
    while not order:
        threading.Event().wait(0.005)
    scheduler.submit(joined)
    assert done.wait(120)
    scheduler.stop()
    before_long = order.index("long")
    assert before_long >= 1 + len(long_prompt) // 16 - 1  # a token of the running request per chunk
    for name, p, n in (("run", running.prompt_ids, 40), ("long", long_prompt, 3)):
        alone = Engine(model).generate(p, SamplingParams(max_new_tokens=n, greedy=True, ignore_eos=True))
        assert results[name].token_ids == alone.token_ids


def test_a_request_cancelled_while_it_is_prefilled_gives_its_ticket_back(model):
    engine = Engine(model, EngineConfig(prefill_chunk_size=16), cache=PrefixCache(model, CacheConfig(block_size=16)))
    scheduler = Scheduler(engine)
    r = Request(prompts(1, shared=300)[0], SamplingParams(max_new_tokens=3))
    chunks = []
    real = engine.model.forward

    def counted(*a, **k):
        chunks.append(1)
        if len(chunks) == 3:
            r.cancel()
        return real(*a, **k)

    engine.model.forward = counted
    try:
        got = run_all(scheduler, [r])[0]
    finally:
        engine.model.forward = real
    assert isinstance(got, Cancelled) and len(chunks) < 300 // 16
    assert engine.cache.admission.pending == {}
