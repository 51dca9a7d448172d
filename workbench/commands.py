"""The workbench's /commands: one typed table read by the plain REPL (`workbench/plain.py`), the
TUI's prompt and its command palette (Ctrl-P), and `/help`, so that a command exists in all of
them or in none.

A `Command` names its arguments and says what it does; its handler takes a `Context` (the session,
a way to answer a turn, the last turn's result) and the parsed arguments, and returns a `Reply`:
the JSON object's type and payload (`--json`) and the same as text lines. A handler raises
ValueError / KeyError / IndexError for input it refuses (one `error:` line for the user).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

from workbench.faults import fault_names
from workbench.options import SETTABLE
from workbench.session import ChatSession
from workbench.turns import TurnResult

# run(on_text, should_stop) -> TurnResult: a turn a command starts (/edit); Context.answer runs it
Run = Callable[[Callable[[str], None] | None, Callable[[], bool] | None], TurnResult]


@dataclass(frozen=True)
class Reply:
    """What a command produced: `kind` and `payload` for --json, `lines` for a person."""

    kind: str
    payload: dict | list
    lines: list[str]
    listing: bool = False  # a listing to read (the TUI shows it in a scrollable panel, not the log)

    def as_json(self) -> dict:
        return {"type": self.kind, **self.payload} if isinstance(self.payload, dict) else \
            {"type": self.kind, "items": self.payload}


@dataclass
class Context:
    session: ChatSession
    answer: Callable[[Run], None]  # answers a turn (streamed by the REPL, in a worker by the TUI)
    last: Callable[[], TurnResult | None]  # the last answered turn of this session, if any


@dataclass(frozen=True)
class Command:
    name: str
    args: str  # the arguments as /help shows them: "N [NAME]"; "" for none; [...] is optional
    help: str
    handler: Callable[[Context, list[str]], Reply | None]
    aliases: tuple[str, ...] = ()
    quits: bool = False

    @property
    def usage(self) -> str:
        return f"/{self.name}" + (f" {self.args}" if self.args else "")

    @property
    def needs_args(self) -> bool:
        """A command that cannot run bare (the palette puts it in the prompt for its arguments)."""
        return bool(self.args) and not self.args.startswith("[")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a message number, got {text!r}") from None


def _usage(name: str) -> ValueError:
    return ValueError(f"usage: {BY_NAME[name].usage}")


def _help(ctx: Context, args: list[str]) -> Reply:
    return Reply("help", [{"command": f"/{c.name}", "args": c.args, "help": c.help} for c in COMMANDS], help_lines(),
                 listing=True)


def _history(ctx: Context, args: list[str]) -> Reply:
    path = ctx.session.path()
    return Reply("history", [{"index": i, "role": m.role, "content": m.content,
                              "incomplete": bool(m.meta.get("incomplete"))} for i, m in enumerate(path)],
                 [f"{i:>3} {m.role:<9} {m.content[:100]!r}" + ("  (incomplete: interrupted)" if m.meta.get("incomplete")
                                                                 else "") for i, m in enumerate(path)],
                 listing=True)


def _branches(ctx: Context, args: list[str]) -> Reply:
    s = ctx.session
    threads = s.store.threads(s.conversation.id)
    return Reply("branches", [{"id": t.id, "name": t.name, "current": t.id == s.thread.id} for t in threads],
                 [f"{'*' if t.id == s.thread.id else ' '} {t.name} ({t.id})" for t in threads], listing=True)


def _on_branch(t, verb: str = "on new branch") -> Reply:
    return Reply("branch", {"branch": t.name, "id": t.id}, [f"{verb} {t.name}"])


def _branch(ctx: Context, args: list[str]) -> Reply:
    return _on_branch(ctx.session.fork(None, args[0] if args else None))


def _fork(ctx: Context, args: list[str]) -> Reply:
    if not args:
        raise _usage("fork")
    return _on_branch(ctx.session.fork(_int(args[0]), args[1] if len(args) > 1 else None))


def _edit(ctx: Context, args: list[str]) -> None:
    if len(args) < 2:
        raise _usage("edit")
    s = ctx.session
    s.edit(_int(args[0]), " ".join(args[1:]))
    ctx.answer(lambda on_text, should_stop: s.regenerate(on_text, should_stop))


def _switch(ctx: Context, args: list[str]) -> Reply:
    if not args:
        raise _usage("switch")
    return _on_branch(ctx.session.switch(args[0]), "on branch")


def _resume(ctx: Context, args: list[str]) -> Reply:
    if not args:
        raise _usage("resume")
    s = ctx.session
    s.resume(args[0])
    return Reply("resume", {"conversation": s.conversation.id, "branch": s.thread.name},
                 [f"resumed {s.conversation.id} on branch {s.thread.name}"])


def _segments(ctx: Context, args: list[str]) -> Reply:
    rows = ctx.session.segments()
    return Reply("segments", [{"index": r.index, "tokens": list(r.tokens), "tier": r.tier, **r.presence,
                               "on_disk": r.on_disk, "exact": r.exact} for r in rows], segment_lines(rows),
                 listing=True)


def _plan(ctx: Context, args: list[str]) -> Reply:
    from workbench.plain import describe_plan

    r = ctx.last()
    return Reply("plan", r.as_dict() if r else {}, describe_plan(r, explain=True), listing=True)


def _fault(ctx: Context, args: list[str]) -> Reply:
    if not args:
        raise ValueError(f"usage: {BY_NAME['fault'].usage} (see /faults)")
    n = ctx.session.fault(args[0])
    return Reply("fault", {"fault": args[0], "damaged": n},
                 [f"fault {args[0]}: {n} piece(s) damaged; the next turn's /plan shows what the validator did"])


def _faults(ctx: Context, args: list[str]) -> Reply:
    names = fault_names()
    return Reply("faults", names, names, listing=True)


def _save(ctx: Context, args: list[str]) -> Reply:
    n = ctx.session.save()
    return Reply("save", {"segments": n}, [f"saved {n} segment(s)"])


def _stats(ctx: Context, args: list[str]) -> Reply:
    stats = ctx.session.stats.as_dict()
    return Reply("stats", stats, [f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in stats.items()],
                 listing=True)


def _set(ctx: Context, args: list[str]) -> Reply:
    if not args:
        width = max(len(n) for n in SETTABLE)
        return Reply("settings", [{"name": n, "help": h} for n, h in SETTABLE.items()],
                     ["/set NAME VALUE changes, for the turns that follow:"]
                     + [f"  {n:<{width}}  {h}" for n, h in SETTABLE.items()], listing=True)
    if len(args) < 2:
        raise ValueError(f"usage: /set NAME VALUE; names: {', '.join(SETTABLE)}")
    value = " ".join(args[1:])
    said = ctx.session.set_option(args[0], value)
    return Reply("set", {"name": args[0], "value": value, "result": said}, [said])


def _quit(ctx: Context, args: list[str]) -> None:
    return None


COMMANDS: tuple[Command, ...] = (
    Command("help", "", "this list", _help, aliases=("commands", "?")),
    Command("history", "", "the current branch, numbered", _history),
    Command("branches", "", "every branch of this conversation", _branches),
    Command("branch", "[NAME]", "a new branch from the last message", _branch),
    Command("fork", "N [NAME]", "a new branch from message N", _fork),
    Command("edit", "N TEXT", "replace user message N on a new branch, answer again", _edit),
    Command("switch", "NAME", "make another branch current", _switch),
    Command("resume", "ID", "continue a stored conversation", _resume),
    Command("segments", "", "the segment state table of this branch", _segments),
    Command("plan", "", "the last lookup: validation layers, plan, outcome", _plan),
    Command("fault", "NAME", "damage this conversation's cached state (see /faults)", _fault),
    Command("faults", "", "the fault drills /fault takes", _faults),
    Command("save", "", "write cached segments to disk now", _save),
    Command("stats", "", "hit rate, degraded hits, TTFT, tokens/s, memory", _stats),
    Command("set", "[NAME VALUE]", "change a sampling option (/set alone lists them)", _set),
    Command("quit", "", "leave (every answered turn is already saved)", _quit, aliases=("exit", "q"), quits=True),
)
BY_NAME: dict[str, Command] = {n: c for c in COMMANDS for n in (c.name, *c.aliases)}


def help_lines() -> list[str]:
    width = max(len(c.usage) for c in COMMANDS)
    return ["commands:"] + [f"  {c.usage:<{width}}  {c.help}" for c in COMMANDS]


def parse(line: str) -> tuple[Command, list[str]]:
    """'/fork 3 side' -> (the fork command, ['3', 'side']); a bare '/' is /help."""
    try:
        parts = shlex.split(line.strip()[1:])
    except ValueError as e:
        raise ValueError(f"cannot parse the command: {e}") from None
    name, args = (parts[0].lower(), parts[1:]) if parts else ("help", [])
    if name not in BY_NAME:
        raise ValueError(f"unknown command /{name}; /help lists them")
    return BY_NAME[name], args


def segment_lines(rows) -> list[str]:
    if not rows:
        return ["no cached segments on this branch yet"]
    cols = list(rows[0].presence)
    head = f"{'seg':>4} {'tokens':>13} {'tier':<7} " + " ".join(f"{c:<10}" for c in cols) + " disk  exact"
    body = [f"{r.index:>4} {f'{r.tokens[0]}-{r.tokens[1]}':>13} {r.tier:<7} "
            + " ".join(f"{'yes' if r.presence[c] else '-':<10}" for c in cols)
            + f" {'yes' if r.on_disk else '-':<5} {'exact' if r.exact else 'approx'}" for r in rows]
    return [head, *body]
