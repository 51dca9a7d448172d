"""`hcw inspect`: what the workbench database holds, and with --verify whether all of it is sound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from store.db import default_home
from store.tier import DiskTier


def inspect(db_path: Path | None, verify: bool, gc: bool, as_json: bool, out: TextIO) -> bool:
    """Print the report; return True when --verify found anything bad."""
    path = db_path or default_home() / "hcw.db"
    if not Path(path).is_file():
        raise ValueError(f"no workbench database at {path}")
    tier = DiskTier(path)
    db = tier.db
    removed = _gc(db) if gc else 0
    by_kind = {kind: {"blobs": n, "stored_bytes": stored or 0, "raw_bytes": raw or 0}
               for kind, n, stored, raw in db.execute(
                   "SELECT kind, count(*), sum(length), sum(raw_len) FROM blobs GROUP BY kind ORDER BY kind")}
    layouts = {layout: n for layout, n in db.execute("SELECT layout, count(*) FROM segments GROUP BY layout")}
    report = {
        "db": str(path),
        "models": db["models"].count,
        "segments": db["segments"].count,
        "layouts": {k[:16]: v for k, v in layouts.items()},
        "by_kind": {k: {**v, "ratio": (v["raw_bytes"] / v["stored_bytes"]) if v["stored_bytes"] else None}
                    for k, v in by_kind.items()},
        "gc_removed": removed,
    }
    bad = []
    if verify:
        for key, layout in db.execute("SELECT key, layout FROM segments ORDER BY idx").fetchall():
            tier.layout = layout  # verify each row against the layout it claims
            pieces, why = tier.load(bytes.fromhex(key))
            if pieces is None:
                bad.append({"segment": key, "reason": why})
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        report["verify"] = {"checked": report["segments"], "bad": bad, "integrity_check": integrity}
        if integrity != "ok":
            bad.append({"segment": None, "reason": f"integrity_check: {integrity}"})
    tier.close()
    if as_json:
        out.write(json.dumps(report) + "\n")
        return bool(bad)
    out.write(f"{report['db']}\n  models: {report['models']}  segments: {report['segments']}  "
              f"layouts: {len(layouts)}\n")
    out.write(f"  {'state kind':16} {'blobs':>7} {'stored MiB':>11} {'raw MiB':>9} {'ratio':>6}\n")
    for kind, v in report["by_kind"].items():
        ratio = f"{v['ratio']:.2f}" if v["ratio"] else "-"
        out.write(f"  {kind:16} {v['blobs']:7d} {v['stored_bytes'] / 2**20:11.3f} {v['raw_bytes'] / 2**20:9.3f} "
                  f"{ratio:>6}\n")
    if gc:
        out.write(f"  gc: removed {removed} unreachable segment(s)\n")
    if verify:
        out.write(f"  verify: {len(bad)} bad of {report['segments']} segments; integrity_check "
                  f"{report['verify']['integrity_check']}\n")
        for b in bad:
            out.write(f"    {b['segment']}: {b['reason']}\n")
    return bool(bad)


def _gc(db) -> int:
    """Remove segments no chain from a first segment reaches (their parent is gone), repeatedly."""
    removed = 0
    while True:
        orphans = [k for (k,) in db.execute(
            "SELECT s.key FROM segments s WHERE s.idx > 0 AND NOT EXISTS "
            "(SELECT 1 FROM segments p WHERE p.key = s.parent)").fetchall()]
        if not orphans:
            return removed
        with db.conn:
            for key in orphans:
                db.execute("DELETE FROM blobs WHERE segment = ?", [key])
                db.execute("DELETE FROM segments WHERE key = ?", [key])
        removed += len(orphans)
