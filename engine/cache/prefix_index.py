"""Prefix index: which whole segments of a token sequence have been computed before.

Segment j covers tokens [j*B, (j+1)*B). Its key chains the parent's key, the model + layout
fingerprint and the segment's token ids through a 128-bit hash, so equal keys mean equal
prefixes under the same model and layout. A hash is never trusted alone: every hit compares the
stored token ids with the request's, and a mismatch (a collision) ends the match.

    root -> [seg 0] -> [seg 1] -> [seg 2a]      branches share every segment before
                              \\-> [seg 2b]      the one where they differ

A match reports the *logical* hit: verified whole segments, plus how far the tokens agree inside
the next segment (token-level longest match). Only the validator decides what is usable.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

ROOT = b"\x00" * 16


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The ids as little-endian int64s: what segment keys hash and hits compare (struct: it packs
    a list of ints faster than numpy converts one)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def segment_hash(parent: bytes, fingerprint: bytes, data: bytes) -> bytes:
    """Key of a segment whose token ids, as int64 bytes, are `data`."""
    return xxhash.xxh3_128_digest(parent + fingerprint + data)


def _common_segments(a: bytes, b: bytes, seg_bytes: int, limit: int) -> int:
    """How many leading whole segments (seg_bytes each, at most `limit`) a and b share."""
    n = min(limit, len(a) // seg_bytes, len(b) // seg_bytes)
    if a[:n * seg_bytes] == b[:n * seg_bytes]:
        return n
    j = 0
    while a[j * seg_bytes:(j + 1) * seg_bytes] == b[j * seg_bytes:(j + 1) * seg_bytes]:
        j += 1
    return j


@dataclass(eq=False)
class SegmentNode:
    key: bytes
    parent: bytes
    index: int  # segment number: tokens [index*B, (index+1)*B)
    tokens: tuple[int, ...]
    data: bytes  # the same token ids as int64 bytes: what every hit is compared against
    children: dict[bytes, SegmentNode] = field(default_factory=dict)


class MatchResult(NamedTuple):
    segments: list[SegmentNode]  # verified whole segments, in order from the start
    logical_tokens: int  # tokens that agree with something cached, whole segments or not
    collisions: int  # hash hits rejected because the stored tokens differ


class PrefixIndex:
    # validation layer 1's token comparison. Only a test turns it off, to show what a hash-only hit
    # (as in engines that trust the hash) does to an answer.
    verify_tokens = True

    def __init__(self, block_size: int, fingerprint: bytes,
                 hash_fn: Callable[[bytes, bytes, Sequence[int]], bytes] = segment_hash):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.hash_fn = hash_fn
        self.nodes: dict[bytes, SegmentNode] = {}
        self.roots: dict[bytes, SegmentNode] = {}
        self.collisions = 0
        # the last match's (hash_fn, fingerprint, token bytes, keys of its segments hashed so far)
        self._memo: tuple[Callable | None, bytes, bytes, list[bytes]] = (None, b"", b"", [])

    def keys_for(self, tokens: Sequence[int]) -> list[bytes]:
        """Chained keys of every whole segment of `tokens`."""
        keys, parent, b = [], ROOT, self.block_size
        raw = token_bytes(tokens)  # converted once, sliced per segment (8 bytes a token)
        for j in range(len(tokens) // b):
            parent = self.hash_fn(parent, self.fingerprint, raw[8 * j * b:8 * (j + 1) * b])
            keys.append(parent)
        return keys

    def match(self, tokens: Sequence[int]) -> MatchResult:
        b = self.block_size
        found: list[SegmentNode] = []
        collisions = 0
        raw = token_bytes(tokens)
        seg_bytes = 8 * b
        # keys of the whole segments this request shares with the last one matched are taken from
        # it (a conversation's next turn repeats its whole prefix): only new segments are hashed
        hash_fn, fingerprint, lookup, verify = self.hash_fn, self.fingerprint, self.nodes.get, self.verify_tokens
        memo_fn, memo_fp, memo_raw, memo_keys = self._memo
        same = (_common_segments(raw, memo_raw, seg_bytes, len(memo_keys))
                if memo_fn is hash_fn and memo_fp == fingerprint else 0)
        # a new list, the kept one untouched: a match that stops half way (an exception) or runs
        # beside another leaves the kept keys true to their bytes
        keys = memo_keys[:same]
        parent = keys[-1] if keys else ROOT
        for j in range(len(tokens) // b):
            chunk = raw[seg_bytes * j:seg_bytes * (j + 1)]
            if j < same:
                key = keys[j]
            else:  # hashed lazily: nothing past the first miss is hashed
                key = parent = hash_fn(parent, fingerprint, chunk)
                keys.append(key)
            node = lookup(key)
            if node is None:
                break
            if verify and node.data != chunk:
                collisions += 1
                break
            found.append(node)
        self._memo = (hash_fn, fingerprint, raw[:seg_bytes * len(keys)], keys)
        self.collisions += collisions
        logical = len(found) * b
        # token-level: how far the next (partial or unmatched) segment agrees with a cached child
        siblings = found[-1].children.values() if found else self.roots.values()
        rest = tokens[logical:logical + b]
        best = 0
        for child in siblings:
            n = 0
            for a, c in zip(rest, child.tokens):
                if a != c:
                    break
                n += 1
            best = max(best, n)
        return MatchResult(found, logical + best, collisions)

    def insert(self, parent: bytes, index: int, seg_tokens: Sequence[int]) -> SegmentNode | None:
        """Register segment `index` (its tokens) under `parent` (ROOT for the first). Returns the
        node, existing or new, or None when the key is taken by other tokens (a collision)."""
        seg = tuple(seg_tokens)
        if len(seg) != self.block_size:
            raise ValueError(f"a segment has {self.block_size} tokens, got {len(seg)}")
        data = token_bytes(seg)
        key = self.hash_fn(parent, self.fingerprint, data)
        node = self.nodes.get(key)
        if node is not None:
            if node.data != data or node.index != index:
                self.collisions += 1
                return None
            return node
        node = SegmentNode(key, parent, index, seg, data)
        self.nodes[key] = node
        if index == 0:
            self.roots[key] = node
        elif parent in self.nodes:
            self.nodes[parent].children[key] = node
        return node

    def remove(self, key: bytes) -> None:
        node = self.nodes.pop(key, None)
        if node is None:
            return
        self.roots.pop(key, None)
        parent = self.nodes.get(node.parent)
        if parent is not None:
            parent.children.pop(key, None)
