"""ChatSession: one conversation on one model, the glue the TUI, the plain REPL and `hcw replay`
share. Text -> chat template over the thread's path -> Engine (PrefixCache + DiskTier) -> the
answer appended to the message tree; the cache's segments are saved to disk at the end of every
turn, so a killed process loses nothing already answered.

The workbench file holds both the conversation tree (store.conversations) and the cached
segments (store.tier): `--db` picks it, default under $HCW_HOME.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from engine import EngineConfig, load_model
from engine.model.loader import resolve_model
from engine.cache.faults import DRILLS
from engine.cache.config import CacheConfig, Reuse
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.engine import Engine, Generation, SamplingParams, Timings
from engine.events import CacheLookup
from engine.tokenizer import StreamDecoder, load_tokenizer
from store.conversations import Conversations, Message, Thread
from store.write_behind import WriteBehind

REUSE_POLICIES = tuple(Reuse)
DRAFT_INTERVAL_S = 0.5  # a streaming answer is on disk at most this far behind (marked incomplete)
# the presence columns of the segment state table: column -> the state kinds it stands for
PRESENCE = {"kv": ("kv",), "compressed": ("compressed",), "tail": ("tail", "overlap"), "window": ("window",),
            "indexer": ("index_keys", "index_tail", "index_overlap"), "gdn": ("recurrent", "conv")}


def _disk_read_error(session: "ChatSession", records) -> int:
    """The next disk read fails with an I/O error (once); memory is emptied so the turn must read."""
    session.save()
    _forget_memory(session)

    def fail_once(key: str) -> None:
        session.tier.read_hook = None
        raise OSError(5, "injected read error (EIO)")
    session.tier.read_hook = fail_once
    return 1


def _disk_corrupt_blob(session: "ChatSession", records) -> int:
    """One stored blob of the middle segment gets a flipped byte; memory is emptied."""
    session.save()
    _forget_memory(session)
    key = records[len(records) // 2].key.hex()
    row = session.tier.db.execute("SELECT id, data FROM blobs WHERE segment = ? ORDER BY id LIMIT 1", [key]).fetchone()
    if row is None:
        return 0
    data = bytearray(row[1])
    data[len(data) // 2] ^= 0x40
    with session.tier.db.conn:
        session.tier.db.execute("UPDATE blobs SET data = ? WHERE id = ?", [bytes(data), row[0]])
    return 1


def _forget_memory(session: "ChatSession") -> None:
    session.cache.forget_memory()


# every drill that works on a live cache, plus the disk faults of the workbench's own tier
def _on_cache(drill: Callable) -> Callable:
    return lambda session, records: drill(session.cache, records)


FAULTS: dict[str, Callable] = {name: _on_cache(drill) for name, drill in DRILLS.items()
                               if name not in ("fail_lower_read", "delay_lower_read")}  # those need MemoryTier
FAULTS["disk_read_error"] = _disk_read_error
FAULTS["disk_corrupt_blob"] = _disk_corrupt_blob


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


def fault_names() -> list[str]:
    return [name.replace("_", "-") for name in FAULTS]


class Cancelled(Exception):
    """Raised from the token callback to stop a generation (Esc in the TUI)."""


@dataclass(frozen=True)
class ChatOptions:
    model: str | Path = "hcw-tiny"
    db: Path | None = None
    session: str | None = None  # a conversation id (or unique prefix) to resume
    reuse: str = "exact"
    replay_budget: float | None = 0.05  # approximate: a fraction (< 1) of the matched prefix, or tokens; None: no cap
    replay_tolerance: float | None = None  # approximate, adaptive: the certified error bound each GDN layer keeps under
    max_new_tokens: int = 256
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)
    greedy: bool = True
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int | None = 0
    block_size: int = 64
    checkpoint_every: int = 4
    sketch_every: int = 0  # approximate: every K segments an int8 sketch of each GDN state a replay may restart from
    checkpoint_tail: int = 3  # of a long prompt (CacheConfig.checkpoint_tail_min), the last K boundaries keep GDN snapshots
    device_budget_mb: int = 1024
    system: str | None = "You are a helpful assistant. Remember what the user tells you."
    decode_threads: int | None = None  # torch intra-op threads while decoding (None: all); the TUI leaves the UI a core
    deterministic: bool = False  # bit-exact: prefill one token a step; the file keeps such states apart
    continue_last: bool = False  # resume the most recently updated conversation (`hcw chat -c`)
    # a cancel (Esc) is heard between two chunks of a prefill: 1024 tokens cost a 4K-token prompt nothing
    # measurable on the built-in models against 2048 (512: 5-8% more)
    prefill_chunk_size: int = 1024

    def __post_init__(self) -> None:
        if self.reuse not in REUSE_POLICIES:
            raise ValueError(f"--reuse must be one of {', '.join(REUSE_POLICIES)}, got {self.reuse!r}")
        if self.reuse == Reuse.APPROXIMATE:
            CacheConfig(reuse="approximate", replay_budget=self.replay_budget, replay_tolerance=self.replay_tolerance)
        if self.sketch_every < 0:
            raise ValueError("--gdn-sketches must be >= 0 (0: none)")
        if self.sketch_every and self.reuse != Reuse.APPROXIMATE:
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
        if self.prefill_chunk_size < 1:
            raise ValueError("prefill_chunk_size must be >= 1")


# what `/set NAME VALUE` may change in a session (ChatSession.set_option), and how
SETTABLE = {
    "temperature": "sampling temperature, > 0 (turns sampling on)",
    "top_p": "nucleus sampling's probability mass, in (0, 1] (turns sampling on)",
    "seed": "the sampler's seed: an integer, or none",
    "max_new_tokens": "tokens an answer may take, >= 1",
    "sample": "on: temperature / top-p sampling; off: greedy",
}


class _Draft:
    """The answer of a turn in progress, kept in the tree while it streams: every DRAFT_INTERVAL_S
    the thread's tip becomes an assistant message holding the text so far, marked incomplete, in
    place of the previous one; the turn's end replaces it with the answer. A process killed in the
    middle leaves the partial answer, labelled, not nothing."""

    def __init__(self, session: ChatSession):
        self.session = session
        self.id: str | None = None
        self.last = time.monotonic()
        self.failures = 0

    def tick(self, token_ids: list[int]) -> None:
        now = time.monotonic()
        if now - self.last < DRAFT_INTERVAL_S:
            return
        self.last = now
        s = self.session
        text = s.tok.decode([t for t in token_ids if t not in s.tok.eos_ids])
        try:
            self.id = s.store.append(s.thread.id, "assistant", text, tokens=len(token_ids),
                                     meta={"incomplete": True}, replaces=self.id).id
        except sqlite3.Error as e:  # a copy for a crash (the file busy or full): the answer streams on
            self.failures += 1
            if self.failures == 1:  # stderr: never into a piped answer on stdout
                print(f"warning: the streaming answer could not be saved ({type(e).__name__}: {e}); "
                      "it is saved when the turn ends", file=sys.stderr, flush=True)

    def discard(self) -> None:
        """Best effort, on a failure path: the error being raised is the one the user must see."""
        if self.id is not None:
            try:
                self.session.store.discard_draft(self.session.thread.id, self.id)
            except (sqlite3.Error, ValueError, KeyError):
                pass  # left as an incomplete message on no path; `hcw inspect` shows it
            self.id = None


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


class ChatSession:
    def __init__(self, opts: ChatOptions, model=None):
        self.opts = opts
        self.model = model if model is not None else load_model(opts.model)
        self.tok = load_tokenizer(resolve_model(opts.model), self.model.config.extra)
        if self.tok is None:
            raise ValueError(f"{opts.model} has no tokenizer; hcw chat needs one")
        cfg = CacheConfig(block_size=opts.block_size, checkpoint_every=opts.checkpoint_every,
                          checkpoint_tail=opts.checkpoint_tail, sketch_every=opts.sketch_every,
                          budget_bytes=opts.device_budget_mb << 20, reuse=opts.reuse,
                          replay_budget=opts.replay_budget, replay_tolerance=opts.replay_tolerance,
                          deterministic=opts.deterministic)
        self.tier = WriteBehind(opts.db, layout_fingerprint(self.model, cfg))  # spills never block decoding
        self.conversation = None
        self._created: str | None = None  # the conversation this session began (forgotten at close if empty)
        try:
            self.cache = PrefixCache(self.model, cfg, lower=self.tier) if opts.reuse != Reuse.OFF else None
            self.engine = Engine(self.model, EngineConfig(dtype=self.model.dtype, device=str(self.model.device),
                                                          prefill_chunk_size=opts.prefill_chunk_size,
                                                          deterministic=opts.deterministic), cache=self.cache)
            self.store = Conversations(self.tier.db)
            self.stats = SessionStats()
            if opts.session:
                self.resume(opts.session)
            elif opts.continue_last:
                latest = self.store.recent(1)
                if not latest:
                    raise ValueError("there is no stored conversation to continue")
                self.resume(latest[0]["id"])
            else:
                self.conversation, self.thread = self.store.create(model=self.tier.layout, system=opts.system,
                                                                     model_name=self.model_name)
                self._created = self.conversation.id
        except BaseException:
            with contextlib.suppress(sqlite3.Error, OSError):  # the error being raised is the one to see
                self.tier.close()  # its writer thread and connections
            raise

    @property
    def model_name(self) -> str:
        """What the user called the model: a built-in's name, or its folder's."""
        return Path(str(self.opts.model)).name

    def path(self) -> list[Message]:
        return self.store.path(self.thread.id)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                            add_generation_prompt=True)

    def send(self, text: str, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> TurnResult:
        """A user turn: appended to the thread, answered (streamed through `on_text`), the answer
        appended and the cache saved."""
        if not text.strip():
            raise ValueError("an empty message")
        messages = [{"role": m.role, "content": m.content} for m in self.path()] + [{"role": "user", "content": text}]
        self.engine.check_prompt(self.tok.apply_chat_template(messages, add_generation_prompt=True))  # before storing
        tip = self.store.thread(self.thread.id).tip
        self.store.append(self.thread.id, "user", text, tokens=len(self.tok.encode(text)))
        try:
            result = self._answer(on_text, should_stop)
        except BaseException:
            # no answer, no turn: the thread goes back to where it was (the row stays, on no path)
            self.store.set_tip(self.thread.id, tip)
            raise
        if result.message is None:  # cancelled before the answer began: the turn is undone too, so
            self.store.set_tip(self.thread.id, tip)  # the next message never follows a user turn
        return result

    def regenerate(self, on_text=None, should_stop=None) -> TurnResult:
        """Answer the thread's last user message again (after an edit or a switch, or in place
        of an answer a killed process left incomplete)."""
        path = self.path()
        if len(path) >= 2 and path[-1].role == "assistant" and path[-1].meta.get("incomplete"):
            self.store.discard_draft(self.thread.id, path[-1].id)
            path = path[:-1]
        if not path or path[-1].role != "user":
            raise ValueError("the thread does not end with a user message")
        return self._answer(on_text, should_stop)

    def _answer(self, on_text, should_stop) -> TurnResult:
        ids = self.prompt_ids(self.path())
        decoder = StreamDecoder(self.tok)
        out: list[int] = []
        draft = _Draft(self)

        def on_token(token: int) -> None:
            out.append(token)
            delta = decoder.push(token)
            if on_text is not None and delta:
                on_text(delta)
            draft.tick(out)

        params = self.sampling()
        saved_before = self.tier.saved
        t0 = time.perf_counter()
        stop_reason = "cancelled"
        gen: Generation | None = None
        try:
            gen = self.engine.generate(ids, params, on_token=on_token, decode_threads=self.opts.decode_threads,
                                       should_stop=should_stop)
            stop_reason = gen.stop_reason
        except Cancelled:  # raised by a caller's on_text (the engine's own stop is should_stop)
            pass
        except BaseException:
            draft.discard()  # no answer: the turn is undone by the caller
            raise
        wall_ms = 1000 * (time.perf_counter() - t0)
        lookup = gen.lookup if gen is not None else None  # (a caller's Cancelled from on_text: not known)
        answer_ids = [t for t in out if t not in self.tok.eos_ids]
        text = self.tok.decode(answer_ids)
        timings = gen.timings if gen else Timings(prompt_n=len(ids), prompt_ms=wall_ms)
        ttft = timings.prompt_ms
        tps = timings.as_dict()["predicted_per_second"]
        meta = {"stop_reason": stop_reason, "prompt_tokens": len(ids), "ttft_ms": round(ttft, 2),
                "tokens_per_s": round(tps, 2), "outcome": lookup.outcome if lookup else "off",
                "cached_tokens": lookup.plan.usable_tokens if lookup else 0,
                "exact": lookup.plan.exact if lookup else True}
        message = None
        if out or stop_reason != "cancelled":  # cancelled before its first token: no answer (send undoes the turn)
            try:
                message = self.store.append(self.thread.id, "assistant", text, tokens=len(answer_ids), meta=meta,
                                            replaces=draft.id)
            except BaseException:
                draft.discard()
                raise
        saved = self.tier.saved - saved_before  # the engine saved (and flushed) at the request's end, cancelled too
        self._count(lookup, timings, cancelled=stop_reason == "cancelled")
        budget = (self.cache.validator.policy.tokens(lookup.plan.usable_tokens) or 0) \
            if lookup is not None and self.opts.reuse == Reuse.APPROXIMATE else 0
        return TurnResult(text, answer_ids, stop_reason, len(ids), meta["cached_tokens"], ttft, tps, lookup, message,
                          saved, budget, conversation=self.conversation.id, branch=self.thread.name,
                          model=self.model_name, timings=timings)

    def set_option(self, name: str, value: str) -> str:
        """`/set NAME VALUE`: change a sampling option (SETTABLE) for the turns that follow;
        returns a line saying what it is now. A bad name or value raises ValueError."""
        key = name.strip().lower().replace("-", "_")
        if key not in SETTABLE:
            raise ValueError(f"unknown option {name!r}; /set takes {', '.join(SETTABLE)}")
        text = value.strip()
        try:
            if key == "sample":
                if text.lower() not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                change = {"greedy": text.lower() in ("off", "false", "0", "no")}
            elif key == "seed":
                change = {"seed": None if text.lower() == "none" else int(text)}
            elif key == "max_new_tokens":
                change = {"max_new_tokens": int(text)}
            else:
                change = {key: float(text), "greedy": False}
        except ValueError:
            raise ValueError(f"/set {key}: {value!r} is not a value it takes ({SETTABLE[key]})") from None
        try:
            self.opts = dataclasses.replace(self.opts, **change)  # ChatOptions checks the values
        except ValueError as e:
            raise ValueError(f"/set {key}: {e}") from None
        o = self.opts
        how = "greedy" if o.greedy else f"sampling at temperature {o.temperature:g}, top_p {o.top_p:g}"
        now = ("off" if o.greedy else "on") if key == "sample" else getattr(o, key)
        return f"{key} = {now}; answers: {how}, seed {o.seed}, up to {o.max_new_tokens} tokens"

    def sampling(self) -> SamplingParams:
        o = self.opts
        return SamplingParams(max_new_tokens=o.max_new_tokens, greedy=o.greedy, temperature=o.temperature,
                              top_p=o.top_p, seed=o.seed, stop_ids=self.tok.eos_ids, ignore_eos=o.ignore_eos)

    def cold_answer(self) -> str:
        """The thread's last answer computed again by a fresh engine with no cache: the oracle a
        reused answer must equal."""
        path = self.path()
        if not path or path[-1].role != "assistant":
            raise ValueError("the thread does not end with an answer")
        gen = Engine(self.model, self.engine.config).generate(self.prompt_ids(path[:-1]), self.sampling())
        return self.tok.decode([t for t in gen.token_ids if t not in self.tok.eos_ids])

    def _count(self, lookup: CacheLookup | None, timings: Timings, cancelled: bool) -> None:
        """A turn into the session's statistics: a cancelled one counts only as cancelled (its
        lookup and its cut-short prefill say nothing about the cache); tokens/s is over every
        token the session decoded, not the last answer's few."""
        s = self.stats
        s.decoded_tokens += timings.predicted_n
        s.decode_ms += timings.predicted_ms
        if cancelled:
            s.cancelled += 1
            return
        s.turns += 1
        s.last_ttft_ms = timings.prompt_ms
        if lookup is not None:
            outcome = lookup.outcome
            if outcome == "hit":
                s.hits += 1
            elif outcome == "degraded":
                s.degraded += 1
            else:
                s.misses += 1

    def save(self) -> int:
        """Write every segment the disk lacks; returns how many were written."""
        return self.cache.save() if self.cache is not None else 0

    def edit(self, index: int, text: str) -> Thread:
        """Replace message `index` of the current path (a user turn) on a new branch, which becomes
        current; the old branch keeps its history. Answer it with `regenerate`."""
        path = self.path()
        if not 0 <= index < len(path):
            raise IndexError(f"no message {index}; the thread has {len(path)}")
        if path[index].role != "user":
            raise ValueError(f"message {index} is a {path[index].role} message; only user turns are edited")
        self.thread, _ = self.store.edit(self.thread.id, path[index].id, text)
        return self.thread

    def fork(self, index: int | None = None, name: str | None = None) -> Thread:
        """A new branch from message `index` of the current path (default: its tip); it becomes current."""
        path = self.path()
        index = len(path) - 1 if index is None else index
        if not 0 <= index < len(path):
            raise IndexError(f"no message {index}; the thread has {len(path)}")
        self.thread = self.store.fork(path[index].id, name)
        return self.thread

    def switch(self, thread: str) -> Thread:
        """Make another branch (id, id prefix or name) of this conversation current; a damaged one
        is refused (ConversationDamaged) and the current branch stays."""
        threads = self.store.threads(self.conversation.id)
        named = [t for t in threads if t.name == thread or (isinstance(t.id, str) and t.id.startswith(thread))]
        if len(named) != 1:
            known = ", ".join(f"{t.name} ({t.id})" for t in threads)
            raise KeyError(f"{'no' if not named else 'more than one'} branch {thread!r}; branches: {known}")
        self.store.path(named[0].id)
        self.thread = named[0]
        return self.thread

    def resume(self, conversation: str) -> None:
        """Continue a stored conversation (id or unique prefix) on its most recently updated
        branch. Its history is read now: a damaged one is refused here (ConversationDamaged names
        the damage and what is intact), never answered from a shortened context later."""
        found = self.store.conversation(self.store.resolve("conversation", conversation))
        # a thread row without an id cannot be named or continued (`hcw inspect --verify` lists it)
        threads = sorted((t for t in self.store.threads(found.id) if isinstance(t.id, str)),
                         key=lambda t: t.updated if isinstance(t.updated, str) else "", reverse=True)
        if not threads:
            raise ValueError(f"conversation {found.id} has no usable branch; `hcw inspect --verify` names the damage")
        self.store.path(threads[0].id)
        if found.id != getattr(self.conversation, "id", None):
            self._forget_if_empty()  # a chat begun and left for another at once leaves nothing
        self.conversation, self.thread = found, threads[0]

    def warnings(self) -> list[str]:
        """What the workbench file held that could not be used: each a line for the user."""
        damage = getattr(self.cache, "lower_damage", None) or []
        if not damage:
            return []
        return [f"the workbench file has {len(damage)} damaged segment row(s) (first: {damage[0]}); they and "
                "the segments after them are recomputed when needed; `hcw inspect --verify` lists them"]

    def fault(self, name: str) -> int:
        """Damage the cached state of the current conversation on purpose (a fault drill), so the
        next turn shows the validator catching it; returns how many pieces were damaged."""
        name = name.replace("-", "_")
        if name not in FAULTS:
            raise KeyError(f"unknown fault {name!r}; faults: {', '.join(fault_names())}")
        if self.cache is None:
            raise ValueError("the cache is off (--reuse off): there is nothing to damage")
        ids = self.prompt_ids(self.path())
        records = [view.record for view in self.cache.segments_of(ids) if view.record is not None]
        if not records:
            raise ValueError("nothing of this conversation is cached yet: send a message first")
        damaged = FAULTS[name](self, records)
        return damaged

    def segments(self) -> list[SegmentRow]:
        """The segment state table for the current thread's tokens."""
        if self.cache is None:
            return []
        ids = self.prompt_ids(self.path())
        b = self.cache.block_size
        rows = []
        for view in self.cache.segments_of(ids):
            rec = view.record
            kinds = {k for _, k in rec.pieces} if rec else set()
            on_disk = view.persisted or self.tier.has(view.key)
            tier = rec.tier if rec else ("disk" if on_disk else "gone")
            rows.append(SegmentRow(view.index, (view.index * b, (view.index + 1) * b), tier,
                                   {col: bool(kinds & set(ks)) for col, ks in PRESENCE.items()}, on_disk,
                                   rec.exact if rec else True,
                                   rec.last_access_step if rec else -1))
        return rows

    def close(self, keep_empty: bool = False) -> None:
        """Save the cache, forget the conversation this session began if nobody wrote in it
        (unless `keep_empty`: another process continues it), close the file."""
        try:
            self.save()
            if not keep_empty:
                self._forget_if_empty()
        finally:
            self.tier.close()

    def _forget_if_empty(self) -> None:
        """The conversation this session created, deleted if it holds no message but the system one."""
        if self._created is not None:
            with contextlib.suppress(sqlite3.Error):  # a damaged file keeps it: `hcw inspect` lists it
                self.store.delete_if_empty(self._created)
            self._created = None
