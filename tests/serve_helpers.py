"""A real `hcw serve` app on a loopback port in a background thread, for the server tests."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from engine.engine import Engine, SamplingParams
from workbench.options import ChatOptions
from workbench.serve.app import create_app
from workbench.serve.run import bind
from workbench.serve.served import Served, ServeOptions


@contextlib.contextmanager
def serving(model: str, db, start: bool = True, chat: dict | None = None, **opts):
    """(served, base URL) of a server listening on a free loopback port; stopped on exit. `chat`:
    ChatOptions.of's flat names (the cache's settings among them)."""
    served = Served(ServeOptions(ChatOptions.of(model=model, db=db, **(chat or {})), **opts))
    if start:
        served.start()
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield served, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        served.close()
        sock.close()


def cold(served: Served, messages: list[dict], max_tokens: int) -> str:
    """The greedy answer of a fresh engine with no cache, on the served model."""
    ids = served.tok.apply_chat_template(messages, add_generation_prompt=True)
    gen = Engine(served.model).generate(ids, SamplingParams(max_new_tokens=max_tokens, greedy=True,
                                                            stop_ids=served.eos))
    return served.tok.decode([t for t in gen.token_ids if t not in served.eos])
