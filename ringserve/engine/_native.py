"""llama-cpp-python, imported with libgomp's spin count set for a serving loop.

Every module of ringserve takes ``llama_cpp`` (and its ``llama_grammar``)
from here, so the first import in a process is this one.

Why: llama-cpp-python builds llama.cpp's CPU backend with OpenMP
(``libggml-cpu.so`` links ``libgomp``), and every barrier between the nodes
of a decode's graph is an ``#pragma omp barrier`` (``ggml_barrier`` in
``ggml-cpu.c``). A libgomp thread that waits, at a barrier or for the next
decode, spins ``GOMP_SPINCOUNT`` times and then sleeps in the kernel
(``do_wait`` in ``libgomp/config/linux/wait.h``). The default, 300,000 spins,
is "about 3 ms" by libgomp's own estimate (``env.c``): 8 ms on the 2-core
machine of issue 19, where one spin (``pause``) took 26-30 ns. A server's
decode threads wait longer than that whenever the event loop, a client or
anything else on the box takes one of their cores, and every sleep then costs
a wake-up, on a virtual machine a slow one. ggml asks for the same thing of
Intel's and LLVM's OpenMP (it sets ``KMP_BLOCKTIME=200`` ms), which libgomp
does not read.

:data:`GOMP_SPINCOUNT` (``infinite``: a waiting thread never sleeps) is
set only when the environment sets neither ``GOMP_SPINCOUNT`` nor
``OMP_WAIT_POLICY`` (a user's choice wins), and only for the import: libgomp
reads it once, as it loads, and child processes (``llama-server`` in the
benchmarks) do not inherit it. Measured over HTTP on that machine, 8 streams,
interleaved: while the machine was slow, infinite spinning made decode steps
2.2-3.3x shorter than the default, where 30,000,000 spins (about 0.8 s) did
not help; while it was fast, it made no difference (``docs/benchmarks.md``).

The cost: a team's threads spin for as long as the thread that decodes lives,
also when nothing decodes. The runner's :class:`~ringserve.engine.thread.EngineThread`
ends after a second without a call, which frees its team (libgomp frees a
thread's team when the thread exits). Code that decodes with ``n_threads > 1``
from a thread of its own keeps ``n_threads - 1`` cores busy until that thread
exits, unless it sets ``GOMP_SPINCOUNT`` itself. With one thread (the default
on a 2-core machine: every core but one) there is no team and nothing spins.

llama-cpp-python opens ``os.devnull`` for writing as it is imported
(``llama_cpp/_utils.py``). On a system without a usable one (a chroot or an
image that lacks ``/dev/null``) the import exits with status 2 and one line
saying so, as other start-up mistakes do, rather than a traceback that ends
deep in llama-cpp-python.
"""

from __future__ import annotations

import os
import sys

#: libgomp's spin count while a thread waits: never sleep.
GOMP_SPINCOUNT = "infinite"

_ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
if _ours:
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
try:
    import llama_cpp
    from llama_cpp import llama_grammar
except OSError as exc:
    if exc.filename != os.devnull:
        raise
    print(f"ringserve: {os.devnull} cannot be opened for writing ({exc.strerror}), and llama-cpp-python needs"
          " it: the system (a chroot, a container image) must provide it", file=sys.stderr)
    raise SystemExit(2) from None
finally:
    if _ours:
        del os.environ["GOMP_SPINCOUNT"]

__all__ = ["GOMP_SPINCOUNT", "llama_cpp", "llama_grammar"]
