"""The OpenAI API's request bodies as hcw takes them, the errors it answers with, and the parts
every response carries: OpenAI's `usage`, llama.cpp's `timings` and hcw's own reuse report.

Fields hcw does not act on are accepted and ignored (clients send many), except those whose
meaning it cannot honour (`n` > 1, `logprobs`, tools): those are refused with a 400 rather than
answered as if they had been applied.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.engine import Generation, SamplingParams


GREEDY_BELOW = 1e-4  # a temperature below this (0 included) is greedy decoding


class ApiError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class Sampling(BaseModel):
    """What chat and text completions share: the model, sampling, stopping, streaming."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default is 1; 0 is greedy (argmax)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: generate max_tokens whatever the model says

    def checked(self, default_max: int, context_limit: int) -> SamplingParams:
        if self.n != 1:
            raise ApiError(400, "hcw generates one choice per request (n must be 1)", param="n")
        if self.logprobs not in (None, False):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max
        if not 1 <= max_tokens <= context_limit:
            raise ApiError(400, f"max_tokens must be between 1 and the context limit ({context_limit}), "
                                f"got {max_tokens}", param="max_tokens")
        temperature = 1.0 if self.temperature is None else self.temperature
        if not 0 <= temperature <= 2:
            raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", param="temperature")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ApiError(400, f"seed must be in [0, 2**63), got {self.seed}", param="seed")
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
        # below GREEDY_BELOW the scaled logits leave float32's range: that is argmax anyway
        greedy = temperature < GREEDY_BELOW
        return SamplingParams(max_new_tokens=max_tokens, greedy=greedy, temperature=1.0 if greedy else temperature,
                              top_p=top_p, seed=self.seed, ignore_eos=self.ignore_eos)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop takes up to 4 non-empty strings", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    conversation: str | None = None  # hcw: record the exchange in the workbench file ("new" or an id)

    def checked(self, default_max: int, context_limit: int) -> SamplingParams:
        if self.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().checked(default_max, context_limit)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False

    def prompt_of(self) -> str | list[int]:
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise ApiError(400, "hcw takes one prompt per request", param="prompt")
            return self.prompt[0]
        if not self.prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return self.prompt



def usage(gen: Generation, completion: int | None = None) -> dict:
    """OpenAI's usage; `completion`: the tokens the answer kept (an answer cut at a stop string
    drops those generated after it, before the cut was heard)."""
    t = gen.timings
    n = t.predicted_n if completion is None else completion
    return {"prompt_tokens": t.prompt_n, "completion_tokens": n, "total_tokens": t.prompt_n + n,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


def reuse_report(gen: Generation, queue_ms: float) -> dict:
    """hcw's object: what the cache matched, what it could prove usable, the plan per state kind,
    whether the reuse was exact, and why anything was given up."""
    lookup = gen.lookup
    if lookup is None:
        return {"outcome": "off", "logical_tokens": 0, "usable_tokens": 0, "exact": True, "plan": None,
                "reasons": [], "queue_ms": round(queue_ms, 3)}
    plan = lookup.plan
    return {"outcome": lookup.outcome, "logical_tokens": plan.logical_tokens, "usable_tokens": plan.usable_tokens,
            "exact": plan.exact, "replay_tokens": plan.replay_tokens, "plan": plan.summary(),
            "reasons": list(lookup.reasons), "queue_ms": round(queue_ms, 3)}


def created() -> int:
    return int(time.time())
