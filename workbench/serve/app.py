"""The HTTP API (FastAPI): OpenAI's chat and text completions (streamed as server-sent events, or
not), the model list, health and Prometheus metrics, over one `Served` engine.

Every error is an OpenAI-style body with a 4xx status (bad JSON, an unknown model, past the context
limit, out-of-range sampling, a missing key, too large a body, a full queue), never a traceback. A
client that disconnects cancels its request, which leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from engine.engine import Cancelled, Generation, PromptError
from engine.scheduler import QueueFull, Unavailable
from engine.scheduler import Request as EngineRequest
from workbench.serve.protocol import (ApiError, ChatRequest, CompletionRequest, Sampling, created,
                                      reuse_report, usage)
from workbench.serve import record
from workbench.serve.served import Served
from workbench.serve.stream import Delta, Done, TextStream


def create_app(served: Served) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # on shutdown, while the loop still runs: what is running is cancelled, its answers end
        # and its segments are saved before the loop (which their last events go to) closes
        await asyncio.to_thread(served.scheduler.stop)

    app = FastAPI(title="hcw", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.served = served
    _errors(app)
    if served.max_body_bytes:
        app.add_middleware(_BodyLimit, limit=served.max_body_bytes)

    def authorized(request: Request) -> None:
        if served.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")

    guarded = [Depends(authorized)]

    @app.get("/health")
    async def health() -> JSONResponse:
        s = served.scheduler
        if s.failure is not None:  # the engine's thread is gone: nothing will be answered
            return JSONResponse({"status": "error", "error": f"{type(s.failure).__name__}: {s.failure}"}, 503)
        return JSONResponse({"status": "ok", "model": served.name, "running": s.batch_size,
                             "waiting": s.queue_depth})

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.loaded_at,
                                            "owned_by": "hcw", "context_length": served.engine.context_limit}]}

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(served.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/hcw/events", dependencies=guarded)
    async def events() -> EventSourceResponse:
        return EventSourceResponse(_events(served), ping=15)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(body: ChatRequest, request: Request):
        params = _checked(served, body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            ids = served.tok.apply_chat_template(messages, add_generation_prompt=True)
        except jinja2.TemplateError as e:  # a model's template refusing these messages (raise_exception)
            raise ApiError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        recorder = None if body.conversation is None else _recorder(served, body.conversation, messages, len(ids))
        return await _respond(served, "chat", ids, params, body, request, recorder)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        params = _checked(served, body)
        prompt = body.prompt_of()
        ids = served.tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await _respond(served, "completions", ids, params, body, request)

    return app


async def _events(served: Served) -> AsyncIterator[dict]:
    """The watcher's stream: the server's stats now and every second, each finished request between."""
    hub = served.events
    q = hub.subscribe()
    try:
        yield {"event": "stats", "data": json.dumps(hub.stats_event())}
        due = time.monotonic() + 1.0
        while True:
            try:
                kind, data = await asyncio.wait_for(q.get(), timeout=max(0.0, due - time.monotonic()))
                yield {"event": kind, "data": json.dumps(data)}
            except TimeoutError:
                pass
            if time.monotonic() >= due:  # every second, however many requests finish in between
                yield {"event": "stats", "data": json.dumps(hub.stats_event())}
                due = time.monotonic() + 1.0
    finally:
        hub.unsubscribe(q)


def _checked(served: Served, body: Sampling):
    if body.model != served.name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {served.name!r}",
                       code="model_not_found", param="model")
    return body.checked(served.default_max_tokens, served.engine.context_limit)


async def _respond(served: Served, endpoint: str, ids: list[int], params, body: Sampling, request: Request,
                   recorder=None):
    """Submit, then answer whole or as a stream; `recorder(text, generation)` -> the conversation
    the exchange was written to (record.py), called once the answer is complete."""
    limit = served.engine.context_limit
    if len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context limit is {limit}, which must "
                            "leave room for one generated token", code="context_length_exceeded")
    stops = body.stops()
    stream = TextStream(served.poster(), served.tok, stops, set(served.eos))

    loop = asyncio.get_running_loop()

    def on_done(result) -> None:  # the engine's thread: the watchers' event first (it reads the cache there)
        served.events.finished(endpoint, req, result, loop)
        stream.on_done(result)

    req = EngineRequest(ids, dataclasses.replace(params, stop_ids=tuple(served.eos)), on_token=stream.on_token,
                        on_done=on_done)
    stream.request = req
    try:
        served.scheduler.submit(req)
    except PromptError as e:
        raise ApiError(400, str(e), param="prompt" if endpoint == "completions" else "messages") from None
    except Unavailable as e:
        raise ApiError(503, f"{e}", code="unavailable", kind="server_error") from None
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}; retry later", code="queue_full", kind="server_busy") from None
    rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    events = stream.events()
    watcher = asyncio.create_task(_watch(request, req))
    try:
        first = await anext(events)
    except BaseException:
        watcher.cancel()
        req.cancel()
        raise
    if isinstance(first, Done) and isinstance(first.result, BaseException):
        watcher.cancel()
        raise _engine_error(first.result)
    if body.stream:
        watcher.cancel()  # sse-starlette hears the disconnect itself and cancels the generator
        return EventSourceResponse(_sse(served, endpoint, rid, body, req, stream, first, events, recorder), ping=15)
    try:
        done = first
        while not isinstance(done, Done):
            done = await anext(events)
    finally:
        watcher.cancel()
        req.cancel()  # a no-op once finished; frees the slot if this handler is being cancelled
    if isinstance(done.result, BaseException):
        raise _engine_error(done.result)
    if done.result.stop_reason == "cancelled":  # the client left (or the server is stopping): not an answer
        served.metrics.failed(endpoint, 499)
        return Response(status_code=499)
    served.metrics.finished(endpoint, done.result, stream.token_times, req.submitted, _queue_s(done.result, req))
    out = _whole(served, endpoint, rid, done, req, stream.kept)
    if recorder is not None:
        out["hcw"]["conversation"] = recorder(done.text, done.result)
    return out


async def _watch(request: Request, req: EngineRequest) -> None:
    """Cancel the request when its client goes away (a whole response is not written until the end)."""
    while not req.cancelled:
        if await request.is_disconnected():
            req.cancel()
            return
        await asyncio.sleep(0.2)


def _queue_s(result: Generation, req: EngineRequest) -> float:
    return max(0.0, time.perf_counter() - req.submitted - (result.timings.prompt_ms + result.timings.predicted_ms)
               / 1000)


def _extras(gen: Generation, req: EngineRequest, kept: int | None) -> dict:
    return {"usage": usage(gen, kept), "timings": gen.timings.as_dict(),
            "hcw": reuse_report(gen, 1000 * _queue_s(gen, req))}


def _whole(served: Served, endpoint: str, rid: str, done: Done, req: EngineRequest, kept: int | None) -> dict:
    gen = done.result
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "finish_reason": done.finish_reason, "logprobs": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": None}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created(), "model": served.name, "choices": [choice],
            **_extras(gen, req, kept)}


async def _sse(served: Served, endpoint: str, rid: str, body: Sampling, req: EngineRequest, stream: TextStream,
               first, events: AsyncIterator, recorder=None) -> AsyncIterator[str]:
    chat = endpoint == "chat"
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created(),
            "model": served.name}

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**base, "choices": [choice]}

    try:
        if chat:
            yield json.dumps(chunk("", None, role=True))
        event = first
        while True:
            if isinstance(event, Delta):
                yield json.dumps(chunk(event.text, None))
            else:
                if isinstance(event.result, BaseException):
                    error = _engine_error(event.result)
                    yield json.dumps(error.body())
                    served.metrics.failed(endpoint, error.status)
                else:
                    gen = event.result
                    served.metrics.finished(endpoint, gen, stream.token_times, req.submitted, _queue_s(gen, req))
                    last = chunk(None, event.finish_reason)
                    extras = _extras(gen, req, stream.kept)
                    if recorder is not None and gen.stop_reason != "cancelled":  # the server stopping it
                        try:
                            extras["hcw"]["conversation"] = recorder(event.text, gen)
                        except ApiError as e:  # the answer was streamed: the failure to keep it is said last
                            extras["hcw"]["conversation"] = e.body()
                    last.update({"timings": extras["timings"], "hcw": extras["hcw"]})
                    yield json.dumps(last)
                    if body.include_usage:
                        yield json.dumps({**base, "choices": [], "usage": extras["usage"]})
                yield "[DONE]"
                return
            event = await anext(events)
    finally:
        req.cancel()  # a disconnect cancels this generator: the request leaves the batch at its next step


def _recorder(served: Served, conversation: str, messages: list[dict], prompt_tokens: int):
    """The conversation checked now (a 404 / 409 before generating); -> what records the answer."""
    target = record.find(served.store, conversation, messages)

    def write(text: str, gen: Generation) -> dict:
        return record.write(served.store, target, messages, text, gen.timings.predicted_n,
                            _turn_meta(gen, prompt_tokens), served.name, served.tier.layout,
                            lambda t: len(served.tok.encode(t)))

    return write


def _turn_meta(gen: Generation, prompt_tokens: int) -> dict:
    """What an answer carries in the workbench file, as `hcw chat` writes it."""
    t, lookup = gen.timings, gen.lookup
    return {"stop_reason": gen.stop_reason, "prompt_tokens": prompt_tokens, "ttft_ms": round(t.prompt_ms, 2),
            "tokens_per_s": round(t.as_dict()["predicted_per_second"], 2),
            "outcome": lookup.outcome if lookup else "off", "cached_tokens": t.cache_n,
            "exact": lookup.plan.exact if lookup else True, "via": "hcw serve"}


def _engine_error(e: BaseException) -> ApiError:
    if isinstance(e, PromptError):
        return ApiError(400, str(e), code="context_length_exceeded" if "context limit" in str(e) else None)
    if isinstance(e, Cancelled):  # by the client, which has left, or by the server stopping
        return ApiError(503, f"the request was not answered: {e}", code="unavailable", kind="server_error")
    return ApiError(500, f"the engine failed on this request: {type(e).__name__}: {e}", kind="server_error")


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        _count(request, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
            loc = []  # where in the text, not a parameter
        else:
            message = f"{'.'.join(loc) or 'body'}: {first['msg']}"
        _count(request, 400)
        return JSONResponse(ApiError(400, message, param=".".join(loc) or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        _count(request, 500)
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body(),
                            status_code=500)


def _count(request: Request, status: int) -> None:
    endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(request.url.path)
    if endpoint is not None:
        request.app.state.served.metrics.failed(endpoint, status)


class _BodyLimit:
    """Refuses a request body past `limit` bytes with a 413: by its Content-Length, or, sent without
    one, by reading it in (up to the limit) before the app sees it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await _too_large(send, self.limit)
            return await self.app(scope, receive, send)
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await _too_large(send, self.limit)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replayed():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replayed, send)


async def _too_large(send, limit: int) -> None:
    body = json.dumps(ApiError(413, f"the request body is larger than {limit} bytes").body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
