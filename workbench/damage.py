"""The damage engine: one workbench file made by a real chat, damaged one way at a time, then used
the way a person would — the conversation resumed and the next question sent through the plain
REPL (`run_plain`), and `hcw inspect --verify` run on a copy — and every case sorted into an
outcome. Used by tests/test_damage_fuzz.py (a few hundred cases) and benchmarks/reliability.py
(ten thousand).

The file (`make_pristine`): a random hcw_hybrid with every layer kind and a byte tokenizer, a chat
of three turns on "main" with a fork and an edit answered again (block 16, a GDN checkpoint at
every segment), a second conversation, and two `models` rows (nothing writes that table yet, so
they are added to have its columns damaged too); closed, so the WAL is checkpointed away.

Damage (`Spec`: kind, table, column, seed), through a raw sqlite3 connection with foreign keys off
(NOT NULL bypassed the way a damaged page would hold it) or on the raw bytes:

    per column   bitflip (one bit of the value: text as UTF-8, possibly left invalid), truncate
                 (a shorter value; an integer's low bytes), null, type (blob for text; text, real
                 or blob for an integer; text or an integer for a blob), swap (with another row)
    per row      delete, clone (a copy under a new key)
    tree         cycle (a message's parent made itself or a descendant), dangling_tip (a thread's
                 tip made an id that is missing, a message of the other conversation, or '')
    file         raw_bitflip (1-8 bits anywhere), truncate_file, zero_page, torn_page (4 KiB
                 sectors of one page zeroed); the page hit is named by `dbstat`

Outcomes of the chat: "correct" — the answer is an oracle answer; "refused" — a ValueError,
KeyError, ConfigError or sqlite3.DatabaseError at open, or an "error: ..." line from the REPL,
one line naming the damage (an id of the damaged row, its table or column, or the file's state);
"warned" — another answer, with a warning naming damage, where the history itself was damaged;
"wrong" — another answer with no warning (the worst); "unclear" — a refusal that is not one line
naming the damage; "crash" — any other exception; "hang" — the case passed its time limit (each
case runs in a worker process the parent kills). `hcw inspect --verify` on the same damage:
"clean" (exit 0), "findings" (exit 1, each named), "error" (one "error: ..." line), "crash" (a
traceback) or "hang"; a case whose chat was refused or warned, or whose history fails the digest
check, while verify said clean is marked `verify_missed`.

The oracle. Answers are greedy, so the oracle is the answer a cold engine (no cache) gives to the
next question on a history; which history depends on what the damage is:

    cache rows (models, segments, blobs): the pristine history of the thread resumed. Nothing here
        may change an answer: a row that fails to parse or verify is a miss and recomputed, so
        these cases must end "correct" (a refusal is a failure too)
    messages.content, messages.role, threads.tip: the history as stored now. Content is the data,
        and a tip is a pointer a person may move (`set_tip`); what must hold is that the cache
        never reuses the states of the old content (segment keys hash the token ids) — the answer
        equals the cold answer on the damaged history, or the damage is refused
    every other column of the conversation tables, and the tree kinds: the history read by a
        strict reader (every row present, of its conversation, a valid role and text, no cycle,
        and each id the digest of its conversation, parent, role and content): when that history
        is whole it is the oracle (a damaged timestamp, token count, meta, title, a thread moved
        away, an id of a message on no path: harmless); when it is not, nothing is an oracle and
        only a refusal (or a warning) is right — a parent set to NULL or swapped must never be
        answered from a shortened or spliced history
    file kinds: either oracle above (a flipped bit may land in a message's text); a page SQLite
        finds malformed may be refused at open, and damage SQLite reads without noticing (an index
        page) may be refused naming the conversation, thread or message it made unreadable

Every oracle answer is computed by `Oracle.answer` with a fresh `Engine` and the session's own
template and sampling, and the pristine file checks it against a reuse="off" session and a cached
one before any case runs.

The parts, each a module of its own:

    damage_spec.py      the kinds, tables and outcomes; Spec, Damage; schedule
    damage_pristine.py  make_pristine: the file every case starts from
    damage_oracle.py    Oracle, read_history
    damage_apply.py     apply_damage: the column, row and tree kinds
    damage_values.py    one value damaged as bitflip, truncate or type do it
    damage_file.py      the file kinds
    damage_runner.py    Runner: one case run and sorted into an outcome
    damage_workers.py   run_cases: the cases in worker processes
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from workbench.damage_apply import apply_damage
from workbench.damage_oracle import Oracle, chat_options, read_history
from workbench.damage_pristine import make_pristine, sidecars
from workbench.damage_runner import Runner
from workbench.damage_spec import (CACHE_TABLES, COLUMN_KINDS, DATA_COLUMNS, FAILURES, FILE_KINDS, FILE_WORDS, KINDS,
                                   OUTCOMES, QUESTION, ROW_KINDS, SECTOR, TABLES, TREE_KINDS, VERIFY_OUTCOMES, Damage,
                                   Spec, columns, combos, schedule)
from workbench.damage_workers import run_cases, worker_main

# what callers import from here
__all__ = ["CACHE_TABLES", "COLUMN_KINDS", "DATA_COLUMNS", "FAILURES", "FILE_KINDS", "FILE_WORDS", "KINDS", "OUTCOMES",
           "QUESTION", "ROW_KINDS", "SECTOR", "TABLES", "TREE_KINDS", "VERIFY_OUTCOMES", "Damage", "Oracle", "Runner",
           "Spec", "apply_damage", "chat_options", "columns", "combos", "failed", "main", "make_pristine",
           "read_history", "reproducer", "run_cases", "schedule", "sidecars", "summarize"]

# benchmarks/reliability.py removes a copy's WAL by this older name
_sidecars = sidecars


def failed(r: dict) -> bool:
    """A failure: wrong, unclear, crash, hang, the harness's own error, or damage to a cache row
    that did not end in the right answer (it must be recomputed)."""
    return r["outcome"] in (*FAILURES, "harness") or (r["scope"] == "cache" and r["outcome"] != "correct")


def summarize(results: list[dict]) -> dict:
    """Counts: outcome overall, per kind and per table hit; verify's outcomes; failures listed."""
    per_kind: dict[str, Counter] = defaultdict(Counter)
    per_table: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        per_kind[r["kind"]][r["outcome"]] += 1
        per_table[r["hit"]][r["outcome"]] += 1
    outcomes = Counter(r["outcome"] for r in results)
    return {"cases": len(results), "outcomes": dict(outcomes),
            "ok": sum(outcomes[o] for o in ("correct", "refused", "warned")),
            "verify": dict(Counter(r["verify"] for r in results)),
            "verify_missed": sum(r["verify_missed"] for r in results),
            "per_kind": {k: dict(v) for k, v in sorted(per_kind.items())},
            "per_table": {k: dict(v) for k, v in sorted(per_table.items())},
            "failures": [r for r in results if failed(r)]}


def main(argv: list[str]) -> None:
    """`python -m workbench.damage case DIR KIND TABLE COLUMN SEED`: one case, printed (the pristine
    file is made in DIR first unless it is there; '-' for no table or column). `worker PRISTINE
    SCRATCH` is what run_cases starts."""
    if argv[:1] == ["worker"]:
        worker_main(argv[1], argv[2])
        return
    if argv[:1] == ["case"] and len(argv) == 6:
        root, kind, table, column, seed = argv[1:6]
        pristine = Path(root) / "pristine.json"
        if not pristine.exists():
            make_pristine(Path(root))
        spec = Spec(kind, None if table == "-" else table, None if column == "-" else column, int(seed))
        print(json.dumps(Runner(pristine, Path(root) / "case").run(spec), indent=1))
        return
    raise SystemExit(main.__doc__)


def reproducer(root: Path | str, r: dict) -> str:
    """The command that runs one result's case again."""
    return (f"python -m workbench.damage case {root} {r['kind']} {r['table'] or '-'} {r['column'] or '-'} "
            f"{r['seed']}")


if __name__ == "__main__":
    main(sys.argv[1:])
