"""A cache that never lies, measured: thousands of corruptions of a workbench file, a thousand
SIGKILLs of piped chats, and the cache state machine run long on three model families. Writes the
"reliability" section of docs/BENCHMARKS.md (each part its own block; a part not run keeps what it
had). Not in CI.

    python benchmarks/reliability.py                            # every part, full counts
    python benchmarks/reliability.py --part kills --kills 1000 --workers 2
    python benchmarks/reliability.py --quick --no-write         # a few of each, to check the script

corruptions  workbench/damage.py: every damage kind on every column of every table and on the raw
             file, each case resumed and asked the next question, and `hcw inspect --verify`
kills        `hcw chat --plain` fed lines and SIGKILLed at a random moment (model load, before the
             first token, mid-answer or its save, between turns); one file per lane takes many kills,
             half the chats continue a conversation with --session. After each: PRAGMA
             integrity_check, Conversations.check(), every answer whose status line was printed
             stored whole, and a partial answer that was streaming found labelled incomplete
machine      tests/test_cache_state_machine.py's CacheMachine, run here with our own hypothesis
             settings, on its hcw_hybrid and on Qwen3.5 and DeepSeek-V4 random models
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import DOC, parse_args, write_section  # noqa: E402
from workbench import damage  # noqa: E402

SECTION, TITLE = "reliability", "Reliability: corruption, kills, the cache state machine (`benchmarks/reliability.py`)"
PARTS = ("corruptions", "kills", "machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--workers", type=int, default=2, help="worker processes / chat lanes run at once")
    parser.add_argument("--corruptions", type=int, default=10_000)
    parser.add_argument("--kills", type=int, default=1_000)
    parser.add_argument("--kills-per-file", type=int, default=100, help="kills one workbench file takes")
    parser.add_argument("--steps", type=int, default=10_000, help="state machine steps per family")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a corruption case may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="working folder (default: a new temporary one)")
    args = parse_args(parser)
    if args.quick:
        args.corruptions, args.kills, args.steps = min(args.corruptions, 300), min(args.kills, 12), \
            min(args.steps, 300)
    root = args.out or Path(tempfile.mkdtemp(prefix="hcw-reliability-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"working in {root}", flush=True)
    pristine = damage.make_pristine(root / "pristine")
    blocks = {}
    for part in PARTS if args.part == "all" else (args.part,):
        t0 = time.time()
        text = {"corruptions": corruptions, "kills": kills, "machine": machine}[part](args, root, pristine)
        blocks[part] = f"{text}\n\n_{part}: {time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d')}._"
        print(blocks[part], flush=True)
    if not args.no_write:
        write_section(SECTION, TITLE, _merged(blocks))


def _merged(blocks: dict[str, str]) -> str:
    """The section's body: this run's blocks, and the blocks of parts it did not run as they were."""
    old = DOC.read_text() if DOC.exists() else ""
    out = []
    for part in PARTS:
        if part in blocks:
            out.append(f"<!-- part:{part} -->\n{blocks[part]}\n<!-- /part:{part} -->")
            continue
        kept = re.search(rf"<!-- part:{part} -->.*?<!-- /part:{part} -->", old, re.S)
        if kept:
            out.append(kept.group(0))
    return "\n\n".join(out)


def corruptions(args, root: Path, pristine: Path) -> str:
    db = Path(json.loads(pristine.read_text())["db"])
    specs = damage.schedule(db, args.corruptions, seed=args.seed)
    t0 = time.time()

    def progress(done: int, total: int, r: dict) -> None:
        if damage.failed(r):
            print(f"  FAIL {r['outcome']}: {r['kind']} {r['table']}.{r['column']}: {r['detail'][:100]} | "
                  f"{r['message'].strip()[-200:]!r}", flush=True)
        if done % 250 == 0 or done == total:
            print(f"corruptions {done}/{total} ({time.time() - t0:.0f} s)", flush=True)

    results = damage.run_cases(pristine, specs, workers=args.workers, timeout_s=args.timeout, progress=progress)
    (root / "corruptions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    s = damage.summarize(results)
    cols = ("correct", "refused", "warned", "wrong", "unclear", "crash", "hang")
    lines = [f"{s['cases']:,} corruptions of a workbench file made by a real chat (a random hcw_hybrid with every "
             "layer kind, three turns, a fork, an edit answered again, a second conversation), "
             f"{len(damage.KINDS)} damage kinds over every column of every table and the raw file "
             "(workbench/damage.py, whose docstring gives the oracle of each); each case resumed the conversation, "
             "asked the next question through the plain REPL and ran `hcw inspect --verify` on a copy. "
             "Detected or harmless = correct + refused + warned; a damaged cache row must end correct.", "",
             "| damage kind | cases | " + " | ".join(cols) + " | detected or harmless |",
             "|---|---:|" + "---:|" * (len(cols) + 1)]
    for kind, counts in s["per_kind"].items():
        n = sum(counts.values())
        ok = sum(counts.get(c, 0) for c in ("correct", "refused", "warned"))
        lines.append(f"| {kind} | {n:,} | " + " | ".join(f"{counts.get(c, 0):,}" for c in cols) +
                     f" | {100 * ok / n:.1f}% |")
    o = s["outcomes"]
    lines.append(f"| **all** | **{s['cases']:,}** | " + " | ".join(f"**{o.get(c, 0):,}**" for c in cols) +
                 f" | **{100 * s['ok'] / max(1, s['cases']):.2f}%** |")
    cache = [r for r in results if r["scope"] == "cache"]
    lines += ["", f"Damage to cache rows (models, segments, blobs): {len(cache):,} cases, "
              f"{sum(r['outcome'] == 'correct' for r in cache):,} correct. `hcw inspect --verify`: "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(s["verify"].items()))
              + f"; refused or digest-damaged but verify clean: {s['verify_missed']:,}."]
    if s["failures"]:
        groups: dict[tuple, list[dict]] = {}
        for r in s["failures"]:
            groups.setdefault((r["outcome"], r["kind"], r["hit"], r["column"]), []).append(r)
        lines += ["", f"Failures ({len(s['failures']):,}), by outcome, kind, table and column (one reason each; "
                  f"`python -m workbench.damage case DIR KIND TABLE COLUMN SEED` runs one again):", ""]
        lines += [f"- {len(rs):,} × {o} — {k} {t}.{c or '*'} (seed {rs[0]['seed']}): {_why(rs[0])}"
                  for (o, k, t, c), rs in sorted(groups.items(), key=lambda g: -len(g[1]))[:20]]
    return "\n".join(lines)


def _why(r: dict) -> str:
    last = [line.strip() for line in (r["message"] or r["verify_text"]).strip().splitlines() if line.strip()]
    if r["verify"] == "crash" and r["chat"] not in damage.FAILURES:
        last = [line.strip() for line in r["verify_text"].strip().splitlines() if line.strip()]
        last = [f"verify: {last[-1]}" if last else "verify crashed"]
    return (last[-1] if last else r["detail"])[:160].replace("|", "\\|")


STATUS = re.compile(r"\[[^\n\]]* · \d+/\d+ prompt tokens reused · TTFT \d+ ms · [\d.]+ tok/s[^\n]*\]")
HEADER = re.compile(r"hcw chat · conversation ([0-9a-f]+) · branch ")
MARKS = ("hcw chat · ", "warning: ", "error: ", "on new branch ", "on branch ", "saved ", "resumed ")
USER_LINES = ("My name is Ada and I keep bees.", "What do bees eat?", "Tell me a long story about a river.",
              "Which flowers do they like best?", "What was my name?", "Count from one to twenty.")
KILL_HIDDEN = 256
MAX_NEW = 500  # tokens a turn: answers long enough (1-3 s) to be killed mid-way, drafts written
RESUMES = 3  # chats one conversation takes (at most 4 turns each), so it stays inside the model's 8K positions
DRAFT_DUE_S = 0.75  # a turn this old, streaming, has had a draft written (every 0.5 s from its start)
COMMANDS = ("/branch", "/switch main", "/edit 1 My name is Bea.", "/save")


class Chat:
    """One `hcw chat --plain` process, its output gathered as it comes."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, cwd=ROOT)
        self.t0 = time.monotonic()
        self.out, self.err = bytearray(), bytearray()
        self.sent_at: float | None = None
        self.killed_at: float | None = None
        self.cond = threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                        for f, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for r in self.readers:
            r.start()

    def _read(self, f, buf: bytearray) -> None:
        while chunk := os.read(f.fileno(), 65536):
            with self.cond:
                buf.extend(chunk)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def text(self) -> str:
        with self.cond:
            return self.out.decode("utf-8", "replace")

    def wait(self, pred, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.out.decode("utf-8", "replace")) or self.proc.poll() is not None,
                                      timeout)

    def turn_age(self) -> float:
        """Seconds from the last line sent to the kill: a turn's drafts are timed from its start."""
        return (self.killed_at or time.monotonic()) - self.sent_at if self.sent_at is not None else 0.0

    def send(self, line: str) -> None:
        self.sent_at = time.monotonic()
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the process is gone (killed by the timer: its pipe closed)
            pass

    def kill(self) -> float:
        at = time.monotonic() - self.t0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
        self.proc.wait()
        for r in self.readers:
            r.join(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        return at


def _drive(chat: Chat, lines: list[str], phase: str, target: int, rng: random.Random) -> tuple[int, float]:
    """Feed `lines` like a person, and SIGKILL at the moment `phase` asks for; (lines sent, time of the kill)."""
    if phase == "load":
        chat.wait(lambda t: HEADER.search(t), rng.uniform(0.0, 3.0))
        return 0, chat.kill()
    if not chat.wait(lambda t: HEADER.search(t) or "error: " in t, 120):
        return 0, chat.kill()
    if phase == "any":  # any moment of the conversation, whatever is running then
        threading.Timer(rng.uniform(0.0, 3.0), chat.kill).start()
    sent = 0
    for k, line in enumerate(lines):
        mark = len(chat.text())
        before = len(STATUS.findall(chat.text())) + chat.text().count("\nerror: ")
        chat.send(line)
        sent += 1
        if phase == "answer" and k == target:
            chat.wait(lambda t: len(t) > mark, 60)
            time.sleep(rng.uniform(0.0, 1.6))  # drafts are written every 0.5 s: some kills before the first
            break
        answers = not line.startswith("/") or line.startswith("/edit")
        done = (lambda t: len(STATUS.findall(t)) + t.count("\nerror: ") > before) if answers else \
            (lambda t: "\n" in t[mark:])
        chat.wait(done, 120)
        if phase == "between" and k == target:
            time.sleep(rng.uniform(0.0, 0.2))
            break
        if chat.proc.poll() is not None:
            break
        time.sleep(rng.uniform(0.0, 0.05))
    return sent, chat.kill()


def _turns(output: str) -> tuple[list[str], str | None]:
    """The answers whose status line was printed, as printed, and the text streaming at the end
    (None when the output ends on a boundary)."""
    answers, pending = [], []
    # lines end at "\n" only: an answer may hold any other break character
    for line in re.findall(r"[^\n]*\n|[^\n]+$", output):
        bare = line.rstrip("\n")
        if STATUS.fullmatch(bare):
            answers.append("".join(pending)[:-1])  # the answer, then say("") ends its line
            pending = []
        elif bare.startswith(MARKS) and line.endswith("\n"):
            pending = []
        else:
            pending.append(line)
    tail = "".join(pending)
    return answers, tail if tail else None


def _same(printed: str, stored: str) -> bool:
    # a trailing incomplete character streams as nothing and is stored as a replacement char
    return stored == printed or (stored.startswith(printed) and not stored[len(printed):].strip("\ufffd"))


def _check(db: Path, scratch: Path) -> dict:
    """A copy of the file as the kill left it (WAL included, so the next chat still recovers it
    itself): integrity_check, Conversations.check(), and the messages."""
    from store.conversations import Conversations
    from store.db import open_db

    scratch.mkdir(parents=True, exist_ok=True)
    copy = scratch / "check.db"
    for p in (copy, *damage._sidecars(copy)):
        p.unlink(missing_ok=True)
    shutil.copy(db, copy)
    wal = db.with_name(db.name + "-wal")
    if wal.exists():
        shutil.copy(wal, copy.with_name(copy.name + "-wal"))
    con = sqlite3.connect(copy)
    integrity = [r[0] for r in con.execute("PRAGMA integrity_check")]
    con.close()
    sdb = open_db(copy)
    try:
        findings = Conversations(sdb).check()
        rows = list(sdb.query("SELECT m.id, m.role, m.content, m.meta, p.role AS parent_role, p.content AS asked "
                              "FROM messages m LEFT JOIN messages p ON p.id = m.parent"))
    finally:
        sdb.conn.close()
    return {"integrity": integrity, "findings": findings, "rows": rows}


def kills(args, root: Path, pristine: Path) -> str:
    from engine.model.random_init import hcw_hybrid_dict, write_random_model

    # wider than the corruptions' model, so an answer lasts long enough (1-2 s) to be killed in
    folder = str(root / "kill-model")
    if not (Path(folder) / "config.json").exists():
        write_random_model(folder, hcw_hybrid_dict(hidden=KILL_HIDDEN), seed=3)
    env = {**os.environ, "HCW_HOME": str(root / "home"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    totals: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    todo = iter(range(args.kills))
    t0 = time.time()

    def lane(w: int) -> None:
        rng = random.Random(args.seed * 7919 + w)
        generation, taken, convs, before = 0, 0, Counter(), set()
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            if taken >= args.kills_per_file:
                generation, taken, convs, before = generation + 1, 0, Counter(), set()
            db = root / f"kills-{w}-{generation}.db"
            short = sorted(c for c, n in convs.items() if n < RESUMES)
            conv = rng.choice(short) if short and rng.random() < 0.5 else None
            lines = [rng.choice(USER_LINES) for _ in range(rng.randint(2, 4))]
            if rng.random() < 0.5:
                lines.insert(rng.randrange(1, len(lines) + 1), rng.choice(COMMANDS))
            phase = rng.choices(("load", "answer", "between", "any"), (2, 4, 2, 3))[0]
            cmd = [sys.executable, "-m", "workbench.cli", "chat", "--plain", "--db", str(db), "--model", folder,
                   "--max-new-tokens", str(MAX_NEW)] + (["--session", conv] if conv else [])
            chat = Chat(cmd, env)
            sent, _ = _drive(chat, lines, phase, rng.randrange(len(lines)), rng)
            taken += 1
            out, err = chat.out.decode("utf-8", "replace"), chat.err.decode("utf-8", "replace")
            seen = HEADER.search(out)
            if seen:
                convs[seen.group(1)] += 1
            tally, notes, before = _after(db, root / f"check-{w}", out, err, lines[:sent], conv, before, chat)
            tally[f"aimed:{phase}"] += 1
            with lock:
                totals.update(tally)
                problems.extend(f"kill {i} ({phase}, {'resumed' if conv else 'new'}): {n}" for n in notes)
                for n in notes:
                    print(f"  PROBLEM kill {i}: {n}", flush=True)
                done = totals["kills"]
                if done % 10 == 0 or done == args.kills:
                    print(f"kills {done}/{args.kills} ({time.time() - t0:.0f} s): answered {totals['answered']}, "
                          f"lost {totals['lost']}, integrity bad {totals['integrity_bad']}, check findings "
                          f"{totals['check_findings']}, streaming at kill {totals['streaming']} (draft due "
                          f"{totals['streaming_due']}), found incomplete {totals['incomplete_found']} (due "
                          f"{totals['incomplete_found_due']})", flush=True)

    threads = [threading.Thread(target=lane, args=(w,), daemon=True) for w in range(max(1, args.workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (root / "kills-problems.txt").write_text("\n".join(problems) + "\n")
    t = totals
    phases = ", ".join(f"{k[6:]} {v:,}" for k, v in sorted(t.items()) if k.startswith("phase:"))
    aimed = ", ".join(f"{k[6:]} {v:,}" for k, v in sorted(t.items()) if k.startswith("aimed:"))
    t["files"] = len(list(root.glob("kills-*.db")))
    lines = [f"{t['kills']:,} SIGKILLs of `hcw chat --plain` (a random hcw_hybrid of width {KILL_HIDDEN}, up to {MAX_NEW} new "
             f"tokens a turn) fed 2–5 lines each (messages, and /branch, /switch, /edit, /save), on {t['files']:,} workbench "
             f"files of up to {args.kills_per_file} kills each, {args.workers} chats at once; {t['resumed']:,} of "
             f"the chats continued a conversation with --session. Kills aimed at: {aimed} (any: a random moment up "
             f"to 3 s after the chat is ready). Where they landed, read from the output: {phases}.", "",
             "| kills | integrity_check not ok | Conversations.check() findings | answers with a printed status "
             "line | of them not stored whole | partial answers streaming at the kill (of them ≥ "
             f"{DRAFT_DUE_S:g} s into their turn) | found stored, labelled incomplete (of those ≥ {DRAFT_DUE_S:g} s) | error lines, "
             "tracebacks |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {t['kills']:,} | {t['integrity_bad']:,} | {t['check_findings']:,} | {t['answered']:,} | {t['lost']:,} "
             f"| {t['streaming']:,} ({t['streaming_due']:,}) | {t['incomplete_found']:,} "
             f"({t['incomplete_found_due']:,}) | {t['errors']:,}, {t['tracebacks']:,} |"]
    if problems:
        lines += ["", f"Problems ({len(problems):,}; the first 10):", ""] + [f"- {p[:200]}" for p in problems[:10]]
    return "\n".join(lines)


def _after(db: Path, scratch: Path, out: str, err: str, sent: list[str], conv: str | None,
           before: set[str], chat: Chat) -> tuple[Counter, list[str], set[str]]:
    """What one kill left: counts, problems, and the message ids the file holds now (a draft found
    must be new, not one an earlier kill left)."""
    tally: Counter = Counter(kills=1, resumed=int(conv is not None))
    notes = []
    answers, tail = _turns(out)
    started = HEADER.search(out) is not None
    replies = len(answers) + sum(line.startswith(MARKS[2:]) for line in out.split("\n"))
    phase = "model load or open" if not started else "mid-answer or its save" if tail else \
        "before the first token" if replies < len(sent) else "between turns"
    tally[f"phase:{phase}"] += 1
    if "Traceback" in err:
        tally["tracebacks"] += 1
        notes.append("traceback: " + err.strip().splitlines()[-1][:160])
    for line in out.split("\n"):
        if line.startswith("error: "):
            tally["errors"] += 1
            notes.append(line[:200])
    if not db.exists():
        return tally, notes, before
    state = _check(db, scratch)
    if state["integrity"] != ["ok"]:
        tally["integrity_bad"] += 1
        notes.append(f"integrity_check: {state['integrity'][:3]}")
    if state["findings"]:
        tally["check_findings"] += len(state["findings"])
        notes += [f"check: {f[:200]}" for f in state["findings"][:3]]
    asked = {line for line in sent if not line.startswith("/")} | {line.split(" ", 2)[2] for line in sent
                                                                   if line.startswith("/edit")}
    stored = [r for r in state["rows"] if r["role"] == "assistant" and r["asked"] in asked]
    for printed in answers:
        tally["answered"] += 1
        if not any(_same(printed, r["content"]) and not _meta(r).get("incomplete") for r in stored):
            tally["lost"] += 1
            notes.append(f"answered turn not stored whole: {printed[:60]!r}")
    if tail is not None and started:
        due = chat.turn_age() >= DRAFT_DUE_S
        found = any(_meta(r).get("incomplete") is True and r["id"] not in before for r in stored)
        tally["streaming"] += 1
        tally["streaming_due"] += due
        tally["incomplete_found"] += found
        tally["incomplete_found_due"] += found and due
        if due and not found:
            notes.append(f"killed {chat.turn_age():.2f} s into a streaming turn, no draft stored: {tail[:40]!r}")
    return tally, notes, {r["id"] for r in state["rows"]}


def _meta(row: dict) -> dict:
    try:
        meta = json.loads(row["meta"] or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def machine(args, root: Path, pristine: Path) -> str:
    import torch
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from engine import load_model
    from engine.model.random_init import qwen3_5_text_dict, write_random_model

    sys.path.insert(0, str(ROOT / "tests"))
    spec = importlib.util.spec_from_file_location("cache_state_machine", ROOT / "tests" / "test_cache_state_machine.py")
    sm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm)
    folder = root / "machine"
    folder.mkdir(parents=True, exist_ok=True)
    # one thread: the other cores run the other parts' processes, and a contended OpenMP team
    # waits at every op
    torch.set_num_threads(1)

    def v4():
        import hf_reference  # tests/: transformers' DeepseekV4Config gives the config.json body

        raw = hf_reference.deepseek_v4_config(vocab_size=61).to_dict()
        return load_model(write_random_model(folder / "v4", raw, seed=6, byte_tokenizer=False), device="cpu")

    families = {
        "hcw_hybrid (the test's model: every layer kind)": lambda: sm._model(folder),
        "qwen3_5_text (GDN and gated full attention, 1 : 1, 4 layers)": lambda: load_model(write_random_model(
            folder / "qwen", qwen3_5_text_dict(hidden=64, layers=4, vocab=61, attn_every=2), seed=6,
            byte_tokenizer=False), device="cpu"),
        "deepseek_v4 (sliding, CSA, HCA; hash and top-k MoE; hyper-connections)": v4,
    }
    rows = ["| family | steps | runs (examples) | failures | seconds |", "|---|---:|---:|---:|---:|"]
    failures = []
    for name, make in families.items():
        t0 = time.time()
        try:
            sm._MODEL["m"] = make()  # the machine takes its model from the module's cache
        except ImportError as e:
            rows.append(f"| {name} | not run: {e} | | | |")
            continue
        sm.STEPS.clear()
        runs, failed = 0, 0
        while len(sm.STEPS) < args.steps:
            try:
                run_state_machine_as_test(sm.CacheMachine, settings=settings(
                    max_examples=25, stateful_step_count=40, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), print_blob=True))
            except Exception as e:  # noqa: BLE001 - a falsified run is this benchmark's finding: reported, and on
                failed += 1
                failures.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
                print(f"  FAIL {failures[-1]}", flush=True)
                if failed >= 3:
                    break
            runs += 25
            print(f"machine {name.split()[0]}: {len(sm.STEPS):,} steps ({time.time() - t0:.0f} s)", flush=True)
        rows.append(f"| {name} | {len(sm.STEPS):,} | {runs:,} | {failed} | {time.time() - t0:.0f} |")
        sm._MODEL.clear()
    text = ["The hypothesis state machine of tests/test_cache_state_machine.py (submit, branch, resume, evict, "
            "fault, budget changes; every prompt checked against a no-cache oracle to 1e-4), run by this script "
            "with its own settings (25 examples of up to 40 steps a run, random seeds) until each family has "
            f"at least {args.steps:,} steps:", "", *rows]
    if failures:
        text += ["", "Failures:", ""] + [f"- {f}" for f in failures]
    return "\n".join(text)


if __name__ == "__main__":
    main()
