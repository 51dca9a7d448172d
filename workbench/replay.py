"""`hcw replay FILE... [--json]`: run scripted chat sessions and check their expectations.

A session file is JSON lines, one step each (blank lines and lines starting with # are skipped):

    {"op": "config", "model": "hcw-tiny", "reuse": "exact", "max_new_tokens": 16, "block_size": 64}
    {"op": "user", "text": "...", "expect": {"outcome": "hit", "contains": "4821", "exact": true}}
    {"op": "edit", "index": 3, "text": "...", "expect": {...}}      replace user message 3 on a new branch
    {"op": "branch", "name": "alt"}  {"op": "fork", "index": 2, "name": "x"}  {"op": "switch", "branch": "main"}
    {"op": "fault", "name": "evict-compressed"}                     damage this conversation's cached state
    {"op": "restart"}                                               the rest runs in a new process, same DB
    {"op": "save"}

`config` may only come first. Expectations of an answer: `outcome` (hit | degraded | miss |
recomputed, or a list of them), `contains` (text), `exact` (true: the answer equals a fresh
no-cache run of the same conversation), `min_cached_tokens`, `approximate` (whether the plan was
labelled approximate: a Tail-Replay). A session runs in a temporary
database unless --db is given. Exit status: 0 all expectations met, 1 some failed, 2 a bad file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from workbench.progress import Steps
from engine.engine_config import EngineConfig
from kernels import dispatch
from workbench.options import CHAT_PREFILL_CHUNK, ChatOptions, parse_budget
from workbench.session import ChatSession
from workbench.turns import TurnResult

OPS = {"config", "user", "edit", "branch", "fork", "switch", "fault", "restart", "save"}
CONFIG_KEYS = {"model", "reuse", "replay_budget", "replay_tolerance", "max_new_tokens", "block_size", "checkpoint_every",
               "checkpoint_tail", "sketch_every", "system"}
EXPECT_KEYS = {"outcome", "contains", "exact", "min_cached_tokens", "approximate"}


class ScriptError(ValueError):
    """A session file that cannot be run: bad JSON, an unknown op or key, a missing field."""


@dataclass
class StepResult:
    line: int
    op: str
    ok: bool
    detail: str = ""
    turn: dict | None = None
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"line": self.line, "op": self.op, "ok": self.ok, "detail": self.detail, "turn": self.turn,
                "failures": self.failures}


def count_steps(steps: list[tuple[int, dict]]) -> int:
    """The steps that run (and are reported): all but config."""
    return sum(step["op"] != "config" for _, step in steps)


def parse(path: Path) -> list[tuple[int, dict]]:
    """(line number, step) pairs, checked before anything runs."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ScriptError(f"{path}: {e.strerror}") from None
    steps = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError as e:
            raise ScriptError(f"{path}:{no}: not JSON: {e.msg}") from None
        if not isinstance(step, dict) or step.get("op") not in OPS:
            raise ScriptError(f"{path}:{no}: each line needs an \"op\" among {', '.join(sorted(OPS))}")
        op = step["op"]
        if op == "config" and steps:
            raise ScriptError(f"{path}:{no}: config must be the first step")
        if op == "config" and set(step) - CONFIG_KEYS - {"op"}:
            raise ScriptError(f"{path}:{no}: unknown config keys {sorted(set(step) - CONFIG_KEYS - {'op'})}")
        need = {"user": ("text",), "edit": ("index", "text"), "switch": ("branch",), "fault": ("name",),
                "fork": ("index",)}.get(op, ())
        missing = [k for k in need if k not in step]
        if missing:
            raise ScriptError(f"{path}:{no}: {op} needs {', '.join(missing)}")
        unknown = set(step.get("expect", {})) - EXPECT_KEYS
        if unknown:
            raise ScriptError(f"{path}:{no}: unknown expectations {sorted(unknown)}; known: {sorted(EXPECT_KEYS)}")
        steps.append((no, step))
    if not steps:
        raise ScriptError(f"{path}: no steps")
    try:
        options(steps, None, None)  # the config's values, checked now rather than mid-run
    except (ValueError, TypeError) as e:
        raise ScriptError(f"{path}: config: {e}") from None
    return steps


def options(steps: list[tuple[int, dict]], db: Path, model: str | None, session: str | None = None,
            engine: EngineConfig | None = None) -> ChatOptions:
    cfg = {k: v for k, v in steps[0][1].items() if k != "op"} if steps[0][1]["op"] == "config" else {}
    if model is not None:
        cfg["model"] = model
    cfg.setdefault("max_new_tokens", 32)
    if isinstance(cfg.get("replay_budget"), str):  # "5%", "0.05", "512", "adaptive", as on the command line
        cfg["replay_budget"] = parse_budget(cfg["replay_budget"])
    if engine is not None:
        cfg["engine"] = engine
    return ChatOptions.of(db=db, session=session, **cfg)


def check(session: ChatSession, result: TurnResult, expect: dict) -> list[str]:
    failures = []
    outcome = result.lookup.outcome if result.lookup else "off"
    wanted = expect.get("outcome")
    if wanted is not None and outcome not in ([wanted] if isinstance(wanted, str) else wanted):
        failures.append(f"outcome {outcome}, expected {wanted} ({'; '.join(result.lookup.reasons) if result.lookup else ''})")
    if "contains" in expect and expect["contains"] not in result.text:
        failures.append(f"answer {result.text!r} does not contain {expect['contains']!r}")
    if "min_cached_tokens" in expect and result.cached_tokens < expect["min_cached_tokens"]:
        failures.append(f"{result.cached_tokens} cached tokens, expected >= {expect['min_cached_tokens']}")
    if "approximate" in expect and (not result.exact) != bool(expect["approximate"]):
        failures.append(f"the plan was {'approximate' if not result.exact else 'exact'}, expected "
                        f"{'approximate' if expect['approximate'] else 'exact'}")
    if expect.get("exact"):
        cold = session.cold_answer()
        if cold != result.text:
            failures.append(f"answer {result.text!r} differs from a fresh no-cache run's {cold!r}")
    return failures


