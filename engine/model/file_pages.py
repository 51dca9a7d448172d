"""The pages of a mapped weights file that a load has read and will not read again.

safetensors maps each file and hands out tensors that are views of the mapping, so a weight used
as stored costs no copy. A weight the loader rebuilds (fused projections, another dtype, the
transposed fp32 layout) reads its source through that mapping, and the pages it read stay in the
process's resident set for as long as the mapping lives, which is as long as any weight that is
a view of it: a second copy of every rebuilt weight, never read again. `drop_resident` gives those
pages back (MADV_DONTNEED); a later read of them would fault them in again from the file, with
the same bytes, so it changes nothing but what is resident, and the loader may call it at any
time while it holds the file open (the mapping cannot then be unmapped and its addresses reused).

Linux only (it finds the mappings in /proc/self/maps); elsewhere, or when safetensors copied the
tensors instead of mapping them, there is nothing to drop and it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

_MADV_DONTNEED = 4


def file_ranges(path: Path, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The [start, end) address ranges of this process's mappings of `path` that hold any of
    `tensors`' bytes (none when the tensors are not views of a mapping of the file)."""
    if sys.platform != "linux" or not tensors:
        return []
    st = os.stat(path)
    mappings = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            # start-end perms offset dev inode [path]; a file's identity is its device and inode
            if len(fields) == 6 and int(fields[4]) == st.st_ino and _same_device(fields[3], st.st_dev):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                mappings.append((start, end))
    ptrs = [t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()]
    return [(s, e) for s, e in mappings if any(s <= p < e for p in ptrs)]


def drop_resident(ranges: list[tuple[int, int]]) -> None:
    """Give back the resident pages of these file mappings (the caller keeps them mapped)."""
    if not ranges:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for start, end in ranges:
        # a refusal only leaves the pages resident: nothing to undo
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _same_device(field: str, dev: int) -> bool:
    major, minor = (int(x, 16) for x in field.split(":"))
    return os.major(dev) == major and os.minor(dev) == minor
