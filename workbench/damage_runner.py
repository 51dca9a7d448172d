"""`Runner`: one damage case run the way a person would meet it (the conversation resumed, the
question sent through the plain REPL, `hcw inspect --verify` on a copy) and sorted into an outcome."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from workbench.damage_apply import apply_damage
from workbench.damage_oracle import Oracle, chat_options, read_history
from workbench.damage_pristine import sidecars
from workbench.damage_spec import FAILURES, FILE_WORDS, Damage, Spec


class Runner:
    """Runs cases on one process's copy of the pristine file: the model loaded once."""

    def __init__(self, pristine: Path, scratch: Path, model=None):
        from engine import load_model

        self.info = json.loads(Path(pristine).read_text())
        self.folder, self.pristine = Path(self.info["model"]), Path(self.info["db"])
        self.model = model if model is not None else load_model(self.folder)
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.oracle = Oracle({**self.info, "db": str(self.scratch / "oracle.db")}, self.model)

    def run(self, spec: Spec) -> dict:
        t0 = time.perf_counter()
        db, copy = self.scratch / "case.db", self.scratch / "verify.db"
        for p in (db, copy, *sidecars(db), *sidecars(copy)):
            p.unlink(missing_ok=True)
        shutil.copy(self.pristine, db)
        damage = apply_damage(db, spec, self.info)
        shutil.copy(db, copy)
        verify, verify_text = _verify(copy)
        chat, message, strict_whole = self._chat(db, damage)
        missed = verify == "clean" and (chat in ("refused", "warned") or strict_whole is False)
        return {**asdict(spec), "hit": damage.table, "scope": damage.scope, "detail": damage.detail,
                "chat": chat, "verify": verify, "verify_missed": missed, "message": message,
                "verify_text": verify_text, "outcome": _worst(chat, verify),
                "ms": round(1000 * (time.perf_counter() - t0), 1)}

    def _chat(self, db: Path, damage: Damage) -> tuple[str, str, bool | None]:
        """(outcome, what the user was told, whether the strict reader found a whole history)."""
        from engine.config import ConfigError
        from workbench.plain import run_plain
        from workbench.session import ChatSession

        try:
            session = ChatSession(chat_options(self.folder, db, session=self.info["conversation"]), model=self.model)
        except (ConfigError, ValueError, KeyError, sqlite3.DatabaseError, OSError) as e:
            _release_writers()
            msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
            return self._refusal(msg, damage), f"{type(e).__name__}: {msg}", None
        except Exception:  # noqa: BLE001 - any other exception at open is the crash being counted
            _release_writers()
            return "crash", traceback.format_exc(limit=-3), None
        try:
            warnings = list(getattr(session, "warnings", list)())
            strict = read_history(db, session.thread.id, strict=True)
            answers = {self.oracle.answer(strict)} if strict is not None else set()
            if damage.data:
                lenient = read_history(db, session.thread.id, strict=False)
                if lenient is not None:
                    answers.add(self.oracle.answer(lenient))
            turns = []
            send = session.send

            def recorded(text, on_text=None, should_stop=None):
                turns.append(send(text, on_text, should_stop))
                return turns[-1]

            session.send = recorded
            out = io.StringIO()
            run_plain(session, [self.info["question"]], out)
        except Exception:  # noqa: BLE001 - the REPL let an exception out: a crash
            _close_quietly(session)
            return "crash", traceback.format_exc(limit=-3), None
        text = out.getvalue()
        errors = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
        told = "; ".join(warnings)
        if not turns:
            return (self._refusal(errors[0], damage) if errors else "crash"), (errors or [text[-300:]])[0], \
                strict is not None
        if turns[0].text in answers:
            return "correct", told, strict is not None
        if warnings and damage.scope != "cache":
            return "warned", told, strict is not None
        return "wrong", f"answered {turns[0].text!r}, oracle {sorted(answers)!r}; warnings: {told or 'none'}", \
            strict is not None

    @staticmethod
    def _refusal(message: str, damage: Damage) -> str:
        """"refused" when the message is one line that names the damage, else "unclear"."""
        lowered = message.lower()
        named = any(n and n.lower() in lowered for n in damage.names) or \
            (damage.scope == "file" and any(w in lowered for w in FILE_WORDS))
        return "refused" if message.strip() and "\n" not in message and named else "unclear"


def _release_writers() -> None:
    """A session whose open failed leaves its write-behind thread and connections behind (a CLI
    exits; a worker running thousands of cases would run out of files): close them."""
    for t in threading.enumerate():
        writer = getattr(getattr(t, "_target", None), "__self__", None)
        if t.name == "hcw-write-behind" and writer is not None:
            _close_quietly(writer)


def _close_quietly(session) -> None:
    try:
        (session.tier if hasattr(session, "engine") else session).close()
    except Exception:  # noqa: BLE001 - the case is already counted as a crash; this only frees the file
        pass


def _verify(db: Path) -> tuple[str, str]:
    """`hcw inspect --verify` through the CLI: (outcome, its output's first lines)."""
    from typer.testing import CliRunner

    from workbench.cli import app

    res = CliRunner().invoke(app, ["inspect", str(db), "--verify"])
    output = res.output
    head = "\n".join(output.splitlines()[-8:])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        return "crash", "".join(traceback.format_exception(res.exception, limit=-3))
    if "Traceback" in output:
        return "crash", head
    if res.exit_code == 0:
        return "clean", ""
    errors = res.stderr.strip().splitlines()
    if errors and errors[0].startswith("error: "):
        return ("error" if len(errors) == 1 else "crash"), res.stderr.strip()
    return "findings", head


def _worst(chat: str, verify: str) -> str:
    return verify if verify in ("crash", "hang") and chat not in FAILURES else chat
