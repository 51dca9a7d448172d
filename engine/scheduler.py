"""Continuous batching: requests join and leave a running batch at step boundaries.

One thread owns the engine (its model, its cache and every request's state). Each turn of its
loop it gives waiting requests the batch's free slots, runs one prefill chunk of the first request
still being admitted — the cache's lookup, validation and assembly at its first chunk, then
recovery and the prefill of what is left (`Engine.start_steps`), then the first sampled token —
and then advances every running request by one token in one decode step (`Engine.decode_batch`:
the weights are read once for the whole batch). A request leaves the batch
when it stops (an end token, its length, the context limit) or is cancelled (`Request.cancel`,
heard between prefill chunks and at every step); leaving releases its cache admission ticket and
its state. Nothing else touches the engine, so a lookup's plan is used by the same thread before
any other request can evict or write: rule 3 (pinned from check to use) holds by construction,
and rule 1 (the admission cap) counts the reuses of every request in the batch, since each holds
its ticket until it leaves. A long prompt does not stop the batch: its chunks alternate with the
running requests' steps (chunked prefill).

Knows token ids only, as the engine does; text, HTTP and metrics are the caller's
(workbench/serve). Per request it calls `on_token(id)` for each sampled token and `on_done(result)`
once, both on the engine's thread: they must be quick (one that raises is said on stderr).

    submit ─► waiting (bounded) ─► admitting: a prefill chunk per turn ─► running ─► step ─► done
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from engine.engine import Cancelled, Engine, Generation, Sampler, SamplingParams, Started, Timings


class QueueFull(RuntimeError):
    """The scheduler's waiting queue holds its limit of requests."""


class Unavailable(QueueFull):
    """The scheduler takes no more requests: it is stopping, or its thread failed."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[Generation | BaseException], None] | None = None
    id: int = field(default_factory=itertools.count(1).__next__)
    submitted: float = field(default_factory=time.perf_counter)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    cancel_reason: str = "cancelled"

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop this request at the next chunk or step boundary (any thread); `reason` is the stop
        reason it ends with ("stop": the caller found a stop string of its own)."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class Admitting:
    """A request whose prompt is being prefilled, a chunk per turn of the scheduler's loop."""

    request: Request
    steps: Generator[None, None, Started]  # Engine.start_steps
    t0: float


