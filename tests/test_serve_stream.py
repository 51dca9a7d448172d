"""workbench/serve/stream.py: token ids from the engine's thread become text deltas on the loop,
whole characters only, cut at a stop string (held back until it cannot be one), and the request
cancelled there."""

from __future__ import annotations

import asyncio

import pytest

from engine.engine import Generation, SamplingParams, Timings
from engine.scheduler import Request
from engine.tokenizer import ByteTokenizer
from workbench.serve.stream import Delta, Done, LoopPoster, TextStream

TOK = ByteTokenizer()


def run(text: str, stops: list[str], together: bool, reason: str = "length") -> tuple[list[str], Done, Request]:
    """The stream's deltas and end for `text`'s tokens, sent one at a time (each taken before the
    next) or all queued up before the loop looks."""
    async def go():
        stream = TextStream(LoopPoster(asyncio.get_running_loop()), TOK, stops, set(TOK.eos_ids))
        stream.request = Request([1], SamplingParams())
        ids = TOK.encode(text)
        seen = []

        async def consume():
            async for e in stream.events():
                seen.append(e)

        task = None if together else asyncio.create_task(consume())
        for t in ids:
            stream.on_token(t)
            if not together:
                await asyncio.sleep(0.001)
        stream.on_done(Generation(ids, reason, Timings()))
        if together:
            await asyncio.sleep(0.001)  # everything is in the queue before the stream reads it
            task = asyncio.create_task(consume())
        await task
        return [e.text for e in seen if isinstance(e, Delta)], seen[-1], stream.request

    return asyncio.run(go())


@pytest.mark.parametrize("together", [False, True], ids=["one at a time", "queued up"])
def test_a_stop_string_cuts_the_answer_and_cancels_the_request(together):
    deltas, done, request = run("hello world, hello", ["o w"], together)
    assert "".join(deltas) == done.text == "hell"
    assert done.finish_reason == "stop" and request.cancelled


@pytest.mark.parametrize("together", [False, True], ids=["one at a time", "queued up"])
def test_without_a_stop_string_every_character_arrives_once(together):
    text = "naïve café — 東京"  # multi-byte characters: never split
    deltas, done, request = run(text, [], together)
    assert "".join(deltas) == done.text == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(deltas) == (1 if together else len(text))  # queued-up tokens go out as one chunk
    assert done.finish_reason == "length" and not request.cancelled


def test_text_that_might_begin_a_stop_string_is_held_back_until_it_does_not():
    deltas, done, _ = run("abcab", ["abd"], together=False, reason="stop")
    assert "".join(deltas) == "abcab" and done.finish_reason == "stop"
    assert deltas[0] == "a"  # "ab" could have been "abd": held until "c"
