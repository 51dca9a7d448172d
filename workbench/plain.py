"""`hcw chat --plain`: a line-based REPL over ChatSession that pipes and scripts can drive.

A line is a user message, or a /command (workbench/commands.py: the TUI's prompt and command
palette have the same ones). Each answer streams as it is generated, followed by one status line:
the validator's outcome for the prompt, tokens reused, TTFT and decode speed. With --json every
answer is one JSON object instead. Piped, the exit code is 1 when any line failed, and stderr
says how many did.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
from collections.abc import Callable
from typing import TextIO

from workbench import commands
from workbench.commands import Run
from workbench.session import ChatSession
from workbench.turns import TurnResult

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


# the validator's four layers (engine/cache/validation.py): name, what each checks
LAYERS = {1: ("alignment", "only whole segments, their tokens compared with the prompt's, are reused"),
          2: ("kernel interface", "every record was written under the current layout fingerprint"),
          3: ("group intersection", "usable up to the boundary that every state kind of every layer reaches"),
          4: ("byte alignment", "at assembly: dtype, shape, strides, contiguity, 16-byte base of each buffer")}


def _reasons(r: TurnResult) -> list[str]:
    """The lookup's failures, one each: a re-plan reason joins the abandoned plans' with '; '."""
    return [part for reason in r.lookup.reasons
            for part in re.split(r"; (?=layer \d:|a record changed)", reason) if part]


def describe_plan(r: TurnResult | None, explain: bool = False) -> list[str]:
    """The validation panel, as text lines: outcome, the four layers by name (pass, or FAIL and
    why), notes, and one line per object of the plan; `explain` adds what each layer checks."""
    key = [f"  layer {n} {name}: {checks}" for n, (name, checks) in LAYERS.items()] if explain else []
    if r is None or r.lookup is None:
        return ["no lookup yet (or the cache is off)"] + (["what each layer checks:", *key] if explain else [])
    plan = r.lookup.plan
    lines = [f"outcome: {r.lookup.outcome}{'' if plan.exact else ' (approximate)'}",
             f"logical hit {plan.logical_tokens} tokens · usable {plan.usable_tokens} · prompt {plan.prompt_tokens}"]
    reasons = _reasons(r)
    for layer, (name, _) in LAYERS.items():
        failed = [f.split(":", 1)[1].strip() for f in reasons if f.startswith(f"layer {layer}:")]
        lines.append(f"layer {layer} {name}: " + ("FAIL " + "; ".join(failed) if failed else "pass"))
    lines += [f"note: {f}" for f in reasons if not f.startswith("layer ")]
    lines += [f"note: {n}" for n in plan.notes]
    for o in plan.objects:
        kind = f"{len(o.kind.split(','))} state kinds" if "," in o.kind else o.kind
        where = f"tokens [{o.tokens[0]}, {o.tokens[1]})" + (f" layers {list(o.layers)}" if o.layers else "")
        lines.append(f"  {o.action.value:<9} {kind:<14} {where} {o.path or ''} {o.reason or ''}".rstrip())
    return lines + (["what each layer checks:", *key] if explain else [])


def run_plain(session: ChatSession, lines, out: TextIO, as_json: bool = False,
              prompt: Callable[[], None] | None = None, err: TextIO | None = None,
              verbose_load_ms: float | None = None) -> int:
    """Drive `session` from `lines` (an iterable of input lines); returns an exit code: 1 when any
    line (a turn or a command) failed, after saying on `err` (stderr) how many did. With
    `verbose_load_ms` (the model's load time), each answer's Ollama-style stats go to `err`."""
    last: TurnResult | None = None

    def verbose(result: TurnResult) -> None:
        if verbose_load_ms is not None and result.timings is not None:
            from workbench.generate import stats

            t = result.as_dict()
            (err or sys.stderr).write(stats(t, verbose_load_ms, t["prompt_ms"] + t["predicted_ms"]))
            (err or sys.stderr).flush()

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def answer(run: Run) -> None:
        nonlocal last
        if as_json:
            last = run(None, None)
            say(json.dumps({"type": "turn", "branch": session.thread.name, **last.as_dict()}))
            verbose(last)
            return
        last = run(lambda delta: (out.write(delta), out.flush()), None)
        say("")
        say(status_line(last))
        verbose(last)

    if not as_json:
        say(f"hcw chat · conversation {session.conversation.id} · branch {session.thread.name} · /help for commands")
    for warning in session.warnings():
        say(json.dumps({"type": "warning", "warning": warning}) if as_json else f"warning: {warning}")
    failed = done = 0
    try:  # the session is closed (its last writes flushed) however the loop ends, Ctrl-C too
        for raw in lines:
            if prompt is not None:
                prompt()
            line = raw.rstrip("\n")
            if not line.strip():
                continue
            done += 1
            try:
                if not line.startswith("/"):
                    answer(lambda on_text, should_stop: session.send(line, on_text, should_stop))
                    continue
                if _command(session, line, say, answer, lambda: last, as_json):
                    break
            except (ValueError, KeyError, IndexError) as e:
                failed += 1
                msg = e.args[0] if e.args else str(e)
                say(json.dumps({"type": "error", "error": msg}) if as_json else f"error: {msg}")
            except sqlite3.Error as e:  # the workbench file itself failed (damaged, full, locked)
                failed += 1
                msg = f"workbench database: {type(e).__name__}: {e}"
                say(json.dumps({"type": "error", "error": msg}) if as_json else f"error: {msg}")
    finally:
        session.close()
    # a script reads the exit code: 1 when any line was refused or failed; stderr says how many
    # (stdout stays the answers, or one JSON object a line)
    if failed:
        print(f"hcw chat: {failed} of {done} line(s) failed", file=err or sys.stderr, flush=True)
    return 1 if failed else 0


def _command(session: ChatSession, line: str, say, answer, last, as_json: bool) -> bool:
    """Run one /command from the table (workbench/commands.py); True means quit."""
    command, args = commands.parse(line)
    if command.quits:
        return True
    reply = command.handler(commands.Context(session, answer, last), args)
    if reply is not None:
        if as_json:
            say(json.dumps(reply.as_json()))
        else:
            for text in reply.lines:
                say(text)
    return False
