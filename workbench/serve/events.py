"""`GET /hcw/events`: what the workbench's panes show, for a running server, as server-sent events
(what `hcw top` draws).

    event: request   one per finished request: its endpoint, tokens, cached tokens, outcome,
                     TTFT and tokens/s, the validation panel's lines for its lookup (the four
                     layers, the plan) and the segment state table of its prompt
    event: stats     every second: running and waiting requests, decode steps, the cache's
                     counters (hit rate, usable vs logical tokens, validation failures, spills)

A request's event is made on the engine's thread as the request leaves the batch (the cache's
tables are read where they are written) and handed to every subscriber's queue on the loop; a new
subscriber gets the last RECENT first. A subscriber that does not keep up loses its oldest events,
never slows the server.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import psutil

from engine.engine import Generation
from engine.scheduler import Request
from workbench.plain import describe_plan
from workbench.session import segment_rows
from workbench.turns import TurnResult

QUEUE = 256  # events a subscriber may fall behind by
RECENT = 50  # finished requests a new watcher is shown first


class EventHub:
    def __init__(self, served):
        self.served = served
        self.loop: asyncio.AbstractEventLoop | None = None
        self.subscribers: set[asyncio.Queue] = set()
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT)  # on the loop
        self.started = time.time()

    def subscribe(self) -> asyncio.Queue:
        """A new watcher's queue, holding the last RECENT finished requests already."""
        self.loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue(QUEUE)
        for event in self.recent:
            q.put_nowait(("request", event))
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    # the engine's thread
    def finished(self, endpoint: str, req: Request, result: Generation | BaseException, loop) -> None:
        """A request left the batch: its event, made here, goes to the loop (`loop`: the request's)."""
        self.loop = self.loop or loop
        self.loop.call_soon_threadsafe(self._publish, "request", self.request_event(endpoint, req, result))

    def request_event(self, endpoint: str, req: Request, result: Generation | BaseException) -> dict:
        event = {"id": req.id, "endpoint": endpoint, "prompt_tokens": len(req.prompt_ids), "at": time.time()}
        if isinstance(result, BaseException):
            return {**event, "error": f"{type(result).__name__}: {result}"}
        t = result.timings
        turn = TurnResult("", result.token_ids, result.stop_reason, t.prompt_n, t.cache_n, t.prompt_ms,
                          t.as_dict()["predicted_per_second"], result.lookup, None, timings=t)
        served = self.served
        rows = segment_rows(served.cache, served.tier, req.prompt_ids) if served.cache is not None else []
        return {**event, "completion_tokens": t.predicted_n, "cached_tokens": t.cache_n,
                "outcome": result.lookup.outcome if result.lookup else "off",
                "exact": result.lookup.plan.exact if result.lookup else True, "stop_reason": result.stop_reason,
                "ttft_ms": t.prompt_ms, "tokens_per_s": turn.tokens_per_s, "plan": describe_plan(turn),
                "segments": [dataclasses.asdict(r) for r in rows]}

    # the loop
    def stats_event(self) -> dict:
        s = self.served.scheduler
        cache = self.served.engine.metrics()
        return {"model": self.served.name, "running": s.batch_size, "waiting": s.queue_depth, "steps": s.steps,
                "max_batch": s.max_batch, "uptime_s": time.time() - self.started,
                "rss_mb": psutil.Process().memory_info().rss / 2**20, "cache": cache}

    def _publish(self, kind: str, data: dict) -> None:
        if kind == "request":
            self.recent.append(data)
        for q in list(self.subscribers):
            if q.full():
                q.get_nowait()  # the oldest goes: a slow watcher never holds the server up
            q.put_nowait((kind, data))
