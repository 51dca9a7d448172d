"""Freed heap memory handed back to the system between prefill chunks on the CPU.

A prefill chunk allocates and frees tensors of many sizes; glibc's allocator keeps the freed
memory in its heap for the next request, so after a few chunks of a real-size model the process
holds ~150 MiB it is not using, and the peak of a long prompt is that plus the next chunk's
working set (benchmarks/real_size.py: 1,941 against 1,885 MiB for 2,048 tokens in 512-token
chunks, at the same speed). `trim` is glibc's malloc_trim(0) (the heap's free pages given back;
a later allocation faults them in again); where the C library has none (not glibc) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # no C library by that name, or not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Give the heap's free memory back to the system; True when there was an allocator to ask."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
