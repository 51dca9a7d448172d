"""One value damaged as a column kind says (bitflip, truncate, type), whatever its storage class:
an integer's bits as SQLite stores them, text as UTF-8 that a flipped bit may leave invalid."""

from __future__ import annotations

import random


class Invalid(bytes):
    """Bytes to store as TEXT (CAST): not UTF-8."""


def as_text(raw: bytes):
    """Bytes as a TEXT value: a str when they are UTF-8, else left invalid (what a flipped bit on
    disk gives), marked for damage_apply's `_write`."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return Invalid(raw)


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return b"\x01"
    out = bytearray(data)
    out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def bitflip(old, rng: random.Random):
    if isinstance(old, int):  # one bit of its 64-bit two's complement, as SQLite stores it
        flipped = (old ^ (1 << rng.randrange(64))) & ((1 << 64) - 1)
        return flipped - (1 << 64) if flipped >= 1 << 63 else flipped
    if isinstance(old, float):
        return -old
    if isinstance(old, str):
        return as_text(_flip(old.encode(), rng))
    if isinstance(old, bytes):
        return _flip(old, rng)
    return rng.randrange(1 << 16)  # NULL: a value where none was


def truncate(old, rng: random.Random):
    if isinstance(old, int):
        return old % (256 ** rng.randrange(8)) if old >= 0 else old % 256
    if isinstance(old, str):
        return old[:rng.randrange(len(old))] if old else ""
    if isinstance(old, bytes):
        return old[:rng.randrange(len(old))] if old else b""
    return old


def retype(old, decl: str, rng: random.Random):
    """The same value as another storage class (a TEXT column keeps text put in it as an integer,
    so text becomes a blob)."""
    if "INT" in decl:
        return rng.choice([f"{old}x", (old or 0) + 0.5, str(old).encode()])
    if "TEXT" in decl:
        return (old or "").encode() if isinstance(old, str) else b"\x00\x01"
    return rng.choice([old.hex() if isinstance(old, bytes) else "x", rng.randrange(1 << 30)])


def short(value) -> str:
    """A value as a Damage's detail shows it."""
    r = repr(value)
    return r if len(r) < 60 else r[:57] + "..."
