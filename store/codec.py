"""Blob formats on disk: one tensor ("HCWB"), or a pack of same-dtype tensors ("HCWP").

    tensor   magic "HCWB" | format version u8 | dtype code u8 | ndim u8 | shuffle u8 | shape u64 x ndim
    pack     magic "HCWP" | format version u8 | dtype code u8 | shuffle u8 | count u32
             | per tensor: ndim u8, shape u64 x ndim
    payload  zstd frame (content size and content checksum on) of the tensors' bytes, concatenated;
             16-bit floats byte-shuffled (byte plane 0 of every element, then plane 1, each plane
             ending a zstd block): their sign-and-exponent plane compresses apart from the noisy
             mantissa bytes. Wider types are stored in element order: shuffling float32 would
             gain a little ratio on these states (docs/BENCHMARKS.md) but cost an un-shuffle
             pass over every restored byte, while a plain payload decompresses straight into the
             tensor's memory.
             The header's shuffle flag says which, so blobs written either way read back.

The disk tier writes packs: one per segment and state kind, so a restore pays the per-blob costs
(row, checksum, header, frame, un-shuffle) a few times per segment instead of once per tensor.

`decode` trusts nothing: the header must parse, the dtype be known, the frame's declared content
size must equal what the header's shape implies *before* anything is decompressed (a corrupt
header cannot make it allocate gigabytes), the frame's blocks and checksum must fill the blob
exactly, and zstd checks its own content checksum. Whole-blob
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
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.float64, torch.uint8,
           torch.int8]  # (append only: a dtype's code is its index, stored in every frame)
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ITEMSIZE = [torch.empty(0, dtype=d).element_size() for d in _DTYPES]
_HEAD = struct.Struct("<4sBBBB")
PACK_MAGIC = b"HCWP"
_PACK_HEAD = struct.Struct("<4sBBBI")
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(9)]  # a shape of n dimensions
MAX_PACK = 1 << 16  # tensors in one pack: a larger count is a corrupt header
_SHUFFLED = (torch.float16, torch.bfloat16)  # the dtypes written byte-shuffled
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


def _shuffled(dtype: torch.dtype, itemsize: int, shuffle: bool | None) -> bool:
    """None: the tier's policy (16-bit floats only); True / False force it (for measuring)."""
    return dtype in _SHUFFLED if shuffle is None else shuffle and itemsize > 1


def _shuffle(raw: np.ndarray, itemsize: int) -> bytes:
    return raw.reshape(-1, itemsize).T.tobytes()


def encode(t: torch.Tensor, level: int = LEVEL, shuffle: bool | None = None) -> bytes:
    if t.dtype not in _CODE:
        raise BlobError(f"dtype {t.dtype} has no blob encoding")
    itemsize = t.element_size()
    raw = _bytes_of(t)
    shuffled = _shuffled(t.dtype, itemsize, shuffle)
    payload = _shuffle(raw, itemsize) if shuffled else raw.tobytes()
    head = _HEAD.pack(MAGIC, VERSION, _CODE[t.dtype], t.dim(), int(shuffled)) + struct.pack(f"<{t.dim()}Q", *t.shape)
    return head + _frame(payload, itemsize if shuffled else 1, level)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes in element order as a uint8 array: a view when it is contiguous on the
    CPU, else one numpy copy (single-threaded; see encode_pack)."""
    t = t.detach().cpu()
    if not t.numel():
        return np.zeros(0, dtype=np.uint8)
    bits = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()  # same-size ints: numpy has no bfloat16
    return np.ascontiguousarray(bits).reshape(-1).view(np.uint8)


def encode_pack(tensors: list[torch.Tensor], level: int = LEVEL, shuffle: bool | None = None) -> bytes:
    """One blob for several tensors of one dtype, shuffled (see _shuffled) and compressed together."""
    if not tensors or len(tensors) > MAX_PACK:
        raise BlobError(f"a pack holds 1 to {MAX_PACK} tensors, not {len(tensors)}")
    dtype = tensors[0].dtype
    if dtype not in _CODE or any(t.dtype != dtype for t in tensors):
        raise BlobError(f"a pack holds tensors of one encodable dtype, got {sorted({str(t.dtype) for t in tensors})}")
    # numpy, not torch, for the copies: saves run on the write-behind thread, where a torch op
    # big enough to go parallel would start a second OpenMP team beside the generating thread's
    # (engine/threads.py: on 2 cores that halves generation speed)
    flat = [_bytes_of(t) for t in tensors]
    raw = np.concatenate(flat) if flat else np.zeros(0, dtype=np.uint8)
    itemsize = tensors[0].element_size()
    shuffled = _shuffled(dtype, itemsize, shuffle)
    payload = _shuffle(raw, itemsize) if shuffled else raw.tobytes()
    head = _PACK_HEAD.pack(PACK_MAGIC, VERSION, _CODE[dtype], int(shuffled), len(tensors))
    shapes = b"".join(struct.pack(f"<B{t.dim()}Q", t.dim(), *t.shape) for t in tensors)
    return head + shapes + _frame(payload, itemsize if shuffled else 1, level)


def _frame(payload: bytes, planes: int, level: int) -> bytes:
    """One zstd frame (content size and checksum on) of `payload`; a shuffled payload's byte
    planes each end a block. zstd codes a block's literals with one Huffman table, and a
    segment's pack is small enough for both planes of a 16-bit float to share a block: the
    exponent plane then pays for the mantissa's table; ending a block between them compresses
    bf16 KV packs better (docs/BENCHMARKS.md). Any zstd reader reads it."""
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    if planes == 1:
        return compressor.compress(payload)
    stream = compressor.compressobj(size=len(payload))
    size, view = len(payload) // planes, memoryview(payload)
    out = []
    for i in range(planes):
        out.append(stream.compress(view[i * size:(i + 1) * size]))
        out.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK if i < planes - 1 else zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


class _Header(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...] | list[tuple[int, ...]]  # a pack: one shape per tensor
    itemsize: int
    shuffled: bool
    expected: int  # bytes the payload decompresses to
    frame: memoryview  # the zstd frame, not copied out of the blob


def _parse(blob: bytes) -> _Header:
    """Every check that needs no decompression: header, dtype, shape, the frame's declared size."""
    magic, version, code, ndim, shuffled = _head(blob, _HEAD, MAGIC)
    if ndim > 8:
        raise BlobError(f"{ndim} dimensions")
    end = _HEAD.size + 8 * ndim
    if len(blob) < end:
        raise BlobError("blob shorter than its shape")
    shape = _dims(_SHAPES[ndim].unpack_from(blob, _HEAD.size))
    dtype = _DTYPES[code]
    itemsize = _ITEMSIZE[code]
    expected = math.prod(shape) * itemsize if ndim else itemsize
    return _checked_frame(blob, end, dtype, shape, itemsize, bool(shuffled), expected)


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    # beside a zero dimension any size passes the byte count: bound each one on its own
    if shape and max(shape) >= 1 << 48:
        raise BlobError(f"a dimension of {max(shape)}")
    return shape


