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
import sqlite3
import sys
import time
from collections.abc import Callable
from typing import NamedTuple
from pathlib import Path

from engine import load_model
from engine.model.loader import resolve_model
from engine.cache.config import Reuse
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.cache.states import Kind
from engine.engine import Engine, Generation, SamplingParams, Timings
from engine.events import CacheLookup
from engine.model.hybrid import HybridModel
from engine.tokenizer import StreamDecoder, Tokenizer, load_tokenizer
from store.conversations import Conversations, Message, Thread
from store.write_behind import WriteBehind
from workbench.faults import FAULTS, fault_names
# what callers have imported from here since before the options and reports had modules of their own
from workbench.options import REUSE_POLICIES, SETTABLE, ChatOptions, parse_budget  # noqa: F401
from workbench.turns import SegmentRow, SessionStats, TurnResult

DRAFT_INTERVAL_S = 0.5  # a streaming answer is on disk at most this far behind (marked incomplete)
# the presence columns of the segment state table: column -> the state kinds it stands for
PRESENCE = {"kv": (Kind.KV,), "compressed": (Kind.COMPRESSED,), "tail": (Kind.TAIL, Kind.OVERLAP),
            "window": (Kind.WINDOW,), "indexer": (Kind.INDEX_KEYS, Kind.INDEX_TAIL, Kind.INDEX_OVERLAP),
            "gdn": (Kind.RECURRENT, Kind.CONV)}


class Cancelled(Exception):
    """Raised from the token callback to stop a generation (Esc in the TUI)."""


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


class Opened(NamedTuple):
    model: HybridModel
    tok: Tokenizer
    tier: WriteBehind
    cache: PrefixCache | None  # None with --reuse off
    engine: Engine


def open_engine(opts: ChatOptions, who: str, model: HybridModel | None = None) -> Opened:
    """What a chat and a server run on: the model (loaded unless given), its tokenizer, the
    workbench file's write-behind tier, the prefix cache over it and the engine. `who` names the
    command in the error when the model has no tokenizer. If the cache or the engine cannot be
    made, the tier is closed again before the error goes on."""
    model = model if model is not None else load_model(opts.model, dtype=opts.engine.dtype)
    tok = load_tokenizer(resolve_model(opts.model), model.config.extra)
    if tok is None:
        raise ValueError(f"{opts.model} has no tokenizer; {who} needs one")
    if opts.engine.kv_layout is not None:  # before the cache is made: it assembles states of this layout
        model.use_kv_layout(opts.engine.kv_layout)
    tier = WriteBehind(opts.db, layout_fingerprint(model, opts.cache))  # spills never block decoding
    try:
        cache = PrefixCache(model, opts.cache, lower=tier) if opts.reuse != Reuse.OFF else None
        engine = Engine(model, dataclasses.replace(opts.engine, dtype=model.dtype, device=str(model.device)),
                        cache=cache)
    except BaseException:
        with contextlib.suppress(sqlite3.Error, OSError):  # the error being raised is the one to see
            tier.close()
        raise
    return Opened(model, tok, tier, cache, engine)


class ChatSession:
    def __init__(self, opts: ChatOptions, model=None):
        self.opts = opts
        self.model, self.tok, self.tier, self.cache, self.engine = open_engine(opts, "hcw chat", model)
        self.conversation = None
        self._created: str | None = None  # the conversation this session began (forgotten at close if empty)
        try:
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
        threads = self.store.latest_threads(found.id)
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
        return segment_rows(self.cache, self.tier, self.prompt_ids(self.path()))

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


def segment_rows(cache: PrefixCache, tier: WriteBehind, ids: list[int]) -> list[SegmentRow]:
    """One row per cached segment of `ids`' matched prefix: its tier, the state kinds it holds,
    whether it is on disk, exact or approximate, and when it was last used. On the engine's thread:
    it reads the cache's tables."""
    b = cache.block_size
    rows = []
    for view in cache.segments_of(ids):
        rec = view.record
        kinds = {k for _, k in rec.pieces} if rec else set()
        # (a row the disk holds only under another weights format is never used: not "disk")
        on_disk = view.persisted or (view.key not in cache.foreign and tier.has(view.key))
        rows.append(SegmentRow(view.index, (view.index * b, (view.index + 1) * b),
                               rec.tier if rec else ("disk" if on_disk else "gone"),
                               {col: bool(kinds & set(ks)) for col, ks in PRESENCE.items()}, on_disk,
                               rec.exact if rec else True, rec.last_access_step if rec else -1))
    return rows
