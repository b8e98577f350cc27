"""Batched greedy decode throughput: raw llama-cpp-python versus LlamaEngine.

The raw loop uses only llama-cpp-python's low-level API (plus
``modelfile.default_model_path`` to find the bundled model; the library is
imported through ``ringserve.engine._native``, so libgomp spins as in the server): one context with
``n_seq_max = n_seqs`` and a per-sequence KV cache, one ``llama_batch``, one
greedy sampler per sequence. It is the ceiling the engine is measured
against. The engine loop drives :class:`ringserve.engine.llama.LlamaEngine`
the same way through its ``begin`` / ``decode`` interface.

Both loops prefill the same prompt into every sequence (the raw loop in batches
of up to ``N_BATCH`` tokens, one when they fit) and take one untimed decode step (warm-up); then they time ``n_tokens`` decode steps,
each feeding one token per sequence and sampling one per sequence. The
figure is aggregate sampled tokens per second over all sequences
(``n_seqs * n_tokens / seconds``); EOG tokens do not stop a sequence.

Run from the repository root::

    .venv/bin/python bench/raw_decode.py [--seqs 1 4 8] [--tokens 128] [--repeats 3]

A later benchmark can ``from bench.raw_decode import raw_tokens_per_second``
(or :func:`raw_decode_run` for the per-step times too, or keep a
:class:`RawDecoder` open to interleave its runs with another engine's).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs
import outcome

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringserve.engine._native import llama_cpp as lc  # noqa: E402 - loaded as ringserve loads it (libgomp spin count)
from ringserve.engine.modelfile import default_model_path  # noqa: E402

PROMPT = (
    "<|im_start|>user\nWrite a long story about a lighthouse keeper and a storm."
    "<|im_end|>\n<|im_start|>assistant\n"
)
"""ChatML prompt shared by both loops (tokenized with special tokens parsed)."""


@lc.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


N_BATCH = 512
"""Batch size (tokens) of both loops; the raw loop prefills in batches of this many tokens."""


T = TypeVar("T")


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that ends when it returns; its result or exception.

    A thread that runs llama.cpp graphs gets its own OpenMP team, whose threads
    spin while they wait for the next graph (``ringserve.engine._native`` sets
    libgomp's spin count so); libgomp frees the team when the thread ends. A
    loop run on the main thread would leave its team spinning on a core for as
    long as the process lives, beside whatever is measured next.
    """
    result: list[outcome.Outcome[T]] = []
    thread = threading.Thread(target=lambda: result.append(outcome.capture(fn)), name="raw decode")
    thread.start()
    thread.join()
    return result[0].unwrap()


