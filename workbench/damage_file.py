"""The file kinds of damage, done on the raw bytes: bits flipped anywhere, the file cut short, a
page zeroed, a page torn (some of its 4 KiB sectors zeroed); the page hit is named from dbstat."""

from __future__ import annotations

import random
from pathlib import Path

from workbench.damage_spec import SECTOR, Damage, Spec


def file_damage(db: Path, spec: Spec, rng: random.Random, info: dict) -> Damage:
    data = bytearray(db.read_bytes())
    size, page = len(data), info["page_size"]
    if spec.kind == "raw_bitflip":
        at = rng.randrange(size)
        bits = 1 if rng.random() < 0.7 else rng.randint(2, 8)
        for _ in range(bits):
            where = min(size - 1, at + rng.randrange(16))
            data[where] ^= 1 << rng.randrange(8)
        detail = f"{bits} bit(s) flipped at byte {at}"
    elif spec.kind == "truncate_file":
        at = rng.randrange(size // page) * page if rng.random() < 0.4 else rng.randrange(size)
        data = data[:at]
        detail = f"truncated to {at} of {size} bytes"
    elif spec.kind == "zero_page":
        at = rng.randrange(size // page) * page
        data[at:at + page] = bytes(page)
        detail = f"page {at // page + 1} zeroed"
    else:
        base = rng.randrange(size // page) * page
        first = rng.randrange(page // SECTOR)
        last = rng.randrange(first, page // SECTOR)
        data[base + first * SECTOR:base + (last + 1) * SECTOR] = bytes((last + 1 - first) * SECTOR)
        at = base + first * SECTOR
        detail = f"page {base // page + 1}: sectors {first}..{last} zeroed"
    db.write_bytes(bytes(data))
    hit = info["pages"].get(str(at // page + 1), "free") if spec.kind != "truncate_file" else "-"
    # what SQLite reads without noticing surfaces as a row gone missing: naming its id names it
    names = (hit, info["conversation"], info["other"], *info["threads"])
    return Damage(spec.kind, hit, None, detail, names, "file")