def _head(blob: bytes, layout: struct.Struct, magic: bytes) -> tuple:
    """The fixed header, its magic, format version and dtype code checked."""
    if len(blob) < layout.size:
        raise BlobError("blob shorter than its header")
    fields = layout.unpack_from(blob)
    if fields[0] != magic:
        raise BlobError("bad magic")
    if fields[1] != VERSION:
        raise BlobError(f"format version {fields[1]}, expected {VERSION}")
    if fields[2] >= len(_DTYPES):
        raise BlobError(f"unknown dtype code {fields[2]}")
    return fields


def _parse_pack(blob: bytes) -> _Header:
    magic, version, code, shuffled, count = _head(blob, _PACK_HEAD, PACK_MAGIC)
    if not 0 < count <= MAX_PACK:
        raise BlobError(f"a pack of {count} tensors")
    at, size = _PACK_HEAD.size, len(blob)
    first = _shape_at(blob, at, size)
    step = 1 + 8 * len(first)
    if blob[at:at + step * count] == blob[at:at + step] * count:
        # every member has the first one's shape: the usual pack
        shapes, at, elements = [first] * count, at + step * count, math.prod(first) * count
    else:
        shapes = []
        for _ in range(count):
            shapes.append(_shape_at(blob, at, size))
            at += 1 + 8 * len(shapes[-1])
        elements = sum(math.prod(shape) for shape in shapes)
    itemsize = _ITEMSIZE[code]
    expected = elements * itemsize
    return _checked_frame(blob, at, _DTYPES[code], shapes, itemsize, bool(shuffled), expected)


def _shape_at(blob: bytes, at: int, size: int) -> tuple[int, ...]:
    """One pack member's shape record: ndim u8, then shape u64 x ndim."""
    ndim = blob[at] if at < size else 0
    if at + 1 + 8 * ndim > size:
        raise BlobError("blob shorter than its shapes")
    if ndim > 8:
        raise BlobError(f"{ndim} dimensions")
    return _dims(_SHAPES[ndim].unpack_from(blob, at + 1))


def _checked_frame(blob, at, dtype, shape, itemsize, shuffled, expected) -> _Header:
    frame = memoryview(blob)[at:]
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise BlobError(f"bad zstd frame header: {e}") from None
    if declared != expected:
        raise BlobError(f"frame declares {declared} bytes, the shape needs {expected}")
    return _Header(dtype, shape, itemsize, shuffled, expected, frame)


def _tensor(h: _Header) -> torch.Tensor | list[torch.Tensor]:
    payload = _payload(h)
    try:
        return _views(h, payload)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # a shape torch cannot take
        raise BlobError(f"unusable shape: {e}") from None


