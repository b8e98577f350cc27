"""The llama.cpp engine: one model, one context, many sequences in one batch.

This is the only module in ringserve that imports ``llama_cpp``. It drives
llama-cpp-python's low-level ctypes API the way llama.cpp's ``tools/server``
does: one ``llama_context`` with ``n_seq_max = n_slots`` and one KV pool of
``n_ctx`` cells that the sequences share (``kv_unified``, llama-server's
``--kv-unified``), one shared ``llama_batch`` that every decode step
fills with the tokens of all active slots, and one sampler chain per slot
sampled with ``llama_sampler_sample(chain, ctx, i)`` at the batch index of
that slot's last token. A greedy slot with no grammar, bias or penalty on its chain takes the
first highest logit itself (``numpy.argmax`` over ``llama_get_logits_ith``),
the token llama.cpp's greedy sampler picks, without the chain's copy of the
whole vocabulary into a candidate array (49,152 tokens for SmolLM2: about 15
against 60 µs per token on a quiet 2-core AMD EPYC; docs/benchmarks.md, "Greedy
sampling without the chain").

Threading: see :mod:`ringserve.engine.protocol`. Every method blocks and must
run on the runner's worker thread, one call at a time. ctypes releases the
GIL inside each llama.cpp call, so ``llama_decode`` does not stall the Trio
thread. Nothing here is cancellable; the runner cancels between steps.

Logging: llama.cpp writes its log to stderr unless a callback is installed.
The first :class:`LlamaEngine` installs a no-op callback (process-wide,
llama.cpp keeps one logger) unless the environment variable
``RINGSERVE_LLAMA_LOG=1`` is set, in which case llama-cpp-python's own
callback (which prints to ``sys.stderr``) stays in place.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import os
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, assert_never

import numpy as np

from ringserve.config import decode_threads
from ringserve.core.batch import Sampled, SlotFeed
from ringserve.core.events import ChatMessage, GenerationRequest, Role, TokenLogprob, TopLogprob
from ringserve.core.offload import ALL_LAYERS, plan_offload
from ringserve.core.sampling import ResolvedSampling
from ringserve.core.toolcalls import plain_messages
from ringserve.engine._native import llama_cpp as lc
from ringserve.engine.gbnf import CallWatch, Constraint, GrammarOff, GrammarOn, LazyCalls
from ringserve.engine.modelfile import ModelFileError, check_model_file
from ringserve.engine.protocol import ChatPrompt, EngineError, KVCacheFull, check_feeds
from ringserve.formats.base import ChatFormat
from ringserve.formats.detect import detect
from ringserve.formats.families import FAMILIES
from ringserve.formats.prompt import render_request
from ringserve.formats.template import (
    ChatTemplate,
    SpecialToken,
    SpecialTokens,
    TemplateLoadError,
    TemplateRenderError,
    prompt_fragments,
)

__all__ = ["ChatTemplateError", "LlamaEngine"]

log = logging.getLogger("ringserve.engine")

FALLBACK_CHAT_TEMPLATE = b"chatml"
"""llama.cpp's built-in template (``llama_chat_apply_template``), used when the GGUF has no
``tokenizer.chat_template`` and none is configured."""

_DECODE_ERRORS = {
    2: "llama_decode aborted",
    -1: "llama_decode rejected the batch as invalid (token ids, positions or sequence ids)",
}

_init_lock = threading.Lock()
_backend_ready = False


@lc.llama_log_callback
def _silent_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp log sink that drops every line (kept alive at module level)."""


