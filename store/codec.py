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

import struct

import numpy as np
import torch
import xxhash
import zstandard

MAGIC = b"HCWB"
VERSION = 1
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.float64, torch.uint8]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_HEAD = struct.Struct("<4sBBBB")
LEVEL = 1  # measured (docs/BENCHMARKS.md, disk tier): higher levels gain no ratio on these planes and lose speed


class BlobError(ValueError):
    """A blob that cannot be trusted: the reason says which check failed."""


def checksum(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


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


def decode(blob: bytes) -> torch.Tensor:
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
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize if ndim else itemsize
    frame = blob[end:]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise BlobError(f"bad zstd frame header: {e}") from None
    if declared != expected:
        raise BlobError(f"frame declares {declared} bytes, the shape needs {expected}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise BlobError(f"zstd: {e}") from None
    if len(raw) != expected:
        raise BlobError(f"{len(raw)} bytes decompressed, expected {expected}")
    # one copy: the un-shuffle (or, unshuffled, a writable copy); torch then shares that memory
    flat = np.frombuffer(raw, dtype=np.uint8)
    flat = flat.reshape(itemsize, -1).T.copy(order="C").reshape(-1) if shuffled else flat.copy()
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(flat).view(dtype).reshape(shape)
