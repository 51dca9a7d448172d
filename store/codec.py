"""Blob format for one tensor on disk.

    header   magic "HCWB" | format version u8 | dtype code u8 | ndim u8 | shuffle u8 | shape u64 x ndim
    payload  zstd frame (content size and content checksum on) of the tensor's bytes, byte-shuffled:
             byte plane 0 of every element, then plane 1, ... (floats compress far better that way)

`decode` trusts nothing: the header must parse, the dtype be known, the frame's declared content
size must equal what the header's shape implies *before* anything is decompressed (a corrupt
header cannot make it allocate gigabytes), and zstd checks its own content checksum. Whole-blob
integrity (the row's xxh3-128 and length) is checked by the tier before decode is even called.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import NamedTuple

import numpy as np
import torch
import xxhash
import zstandard

MAGIC = b"HCWB"
VERSION = 1
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.float64, torch.uint8]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ITEMSIZE = [torch.empty(0, dtype=d).element_size() for d in _DTYPES]
_HEAD = struct.Struct("<4sBBBB")
LEVEL = 1  # measured (docs/BENCHMARKS.md, disk tier): higher levels gain no ratio on these planes and lose speed


class BlobError(ValueError):
    """A blob that cannot be trusted: the reason says which check failed."""


def checksum(data: bytes, prefix: bytes = b"") -> bytes:
    """xxh3-128 of prefix + data, without building the concatenation."""
    if not prefix:
        return xxhash.xxh3_128_digest(data)
    h = xxhash.xxh3_128(prefix)
    h.update(data)
    return h.digest()


def _shuffle(raw: np.ndarray, itemsize: int) -> bytes:
    return raw.reshape(-1, itemsize).T.tobytes()


def encode(t: torch.Tensor, level: int = LEVEL, shuffle: bool = True) -> bytes:
    if t.dtype not in _CODE:
        raise BlobError(f"dtype {t.dtype} has no blob encoding")
    t = t.detach().contiguous().cpu()
    itemsize = t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)
    shuffled = shuffle and itemsize > 1
    payload = _shuffle(raw, itemsize) if shuffled else raw.tobytes()
    head = _HEAD.pack(MAGIC, VERSION, _CODE[t.dtype], t.dim(), int(shuffled)) + struct.pack(f"<{t.dim()}Q", *t.shape)
    frame = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress(payload)
    return head + frame


class _Header(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    itemsize: int
    shuffled: bool
    expected: int  # bytes the payload decompresses to
    frame: memoryview  # the zstd frame, not copied out of the blob


def _parse(blob: bytes) -> _Header:
    """Every check that needs no decompression: header, dtype, shape, the frame's declared size."""
    if len(blob) < _HEAD.size:
        raise BlobError("blob shorter than its header")
    magic, version, code, ndim, shuffled = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise BlobError("bad magic")
    if version != VERSION:
        raise BlobError(f"format version {version}, expected {VERSION}")
    if code >= len(_DTYPES):
        raise BlobError(f"unknown dtype code {code}")
    if ndim > 8:
        raise BlobError(f"{ndim} dimensions")
    end = _HEAD.size + 8 * ndim
    if len(blob) < end:
        raise BlobError("blob shorter than its shape")
    shape = struct.unpack_from(f"<{ndim}Q", blob, _HEAD.size)
    dtype = _DTYPES[code]
    itemsize = _ITEMSIZE[code]
    expected = math.prod(shape) * itemsize if ndim else itemsize
    frame = memoryview(blob)[end:]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise BlobError(f"bad zstd frame header: {e}") from None
    if declared != expected:
        raise BlobError(f"frame declares {declared} bytes, the shape needs {expected}")
    return _Header(dtype, shape, itemsize, bool(shuffled), expected, frame)


def _tensor(h: _Header, raw) -> torch.Tensor:
    """The tensor from its decompressed payload: one copy (the un-shuffle, or, unshuffled, a
    writable copy); torch then shares that memory."""
    flat = np.frombuffer(raw, dtype=np.uint8)
    if len(flat) != h.expected:
        raise BlobError(f"{len(flat)} bytes decompressed, expected {h.expected}")
    if not h.expected:
        return torch.empty(h.shape, dtype=h.dtype)
    if h.shuffled:
        # plane by plane into the interleaved layout: ~3x faster than a transposed copy (measured)
        planes = flat.reshape(h.itemsize, -1)
        out = np.empty((planes.shape[1], h.itemsize), dtype=np.uint8)
        for i in range(h.itemsize):
            out[:, i] = planes[i]
        flat = out.reshape(-1)
    else:
        flat = flat.copy()
    return torch.from_numpy(flat).view(h.dtype).reshape(h.shape)


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One decompression context per thread, reused: creating one per blob costs more than
    decompressing a small blob."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def decode(blob: bytes) -> torch.Tensor:
    h = _parse(blob)
    try:
        raw = _decompressor().decompress(h.frame, max_output_size=h.expected)
    except zstandard.ZstdError as e:
        raise BlobError(f"zstd: {e}") from None
    return _tensor(h, raw)


def decode_many(blobs: list[bytes], threads: int = 1) -> list[torch.Tensor | BlobError]:
    """`decode` of many blobs at once, each result a tensor or the BlobError that blob raised.
    The frames are decompressed in one call (zstd's multi-frame API, on `threads` threads; 0:
    one per core, which only pays for large segments): per-blob overhead, not zstd, is what
    limits a restore of many small blobs."""
    out: list[torch.Tensor | BlobError] = []
    headers: list[tuple[int, _Header]] = []
    for i, blob in enumerate(blobs):
        try:
            headers.append((i, _parse(blob)))
            out.append(None)
        except BlobError as e:
            out.append(e)
    frames = [h.frame for _, h in headers if h.expected]
    try:
        raws = iter(_decompressor().multi_decompress_to_buffer(frames, threads=threads or -1) if frames else [])
    except zstandard.ZstdError:
        raws = None  # some frame is bad: decode one by one to tell which
    for i, h in headers:
        try:
            out[i] = _tensor(h, next(raws) if h.expected else b"") if raws is not None else decode(blobs[i])
        except BlobError as e:
            out[i] = e
    return out