class Running:
    """A request in the batch: its started prompt, its sampler and what it has produced."""

    def __init__(self, request: Request, run: Started, eos: tuple[int, ...], limit: int, prompt_ms: float,
                 device: torch.device):
        p = request.params
        self.request, self.run = request, run
        self.stops = set() if p.ignore_eos else set(p.stop_ids) | set(eos)
        self.sampler = Sampler(p, device)
        self.limit = limit
        self.out: list[int] = []
        self.logits = run.logits
        self.prompt_logits = run.logits
        self.timings = Timings(prompt_n=len(request.prompt_ids), prompt_ms=prompt_ms,
                               cache_n=run.plan.usable_tokens if run.plan is not None else 0)
        self.decode_t0 = time.perf_counter()
        self.reason = ""

    def sample(self, greedy: int | None = None) -> bool:
        """Sample the next token from the last logits (`greedy`: their argmax, taken already for the
        whole step) and hand it out; True when the request is done (its reason set), the same checks
        in the same order as Engine.generate."""
        token = greedy if greedy is not None and self.request.params.greedy else self.sampler(self.logits)
        self.out.append(token)
        if self.request.on_token is not None:
            self.request.on_token(token)
        if token in self.stops:
            self.reason = "stop"
        elif self.request.cancelled:
            self.reason = self.request.cancel_reason
        elif len(self.out) == self.request.params.max_new_tokens:
            self.reason = "length"
        elif self.run.state.seq_len >= self.limit:
            self.reason = "context"
        return bool(self.reason)

    def result(self) -> Generation:
        self.timings.predicted_ms = 1000 * (time.perf_counter() - self.decode_t0)
        self.timings.predicted_n = len(self.out)
        return Generation(self.out, self.reason, self.timings, None, self.run.plan, self.prompt_logits,
                          lookup=self.run.lookup)


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = tuple(engine.model.config.eos_token_ids)
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.running: list[Running] = []
        self.admitting: list[Admitting] = []  # taking a slot: prefilling, a chunk between two steps
        self.steps = 0  # decode steps run (each advances every running request by one token)
        self.on_step: Callable[[Scheduler], None] | None = None  # after every decode step (metrics)
        self.failure: BaseException | None = None  # what ended the engine's thread, if anything did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hcw-scheduler", daemon=True)

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def queue_depth(self) -> int:
        return self.waiting.qsize()

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel what runs and waits, and end the loop."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Started, not stopped, and its thread running (False after a failure: `failure` says why)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, request: Request) -> Request:
        if self.failure is not None:
            raise Unavailable(f"the engine's thread failed ({type(self.failure).__name__}: {self.failure})")
        if self._stop.is_set():
            raise Unavailable("the server is stopping")
        if self.waiting.qsize() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are waiting already")
        self.engine.check_prompt(request.prompt_ids)  # PromptError now, not later on the engine's thread
        self.waiting.put(request)
        return request

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drop_cancelled()
                if not self.running and not self.admitting:
                    try:
                        first = self.waiting.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    self._begin(first)
                while len(self.running) + len(self.admitting) < self.max_batch:
                    try:
                        self._begin(self.waiting.get_nowait())
                    except queue.Empty:
                        break
                if self.admitting:
                    self._advance(self.admitting[0])  # one prefill chunk, then the running requests' step
                if self.running:
                    self._step()
            ended: BaseException = Cancelled("the server is stopping")
        except BaseException as e:  # noqa: BLE001 - the engine's thread must not die silently: say so to all
            self.failure = e
            ended = e
            print(f"error: the engine's thread failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        for a in self.admitting:
            a.steps.close()  # its admission ticket back, what it captured kept
            self._fail(a.request, ended)
        self.admitting = []
        for r in self.running:
            r.request.cancel()
            r.reason = "cancelled"
            self._finish(r)
        self.running = []
        while not self.waiting.empty():
            self._fail(self.waiting.get_nowait(), ended)

    def _drop_cancelled(self) -> None:
        """Requests cancelled while they wait leave the queue now, not when a slot frees."""
        with self.waiting.mutex:
            gone = [r for r in self.waiting.queue if r.cancelled]
            for r in gone:
                self.waiting.queue.remove(r)
        for r in gone:
            self._fail(r, Cancelled("cancelled while waiting"))

    def _begin(self, request: Request) -> None:
        """A request takes a slot: its prefill runs a chunk per turn of the loop from now on."""
        if request.cancelled:  # gone before its turn (a client that disconnected while queued)
            self._fail(request, Cancelled("cancelled while waiting"))
            return
        steps = self.engine.start_steps(request.prompt_ids,
                                        should_stop=lambda: request.cancelled or self._stop.is_set())
        self.admitting.append(Admitting(request, steps, time.perf_counter()))

    def _advance(self, a: Admitting) -> None:
        """One chunk of a's prefill (the cache's lookup at the first); at its end a joins the batch
        with its first token."""
        try:
            next(a.steps)
            return
        except StopIteration as done:
            run = done.value
        except Exception as e:  # noqa: BLE001 - one request's failure (Cancelled too) is its own; the batch runs on
            self.admitting.remove(a)
            self._fail(a.request, e)
            return
        self.admitting.remove(a)
        request = a.request
        try:
            r = Running(request, run, self.eos, self.engine.context_limit, 1000 * (time.perf_counter() - a.t0),
                        self.engine.model.device)
        except Exception as e:  # noqa: BLE001 - as above
            run.finish()
            self._fail(request, e)
            return
        if request.params.max_new_tokens == 0:
            r.reason = "length"
            self._finish(r)
        elif self._sample(r):
            self.running.append(r)

    def _sample(self, r: Running, greedy: int | None = None) -> bool:
        """Sample r's next token; False (and r finished) when it is done."""
        try:
            done = r.sample(greedy)
        except Exception as e:  # noqa: BLE001 - a callback or the sampler failed this request alone
            r.run.finish()
            self._fail(r.request, e)
            return False
        if done:
            self._finish(r)
        return not done

    def _step(self) -> None:
        batch = self.running
        try:
            tokens = [r.out[-1] for r in batch]
            if len(batch) == 1:  # one sequence keeps the single-sequence path (the static decoder on CUDA)
                batch[0].logits = self.engine.decode(tokens[0], batch[0].run.state)
                greedy = [None]
            else:  # the weights read once for every row (engine/batch_decode.py)
                logits = self.engine.decode_batch(tokens, [r.run.state for r in batch])  # [N, vocab]
                for r, row in zip(batch, logits):
                    r.logits = row
                # every row's argmax in one op (a greedy row's token; a sampled row ignores its own):
                # per row it was N ops, each giving the GIL up to the HTTP loop and waiting for it back
                greedy = (logits.argmax(-1).tolist() if any(r.request.params.greedy for r in batch)
                          else [None] * len(batch))
            for r, token in zip(batch, tokens):
                r.run.fed.append(token)
                if r.run.writer is not None and r.run.state.seq_len % self.engine.cache.block_size == 0:
                    r.run.capture(r.run.state)
        except Exception as e:  # noqa: BLE001 - the step failed for the batch: each request is told
            for r in batch:
                r.run.finish()
                self._fail(r.request, e)
            self.running = []
            return
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)
        self.running = [r for r, g in zip(batch, greedy) if self._sample(r, g)]

    def _finish(self, r: Running) -> None:
        r.run.finish()  # the admission ticket back, the segments saved
        result = r.result()
        r.run = None  # the state goes with it (a paged state's blocks back to the pool)
        self._tell(r.request, result)

    def _fail(self, request: Request, error: BaseException) -> None:
        self._tell(request, error)

    @staticmethod
    def _tell(request: Request, result: Generation | BaseException) -> None:
        """The request's on_done; a callback that raises is the caller's bug, said on stderr, and
        must not stop the thread every other request depends on."""
        if request.on_done is None:
            return
        try:
            request.on_done(result)
        except Exception as e:  # noqa: BLE001 - reported, not hidden: the line below
            print(f"error: request {request.id}'s on_done raised {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
