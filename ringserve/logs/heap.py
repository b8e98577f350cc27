"""Giving the memory that streams freed back to the system once they are over (glibc's ``malloc_trim``).

CPython hands every object over 512 bytes (a stream's entries, a reply's text, a store
snapshot's join) to ``malloc``, and glibc's malloc keeps what is freed in its arenas for the
next ``malloc`` rather than returning it: only a free chunk at the top of a heap goes back, and
its threshold for serving a large block with its own mapping (returned at ``free``) rises to
the largest block freed so far, so replies of megabytes end up in the arenas too. After a burst
of large replies the process keeps the burst's peak: three waves of 60 replies of 3 MB left
767 MB resident with no stream left (``bench/reply_waves.py``, docs/benchmarks.md).
``malloc_trim(0)`` gives every free page of every arena back (``madvise``): 15 ms for 330 MB
on a loaded 2-core machine, after which that process was at 96 MB. It is called on a worker
thread, and only while no stream is live (``MemoryLogStore.run``): under steady traffic the
arenas' free memory is what the next replies use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

#: Bytes of stream-log entries the log store has let go of (evicted, expired, forgotten) since
#: the last trim before it trims again: a trim for less is not worth its pass over the arenas.
TRIM_AFTER_BYTES = 16 * 1024 * 1024


def malloc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of the C library, or None where it has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)
