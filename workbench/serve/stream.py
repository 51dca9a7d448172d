"""One request's answer crossing from the engine's thread to the event loop, as text.

The scheduler calls `on_token` / `on_done` on its own thread; they only queue onto the loop,
through a `LoopPoster`: the tokens of one decode step (one per running request) wake the loop once.
`TextStream.events()` turns the ids into text deltas (whole characters only), holds back what
could be the start of a stop string, cuts the answer at one (cancelling the request so that its
slot frees at the next step), and ends with the engine's result.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.engine import Generation
from engine.scheduler import Request
from engine.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    result: Generation | BaseException
    finish_reason: str  # OpenAI's: stop | length
    text: str  # the whole answer, cut at a stop string


class LoopPoster:
    """Calls from another thread run on the loop, as many as are waiting per wakeup: each
    call_soon_threadsafe writes the loop's wake-up pipe, and a step of a batch of 8 would
    otherwise wake it 8 times, each time taking the GIL from the engine's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.calls: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def post(self, fn, arg) -> None:
        self.calls.append((fn, arg))
        with self.lock:
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop has closed (the server stopped): nobody is listening any more
            pass

    def _run(self) -> None:
        with self.lock:
            self.scheduled = False  # a call posted from now on wakes the loop again
        while self.calls:
            fn, arg = self.calls.popleft()
            fn(arg)


class TextStream:
    def __init__(self, poster: LoopPoster, tok: Tokenizer, stops: list[str], eos: set[int]):
        self.poster = poster
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoder = StreamDecoder(tok)
        self.stops, self.eos = stops, eos
        self.request: Request | None = None
        self.token_times: list[float] = []  # when each token reached the loop's queue (engine thread clock)
        self.kept: int | None = None  # tokens up to a stop string, once one cut the answer

    # the engine's thread
    def on_token(self, token: int) -> None:
        self.token_times.append(time.perf_counter())
        self.poster.post(self.queue.put_nowait, token)

    def on_done(self, result: Generation | BaseException) -> None:
        self.poster.post(self.queue.put_nowait, result)

    # the loop
    async def events(self) -> AsyncIterator[Delta | Done]:
        """Text deltas, then Done. Tokens that queued up while the loop was busy go out as one delta
        (fewer, larger chunks when many streams run: each chunk costs the loop, and so the engine's
        thread, its share of the GIL)."""
        text, shown, cut, taken = "", 0, False, 0
        hold = max((len(s) for s in self.stops), default=1) - 1
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            end = None
            for item in items:
                if not isinstance(item, int):
                    end = item  # the result: always the last thing queued
                    break
                if cut:
                    continue
                taken += 1
                if item in self.eos:
                    continue
                text += self.decoder.push(item)
                hit = self._stop_at(text, shown)
                if hit is not None:
                    text, cut, self.kept = text[:hit], True, taken
                    self.request.cancel("stop")  # the rest is not wanted: free the slot at the next step
            if end is None:
                visible = len(text) if cut else len(text) - hold
                if visible > shown:
                    yield Delta(text[shown:visible])
                    shown = visible
                continue
            if not cut and not isinstance(end, BaseException):
                text += self.decoder.flush()
                hit = self._stop_at(text, shown)
                if hit is not None:
                    text, cut = text[:hit], True
            if not isinstance(end, BaseException) and len(text) > shown:
                yield Delta(text[shown:])
            reason = "stop" if cut else "length" if isinstance(end, Generation) and end.stop_reason in (
                "length", "context") else "stop"
            yield Done(end, reason, text)
            return

    def _stop_at(self, text: str, shown: int) -> int | None:
        """Where the first stop string begins, if one has appeared (only text not yet shown can hold one)."""
        start = max(0, shown - max((len(s) for s in self.stops), default=0))
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None
