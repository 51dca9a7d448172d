"""A digest of every byte of a model's weights: the part of the layout fingerprint that tells two
models apart, so one never reuses another's cached states.

    files_digest(paths)     xxh3-128 over each safetensors file's whole bytes (header and every
                            tensor), remembered per file in a small cache keyed by (path, size,
                            mtime, ctime, inode, device, header digest), so a model hashed once
                            starts at a stat's cost
    tensors_digest(model)   a model built in memory (tests, training): xxh3-128 over every
                            parameter's and buffer's bytes in logical order

A file changed in place is hashed again: its ctime moves even when its mtime is set back.
The cache lives in `$HCW_DIGEST_CACHE`, else `$XDG_CACHE_HOME/hcw/weights.json`, else
`~/.cache/hcw/weights.json`; a damaged or unwritable cache is recomputed, never trusted.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import xxhash

_READ = 16 << 20  # bytes read at a time while hashing a file
_HEADER_MAX = 100 << 20  # a safetensors header longer than this is not one (the format's own bound)


def cache_path() -> Path:
    if os.environ.get("HCW_DIGEST_CACHE"):
        return Path(os.environ["HCW_DIGEST_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hcw" / "weights.json"


def header_digest(path: Path) -> str:
    """xxh3-128 of the safetensors header (its length prefix and JSON), hex. Raises ValueError
    when the file is too short or its declared header length is out of bounds."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} is not a safetensors file: {len(prefix)} bytes")
        (n,) = struct.unpack("<Q", prefix)
        if n > _HEADER_MAX or n > path.stat().st_size - 8:
            raise ValueError(f"{path.name} is not a safetensors file: it declares a {n}-byte header "
                             f"in a {path.stat().st_size}-byte file")
        return xxhash.xxh3_128_hexdigest(prefix + f.read(n))


def file_digest(path: Path) -> str:
    """xxh3-128 of the whole file, hex."""
    h = xxhash.xxh3_128()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:  # into one buffer: no allocation per read
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def files_digest(paths: Iterable[Path]) -> bytes:
    """One digest over the named files' digests (each cached by path, size, mtime and header)."""
    cache = _read_cache()
    h = xxhash.xxh3_128()
    changed = False
    digests = []
    for path in sorted(Path(p).resolve() for p in paths):
        st = path.stat()
        key = str(path)
        # ctime too: a file rewritten in place and its mtime set back (cp -p, rsync -a) has a new one
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, header_digest(path)]
        entry = cache.get(key)
        if not (isinstance(entry, list) and len(entry) == len(stamp) + 1 and entry[:-1] == stamp
                and isinstance(entry[-1], str)):
            entry = [*stamp, file_digest(path)]
            cache[key] = entry
            changed = True
        digests.append(entry[-1])
    # the files' contents alone: a copy, or a link under another name, is the same model
    for digest in sorted(digests):
        h.update(digest.encode())
    if changed:
        _write_cache(cache)
    return h.digest()


def tensors_digest(model: torch.nn.Module) -> bytes:
    """Every parameter's and buffer's bytes, by name, in logical (row-major) order."""
    h = xxhash.xxh3_128()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        flat = t.contiguous().reshape(-1).cpu().view(torch.uint8)  # any dtype's bytes (numpy lacks some)
        h.update(flat.numpy().data)
    return h.digest()


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict) -> None:
    """Atomically (a rename): a reader never sees half a file; a failure only costs a rehash."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".weights-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the digest is recomputed next time
