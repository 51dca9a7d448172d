"""What a chat runs with: `ChatOptions` (the cache's and the engine's configs, sampling, the
workbench file), built once from the CLI's flags or a scripted session's config step
(`ChatOptions.of`), and what `/set` may change in a running session (SETTABLE)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from engine.cache.config import CacheConfig, Reuse
from engine.engine_config import EngineConfig

REUSE_POLICIES = tuple(Reuse)
# a cancel (Esc) is heard between two chunks of a prefill, so a chat's chunks are at most this
# long (the engine's default may be shorter: on the CPU it shrinks with the model's width). At
# this length a long prompt costs nothing measurable against 2,048, and a cancel waits half as
# long (hcw-tiny at 2K context: 135 against 318 ms a chunk; docs/BENCHMARKS.md)
CHAT_PREFILL_CHUNK = 1024


def parse_budget(text: str) -> float | None:
    """'5%' or '0.05' -> a fraction of the matched prefix; '512' -> tokens; 'adaptive' -> None
    (no cap: the tolerance decides)."""
    t = text.strip()
    if t.lower() == "adaptive":
        return None
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"--replay-budget: {text!r} is not a fraction (0.05, 5%) or a token count (512)") from None
    if value <= 0 or (t.endswith("%") and value >= 1):
        raise ValueError(f"--replay-budget: {text!r} must be above 0 (and a percentage below 100%)")
    return value


# the cache's settings a chat exposes by name (the CLI's flags, a scripted session's config step)
CACHE_OPTIONS = ("block_size", "checkpoint_every", "checkpoint_tail", "sketch_every", "reuse", "replay_budget",
                 "replay_tolerance")


def _chat_engine() -> EngineConfig:
    return EngineConfig(prefill_chunk_most=CHAT_PREFILL_CHUNK, cache=CacheConfig())


@dataclass(frozen=True)
class ChatOptions:
    model: str | Path = "hcw-tiny"
    db: Path | None = None
    session: str | None = None  # a conversation id (or unique prefix) to resume
    # dtype and device come from the loaded model; its prefill chunks the engine's default, at most
    # CHAT_PREFILL_CHUNK; `engine.cache`
    # is what the session builds its PrefixCache with
    engine: EngineConfig = dataclasses.field(default_factory=_chat_engine)
    max_new_tokens: int = 256
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)
    greedy: bool = True
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int | None = 0
    system: str | None = "You are a helpful assistant. Remember what the user tells you."
    decode_threads: int | None = None  # torch intra-op threads while decoding (None: all); the TUI leaves the UI a core
    continue_last: bool = False  # resume the most recently updated conversation (`hcw chat -c`)

    @classmethod
    def of(cls, *, deterministic: bool | None = None, device_budget_mb: int | None = None,
           prefill_chunk_size: int | None = None, **flat) -> ChatOptions:
        """Options from flat names, as the CLI's flags and a scripted session's config step give
        them: CACHE_OPTIONS go to `cache`, `prefill_chunk_size` to `engine`, `deterministic` to
        both (they must agree; default: the given engine's), the rest to ChatOptions itself."""
        reuse = flat.get("reuse", Reuse.EXACT)
        if reuse not in REUSE_POLICIES:
            raise ValueError(f"--reuse must be one of {', '.join(REUSE_POLICIES)}, got {reuse!r}")
        if flat.get("sketch_every", 0) < 0:
            raise ValueError("--gdn-sketches must be >= 0 (0: none)")
        given = {name: flat.pop(name) for name in CACHE_OPTIONS if name in flat}
        if device_budget_mb is not None:
            given["budget_bytes"] = device_budget_mb << 20
        engine = flat.pop("engine", None) or _chat_engine()
        deterministic = engine.deterministic if deterministic is None else deterministic
        chunk = engine.prefill_chunk_size if prefill_chunk_size is None else prefill_chunk_size
        cache = dataclasses.replace(engine.cache or CacheConfig(), **given, deterministic=deterministic)
        engine = dataclasses.replace(engine, deterministic=deterministic, prefill_chunk_size=chunk, cache=cache)
        return cls(engine=engine, **flat)

    @property
    def cache(self) -> CacheConfig:
        """The prefix cache's settings (held by the EngineConfig)."""
        return self.engine.cache

    @property
    def reuse(self) -> Reuse:
        return Reuse(self.cache.reuse)

    def __post_init__(self) -> None:
        if self.engine.cache is None:
            raise ValueError("a chat's EngineConfig needs its cache settings (EngineConfig.cache)")
        if self.cache.sketch_every and self.reuse != Reuse.APPROXIMATE:
            raise ValueError("--gdn-sketches needs --reuse approximate: only an approximate replay reads a sketch")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError("decode_threads must be >= 1")
        if not self.greedy and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0 (and finite), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.continue_last and self.session:
            raise ValueError("give --session or --continue, not both")


# what `/set NAME VALUE` may change in a session (ChatSession.set_option), and how
SETTABLE = {
    "temperature": "sampling temperature, > 0 (turns sampling on)",
    "top_p": "nucleus sampling's probability mass, in (0, 1] (turns sampling on)",
    "seed": "the sampler's seed: an integer, or none",
    "max_new_tokens": "tokens an answer may take, >= 1",
    "sample": "on: temperature / top-p sampling; off: greedy",
}


