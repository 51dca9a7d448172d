"""Freed heap memory handed back to the system: glibc's malloc_trim(0), the heap's free pages
given back (a later allocation faults them in again); where the C library has none (not glibc,
musl) nothing.

glibc keeps freed memory in its heap for the next request. A freed block of a few MB also raises
its threshold for serving blocks from mmap, so later blocks of that size come from the heap too,
between blocks that stay. Two places hand it back:

- the loader, between blocks of weights it builds: its block-sized temporaries stayed resident
  after being freed (~110 MiB over 213 MiB of int8 weights, measured);
- the engine, after a CPU prefill chunk: after a few chunks of a real-size model the process held
  ~150 MiB it was not using, and a long prompt's peak was that plus the next chunk's working set
  (benchmarks/real_size.py's model: 1,941 against 1,885 MiB for 2,048 tokens in 512-token
  chunks, at the same speed).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # a C library without it (musl)
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
