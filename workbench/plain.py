"""`hcw chat --plain`: a line-based REPL over ChatSession that pipes and scripts can drive.

A line is a user message, or a /command (the TUI's command palette has the same ones). Each
answer streams as it is generated, followed by one status line: the validator's outcome for the
prompt, tokens reused, TTFT and decode speed. With --json every answer is one JSON object instead.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
from collections.abc import Callable
from typing import TextIO

from workbench.session import ChatSession, TurnResult, fault_names

HELP = """commands:
  /help                      this list
  /history                   the current branch, numbered
  /branches                  every branch of this conversation
  /branch [NAME]             a new branch from the last message
  /fork N [NAME]             a new branch from message N
  /edit N TEXT               replace user message N on a new branch and answer it again
  /switch NAME               make another branch current
  /resume ID                 continue a stored conversation
  /segments                  the segment state table of this branch
  /plan                      the last lookup: validation layers, plan, outcome
  /fault NAME                damage this conversation's cached state (see /faults)
  /faults                    the fault drills
  /save                      write cached segments to disk now
  /stats                     hit rate, degraded hits, TTFT, tokens/s, memory
  /quit                      leave (every answered turn is already saved)"""


def status_line(r: TurnResult) -> str:
    outcome = r.lookup.outcome if r.lookup else "cache off"
    label = "" if r.lookup is None or r.lookup.plan.exact else " approximate"
    parts = [f"{outcome}{label}", f"{r.cached_tokens}/{r.prompt_tokens} prompt tokens reused",
             f"TTFT {r.ttft_ms:.0f} ms", f"{r.tokens_per_s:.1f} tok/s"]
    if r.replay_tokens:
        parts.append(f"GDN replayed {r.replay_tokens}" + (f"/{r.replay_budget_tokens} budget" if r.replay_budget_tokens
                                                          else "") + " tokens"
                     + (f" from int8 sketches at {r.lookup.plan.replay_seed}" if r.lookup.plan.replay_seed is not None
                        else "")
                     + (f", error bound {r.lookup.plan.replay_bound:.1e}" if not r.exact else ""))
    if r.stop_reason == "cancelled":
        parts.append("cancelled")
    return "[" + " · ".join(parts) + "]"


def describe_plan(r: TurnResult | None) -> list[str]:
    """The validation panel, as text lines."""
    if r is None or r.lookup is None:
        return ["no lookup yet (or the cache is off)"]
    plan = r.lookup.plan
    lines = [f"outcome: {r.lookup.outcome}{'' if plan.exact else ' (approximate)'}",
             f"logical hit {plan.logical_tokens} tokens · usable {plan.usable_tokens} · prompt {plan.prompt_tokens}"]
    for layer in (1, 2, 3, 4):
        failed = [f for f in r.lookup.reasons if f.startswith(f"layer {layer}:")]
        lines.append(f"layer {layer}: " + ("FAIL " + "; ".join(f.split(':', 1)[1].strip() for f in failed)
                                           if failed else "pass"))
    other = [f for f in r.lookup.reasons if not f.startswith("layer ")]
    lines += [f"note: {f}" for f in other]
    lines += [f"note: {n}" for n in plan.notes]
    for o in plan.objects:
        kind = f"{len(o.kind.split(','))} state kinds" if "," in o.kind else o.kind
        where = f"tokens [{o.tokens[0]}, {o.tokens[1]})" + (f" layers {list(o.layers)}" if o.layers else "")
        lines.append(f"  {o.action.value:<9} {kind:<14} {where} {o.path or ''} {o.reason or ''}".rstrip())
    return lines


def run_plain(session: ChatSession, lines, out: TextIO, as_json: bool = False,
              prompt: Callable[[], None] | None = None) -> int:
    """Drive `session` from `lines` (an iterable of input lines); returns an exit code."""
    last: TurnResult | None = None

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def answer(run) -> None:
        nonlocal last
        if as_json:
            last = run(None)
            say(json.dumps({"type": "turn", "branch": session.thread.name, **last.as_dict()}))
            return
        last = run(lambda delta: (out.write(delta), out.flush()))
        say("")
        say(status_line(last))

    if not as_json:
        say(f"hcw chat · conversation {session.conversation.id} · branch {session.thread.name} · /help for commands")
    for warning in session.warnings():
        say(json.dumps({"type": "warning", "warning": warning}) if as_json else f"warning: {warning}")
    errors = 0
    for raw in lines:
        if prompt is not None:
            prompt()
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        try:
            if not line.startswith("/"):
                answer(lambda on_text: session.send(line, on_text))
                continue
            if _command(session, line, say, answer, lambda: last, as_json):
                break
        except (ValueError, KeyError, IndexError) as e:
            errors += 1
            msg = e.args[0] if e.args else str(e)
            say(json.dumps({"type": "error", "error": msg}) if as_json else f"error: {msg}")
        except sqlite3.Error as e:  # the workbench file itself failed (damaged, full, locked)
            errors += 1
            msg = f"workbench database: {type(e).__name__}: {e}"
            say(json.dumps({"type": "error", "error": msg}) if as_json else f"error: {msg}")
    session.close()
    # a script reads the exit code: 1 when any line was refused or failed
    return 1 if errors else 0


def _command(session: ChatSession, line: str, say, answer, last, as_json: bool) -> bool:
    """Run one /command; True means quit."""
    try:
        parts = shlex.split(line[1:])
    except ValueError as e:
        raise ValueError(f"cannot parse the command: {e}") from None
    cmd, args = (parts[0].lower(), parts[1:]) if parts else ("help", [])

    def emit(kind: str, payload, text_lines: list[str]) -> None:
        if as_json:
            say(json.dumps({"type": kind, **payload} if isinstance(payload, dict) else {"type": kind, "items": payload}))
        else:
            for t in text_lines:
                say(t)

    if cmd in ("quit", "exit", "q"):
        return True
    if cmd == "help":
        say(HELP)
    elif cmd == "history":
        path = session.path()
        emit("history", [{"index": i, "role": m.role, "content": m.content,
                          "incomplete": bool(m.meta.get("incomplete"))} for i, m in enumerate(path)],
             [f"{i:>3} {m.role:<9} {m.content[:100]!r}" + ("  (incomplete: interrupted)" if m.meta.get("incomplete")
                                                             else "") for i, m in enumerate(path)])
    elif cmd == "branches":
        threads = session.store.threads(session.conversation.id)
        emit("branches", [{"id": t.id, "name": t.name, "current": t.id == session.thread.id} for t in threads],
             [f"{'*' if t.id == session.thread.id else ' '} {t.name} ({t.id})" for t in threads])
    elif cmd == "branch":
        t = session.fork(None, args[0] if args else None)
        emit("branch", {"branch": t.name, "id": t.id}, [f"on new branch {t.name}"])
    elif cmd == "fork":
        if not args:
            raise ValueError("usage: /fork N [NAME]")
        t = session.fork(_int(args[0]), args[1] if len(args) > 1 else None)
        emit("branch", {"branch": t.name, "id": t.id}, [f"on new branch {t.name}"])
    elif cmd == "edit":
        if len(args) < 2:
            raise ValueError("usage: /edit N TEXT")
        session.edit(_int(args[0]), " ".join(args[1:]))
        answer(lambda on_text: session.regenerate(on_text))
    elif cmd == "switch":
        if not args:
            raise ValueError("usage: /switch NAME")
        t = session.switch(args[0])
        emit("branch", {"branch": t.name, "id": t.id}, [f"on branch {t.name}"])
    elif cmd == "resume":
        if not args:
            raise ValueError("usage: /resume ID")
        session.resume(args[0])
        emit("resume", {"conversation": session.conversation.id, "branch": session.thread.name},
             [f"resumed {session.conversation.id} on branch {session.thread.name}"])
    elif cmd == "segments":
        rows = session.segments()
        emit("segments", [{"index": r.index, "tokens": list(r.tokens), "tier": r.tier, **r.presence,
                           "on_disk": r.on_disk, "exact": r.exact} for r in rows], _segment_lines(rows))
    elif cmd == "plan":
        r = last()
        emit("plan", r.as_dict() if r else {}, describe_plan(r))
    elif cmd == "fault":
        if not args:
            raise ValueError("usage: /fault NAME (see /faults)")
        n = session.fault(args[0])
        emit("fault", {"fault": args[0], "damaged": n}, [f"fault {args[0]}: {n} piece(s) damaged; "
                                                         "the next turn's /plan shows what the validator did"])
    elif cmd == "faults":
        names = fault_names()
        emit("faults", names, names)
    elif cmd == "save":
        n = session.save()
        emit("save", {"segments": n}, [f"saved {n} segment(s)"])
    elif cmd == "stats":
        stats = session.stats.as_dict()
        emit("stats", stats, [f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in stats.items()])
    else:
        raise ValueError(f"unknown command /{cmd}; /help lists them")
    return False


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a message number, got {text!r}") from None


def _segment_lines(rows) -> list[str]:
    if not rows:
        return ["no cached segments on this branch yet"]
    cols = list(rows[0].presence)
    head = f"{'seg':>4} {'tokens':>13} {'tier':<7} " + " ".join(f"{c:<10}" for c in cols) + " disk  exact"
    body = [f"{r.index:>4} {f'{r.tokens[0]}-{r.tokens[1]}':>13} {r.tier:<7} "
            + " ".join(f"{'yes' if r.presence[c] else '-':<10}" for c in cols)
            + f" {'yes' if r.on_disk else '-':<5} {'exact' if r.exact else 'approx'}" for r in rows]
    return [head, *body]