def _ctx_per_seq(n_tokens: int) -> int:
    """KV cells per sequence: prompt (bounded by its bytes) + warm-up + timed tokens, to 256."""
    need = len(PROMPT.encode()) + n_tokens + 2
    return -(-need // 256) * 256


@attrs.frozen
class RawRun:
    """One timed run of the raw loop (:meth:`RawDecoder.run`).

    Attributes:
        tokens_per_second: sampled tokens per second, summed over sequences.
        prefill_seconds: the batched prefill of every prompt, first
            samples included (seconds): the loop's time to first token.
        step_seconds: each timed decode step (one token per sequence), in order
            (seconds): the loop's time between tokens.
    """

    tokens_per_second: float
    prefill_seconds: float
    step_seconds: tuple[float, ...]


def raw_tokens_per_second(
    path: str | Path, n_seqs: int, n_tokens: int, *, n_threads: int = 0, repeats: int = 1
) -> float:
    """Aggregate greedy decode speed of a raw low-level llama-cpp-python loop.

    ``raw_decode_run(...).tokens_per_second``; see :func:`raw_decode_run`.
    """
    return raw_decode_run(path, n_seqs, n_tokens, n_threads=n_threads, repeats=repeats).tokens_per_second


def raw_decode_run(
    path: str | Path, n_seqs: int, n_tokens: int, *, n_threads: int = 0, repeats: int = 1,
    kv_unified: bool = False, n_ctx: int | None = None, flash_attn: bool | None = False, prompt: str = PROMPT,
) -> RawRun:
    """Aggregate greedy decode speed of a raw low-level llama-cpp-python loop, with step times.

    Loads the model, runs :meth:`RawDecoder.run` ``repeats`` times on the same
    context and returns the fastest run. Model load and prefill are not in
    the tokens per second.

    Args:
        path: GGUF model file.
        n_seqs: sequences decoded together (>= 1).
        n_tokens: timed decode steps, so tokens sampled per sequence (>= 1).
        n_threads: CPU threads; 0 means ``os.cpu_count()``.
        repeats: timed runs on the same context (>= 1); the fastest is returned.
        kv_unified, n_ctx, flash_attn, prompt: the KV layout, flash attention and prompt (:class:`RawDecoder`).

    Returns:
        The fastest repeat: tokens per second, prefill and step times.

    Raises:
        RuntimeError: llama.cpp failed to load, create or decode.
    """
    with RawDecoder(path, n_seqs, n_tokens, n_threads=n_threads, kv_unified=kv_unified, n_ctx=n_ctx,
                    flash_attn=flash_attn, prompt=prompt) as decoder:
        runs = [decoder.run() for _ in range(repeats)]
    return max(runs, key=lambda r: r.tokens_per_second)


class RawDecoder:
    """The raw loop's model, context, batch and samplers, kept for repeated runs.

    Loads the model (``use_extra_bufts=False``) and creates a context for
    ``n_seqs`` sequences of :func:`_ctx_per_seq` cells each (per-sequence KV
    cache; ``n_ctx`` cells in all when given, and one pool that every sequence
    shares with ``kv_unified``, as ringserve's default ``[model] kv_unified``
    and llama-server's ``-kvu``), one batch of :data:`N_BATCH` tokens and one
    greedy sampler per sequence. A benchmark may keep it open next to another engine and
    interleave runs. Close it (or use it as a context manager) to free them.

    Args:
        path: GGUF model file.
        n_seqs: sequences decoded together (>= 1).
        n_tokens: timed decode steps per :meth:`run` (>= 1).
        n_threads: CPU threads; 0 means ``os.cpu_count()``.
        kv_unified: one KV pool for all sequences (llama.cpp's ``kv_unified``), else one per sequence.
        n_ctx: KV cells in all (None: ``n_seqs`` x :func:`_ctx_per_seq`).
        flash_attn: flash attention on (True), off (False) or llama.cpp's choice (None), as
            ringserve's ``[model] flash_attn`` ``on``, ``off``, ``auto``.
        prompt: the text every sequence is prefilled with (special tokens parsed; default
            :data:`PROMPT`).

    Raises:
        RuntimeError: llama.cpp failed to load the model or create the context.
    """

    def __init__(self, path: str | Path, n_seqs: int, n_tokens: int, *, n_threads: int = 0,
                 kv_unified: bool = False, n_ctx: int | None = None, flash_attn: bool | None = False,
                 prompt: str = PROMPT) -> None:
        if os.environ.get("RINGSERVE_LLAMA_LOG") != "1":
            lc.llama_log_set(_quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.n_seqs = n_seqs
        self.n_tokens = n_tokens
        threads = n_threads or os.cpu_count() or 1
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = False
        self._model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"cannot load {path}")
        vocab = lc.llama_model_get_vocab(self._model)
        text = prompt.encode()
        buf = (lc.llama_token * (len(text) + 8))()
        n_prompt = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), True, True)
        self.prompt = list(buf[:n_prompt])
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx or n_seqs * _ctx_per_seq(n_tokens)
        cparams.n_seq_max = n_seqs
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_BATCH
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = kv_unified
        cparams.flash_attn_type = {True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                                   None: lc.LLAMA_FLASH_ATTN_TYPE_AUTO}[flash_attn]  # as ringserve's [model] flash_attn
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise RuntimeError("cannot create context")
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self._samplers = []
        for _ in range(n_seqs):
            chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            self._samplers.append(chain)

    def _decode(self) -> None:
        rc = lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _step(self, last: list[int], pos: int) -> None:
        batch = self._batch
        for s in range(self.n_seqs):
            batch.token[s] = last[s]
            batch.pos[s] = pos
            batch.n_seq_id[s] = 1
            batch.seq_id[s][0] = s
            batch.logits[s] = 1
        batch.n_tokens = self.n_seqs
        self._decode()
        for s in range(self.n_seqs):
            last[s] = lc.llama_sampler_sample(self._samplers[s], self._ctx, s)

    def run(self) -> RawRun:
        """Empty the KV cache, prefill the prompt into every sequence (in batches of up to
        :data:`N_BATCH` tokens, each sequence sampled after the batch that holds its prompt's last
        token), take one untimed step, then time ``n_tokens`` steps of one token per sequence.

        Runs on a thread of its own (:func:`on_own_thread`), so no OpenMP team
        spins after it.

        Raises:
            RuntimeError: ``llama_decode`` failed.
        """
        return on_own_thread(self._run)

    def _run(self) -> RawRun:
        batch, prompt, n_prompt = self._batch, self.prompt, len(self.prompt)
        lc.llama_memory_seq_rm(self._mem, -1, -1, -1)
        last = [0] * self.n_seqs
        ends: list[tuple[int, int]] = []  # (sequence, its last prompt token's index in the batch)

        def prefill_batch(n: int) -> None:
            batch.n_tokens = n
            self._decode()
            for s, i in ends:
                last[s] = lc.llama_sampler_sample(self._samplers[s], self._ctx, i)
            ends.clear()

        i = 0
        t0 = time.perf_counter()
        for s in range(self.n_seqs):
            for p, t in enumerate(prompt):
                if i == N_BATCH:
                    prefill_batch(i)
                    i = 0
                batch.token[i] = t
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = p == n_prompt - 1
                if p == n_prompt - 1:
                    ends.append((s, i))
                i += 1
        prefill_batch(i)
        prefill = time.perf_counter() - t0
        self._step(last, n_prompt)  # warm-up
        steps = []
        t0 = time.perf_counter()
        for k in range(self.n_tokens):
            self._step(last, n_prompt + 1 + k)
            steps.append(time.perf_counter())
        return RawRun(
            self.n_seqs * self.n_tokens / (steps[-1] - t0),
            prefill,
            tuple(b - a for a, b in itertools.pairwise([t0, *steps])),
        )

    def close(self) -> None:
        """Free the samplers, the batch, the context and the model. Idempotent."""
        for chain in self._samplers:
            lc.llama_sampler_free(chain)
        self._samplers = []
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> RawDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_tokens_per_second(
    path: str | Path, n_seqs: int, n_tokens: int, *, n_threads: int = 0, repeats: int = 1
) -> float:
    """The same measurement as :func:`raw_tokens_per_second`, through ``LlamaEngine``.

    Args and Returns as :func:`raw_tokens_per_second`; each repeat begins
    (and at the end releases) every slot, on a thread of its own (:func:`on_own_thread`).
    """
    from ringserve.core.batch import SlotFeed
    from ringserve.core.events import SamplingParams
    from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling
    from ringserve.engine.llama import LlamaEngine

    greedy = resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS)
    engine = LlamaEngine(
        path,
        n_slots=n_seqs,
        n_ctx=n_seqs * _ctx_per_seq(n_tokens),
        n_batch=N_BATCH,
        n_threads=n_threads,
    )
    with engine as eng:
        prompt = tuple(eng.tokenize(PROMPT, add_special=True, parse_special=True))
        n_prompt = len(prompt)
        slots = range(n_seqs)

        def repeat() -> float:
            for s in slots:
                eng.begin(s, greedy)
            out = eng.decode([SlotFeed(s, prompt, 0, True) for s in slots])
            last = {o.slot: o.token for o in out}
            out = eng.decode([SlotFeed(s, (last[s],), n_prompt, True) for s in slots])  # warm-up
            last = {o.slot: o.token for o in out}
            t0 = time.perf_counter()
            for k in range(n_tokens):
                pos = n_prompt + 1 + k
                out = eng.decode([SlotFeed(s, (last[s],), pos, True) for s in slots])
                for o in out:
                    last[o.slot] = o.token
            elapsed = time.perf_counter() - t0
            for s in slots:
                eng.release(s)
            return n_seqs * n_tokens / elapsed

        return max(on_own_thread(repeat) for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    """Print raw and engine tokens/s and their ratio for each sequence count."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    threads = args.threads or os.cpu_count()
    print(f"model {path.name}, {args.tokens} tokens/seq, best of {args.repeats}, {threads} threads")
    print(f"{'seqs':>4} {'raw tok/s':>10} {'engine tok/s':>13} {'engine/raw':>10}")
    for n in args.seqs:
        kw = {"n_threads": args.threads, "repeats": args.repeats}
        raw = raw_tokens_per_second(path, n, args.tokens, **kw)
        eng = engine_tokens_per_second(path, n, args.tokens, **kw)
        print(f"{n:>4} {raw:>10.1f} {eng:>13.1f} {eng / raw:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