def _payload(h: _Header) -> np.ndarray:
    """The decompressed bytes in element order, in memory of their own: a plain payload is
    decompressed straight into it, a shuffled one into a per-thread scratch buffer and un-shuffled
    from there (numpy copies outside the GIL)."""
    if not h.expected:
        return np.zeros(0, dtype=np.uint8)
    if not h.shuffled:
        return _decompress_into(h, np.empty(h.expected, dtype=np.uint8))
    flat = _decompress_into(h, _scratch(h.expected))
    # plane by plane into the interleaved layout: faster than a transposed copy (docs/BENCHMARKS.md)
    planes = flat.reshape(h.itemsize, -1)
    out = np.empty((planes.shape[1], h.itemsize), dtype=np.uint8)
    for i in range(h.itemsize):
        out[:, i] = planes[i]
    return out.reshape(-1)


def _decompress_into(h: _Header, buf: np.ndarray) -> np.ndarray:
    """The frame decompressed into `buf` (exactly h.expected bytes); zstd checks the content
    checksum, which the frame must carry in full (_check_whole)."""
    try:
        if not h.frame[4] & 0x04:  # the frame header descriptor's content-checksum flag
            raise BlobError("zstd frame without a content checksum")
        _check_whole(h.frame)
        done = 0
        with _decompressor().stream_reader(h.frame) as reader:
            while done < h.expected:
                got = reader.readinto(buf[done:])
                if not got:
                    break
                done += got
            extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise BlobError(f"zstd: {e}") from None
    if done != h.expected or extra:
        raise BlobError(f"frame holds {'more than ' if extra else ''}{done} bytes, expected {h.expected}")
    return buf


def _check_whole(frame: memoryview) -> None:
    """The frame's blocks and its 4 checksum bytes fill `frame` exactly. zstd checks the content
    checksum when it reaches it, but a streaming read that runs out of input right after the
    content never reaches it: a frame cut short by its last bytes would decode. Walking the block
    headers (3 bytes each, a few per blob) costs far less than hashing the content again."""
    size, at = len(frame), zstandard.frame_header_size(frame)
    last = 0
    while not last:
        if at + 3 > size:
            raise BlobError("zstd: the frame is cut short")
        head = frame[at] | frame[at + 1] << 8 | frame[at + 2] << 16
        last = head & 1
        at += 3 + (1 if (head >> 1) & 3 == 1 else head >> 3)  # an RLE block stores one byte
    if at + 4 != size:
        raise BlobError(f"zstd: the frame's blocks and checksum take {at + 4} bytes, the blob holds {size}")


def _views(h: _Header, payload: np.ndarray) -> torch.Tensor | list[torch.Tensor]:
    """The tensor, or a pack's tensors, as views of the payload's memory."""
    values = torch.frombuffer(payload, dtype=h.dtype) if h.expected else torch.empty(0, dtype=h.dtype)
    if not isinstance(h.shape, list):
        return values.view(h.shape)
    at, shapes, count = 0, h.shape, len(h.shape)
    if shapes.count(shapes[0]) == count:  # one shape throughout: the usual pack
        return list(values.view(count, *shapes[0]).unbind(0))
    out: list[torch.Tensor] = []
    for i, shape in enumerate(shapes):
        if i and shape == shapes[i - 1]:
            continue  # taken with the run it belongs to
        run = 1
        while i + run < count and shapes[i + run] == shape:
            run += 1
        numel = math.prod(shape)
        # a run of same-shape members is one view and one unbind: a view per tensor cost more
        # than the rest of assembling a segment
        out.extend(values.narrow(0, at, run * numel).view(run, *shape).unbind(0))
        at += run * numel
    return out


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One decompression context per thread, reused: creating one per blob costs more than
    decompressing a small blob."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _scratch(size: int) -> np.ndarray:
    """A per-thread buffer of at least `size` bytes, reused: fresh pages cost a fault each."""
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < size:
        buf = _local.scratch = np.empty(size, dtype=np.uint8)
    return buf[:size]


def decode(blob: bytes) -> torch.Tensor:
    value = _decode_one(blob)
    if isinstance(value, list):
        raise BlobError("a pack where one tensor was expected")
    return value


def decode_pack(blob: bytes) -> list[torch.Tensor]:
    value = _decode_one(blob)
    if not isinstance(value, list):
        raise BlobError("one tensor where a pack was expected")
    return value


def _decode_one(blob: bytes) -> torch.Tensor | list[torch.Tensor]:
    value = decode_many([blob])[0]
    if isinstance(value, BlobError):
        raise value
    return value


def decode_many(blobs: list[bytes]) -> list[torch.Tensor | list[torch.Tensor] | BlobError]:
    """`decode` of many blobs at once (tensors or packs), each result a tensor, a pack's list of
    tensors, or the BlobError that blob raised."""
    out: list = []
    for blob in blobs:
        try:
            out.append(_tensor(_parse_pack(blob) if blob[:4] == PACK_MAGIC else _parse(blob)))
        except BlobError as e:
            out.append(e)
    return out
