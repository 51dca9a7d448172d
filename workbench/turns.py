"""What a chat turn and a session report: `TurnResult` (one answer, its cache lookup and
timings, with llama.cpp's timing fields in `as_dict`), `SessionStats` (the footer's counters) and
`SegmentRow` (one row of the segment state table)."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from engine.engine import Timings
from engine.events import CacheLookup
from store.conversations import Message


@dataclass(frozen=True)
class SegmentRow:
    """One row of the segment state table."""

    index: int
    tokens: tuple[int, int]
    tier: str  # device | host | disk | gone
    presence: dict[str, bool]  # PRESENCE column -> this segment holds that state (for some layer)
    on_disk: bool
    exact: bool
    last_access: int


@dataclass
class TurnResult:
    text: str
    token_ids: list[int]
    stop_reason: str  # length | stop | context | cancelled
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    tokens_per_s: float
    lookup: CacheLookup | None
    message: Message | None  # the assistant message appended to the tree
    saved_segments: int = 0
    replay_budget_tokens: int = 0  # what the policy allowed this resume to replay (approximate only)
    conversation: str | None = None
    branch: str | None = None
    model: str | None = None  # the model's name (its folder's, or the built-in's)
    timings: Timings | None = None  # llama.cpp's names: prompt_n, prompt_ms, predicted_n, predicted_ms, cache_n

    @property
    def cancelled(self) -> bool:
        return self.stop_reason == "cancelled"

    @property
    def exact(self) -> bool:
        return self.lookup is None or self.lookup.plan.exact

    @property
    def replay_tokens(self) -> int:
        return self.lookup.plan.replay_tokens if self.lookup else 0

    def as_dict(self) -> dict:
        return {"text": self.text, "stop_reason": self.stop_reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "ttft_ms": self.ttft_ms, "tokens_per_s": self.tokens_per_s,
                "outcome": self.lookup.outcome if self.lookup else "off",
                "plan": self.lookup.plan.summary() if self.lookup else None,
                "reasons": list(self.lookup.reasons) if self.lookup else [],
                "exact": self.exact, "replay_tokens": self.replay_tokens,
                "replay_budget_tokens": self.replay_budget_tokens,
                "message": self.message.id if self.message else None, "saved_segments": self.saved_segments,
                "conversation": self.conversation, "branch": self.branch, "model": self.model,
                **self._llama_timings()}

    def _llama_timings(self) -> dict:
        """llama.cpp server's timing names (as `hcw generate --json` prints them), beside hcw's own."""
        t = self.timings or Timings(prompt_n=self.prompt_tokens, prompt_ms=self.ttft_ms)
        d = t.as_dict()
        return {"prompt_n": d["prompt_n"], "prompt_ms": d["prompt_ms"], "predicted_n": d["predicted_n"],
                "predicted_ms": d["predicted_ms"], "predicted_per_second": d["predicted_per_second"],
                "cache_n": self.cached_tokens}


@dataclass
class SessionStats:
    turns: int = 0  # answered turns (a cancelled one is counted apart)
    hits: int = 0
    degraded: int = 0
    misses: int = 0
    cancelled: int = 0
    last_ttft_ms: float = 0.0
    decoded_tokens: int = 0  # over the session, cancelled turns too
    decode_ms: float = 0.0

    @property
    def last_tokens_per_s(self) -> float:
        """Decode speed over the session's decoded tokens (one 2-token answer says little)."""
        return 1000 * self.decoded_tokens / self.decode_ms if self.decode_ms else 0.0

    def as_dict(self) -> dict:
        looked = self.hits + self.degraded + self.misses
        return {"turns": self.turns, "hits": self.hits, "degraded": self.degraded, "misses": self.misses,
                "cancelled": self.cancelled, "decoded_tokens": self.decoded_tokens,
                "hit_rate": (self.hits + self.degraded) / looked if looked else 0.0,
                "degraded_rate": self.degraded / looked if looked else 0.0,
                "ttft_ms": self.last_ttft_ms, "tokens_per_s": self.last_tokens_per_s,
                "rss_mb": psutil.Process().memory_info().rss / 2**20,
                "device_mb": torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0}