def run_steps(session: ChatSession, steps: list[tuple[int, dict]], start: int = 0,
              counter: Steps | None = None) -> tuple[list[StepResult], int | None]:
    """Run steps[start:] until the end or a restart; returns (results, index after the restart or None).
    `counter` hears of each step as it starts and when it is done (a progress display)."""
    results = []
    counter = counter or Steps()
    for i in range(start, len(steps)):
        no, step = steps[i]
        op = step["op"]
        if op == "config":
            continue
        counter.doing(f"line {no}: {op}")
        try:
            if op == "restart":
                session.close(keep_empty=True)  # the new process continues this conversation, empty or not
                results.append(StepResult(no, op, True,
                                          f"conversation {session.conversation.id} continues in a new process"))
                return results, i + 1
            results.append(_step(session, no, op, step))
        finally:
            counter.done()
    session.close()
    return results, None


def _step(session: ChatSession, no: int, op: str, step: dict) -> StepResult:
    try:
        detail, turn = _apply(session, op, step)
    except (ValueError, KeyError, IndexError) as e:
        return StepResult(no, op, False, "", None, [e.args[0] if e.args else str(e)])
    except sqlite3.Error as e:  # the workbench file failed under the step: a failed step, said
        return StepResult(no, op, False, "", None, [f"workbench database: {type(e).__name__}: {e}"])
    failures = check(session, turn, step.get("expect", {})) if turn is not None else []
    return StepResult(no, op, not failures, detail, turn.as_dict() if turn else None, failures)


def _apply(session: ChatSession, op: str, step: dict) -> tuple[str, TurnResult | None]:
    if op == "user":
        return "", session.send(step["text"])
    if op == "edit":
        session.edit(step["index"], step["text"])
        return f"branch {session.thread.name}", session.regenerate()
    if op == "branch":
        return f"branch {session.fork(None, step.get('name')).name}", None
    if op == "fork":
        return f"branch {session.fork(step['index'], step.get('name')).name}", None
    if op == "switch":
        return f"branch {session.switch(step['branch']).name}", None
    if op == "fault":
        return f"{session.fault(step['name'])} piece(s) damaged", None
    if op == "save":
        return f"{session.save()} segment(s) saved", None
    raise ValueError(f"unknown op {op!r}")


def replay_file(path: Path, db: Path | None = None, model: str | None = None, progress=None,
                counter: Steps | None = None, engine: EngineConfig | None = None) -> dict:
    """Run one session file; each restart continues in a child process on the same database (an
    entry point of its own: it maps the HCW_* variables it inherits as the CLI does).
    `progress`: called with a line per step result; `counter`: counts the steps (`workbench.progress`);
    `engine`: what the sessions' engines run with."""
    steps = parse(path)
    counter = counter or Steps()
    with tempfile.TemporaryDirectory() as tmp:
        db = db or Path(tmp) / "replay.db"
        session = ChatSession(options(steps, db, model, engine=engine))
        results, resume_at = run_steps(session, steps, counter=counter)
        conversation, thread = session.conversation.id, session.thread.id
        _report(progress, results)
        while resume_at is not None:
            child = subprocess.run([sys.executable, "-m", "workbench.replay", str(path), str(db), model or "",
                                    conversation, thread, str(resume_at)],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                raise RuntimeError(f"the restarted process failed: {child.stderr.strip()[-2000:]}")
            out = json.loads(child.stdout.strip().splitlines()[-1])
            more = [StepResult(**r) for r in out["results"]]
            counter.done(len(more))  # the child's steps, counted when it is done
            _report(progress, more)
            results += more
            resume_at, thread = out["resume_at"], out["thread"]
    failed = [r for r in results if not r.ok]
    return {"file": str(path), "steps": [r.as_dict() for r in results], "failed": len(failed),
            "conversation": conversation}


def _report(progress, results: list[StepResult]) -> None:
    if progress is None:
        return
    for r in results:
        turn = r.turn or {}
        what = f"{turn.get('outcome', '')} {turn.get('cached_tokens', '')}/{turn.get('prompt_tokens', '')} " \
               f"{turn.get('text', '')[:50]!r}" if r.turn else r.detail
        progress(f"  {'ok  ' if r.ok else 'FAIL'} line {r.line:<3} {r.op:<7} {what}")
        for f in r.failures:
            progress(f"       {f}")


def _child(argv: list[str]) -> None:
    """The process after a restart: resume the conversation, run the rest, print one JSON line."""
    path, db, model, conversation, thread, start = argv
    steps = parse(Path(path))
    engine = EngineConfig.from_env(os.environ, prefill_chunk_most=CHAT_PREFILL_CHUNK)
    dispatch.select(engine.kernels, engine.native)
    session = ChatSession(options(steps, Path(db), model or None, conversation, engine=engine))
    session.switch(thread)
    results, resume_at = run_steps(session, steps, int(start))
    print(json.dumps({"results": [r.as_dict() for r in results], "resume_at": resume_at, "thread": session.thread.id}))


if __name__ == "__main__":
    _child(sys.argv[1:])