def _init_backend() -> None:
    """Install the log sink and call ``llama_backend_init`` once per process."""
    global _backend_ready
    with _init_lock:
        if _backend_ready:
            return
        if os.environ.get("RINGSERVE_LLAMA_LOG") != "1":
            lc.llama_log_set(_silent_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def _call_if_bound(name: str, *args: object) -> object:
    """``llama_cpp.NAME(*args)``, or None when this llama-cpp-python does not bind it."""
    fn = getattr(lc, name, None)
    return None if fn is None else fn(*args)


class _DeviceType(enum.IntEnum):
    """``enum ggml_backend_dev_type`` (``ggml/include/ggml-backend.h``)."""

    CPU = 0
    GPU = 1
    IGPU = 2  # an integrated GPU using host memory
    ACCEL = 3  # BLAS, AMX: works beside the CPU, never an offload target


def gpu_devices() -> tuple[str, ...]:
    """The devices llama.cpp offloads layers to, each ``NAME (DESCRIPTION)``: the GPUs ggml
    registered, or, when there is none, the integrated GPUs (as ``llama_model_load_from_file_impl``
    in llama.cpp's ``src/llama.cpp`` picks them). Empty on a CPU-only build.

    ggml's device registry (``ggml_backend_dev_*``, ``ggml/include/ggml-backend.h``) has no
    binding in llama-cpp-python; its functions are reached through ``libllama``'s handle, which
    resolves the symbols of the ggml libraries it links. Call after ``llama_backend_init``.
    """
    lib = lc.llama_cpp._lib
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_char_p
    found: dict[_DeviceType, list[str]] = {_DeviceType.GPU: [], _DeviceType.IGPU: []}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind in found:
            name = lib.ggml_backend_dev_name(dev).decode(errors="replace")
            found[_DeviceType(kind)].append(f"{name} ({lib.ggml_backend_dev_description(dev).decode(errors='replace')})")
    return tuple(found[_DeviceType.GPU] or found[_DeviceType.IGPU])


class ChatTemplateError(ModelFileError):
    """The model's chat template cannot be loaded, or the configured chat format is not a
    family ringserve knows (one line, names the path)."""


def _address(pointer: Any) -> int:
    """The address a ctypes pointer field points at (``llama_cpp`` types those fields as arrays)."""
    return ctypes.addressof(pointer.contents)


def _add_samplers(chain: Any, sampling: ResolvedSampling, vocab: Any, n_vocab: int, prompt: Sequence[int]) -> None:
    """The samplers of ``sampling`` at the end of ``chain``, in llama.cpp's order
    (``common/sampling.cpp`` ``common_sampler_init``): the logit bias, the repetition
    penalties and DRY where they change anything, then greedy for temperature 0, else top-k,
    typical-p, top-p, min-p and XTC where set, the temperature and a seeded draw (``seed``;
    llama.cpp draws one for :data:`~ringserve.core.events.RANDOM_SEED`). The penalties and DRY
    first take the last tokens of ``prompt``, as llama-server's accept the prompt into its
    sampler; the chain's ``accept`` then gives them every token sampled."""
    add = lc.llama_sampler_chain_add
    if sampling.logit_bias:
        n = len(sampling.logit_bias)
        biases = (lc.llama_logit_bias * n)()
        for entry, bias in zip(biases, sampling.logit_bias, strict=True):
            assert isinstance(bias.token, int), "logit_bias is by token id (core/sampling.py check_logit_bias)"
            entry.token, entry.bias = bias.token, bias.bias
        add(chain, lc.llama_sampler_init_logit_bias(n_vocab, n, biases))
    if sampling.penalties:
        penalties = lc.llama_sampler_init_penalties(n_vocab, sampling.repeat_last_n, sampling.repeat_penalty,
                                                    sampling.frequency_penalty, sampling.presence_penalty)
        _accept(penalties, prompt[-sampling.repeat_last_n:])
        add(chain, penalties)
    if sampling.dry:
        breakers = [b.encode("utf-8") for b in sampling.dry_sequence_breakers]
        dry = lc.llama_sampler_init_dry(vocab, sampling.dry_multiplier, sampling.dry_base,
                                        sampling.dry_allowed_length, sampling.dry_penalty_last_n,
                                        (ctypes.c_char_p * len(breakers))(*breakers), len(breakers))
        _accept(dry, prompt[-sampling.dry_penalty_last_n:])
        add(chain, dry)
    if sampling.temperature == 0:
        add(chain, lc.llama_sampler_init_greedy())
        return
    if sampling.top_k > 0:
        add(chain, lc.llama_sampler_init_top_k(sampling.top_k))
    if sampling.typical_p < 1.0:
        add(chain, lc.llama_sampler_init_typical(sampling.typical_p, 1))
    if sampling.top_p < 1.0:
        add(chain, lc.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        add(chain, lc.llama_sampler_init_min_p(sampling.min_p, 1))
    if sampling.xtc:
        add(chain, lc.llama_sampler_init_xtc(sampling.xtc_probability, sampling.xtc_threshold, 1, sampling.seed))
    add(chain, lc.llama_sampler_init_temp(sampling.temperature))
    add(chain, lc.llama_sampler_init_dist(sampling.seed))


def _accept(sampler: Any, tokens: Sequence[int]) -> None:
    """``llama_sampler_accept`` of each token, in order."""
    for token in tokens:
        lc.llama_sampler_accept(sampler, token)


def token_logprob(logits: np.ndarray, token: int, n_top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """``token``'s log probability under ``logits`` (one position's raw logits over the
    vocabulary: the log-softmax, its exponentials in float32 summed in float64: 4 times faster
    than all in float64, 0.2 against 0.8 ms over SmolLM2's 49,152 logits on the shared 2-core
    machine, within 1e-9), and the ``n_top`` most likely tokens', most likely first (equal logits
    by token id); ``piece`` gives a token's bytes. The sampled token's value is the one it has in
    the list when it is there."""
    peak = logits.max()
    total = float(peak) + math.log(float(np.exp(logits - peak).sum(dtype=np.float64)))
    if n_top:
        top = np.argpartition(logits, -n_top)[-n_top:]
        top = top[np.lexsort((top, -logits[top]))]
        alternatives = tuple(TopLogprob(piece(int(t)), float(logits[t]) - total) for t in top)
    else:
        alternatives = ()
    return TokenLogprob(piece(token), float(logits[token]) - total, alternatives)


def _check_sizes(n_slots: int, n_ctx: int, n_batch: int, n_threads: int) -> None:
    """:class:`LlamaEngine`'s size arguments in range.

    Raises:
        ValueError: one is not (the message names it).
    """
    if not 1 <= n_slots <= lc.llama_max_parallel_sequences():
        raise ValueError(
            f"n_slots must be 1..{lc.llama_max_parallel_sequences()}, got {n_slots}"
        )
    if n_ctx < 0:
        raise ValueError(f"n_ctx must be >= 0, got {n_ctx}")
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    if n_threads < 0:
        raise ValueError(f"n_threads must be >= 0, got {n_threads}")


def _load_model(path: Path, n_gpu_layers: int, use_extra_bufts: bool, devices: tuple[str, ...]) -> Any:
    """``llama_model_load_from_file`` with ``n_gpu_layers`` offloaded to ``devices``.

    Raises:
        ModelFileError: llama.cpp could not load it (the message suggests a lower
            ``n_gpu_layers`` when layers were to go to a GPU).
    """
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    mparams.use_extra_bufts = use_extra_bufts
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        on_gpu = f" (offloading to {', '.join(devices)}: lower [model] n_gpu_layers if it does not fit)"
        raise ModelFileError(f"llama.cpp could not load the model: {path}{on_gpu if devices and n_gpu_layers else ''}", path)
    return model


class _Batch:
    """The engine's one ``llama_batch`` (``llama_batch_init(n_batch, 0, 1)``: token ids, positions,
    one sequence id per token, an output flag per token), with views over its C arrays so that
    :meth:`fill` writes whole runs by slice assignment.
    """

    def __init__(self, n_batch: int) -> None:
        self.raw = lc.llama_batch_init(n_batch, 0, 1)
        b = self.raw
        self._tok = (lc.llama_token * n_batch).from_address(_address(b.token))
        self._pos = (lc.llama_pos * n_batch).from_address(_address(b.pos))
        self._out = (ctypes.c_int8 * n_batch).from_address(_address(b.logits))
        n_seq = (ctypes.c_int32 * n_batch).from_address(_address(b.n_seq_id))
        n_seq[:] = [1] * n_batch
        self._seq = [b.seq_id[i] for i in range(n_batch)]
        self._out_addr = ctypes.addressof(self._out)

    def fill(self, feeds: Sequence[SlotFeed]) -> list[tuple[int, int, int | None]]:
        """Put every feed in the batch (tokens at their positions, sequence id = slot, the
        output flag on the last token of each sampling feed); return (slot, batch index of
        its last token, forced token) per sampling feed, in feed order. The feeds passed
        :func:`~ringserve.engine.protocol.check_feeds`."""
        tok, pos, seq, out = self._tok, self._pos, self._seq, self._out
        n = 0
        sample_at: list[tuple[int, int, int | None]] = []
        for f in feeds:
            end = n + len(f.tokens)
            tok[n:end] = f.tokens  # type: ignore[call-overload]  # ctypes stubs: any sequence fills a slice
            pos[n:end] = range(f.pos, f.pos + end - n)  # type: ignore[call-overload]
            for i in range(n, end):
                seq[i][0] = f.slot
            if f.sample:
                sample_at.append((f.slot, end - 1, f.forced))
            n = end
        ctypes.memset(self._out_addr, 0, n)
        for _, i, _ in sample_at:
            out[i] = 1
        self.raw.n_tokens = n
        return sample_at

    def free(self) -> None:
        """``llama_batch_free``; call once."""
        lc.llama_batch_free(self.raw)


class LlamaEngine:
    """An :class:`~ringserve.engine.protocol.Engine` backed by llama.cpp.

    Loads the model and creates one context of ``n_ctx`` KV cells that its
    ``n_slots`` sequences share (``kv_unified = True``): any sequence may hold
    up to :attr:`n_ctx_seq` of them, and the runner keeps their sum within
    the pool. llama.cpp rounds ``n_ctx`` up to a multiple of 256 cells
    (:attr:`n_ctx` is what it made).

    Args:
        path: the GGUF model file (checked with
            :func:`~ringserve.engine.modelfile.check_model_file`).
        n_slots: sequences decoded together (llama.cpp ``n_seq_max``), 1..
            ``llama_max_parallel_sequences()``.
        n_ctx: KV cells (tokens) of the pool: every sequence's prompt and generated
            tokens together; at most ``n_slots`` times the model's trained context; 0:
            the trained context (llama.cpp's ``-c 0``).
        kv_unified: one pool any sequence may fill (True), or ``n_ctx`` split evenly
            among the sequences (False: each holds ``n_ctx / n_slots``).
        n_batch: most tokens per :meth:`decode`, summed over slots; also the
            physical micro-batch (``n_ubatch``).
        n_gpu_layers: layers to offload to the GPU devices llama.cpp finds
            (:func:`gpu_devices`): a count, or -1 (the default) for every layer;
            with no GPU device none is offloaded, whatever the value.
        n_threads: CPU threads for decoding; 0 means
            :func:`ringserve.config.decode_threads` (every core but one).
        use_extra_bufts: let llama.cpp use extra CPU buffer types (weight
            repacking, AMX). Off by default: with a native build on AMX CPUs
            ``ggml_backend_amx_mul_mat`` crashes on multi-token batches.
        flash_attn: flash attention on (True), off (False, the default) or
            llama.cpp's choice (None: on where the backend supports it, CPUs
            included). With it on, a token's attention is summed in an order
            that depends on how many tokens of its sequence share the batch, so
            greedy output after a prompt-prefix cache hit (the rest of the
            prompt fed in other batch shapes) can differ from a full
            prefill's; off, it does not.
        model_id: name reported to clients; default the file's stem.
        chat_template: the chat template's Jinja source, over the GGUF's
            ``tokenizer.chat_template`` (``[model] chat_template_file``); None:
            the GGUF's.
        chat_format: the name of the model's family
            (:data:`~ringserve.formats.families.FAMILIES`), over the one
            detected from the template (``[model] chat_format``); None: detected.

    Attributes:
        model_id, n_slots, n_batch: as the arguments
            (the :class:`~ringserve.engine.protocol.Engine` attributes).
        n_ctx: the pool's KV cells as llama.cpp made it (``llama_n_ctx``: the
            argument rounded up to a multiple of 256).
        n_ctx_seq: most cells one sequence may hold: the pool (its share of it
            without ``kv_unified``), at most the trained context (``n_ctx_train``).
        n_ctx_train: the context the model was trained with (tokens,
            ``llama_model_n_ctx_train``, the GGUF's ``<arch>.context_length``).
        prefix_cache: whether a slot may keep a prefix of its cells and copy
            one from another slot: False for recurrent and hybrid models and
            for sliding-window attention, whose memory cannot drop a
            sequence's tail or has already dropped its head
            (``llama_model_is_recurrent``, ``llama_model_is_hybrid``,
            ``llama_model_n_swa``).
        n_vocab: tokens in the vocabulary.
        max_token_bytes: the longest piece in the vocabulary (bytes): plain
            text of N bytes is at least ``N / max_token_bytes`` tokens, as a
            BPE or SentencePiece token stands for the bytes of its piece;
            None for other vocabulary types (the runner then does not bound
            the text before tokenizing).
        n_threads: CPU threads used.
        offload: the layers on GPU devices (:func:`~ringserve.core.offload.plan_offload`
            from ``n_gpu_layers``, ``llama_model_n_layer`` and :func:`gpu_devices`).
        path: the checked, absolute model path.
        chat_template: the loaded chat template; None when the GGUF has none
            and none was configured (llama.cpp's ChatML is then used, with
            the generic format).
        chat_format: the model's format: the configured family, else the one
            :func:`~ringserve.formats.detect.detect` finds in the template
            (the generic one without a template).
        reasoning_close: the tokens of the format's
            :attr:`~ringserve.formats.base.ReasoningMarkers.closing` (empty
            for a format without a thinking block).

    Raises:
        ModelFileError: the file is missing, unreadable or not GGUF, or
            llama.cpp could not load it (the message suggests a lower
            ``n_gpu_layers`` when layers were to go to a GPU).
        ChatTemplateError: the chat template does not compile, or
            ``chat_format`` names no family.
        ValueError: a size argument is out of range.
        EngineError: ``n_ctx`` is above ``n_slots * n_ctx_train`` (refused
            before anything is allocated: a typo would take GBs), or llama.cpp
            could not create the context or the batch.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_slots: int = 4,
        n_ctx: int = 4096,
        n_batch: int = 512,
        kv_unified: bool = True,
        n_gpu_layers: int = ALL_LAYERS,
        n_threads: int = 0,
        use_extra_bufts: bool = False,
        flash_attn: bool | None = False,
        model_id: str | None = None,
        chat_template: str | None = None,
        chat_format: str | None = None,
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch: _Batch | None = None
        self._closed = False
        path = check_model_file(path)
        _init_backend()
        _check_sizes(n_slots, n_ctx, n_batch, n_threads)
        self.path = path
        self.model_id = model_id or path.stem
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self._kv_unified = kv_unified
        self.n_batch = n_batch
        self.n_threads = decode_threads(n_threads, os.cpu_count() or 1)
        self._chains: list[int | None] = [None] * n_slots
        self._held: list[int | None] = [None] * n_slots  # cells of a begun slot's sequence (check_feeds)
        self._watches: list[CallWatch | None] = [None] * n_slots
        self._call_grammar: list[bool] = [False] * n_slots  # a call's grammar is first on the chain
        self._argmax: list[bool] = [False] * n_slots  # plain greedy, no grammar on the chain: argmax of _logits
        self._logprobs: list[int | None] = [None] * n_slots  # alternatives per token, where logprobs are asked
        self._pieces: dict[int, tuple[bytes, bool]] = {}
        self._piece_buf = ctypes.create_string_buffer(64)

        devices = gpu_devices()
        self._model = _load_model(path, n_gpu_layers, use_extra_bufts, devices)
        try:
            self.offload = plan_offload(n_gpu_layers, lc.llama_model_n_layer(self._model), devices)
            self._vocab = lc.llama_model_get_vocab(self._model)
            self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
            self._bos = lc.llama_vocab_bos(self._vocab)
            self._add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
            self.max_token_bytes, specials = self._scan_vocab()
            self._load_chat(chat_template, chat_format, specials)
            self.n_ctx_train = lc.llama_model_n_ctx_train(self._model)
            n_ctx = self.n_ctx = n_ctx or self.n_ctx_train
            if n_ctx > n_slots * self.n_ctx_train > 0:
                # Refused before llama.cpp allocates the KV cells (GBs for a typo).
                raise EngineError(
                    f"a context of {n_ctx} tokens is more than {n_slots} slot(s) of the model's trained context of "
                    f"{self.n_ctx_train} tokens (n_ctx_train of {path})"
                )
            self._create_context(flash_attn)
            self._batch = _Batch(n_batch)  # one batch for the engine's life
        except BaseException:
            self.close()
            raise

    def _create_context(self, flash_attn: bool | None) -> None:
        """The context of ``n_ctx`` cells that ``n_slots`` sequences share (unified KV cache, or split), and
        what it says of the model's memory (:attr:`prefix_cache`, :attr:`n_ctx`, :attr:`n_ctx_seq`).

        Raises:
            EngineError: llama.cpp could not create it.
        """
        n_slots, n_ctx = self.n_slots, self.n_ctx
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_seq_max = n_slots
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        if flash_attn is not None:
            cparams.flash_attn_type = (
                lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        cparams.kv_unified = self._kv_unified
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise EngineError(f"llama.cpp could not create a context of {n_ctx} tokens for {n_slots} slot(s)")
        self._mem: Any = lc.llama_get_memory(self._ctx)
        self.prefix_cache: bool = not (
            lc.llama_model_is_recurrent(self._model)
            or _call_if_bound("llama_model_is_hybrid", self._model)
            or _call_if_bound("llama_model_n_swa", self._model)
        )
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_ctx_seq: int = min(lc.llama_n_ctx_seq(self._ctx), self.n_ctx_train or self.n_ctx)

    # -- chat template and tokens ------------------------------------------

    def _scan_vocab(self) -> tuple[int | None, SpecialTokens]:
        """One pass over the vocabulary: the bytes of the longest token piece (for BPE and SPM
        vocabularies; None for others) and the special tokens (control and unknown ones, the
        tokens only ``parse_special`` makes: the chat template's markers)."""
        byte_sized = lc.llama_vocab_type(self._vocab) in (lc.LLAMA_VOCAB_TYPE_SPM, lc.LLAMA_VOCAB_TYPE_BPE)
        special_attrs = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
        buf = ctypes.create_string_buffer(256)
        longest = 1
        specials = []
        for token in range(self.n_vocab):
            if byte_sized:
                n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
                longest = max(longest, abs(n))  # negative: the piece needs -n bytes
            attr = lc.llama_vocab_get_attr(self._vocab, token)
            if attr & special_attrs:
                text = self._special_text(token)
                if text:
                    specials.append(SpecialToken(text, lstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_LSTRIP),
                                                 rstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_RSTRIP)))
        return (longest if byte_sized else None), SpecialTokens(specials)

    def _special_text(self, token: int) -> str:
        """A token's text with special tokens rendered (``<|im_start|>``), ``""`` for none."""
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def _load_chat(self, source: str | None, family: str | None, specials: SpecialTokens) -> None:
        """The chat template (``source``, else the GGUF's), the format (``family``, else the
        detected one) and the tokens that close its thinking block.

        Raises:
            ChatTemplateError: the template does not compile, or ``family`` is unknown.
        """
        if source is None:
            raw = lc.llama_model_chat_template(self._model, None)
            source = raw.decode("utf-8", errors="replace") if raw else None
        self.chat_template: ChatTemplate | None = None
        if source:
            try:
                self.chat_template = ChatTemplate(
                    source,
                    bos_token=self._special_text(self._bos),
                    eos_token=self._special_text(lc.llama_vocab_eos(self._vocab)),
                    special_tokens=specials,
                    strip_bos=self._add_bos,
                    strip_eos=bool(lc.llama_vocab_get_add_eos(self._vocab)),
                )
            except TemplateLoadError as exc:
                raise ChatTemplateError(f"{exc}: {self.path}", self.path) from None
        if family is not None:
            if family not in FAMILIES:
                raise ChatTemplateError(
                    f"unknown chat format {family!r} (one of {', '.join(sorted(FAMILIES))}): {self.path}", self.path
                )
            self.chat_format: ChatFormat = FAMILIES[family]
        else:
            self.chat_format = detect(source) if source else FAMILIES["generic"]
        markers = self.chat_format.reasoning
        self.reasoning_close = () if markers is None else tuple(self.tokenize(markers.closing, parse_special=True))

    def tokenize_chat(self, request: GenerationRequest) -> ChatPrompt:
        """Render the request with the model's chat template and tokenize the result.

        The template is rendered by :func:`~ringserve.formats.prompt.render_request` (where
        the tools go, the reasoning switches, a final assistant turn left open), and the
        prompt is tokenized as llama-server tokenizes it: BOS if the model asks for it, then
        the template's text with its special tokens parsed, and the request's own text
        (message contents, tools, kwargs) as plain text
        (:func:`~ringserve.formats.template.prompt_fragments`), so a message holding
        ``<|im_end|>`` or ``<|im_start|>system`` cannot forge a turn.

        A model without a template (and none configured) is rendered by llama.cpp's
        ``llama_chat_apply_template`` with ChatML (:meth:`_tokenize_builtin`).

        Safe to call while another thread decodes: it reads only the vocabulary and the
        chat template (llama.cpp's ``llama_tokenize`` keeps its working state per call;
        ``tools/server`` tokenizes on its HTTP threads while the main loop decodes).

        Raises:
            ValueError: a NUL character in a message, a template that refused the request
                or failed on it (the message says why), a call's arguments that are not JSON.
        """
        for i, m in enumerate(request.messages):
            if "\x00" in m.content:
                raise ValueError(f"message {i} contains a NUL character")
        template = self.chat_template
        if template is None:
            return self._tokenize_builtin(plain_messages(request.messages, request.tools, request.tool_choice))
        try:
            rendered = render_request(template, self.chat_format, request)
        except TemplateRenderError as exc:
            raise ValueError(str(exc)) from None
        tokens = [self._bos] if self._add_bos else []
        for text, special in prompt_fragments(rendered.prompt, template.special_tokens):
            tokens += self.tokenize(text, parse_special=special)
        return ChatPrompt(rendered.prompt.text, tuple(tokens), rendered.reasoning_open)

    def _tokenize_builtin(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        """A prompt rendered by llama.cpp's built-in ChatML: the template's text with special
        tokens parsed, the contents as plain text; BOS if the model asks for it (not doubled).
        A final assistant turn stays open (no end-of-turn after it)."""
        marker = f"\x01{secrets.token_hex(8)}:"
        holders = [ChatMessage(m.role, f"{marker}{i}\x01") for i, m in enumerate(messages)]
        prefill = messages[-1].role is Role.ASSISTANT if messages else False
        text = self._apply_builtin(holders, add_generation_prompt=not prefill)
        parts = re.split(re.escape(marker) + r"(\d+)\x01", text)
        if len(parts) != 2 * len(messages) + 1:
            raise ValueError("the chat template did not copy every message verbatim")
        if prefill:
            parts[-1] = ""  # the assistant's turn stays open
        tokens: list[int] = []
        texts: list[str] = []
        for j, part in enumerate(parts):
            if j % 2:  # a message's content: plain text
                content = messages[int(part)].content
                texts.append(content)
                tokens += self.tokenize(content, parse_special=False)
            elif part:  # the template's own text: markers are special tokens
                texts.append(part)
                tokens += self.tokenize(part, add_special=j == 0, parse_special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos:
            del tokens[0]  # the template already wrote BOS as text
        return ChatPrompt("".join(texts), tuple(tokens))

    def _apply_builtin(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """``messages`` through ``llama_chat_apply_template`` with :data:`FALLBACK_CHAT_TEMPLATE`.

        Raises:
            ValueError: no messages, or llama.cpp failed to apply the template.
        """
        self._check_open()
        if not messages:
            raise ValueError("at least one message is required")
        chat = (lc.llama_chat_message * len(messages))()
        size = 256
        for i, m in enumerate(messages):
            content = m.content.encode("utf-8")
            chat[i].role = m.role.encode("ascii")
            chat[i].content = content
            size += 2 * len(content) + 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_chat_apply_template(FALLBACK_CHAT_TEMPLATE, chat, len(messages), add_generation_prompt, buf, size)
            if n < 0:
                raise ValueError("llama.cpp could not apply the chat template to these messages")
            if n <= size:
                break
            size = n
        return buf.raw[:n].decode("utf-8", errors="replace")

    def tokenize(
        self, text: str | bytes, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Tokenize plain text (no chat template).

        Args:
            text: the text; ``str`` is encoded as UTF-8.
            add_special: add BOS/EOS if the model is configured to.
            parse_special: turn special-token text such as ``<|im_start|>``
                into its token instead of plain text.

        Returns:
            Token ids.
        """
        self._check_open()
        data = text.encode("utf-8") if isinstance(text, str) else text
        cap = len(data) + 8
        while True:
            toks = (lc.llama_token * cap)()
            n = lc.llama_tokenize(
                self._vocab, data, len(data), toks, cap, add_special, parse_special
            )
            if n >= 0:
                return toks[:n]
            if n == -(2**31):
                raise ValueError("text too long to tokenize")
            cap = -n

    def token_piece(self, token: int) -> bytes:
        """Raw bytes of ``token`` as generated text: its piece, special tokens' text included
        (``<|channel|>``, ``[TOOL_CALLS]``: the formats' parsers read them), except the
        end-of-generation tokens', which render empty."""
        return self._piece(token)[0]

    def _piece(self, token: int) -> tuple[bytes, bool]:
        """(bytes, is-end-of-generation) of ``token``, cached per token id."""
        hit = self._pieces.get(token)
        if hit is not None:
            return hit
        eog = bool(lc.llama_vocab_is_eog(self._vocab, token))
        buf = self._piece_buf
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, not eog)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, not eog)
        hit = (buf.raw[:n], eog)
        self._pieces[token] = hit
        return hit

    # -- slots --------------------------------------------------------------

    def begin(
        self,
        slot: int,
        sampling: ResolvedSampling,
        keep: int = 0,
        source: int | None = None,
        constraint: Constraint | LazyCalls | None = None,
        *,
        prompt: Sequence[int] = (),
        logprobs: int | None = None,
        replay: Sequence[int] = (),
    ) -> None:
        """Prepare ``slot`` for a new sequence: set up its KV cells and build its sampler chain.

        The slot keeps the first ``keep`` cells of its own sequence, or of a
        copy of ``source``'s (``llama_memory_seq_cp(mem, source, slot, -1,
        -1)``: in one pool llama.cpp tags the source's cells with the slot's
        sequence too, with the pool split per sequence it copies the whole
        stream; either way the copy is whole and its tail is then cut), and
        every later cell is removed (``llama_memory_seq_rm(mem, slot, keep,
        -1)``). A stream's copy happens at the start of the next
        ``llama_decode``, before that batch writes any cell, so ``source`` may
        be decoding in the same batch.

        The chain is :func:`_add_samplers`' (llama.cpp's order: logit bias, penalties, DRY,
        then greedy for temperature 0, else top-k, typical-p, top-p, min-p, XTC, temperature
        and a seeded draw); the penalties and DRY count the last tokens of ``prompt``. A greedy
        slot with nothing before its greedy sampler and no grammar takes the first highest logit
        itself (the argmax of ``_logits``). With ``logprobs``, each token sampled comes with its log
        probability and that many alternatives (:func:`token_logprob`). With a
        ``constraint``, the chain starts with llama.cpp's grammar sampler
        (``llama_sampler_init_grammar(vocab, grammar, "root")``): it sets every
        token the grammar does not allow next to -inf before the others pick,
        and allows end-of-generation only once the grammar is complete; the
        chain's accept advances it. With :class:`LazyCalls` the chain starts
        without one and a :class:`CallWatch` follows the slot's tokens: from the
        token after a ``<tool_call>`` marker to the one that completes the call,
        the call's grammar is first on the chain (see :meth:`decode`). Any
        previous chain of the slot is freed. The ``replay`` tokens (a preempted
        request's samples) are then accepted by the chain, and fed to its call
        watch, in order, as if sampled: penalties, a grammar and the watch are
        where they were (a seeded draw's state is not: it starts again).

        Raises:
            ValueError: ``slot`` or ``source`` is not in ``0 .. n_slots-1``,
                ``keep > 0`` or a ``source`` without :attr:`prefix_cache`, or
                fewer than ``keep`` cells (from position 0) there to keep;
                nothing changed.
            EngineError: llama.cpp refused to cut the sequence, or could not
                parse the constraint's grammar; the slot is then empty.
        """
        self._check_open()
        self._check_slot(slot)
        origin = slot if source is None else source
        self._check_slot(origin)
        if (keep or source is not None) and not self.prefix_cache:
            raise ValueError("this model's memory cannot keep or copy a prefix of a sequence")
        if keep < 0 or (keep and not self._holds_prefix(origin, keep)):
            raise ValueError(f"slot {origin} does not hold {keep} cells from position 0")
        if origin != slot:
            lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
            lc.llama_memory_seq_cp(self._mem, origin, slot, -1, -1)
        self.release(slot, keep)  # cells from keep on removed, old chain freed
        params = lc.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = lc.llama_sampler_chain_init(params)
        self._chains[slot] = chain
        if isinstance(constraint, LazyCalls):
            # The grammar a call gets is parsed now once, so that a grammar llama.cpp refuses
            # fails the begin, not a decode step; the ones of the other marker tails differ
            # only in the head's literal.
            probe = constraint.after("")
            assert probe is not None, "the empty tail is a prefix of every call"
            grammar = self._grammar(slot, probe)
            lc.llama_sampler_free(grammar)
            self._watches[slot] = CallWatch(constraint)
        elif constraint is not None:
            lc.llama_sampler_chain_add(chain, self._grammar(slot, constraint))
        _add_samplers(chain, sampling, self._vocab, self.n_vocab, prompt)
        self._argmax[slot] = sampling.plain_greedy and not isinstance(constraint, Constraint)
        self._logprobs[slot] = logprobs
        self._held[slot] = keep
        for token in replay:
            self._replayed(slot, token)

    def _grammar(self, slot: int, constraint: Constraint) -> Any:
        """A grammar sampler for ``constraint`` (start rule ``root``).

        Raises:
            EngineError: llama.cpp could not parse the grammar; the slot's chain is freed.
        """
        grammar = lc.llama_sampler_init_grammar(self._vocab, constraint.grammar.encode(), b"root")
        if not grammar:
            self._free_chain(slot)
            raise EngineError(f"llama.cpp could not parse the grammar for slot {slot}", [slot])
        return grammar

    def _switch(self, slot: int, switch: GrammarOn | GrammarOff) -> None:
        """Put a call's grammar first on the slot's chain, or take it off.

        The chain's other samplers are taken out and put back after the
        grammar (``llama_sampler_chain_remove`` hands a sampler back without
        freeing it), so a seeded draw keeps its state. A grammar llama.cpp
        cannot parse (begin parsed one of the same shape) leaves the call
        free and is logged.
        """
        chain = self._chains[slot]
        assert chain is not None
        match switch:
            case GrammarOn():
                grammar = lc.llama_sampler_init_grammar(self._vocab, switch.constraint.grammar.encode(), b"root")
                if not grammar:
                    log.error("llama.cpp could not parse a tool call's grammar for slot %d", slot)
                    return
                others = [lc.llama_sampler_chain_remove(chain, 0) for _ in range(lc.llama_sampler_chain_n(chain))]
                lc.llama_sampler_chain_add(chain, grammar)
                for sampler in others:
                    lc.llama_sampler_chain_add(chain, sampler)
                self._call_grammar[slot] = True
            case GrammarOff():
                if self._call_grammar[slot]:
                    lc.llama_sampler_free(lc.llama_sampler_chain_remove(chain, 0))
                    self._call_grammar[slot] = False
            case _:
                assert_never(switch)

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        """Decode one batch holding every feed; sample one token per feed with ``sample``.

        All feeds go into the one shared ``llama_batch`` (tokens at their
        positions, sequence id = slot, output flag on the last token of each
        sampling feed), then a single ``llama_decode``. Each sampling feed's
        chain then samples from the logits of its last token (a feed with
        ``forced`` takes that token instead, which the chain accepts as if it
        had sampled it: a grammar advances over it); a slot begun
        with :class:`LazyCalls` has its :class:`CallWatch` fed the token right
        away, so a call's grammar goes on (or off) before the slot's next
        token is sampled, however the caller pipelines steps.

        Args:
            feeds: the batch, under the rules of
                :func:`~ringserve.engine.protocol.check_feeds` (at most one feed
                per slot, each for a begun slot and at the position that
                continues its sequence; 1..``n_batch`` tokens in all).

        Returns:
            One :class:`Sampled` per feed with ``sample=True``, in feed order.
            ``piece`` is the token's text bytes (:meth:`token_piece`: empty for
            an end-of-generation token such as ``<|im_end|>``); ``eog`` marks one.

        Raises:
            ValueError: the batch breaks a rule of
                :func:`~ringserve.engine.protocol.check_feeds` (too many tokens,
                an empty feed, a slot out of range, fed twice or not begun, a
                position that does not continue the slot). Nothing was decoded.
            KVCacheFull: a feed would take its sequence past ``n_ctx_seq``
                tokens (checked before decoding; ``slots`` = those slots), or
                ``llama_decode`` returned 1, no KV cells for the batch
                (``slots`` = all fed slots). Either way nothing was decoded
                and the KV cache is as before the call.
            EngineError: any other nonzero return (abort, fatal error); after
                a fatal error some of the batch may stay in the KV cache, so
                the runner should release the slots.
        """
        self._check_open()
        if not feeds:
            return []
        check_feeds(feeds, n_slots=self.n_slots, n_batch=self.n_batch, n_ctx_seq=self.n_ctx_seq, held=self._held)
        batch = self._batch
        assert batch is not None, "decode() after close()"
        sample_at = batch.fill(feeds)
        rc = lc.llama_decode(self._ctx, batch.raw)
        if rc != 0:
            slots = [f.slot for f in feeds]
            if rc == 1:
                n = batch.raw.n_tokens
                raise KVCacheFull(f"no KV cells for a batch of {n} tokens (llama_decode returned 1)", slots)
            raise EngineError(_DECODE_ERRORS.get(rc, f"llama_decode failed with code {rc}"), slots)
        held = self._held
        for f in feeds:
            held[f.slot] = f.pos + len(f.tokens)
        return [self._sample(slot, i, forced) for slot, i, forced in sample_at]

    def _sample(self, slot: int, i: int, forced: int | None) -> Sampled:
        """The slot's token from the logits at batch index ``i`` (``forced``, where given, as if
        sampled), with its :class:`CallWatch` fed and any grammar switch applied, and its logprobs
        where the slot asks for them."""
        if forced is not None:
            token = forced
            lc.llama_sampler_accept(self._chains[slot], token)
        elif self._argmax[slot] and not self._call_grammar[slot]:
            token = int(self._logits(i).argmax())
        else:
            token = lc.llama_sampler_sample(self._chains[slot], self._ctx, i)
        piece, eog = self._watched(slot, token)
        n_top = self._logprobs[slot]
        logprob = None if n_top is None else token_logprob(self._logits(i), token, n_top, self.token_piece)
        return Sampled(slot, token, piece, eog, logprob)

    def _replayed(self, slot: int, token: int) -> None:
        """``token`` taken by the slot's chain and call watch as if sampled (a preempted request's)."""
        lc.llama_sampler_accept(self._chains[slot], token)
        self._watched(slot, token)

    def _watched(self, slot: int, token: int) -> tuple[bytes, bool]:
        """``token``'s piece and whether it ends generation, with the slot's call watch fed and any
        grammar switch applied."""
        piece, eog = self._piece(token)
        watch = self._watches[slot]
        if watch is not None:
            switch = watch.feed(piece)
            if switch is not None:
                self._switch(slot, switch)
        return piece, eog

    def _logits(self, i: int) -> np.ndarray:
        """The raw logits at batch index ``i`` (a view of llama.cpp's buffer, valid until the next
        decode; samplers work on a copy). Its first highest is what ``llama_sampler_sample`` with a
        chain of only ``llama_sampler_init_greedy`` returns (``llama_sampler_greedy_apply`` keeps
        the first maximum; greedy's ``accept`` does nothing, so skipping it changes no state)."""
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))

    def release(self, slot: int, keep: int = 0) -> None:
        """Free the slot's sampler chain and remove its KV cells from position ``keep`` on.

        Calls ``llama_memory_seq_rm(mem, slot, -1, -1)`` for ``keep`` 0, which
        never fails for a whole sequence, else ``llama_memory_seq_rm(mem,
        slot, keep, -1)``, which keeps the prefix for a later :meth:`begin`.

        Idempotent; a released slot can be begun again.

        Raises:
            ValueError: ``slot`` is not in ``0 .. n_slots-1``, or ``keep > 0``
                without :attr:`prefix_cache`.
            EngineError: llama.cpp refused to cut the sequence; it is then
                removed whole.
        """
        self._check_open()
        self._check_slot(slot)
        if keep and not self.prefix_cache:
            raise ValueError("this model's memory cannot keep a prefix of a sequence")
        self._free_chain(slot)
        if not lc.llama_memory_seq_rm(self._mem, slot, keep or -1, -1):
            lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
            raise EngineError(f"llama.cpp could not cut slot {slot} at position {keep}", [slot])

    def _holds_prefix(self, slot: int, n: int) -> bool:
        """Whether ``slot`` holds cells at every position ``0 .. n-1``."""
        return lc.llama_memory_seq_pos_min(self._mem, slot) == 0 and lc.llama_memory_seq_pos_max(self._mem, slot) >= n - 1

    def kv_cells_used(self, slot: int | None = None) -> int:
        """KV cells holding tokens of ``slot``, or of every slot when None.

        Counted from ``llama_memory_seq_pos_min/max`` as ``max - min + 1``
        (0 for an empty sequence); llama.cpp guarantees every position in
        that range is present.

        Raises:
            ValueError: ``slot`` is not in ``0 .. n_slots-1``.
        """
        self._check_open()
        if slot is not None:
            self._check_slot(slot)
            return self._cells(slot)
        return sum(self._cells(s) for s in range(self.n_slots))

    def _cells(self, slot: int) -> int:
        hi = lc.llama_memory_seq_pos_max(self._mem, slot)
        if hi < 0:
            return 0
        return hi - lc.llama_memory_seq_pos_min(self._mem, slot) + 1

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Free the sampler chains, the batch, the context and the model. Idempotent.

        Any other method called afterwards raises :class:`EngineError`.
        """
        self._closed = True
        for slot in range(len(getattr(self, "_chains", ()))):
            self._free_chain(slot)
        if self._batch is not None:
            self._batch.free()
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _free_chain(self, slot: int) -> None:
        self._held[slot] = None  # not begun: no feed until the next begin
        self._watches[slot] = None
        self._call_grammar[slot] = False
        self._argmax[slot] = False
        self._logprobs[slot] = None
        chain = self._chains[slot]
        if chain is not None:
            self._chains[slot] = None
            lc.llama_sampler_free(chain)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot must be 0..{self.n_slots - 1}, got {slot}")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the engine is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<LlamaEngine {self.model_id!r} slots={self.n_slots} ctx={self.n_ctx}"
            f" batch={self.n_batch} {state}>"
        )
