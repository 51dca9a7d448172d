"""What `hcw serve` serves: one model, its tokenizer, its prefix cache over the workbench file's disk
tier, one engine and the scheduler that batches every request onto it, and the server's limits."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.scheduler import Scheduler
from engine.threads import release_idle_team
from store.conversations import Conversations
from store.db import open_db
from workbench.options import ChatOptions
from workbench.serve.events import EventHub
from workbench.serve.metrics import ServerMetrics
from workbench.serve.stream import LoopPoster
from workbench.session import open_engine

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeOptions:
    chat: ChatOptions  # the model, the workbench file, the cache's and the engine's settings
    max_batch: int = 8
    max_queue: int = 64
    max_tokens: int = 512  # a request's max_tokens when it names none
    api_key: str | None = None
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")


class Served:
    def __init__(self, opts: ServeOptions):
        chat = opts.chat
        self.opts = opts
        self.name = Path(str(chat.model)).name
        self.model, self.tok, self.tier, self.cache, self.engine = open_engine(chat, "hcw serve")
        if self.cache is not None:
            # a request's end hands its segments to the write-behind tier and the batch goes on
            # (waiting for the disk there stalled every other stream); close() flushes
            self.cache.wait_for_disk = False
        self.eos = tuple(self.tok.eos_ids)
        self.scheduler = Scheduler(self.engine, opts.max_batch, opts.max_queue)
        self.metrics = ServerMetrics(self.scheduler)
        self.events = EventHub(self)
        self.scheduler.on_step = lambda s: self.metrics.batch_size.observe(s.batch_size)
        self.loaded_at = int(time.time())
        self._store: Conversations | None = None
        self._poster: LoopPoster | None = None
        self._switch_interval: float | None = None  # the process's, while serving

    def poster(self) -> LoopPoster:
        """The one LoopPoster of the running loop (made on first use, on the loop)."""
        loop = asyncio.get_running_loop()
        if self._poster is None or self._poster.loop is not loop:
            self._poster = LoopPoster(loop)
        return self._poster

    @property
    def store(self) -> Conversations:
        """The workbench file's conversations, on a connection of the event loop's own (made there)."""
        if self._store is None:
            self._store = Conversations(open_db(self.tier.path))
        return self._store

    @property
    def api_key(self) -> str | None:
        return self.opts.api_key

    @property
    def max_body_bytes(self) -> int:
        return self.opts.max_body_bytes

    @property
    def default_max_tokens(self) -> int:
        return self.opts.max_tokens

    def start(self) -> Served:
        """Start the engine's thread. Call it on the thread that loaded the model, which computes no
        more: its idle OpenMP team is released first (engine/threads.py: two teams on few cores make
        every op's hand-off go through the kernel, ~10x slower decoding measured on 2 busy cores)."""
        release_idle_team()
        # the engine's thread gives up the GIL at every torch op and waits for it back: the loop
        # (HTTP, one SSE chunk per token) may hold it up to the switch interval, 5 ms by default,
        # longer than a decode step; 0.5 ms measured +12% aggregate tokens/s at 8 streams
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.scheduler.start()
        return self

    def close(self) -> None:
        """Stop the scheduler (what runs is cancelled, its segments saved), then close the workbench file."""
        self.scheduler.stop()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        if self._store is not None:
            self._store.db.conn.close()
        self.tier.close()
