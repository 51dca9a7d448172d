"""Engine: chunked prefill, decode and generation over one model.

Contract: the engine knows token ids only, never text. Each request owns a `ModelState` (every
layer's state object); the model's modules hold weights only. Streaming is a callback invoked with
each new token id as soon as it is sampled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from engine import heap
from engine.batch_decode import decode_batch
from engine.cache.kv import kv_layout
from engine.cache.prefix_cache import PrefixCache
from engine.cache.states import ModelState
from engine.cache.validation import ReusePlan
from engine.cache.writer import RequestWriter
from engine.engine_config import EngineConfig
from engine.events import CacheLookup
from engine.model.hybrid import HybridModel
from engine.static_decode import StaticDecoder, StaticUnsupported
from engine.threads import intra_op_threads
from kernels import dispatch


class PromptError(ValueError):
    """A prompt the engine refuses: empty, out-of-vocabulary ids, or past the context limit."""


class Cancelled(Exception):
    """A prefill stopped between two chunks because its `should_stop` said so."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate max_new_tokens: no stop ids, not even the model's (benchmarks)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if not self.greedy and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError("temperature must be > 0 and finite (use greedy for argmax decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass
class Timings:
    """Named like llama.cpp's server timings so the two can be compared field by field."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prompt_per_second"] = 1000 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0
        d["predicted_per_second"] = 1000 * self.predicted_n / self.predicted_ms if self.predicted_ms else 0.0
        return d


@dataclass
class Generation:
    token_ids: list[int]
    stop_reason: str  # "length" | "stop" | "context" | "cancelled"
    timings: Timings = field(default_factory=Timings)
    state: ModelState | None = field(default=None, repr=False)  # describes prompt + token_ids[:-1]
    plan: ReusePlan | None = None  # the cache's plan for the prompt, when a cache is in use
    prompt_logits: torch.Tensor | None = field(default=None, repr=False)  # after the prompt's last token
    lookup: CacheLookup | None = None  # the cache's event for the prompt (plan, outcome, reasons)


# the most tokens a prefill pass takes by default, and a GPU's chunk
PREFILL_CHUNK = 2048
# on the CPU the default chunk keeps one float32 copy of its widest projection's output within
# this: the pass holds a few such copies at once (a Qwen3.5-0.8B-shaped model's GDN layer ~4 at
# 512 tokens), on top of the weights. 16 MiB makes that model's chunk 256 tokens, prefilled as
# fast as in 2,048-token chunks, with ~300 MiB less peak (docs/BENCHMARKS.md, "Real size")
CPU_CHUNK_BYTES = 16 << 20
# a CPU chunk of at least this many tokens gives its freed heap back afterwards (engine/heap.py):
# a shorter one's working set is too small to matter, and a decode-sized pass should not pay it
TRIM_MIN_TOKENS = 64


def default_prefill_chunk(model: HybridModel) -> int:
    """Tokens a prefill pass takes when nobody asked: PREFILL_CHUNK on a GPU; on the CPU the largest
    power of two up to it (and at least 64) whose float32 output of the widest projection in the
    layers fits CPU_CHUNK_BYTES. Remembered on the model for its device."""
    device = model.device
    held = getattr(model, "_default_prefill_chunk", None)
    if held is not None and held[0] == device:
        return held[1]
    chunk = PREFILL_CHUNK
    if device.type == "cpu":
        # a projection's output width is one of its weight's last two sizes (an fp32 CPU weight is
        # held [in, out]; stacked experts lead with their count); weights are float or int8 (an
        # integer table, e.g. DeepSeek-V4's hash router's [vocab, top-k], is no projection)
        width = max((max(t.shape[-2:]) for t in [*model.layers.parameters(), *model.layers.buffers()]
                     if t.dim() >= 2 and (t.is_floating_point() or t.dtype is torch.int8)), default=1)
        while chunk > 64 and chunk * width * 4 > CPU_CHUNK_BYTES:
            chunk //= 2
    model._default_prefill_chunk = (device, chunk)
    return chunk


class Engine:
    def __init__(self, model: HybridModel, config: EngineConfig | None = None, cache: PrefixCache | None = None):
        self.model = model
        deterministic = cache is not None and cache.config.deterministic
        self.config = config or EngineConfig(dtype=model.dtype, device=str(model.device), deterministic=deterministic)
        if cache is not None and self.config.cache is not None and cache.config != self.config.cache:
            raise ValueError("the cache was not built from this EngineConfig's cache settings (EngineConfig.cache)")
        if cache is not None and cache.config.deterministic != self.config.deterministic:
            # its states were made (and are fingerprinted) under one arithmetic; reuse under the other is not bit-exact
            raise ValueError("the engine and its cache must agree on deterministic (bit-exact) arithmetic")
        self.cache = cache
        # the kernel choice is the process's and the KV layout the model's: an engine that names one sets it
        dispatch.select(self.config.kernels, self.config.native)
        if self.config.kv_layout is not None:
            if cache is not None and cache.kv_layout not in (None, kv_layout(self.config.kv_layout, model.device)):
                raise ValueError(f"the cache assembles {cache.kv_layout} KV states and the engine asks for "
                                 f"{self.config.kv_layout}: set the layout on the model before making its cache "
                                 "(EngineConfig.bind)")
            model.use_kv_layout(self.config.kv_layout)
        # a captured decode's fused buffers are not the arithmetic the deterministic prefill's
        # single-token steps take, so bit-exact mode decodes as usual
        self.static = self.config.static and not self.config.deterministic

    def metrics(self) -> dict:
        return self.cache.metrics.as_dict() if self.cache is not None else {}

    @property
    def context_limit(self) -> int:
        return self.model.config.max_position_embeddings

    def new_state(self) -> ModelState:
        """A fresh state, made as its cache makes them (its page size) when it has one."""
        return self.cache.new_state() if self.cache is not None else self.model.new_state(batch=1)

    def check_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise PromptError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= int(i) < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of range for vocabulary size {vocab}")
        if len(ids) > self.context_limit:
            raise PromptError(f"the prompt has {len(ids)} tokens, past the context limit of {self.context_limit}")

    def prefill(self, ids: Sequence[int], state: ModelState, chunk_size: int | None = None,
                on_stops: Callable[[ModelState, list[int]], None] | None = None,
                stops: Callable[[int, int], list[int]] | None = None,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run `ids` through the model in chunks, advancing `state`; return the last token's logits.
        With `stops` (the positions in (lo, hi] a chunk crosses where the caller wants the state),
        `on_stops(state, positions)` is called after the chunk with those it crossed: a state that keeps
        snapshots inside a forward pass (ModelState.snapshots_inside) keeps them there, so the
        chunks are the ones a prefill without stops runs; any other ends a chunk at each stop.
        `should_stop` is asked before every chunk after the first: True raises Cancelled (the
        state then covers the chunks run so far)."""
        logits = None
        for logits in self.prefill_steps(ids, state, chunk_size, on_stops, stops, should_stop):
            pass
        return logits

    @torch.inference_mode()
    def prefill_steps(self, ids: Sequence[int], state: ModelState, chunk_size: int | None = None,
                      on_stops: Callable[[ModelState, list[int]], None] | None = None,
                      stops: Callable[[int, int], list[int]] | None = None,
                      should_stop: Callable[[], bool] | None = None) -> Iterator[torch.Tensor]:
        """`prefill` a chunk at a time: yields the logits after each chunk's last token [vocab] (the
        last yielded: the prompt's), so that a caller can run other work between chunks."""
        if len(ids) == 0:
            raise PromptError("nothing to prefill")
        if state.seq_len + len(ids) > self.context_limit:
            raise PromptError(f"{state.seq_len + len(ids)} tokens would pass the context limit of {self.context_limit}")
        chunk = self._chunk(chunk_size)
        tokens = torch.as_tensor(list(ids), dtype=torch.long, device=self.model.device)
        logits = None
        lo = 0
        while lo < len(tokens):
            if lo and should_stop is not None and should_stop():
                raise Cancelled
            hi = min(lo + chunk, len(tokens))
            at = stops(state.seq_len, state.seq_len + hi - lo) if stops is not None else []
            if at and not state.snapshots_inside:  # end the chunk at the first stop instead
                at = at[:1]
                hi = lo + at[0] - state.seq_len
            end = state.seq_len + hi - lo
            if at:
                state.mark([p for p in at if p < end])
            logits = self.model(tokens[lo:hi], state, last_only=True)
            if at:
                on_stops(state, at)
                state.mark()  # the kept snapshots are in the cache now
            if hi - lo >= TRIM_MIN_TOKENS and tokens.device.type == "cpu":
                heap.trim()  # the chunk's freed working set back to the system (engine/heap.py)
            lo = hi
            yield logits[0, -1]

    @torch.inference_mode()
    def replay(self, ids: Sequence[int], state: ModelState, start: int, restarts: dict[int, int] | None = None,
               chunk_size: int | None = None) -> None:
        """Tail-Replay: run positions start.. (which `state` already covers for every other layer)
        through the model so that its GDN layers rebuild their states; layer i's recurrent state
        restarts at restarts[i] (default: at `start`) from zero, or from its `seed` (an
        unsketched int8 sketch of the state there) when it has one; the tokens before that
        rebuild its conv state."""
        chunk = self._chunk(chunk_size)
        tokens = torch.as_tensor(list(ids), dtype=torch.long, device=self.model.device)
        restarts = restarts or {}
        end = start + len(tokens)
        cuts = sorted({start, end, *(p for p in restarts.values() if start < p <= end)})
        for lo, hi in zip(cuts, cuts[1:] + [end]):
            for i, p in restarts.items():
                if p == lo:
                    layer = state.layers[i]
                    layer.recurrent = torch.zeros_like(layer.recurrent) if layer.seed is None else layer.seed
                    layer.seed = None
            for a in range(lo, hi, chunk):
                b = min(a + chunk, hi)
                self.model(tokens[a - start:b - start], state, replay_from=a, rebuild_only=True)

    def _chunk(self, asked: int | None) -> int:
        """Tokens a forward pass takes: one in deterministic mode, else what was asked, else the
        config's, else the model's default on its device (at most the config's prefill_chunk_most)."""
        if self.config.deterministic:
            return 1
        chosen = asked or self.config.prefill_chunk_size
        if chosen:
            return chosen
        return min(default_prefill_chunk(self.model), self.config.prefill_chunk_most or PREFILL_CHUNK)

    @torch.inference_mode()
    def decode(self, token: int, state: ModelState) -> torch.Tensor:
        decoder = self._static_decoder(state) if self.static else None
        if decoder is not None:
            return decoder.step(token)[0]
        tokens = torch.tensor([[token]], dtype=torch.long, device=self.model.device)
        return self.model(tokens, state)[0, -1]

    def decode_batch(self, tokens: Sequence[int], states: Sequence[ModelState]) -> torch.Tensor:
        """One token for each of N independent sequences in one step (engine/batch_decode.py):
        logits [N, vocab]; row i equals `decode(tokens[i], states[i])` up to float rounding. Always
        the eager path, for one sequence too (the static decoder steps one sequence alone)."""
        return decode_batch(self.model, tokens, states)

    def _static_decoder(self, state: ModelState) -> StaticDecoder | None:
        """The state's static decoder (engine/static_decode.py), made or re-made when it cannot take
        the next step; None for a model it does not cover (decoded as usual, and not asked again)."""
        decoder = state.extra.get("static")
        if decoder is False:
            return None
        if decoder is None or not decoder.fits(state):
            try:
                topology = self.cache.topology if self.cache is not None else b""
                decoder = StaticDecoder(self.model, state, topology=topology)
            except StaticUnsupported:
                decoder = False
            state.extra["static"] = decoder
        return decoder or None

    def start(self, prompt_ids: Sequence[int], state: ModelState | None = None,
              should_stop: Callable[[], bool] | None = None) -> Started:
        """Check the prompt, reuse what the cache can prove usable, prefill the rest; Cancelled
        (from `should_stop`, asked between chunks) leaves the boundaries captured so far cached."""
        steps = self.start_steps(prompt_ids, state, should_stop)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def start_steps(self, prompt_ids: Sequence[int], state: ModelState | None = None,
                    should_stop: Callable[[], bool] | None = None) -> Generator[None, None, Started]:
        """`start` a prefill chunk at a time: a generator that yields between chunks (a server
        decodes its running requests there) and returns the Started. The cache's lookup, its
        validation and the state's assembly happen at the first step, all at once: what the
        plan reuses is in the state before anything else runs. Closing it early releases what
        it holds, as an error does."""
        self.check_prompt(prompt_ids)
        fed = list(prompt_ids)
        writer, plan = None, None
        lookup = None
        if state is None and self.cache is not None:
            plan, state, ticket = self.cache.lookup(fed)
            lookup = self.cache.last_lookup  # the event this lookup recorded (same thread, just now)
            writer = self.cache.writer(plan, ticket)
        state = state or self.new_state()
        started = Started(None, state, fed, writer, plan, lookup)
        if writer is None:
            for started.logits in self.prefill_steps(fed[state.seq_len:], state, should_stop=should_stop):
                yield
            return started
        try:
            try:
                yield from self._recover_and_prefill(started, should_stop)
            except Cancelled:
                raise Cancelled(lookup) from None  # the event travels with it
            if plan.usable_tokens and plan.exact and self.cache.should_shadow():  # approximate plans differ by design
                cold = Engine(self.model, self.config).start(fed)
                if not self.cache.metrics.record_shadow((started.logits - cold.logits).abs().max().item()):
                    # the hit disagreed with a cold prefill: answer from the cold state, forget the records
                    self.cache.forget(plan)
                    started.logits, started.state = cold.logits, cold.state
        except BaseException:  # GeneratorExit too: a caller that closes it early
            writer.finish()  # the admission ticket back; what was captured stays cached
            raise
        return started

    def _recover_and_prefill(self, started: Started, should_stop: Callable[[], bool] | None) -> Iterator[None]:
        fed, state, writer, plan = started.fed, started.state, started.writer, started.plan
        stops = writer.stops
        if plan.replay_from is not None:
            t0 = time.perf_counter()
            self.replay(fed[plan.replay_from:plan.usable_tokens], state, plan.replay_from, dict(plan.replay_starts))
            self.cache.metrics.record_recovery(plan, 1000 * (time.perf_counter() - t0))
            if plan.exact:
                writer.capture_replayed(state)
        recover_to = plan.matched_tokens if any(o.action.value == "recover" for o in plan.objects) else 0
        if state.seq_len < recover_to:
            # the recovery work, timed on its own (its chunks only, not what runs between them)
            spent = 0.0
            chunks = self.prefill_steps(fed[state.seq_len:recover_to], state, on_stops=started.capture_stops,
                                        stops=stops, should_stop=should_stop)
            while True:
                t0 = time.perf_counter()
                try:
                    next(chunks)
                except StopIteration:
                    break
                spent += time.perf_counter() - t0
                yield
            self.cache.metrics.record_recovery(plan, 1000 * spent)
        for started.logits in self.prefill_steps(fed[state.seq_len:], state, on_stops=started.capture_stops,
                                                 stops=stops, should_stop=should_stop):
            yield

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_token: Callable[[int], None] | None = None, state: ModelState | None = None,
                 decode_threads: int | None = None, should_stop: Callable[[], bool] | None = None) -> Generation:
        """Prefill (through the cache) and sample up to params.max_new_tokens; `decode_threads`
        caps torch's intra-op threads for the decode steps (the prefill keeps them all).
        `should_stop`, asked between prefill chunks and after every token, ends the generation
        early with stop_reason "cancelled" (a prefill cancelled midway: no tokens, no state)."""
        stops = set() if params.ignore_eos else set(params.stop_ids) | set(self.model.config.eos_token_ids)
        sampler = Sampler(params, self.model.device)
        timings = Timings(prompt_n=len(prompt_ids))

        t0 = time.perf_counter()
        try:
            run = self.start(prompt_ids, state, should_stop=should_stop)
        except Cancelled as stopped:
            timings.prompt_ms = 1000 * (time.perf_counter() - t0)
            lookup = stopped.args[0] if stopped.args else None
            return Generation([], "cancelled", timings, None, lookup.plan if lookup else None, lookup=lookup)
        state, logits = run.state, run.logits
        prompt_logits = logits
        timings.cache_n = run.plan.usable_tokens if run.plan is not None else 0
        timings.prompt_ms = 1000 * (time.perf_counter() - t0)

        out: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        try:
            with intra_op_threads(decode_threads):
                while len(out) < params.max_new_tokens:
                    token = sampler(logits)
                    out.append(token)
                    if on_token is not None:
                        on_token(token)
                    if token in stops:
                        reason = "stop"
                        break
                    if should_stop is not None and should_stop():
                        reason = "cancelled"
                        break
                    if len(out) == params.max_new_tokens:
                        break
                    if state.seq_len >= self.context_limit:
                        reason = "context"
                        break
                    logits = self.decode(token, state)
                    run.fed.append(token)
                    if run.writer is not None and state.seq_len % self.cache.block_size == 0:
                        run.capture(state)
        finally:
            run.finish()  # the admission ticket is released and the turn saved even if decoding failed
        timings.predicted_ms = 1000 * (time.perf_counter() - t0)
        timings.predicted_n = len(out)
        return Generation(out, reason, timings, state, run.plan, prompt_logits, lookup=run.lookup)


@dataclass
class Started:
    """A prompt that has been through the cache and prefill: its last logits, its state, and the
    recorder that stores its segments as generation crosses their boundaries."""

    logits: torch.Tensor | None
    state: ModelState
    fed: list[int]  # every token that has gone through the model, in order
    writer: RequestWriter | None
    plan: ReusePlan | None
    lookup: CacheLookup | None = None

    def capture(self, state: ModelState, at: int | None = None) -> None:
        if self.writer is not None:
            self.writer.capture(state, self.fed, at)

    def capture_stops(self, state: ModelState, stops: list[int]) -> None:
        if self.writer is not None:
            self.writer.capture_stops(state, self.fed, stops)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.finish()


class Sampler:
    """Greedy, or temperature + nucleus (top-p) sampling from a seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.gen = None
        if not params.greedy:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.params.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            return int(order[torch.multinomial(sorted_p, 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))
