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

import attrs
import numpy as np

from ringserve.config import ModelSettings, Switch, decode_threads
from ringserve.core.batch import Sampled, SlotFeed
from ringserve.core.events import ChatMessage, GenerationRequest, Role, TokenLogprob, TopLogprob
from ringserve.core.offload import ALL_LAYERS, plan_offload
from ringserve.core.sampling import ResolvedSampling, gguf_sampling
from ringserve.core.sizing import (
    CacheType,
    GpuMemory,
    MemoryReport,
    SizingError,
    SizingRequest,
    plan_sizing,
)
from ringserve.core.toolcalls import plain_messages
from ringserve.engine._native import llama_cpp as lc
from ringserve.engine.gbnf import CallWatch, Constraint, GrammarOff, GrammarOn, LazyCalls
from ringserve.engine.gguf import read_gguf
from ringserve.engine.loader import Front, context_window
from ringserve.engine.modelfile import ModelFileError, check_model_file, default_model_path
from ringserve.engine.protocol import ChatPrompt, Engine, EngineError, KVCacheFull, check_feeds
from ringserve.formats.base import ChatFormat
from ringserve.formats.detect import format_for
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

__all__ = ["ChatTemplateError", "LlamaEngine", "host_available", "memory_report"]

log = logging.getLogger("ringserve.engine")

FALLBACK_CHAT_TEMPLATE = b"chatml"
"""llama.cpp's built-in template (``llama_chat_apply_template``), used when the GGUF has no
``tokenizer.chat_template`` and none is configured."""

FALLBACK_TURN_ENDS = ("<|im_end|>", "<|im_start|>")
"""The texts that end a turn in :data:`FALLBACK_CHAT_TEMPLATE`, and begin the next: where the
vocabulary has no end-of-generation token for the first (a base model such as gemma-3-270m writes
them as text), the reply ends at either (:attr:`~ringserve.engine.protocol.ChatPrompt.turn_ends`),
as llama-cpp-python's ``format_chatml`` stops at ``<|im_end|>`` and Ollama's ChatML templates at
both (a base model may go on to write the next turn without ending its own)."""

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


def _offload_devices() -> list[tuple[int, str]]:
    """(handle, ``NAME (DESCRIPTION)``) of each device llama.cpp offloads layers to: the GPUs ggml
    registered, or, when there is none, the integrated GPUs (as ``llama_model_load_from_file_impl``
    in llama.cpp's ``src/llama.cpp`` picks them).

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
    found: dict[_DeviceType, list[tuple[int, str]]] = {_DeviceType.GPU: [], _DeviceType.IGPU: []}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind in found:
            name = lib.ggml_backend_dev_name(dev).decode(errors="replace")
            found[_DeviceType(kind)].append((dev, f"{name} ({lib.ggml_backend_dev_description(dev).decode(errors='replace')})"))
    return found[_DeviceType.GPU] or found[_DeviceType.IGPU]


def gpu_devices() -> tuple[str, ...]:
    """The devices llama.cpp offloads layers to, each ``NAME (DESCRIPTION)`` (:func:`_offload_devices`).
    Empty on a CPU-only build. Call after ``llama_backend_init``."""
    return tuple(name for _, name in _offload_devices())


def memory_report() -> MemoryReport:
    """The memory a model may use now: each offload device's free and total bytes
    (``ggml_backend_dev_memory``) and the host's available bytes (:func:`host_available`).

    Initializes llama.cpp's backends (``llama_backend_init``) if no engine has.
    """
    _init_backend()
    lib = lc.llama_cpp._lib
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    gpus = []
    for dev, name in _offload_devices():
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        gpus.append(GpuMemory(name, free.value, total.value))
    return MemoryReport(tuple(gpus), host_available())


def host_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes the host can give this process without swapping: ``MemAvailable`` of
    ``/proc/meminfo``, or, when lower, the cgroup's limit less what it uses that the kernel
    cannot reclaim (cgroup v2 ``memory.max - memory.current + inactive_file`` of ``memory.stat``,
    as the kubelet counts a container's working set; v1 ``memory.limit_in_bytes -
    memory.usage_in_bytes + total_inactive_file``), the cgroup found from ``/proc/self/cgroup``.
    A file that is missing or unreadable counts as no limit; no ``MemAvailable`` counts as 0.
    """
    available = 0
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    for limit_name, usage_name, inactive_name in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        for folder in _cgroup_folders(proc, cgroup):
            limit, usage = _read(folder / limit_name).strip(), _read(folder / usage_name).strip()
            if not limit.isdigit() or not usage.isdigit():
                continue
            inactive = 0
            for line in _read(folder / "memory.stat").splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_name and value.strip().isdigit():
                    inactive = int(value)
            available = min(available, max(0, int(limit) - int(usage) + inactive))
    return available


def _cgroup_folders(proc: Path, cgroup: Path) -> list[Path]:
    """This process's memory cgroup folders under ``cgroup`` (``/proc/self/cgroup``: ``0::/path``
    for v2, ``N:memory:/path`` for v1; ``cgroup/memory`` for v1's hierarchy), and the root's."""
    folders = [cgroup, cgroup / "memory"]
    for line in _read(proc / "self" / "cgroup").splitlines():
        _, controllers, rel = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        rel = rel.lstrip("/")
        if controllers == "" and rel:
            folders.append(cgroup / rel)
        elif "memory" in controllers.split(",") and rel:
            folders.append(cgroup / "memory" / rel)
    return folders


def _read(path: Path) -> str:
    """A small system file's text, ``""`` when it is missing or unreadable."""
    try:
        return path.read_text()
    except OSError:
        return ""


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


#: ``enum ggml_type`` of each cache type (``ggml/include/ggml.h``; llama-cpp-python has no
#: ``GGML_TYPE_BF16``).
_GGML_TYPES = {
    CacheType.F16: lc.GGML_TYPE_F16,
    CacheType.BF16: 30,  # GGML_TYPE_BF16
    CacheType.Q8_0: lc.GGML_TYPE_Q8_0,
    CacheType.Q4_0: lc.GGML_TYPE_Q4_0,
}


def _flash_attn_for(type_v: CacheType, flash_attn: bool | None) -> bool | None:
    """The flash attention setting for a V cache of ``type_v``: a quantized V cache needs it
    (llama.cpp refuses the context without it), so llama.cpp's choice (None) becomes on, with a
    log line.

    Raises:
        ValueError: a quantized ``type_v`` with flash attention off.
    """
    if not type_v.quantized:
        return flash_attn
    if flash_attn is False:
        raise ValueError(f"a {type_v} V cache needs flash attention, which is off (turn it on or use an f16 V cache)")
    if flash_attn is None:
        log.info("flash attention on: the %s V cache needs it", type_v)
    return True


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


def _load_model(path: Path, n_gpu_layers: int, use_extra_bufts: bool, devices: tuple[str, ...],
                progress: Callable[[float], None] | None = None) -> Any:
    """``llama_model_load_from_file`` with ``n_gpu_layers`` offloaded to ``devices``; ``progress`` is
    told the share loaded (0..1) as llama.cpp reports it (``progress_callback``).

    Raises:
        ModelFileError: llama.cpp could not load it (the message suggests a lower
            ``n_gpu_layers`` when layers were to go to a GPU).
    """
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    mparams.use_extra_bufts = use_extra_bufts
    if progress is not None:
        @lc.llama_progress_callback
        def report(share: float, _user: ctypes.c_void_p) -> bool:
            progress(share)
            return True  # go on

        mparams.progress_callback = report
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


class LlamaVocab:
    """A model's vocabulary and chat template: a :class:`~ringserve.engine.protocol.Tokenizer`.

    Over a loaded model's ``llama_model`` (an engine's), or over its own, loaded with
    ``vocab_only`` (:meth:`load`: the metadata and the vocabulary, without the weights or a
    context; a fraction of a second), so that a catalog model's requests are tokenized and
    checked against its context before its weights load (``engine/loader.py``). Token ids are the
    file's, whichever loaded them.

    Args:
        model: the ``llama_model`` pointer.
        path: its file.
        model_id: name reported to clients; default the file's stem.
        chat_template: Jinja source over the GGUF's ``tokenizer.chat_template`` (``[model]
            chat_template_file``); None: the GGUF's.
        chat_format: the family's name over the detected one (``[model] chat_format``); None: detected.
        owned: free ``model`` on :meth:`close` (a vocabulary-only load's own model).

    Attributes:
        model_id, n_vocab, max_token_bytes, chat_template, chat_format, reasoning_close:
            the :class:`~ringserve.engine.protocol.Tokenizer`'s (``max_token_bytes``: the longest
            piece in the vocabulary, for BPE and SentencePiece vocabularies; None for others).
        n_ctx_train: the context the model was trained with (tokens).

    Raises:
        ChatTemplateError: the chat template does not compile, or ``chat_format`` names no family.
    """

    def __init__(self, model: Any, path: Path, *, model_id: str | None = None, chat_template: str | None = None,
                 chat_format: str | None = None, owned: bool = False) -> None:
        self._model = model
        self._owned = owned
        self.path = path
        self.model_id = model_id or path.stem
        self._vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self._bos = lc.llama_vocab_bos(self._vocab)
        self._add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, tuple[bytes, bool]] = {}
        self._builtin_turn_ends: tuple[str, ...] = ()  # (set by _load_chat for a model with no template)
        self._piece_buf = ctypes.create_string_buffer(64)
        self.n_ctx_train = lc.llama_model_n_ctx_train(model)
        self.max_token_bytes, specials = self._scan_vocab()
        self._load_chat(chat_template, chat_format, specials)

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None, chat_template: str | None = None,
             chat_format: str | None = None) -> LlamaVocab:
        """The vocabulary and chat template of the GGUF at ``path``, without its weights.

        Raises:
            ModelFileError: the file is missing, not GGUF, or llama.cpp could not read it.
            ChatTemplateError: as the constructor.
        """
        path = check_model_file(path)
        _init_backend()
        params = lc.llama_model_default_params()
        params.vocab_only = True
        model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelFileError(f"llama.cpp could not read the model's vocabulary: {path}", path)
        try:
            return cls(model, path, model_id=model_id, chat_template=chat_template, chat_format=chat_format,
                       owned=True)
        except BaseException:
            lc.llama_model_free(model)
            raise

    def close(self) -> None:
        """Free the vocabulary-only model it loaded (nothing for an engine's). Idempotent."""
        if self._owned and self._model:
            lc.llama_model_free(self._model)
        self._model = None


    def _scan_vocab(self) -> tuple[int | None, SpecialTokens]:
        """One pass over the vocabulary: the bytes of the longest token piece (for BPE and SPM
        vocabularies; None for others) and the special tokens (control and unknown ones, the
        tokens only ``parse_special`` makes: the chat template's markers).

        A loading thread runs this beside running streams, so it makes one llama.cpp call per
        token: ``llama_token_to_piece`` without special tokens gives control and unknown tokens
        no piece (0 bytes; ``llama_vocab::impl::token_to_piece`` in llama.cpp's
        ``src/llama-vocab.cpp``), so only the tokens of no piece have their attributes read
        (gemma-3-270m: 6,250 of 262,144): about 0.6 of the time with the GIL of two calls per
        token (``bench/load_beside.py``, docs/benchmarks.md)."""
        vocab, to_piece = self._vocab, lc.llama_token_to_piece
        buf = ctypes.create_string_buffer(256)
        size = len(buf)
        longest = 1
        pieceless = []
        for token in range(self.n_vocab):
            n = abs(to_piece(vocab, token, buf, size, 0, False))  # negative: the piece needs -n bytes
            if n > longest:
                longest = n
            elif not n:
                pieceless.append(token)
        special_attrs = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
        specials = []
        for token in pieceless:
            attr = lc.llama_vocab_get_attr(vocab, token)
            if attr & special_attrs and (text := self._special_text(token)):
                specials.append(SpecialToken(text, lstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_LSTRIP),
                                             rstrip=bool(attr & lc.LLAMA_TOKEN_ATTR_RSTRIP)))
        byte_sized = lc.llama_vocab_type(vocab) in (lc.LLAMA_VOCAB_TYPE_SPM, lc.LLAMA_VOCAB_TYPE_BPE)
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
            if source is None:
                end = self.tokenize(FALLBACK_TURN_ENDS[0], parse_special=True)
                eog = len(end) == 1 and lc.llama_vocab_is_eog(self._vocab, end[0])
                self._builtin_turn_ends = () if eog else FALLBACK_TURN_ENDS
                log.warning("model %s has no chat template: chats are written in llama.cpp's ChatML, which a base"
                            " model may not follow (a reply ends at its <|im_end|>, else runs to max_tokens); give"
                            " [model] chat_template_file for a model that has its own format: %s",
                            self.model_id, self.path)
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
        chat_format = format_for(family, source)
        if chat_format is None:
            raise ChatTemplateError(
                f"unknown chat format {family!r} (one of {', '.join(sorted(FAMILIES))}): {self.path}", self.path
            )
        self.chat_format: ChatFormat = chat_format
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
        return ChatPrompt("".join(texts), tuple(tokens), turn_ends=self._builtin_turn_ends)

    def _apply_builtin(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """``messages`` through ``llama_chat_apply_template`` with :data:`FALLBACK_CHAT_TEMPLATE`.

        Raises:
            ValueError: no messages, or llama.cpp failed to apply the template.
        """
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
        return self.piece(token)[0]

    def piece(self, token: int) -> tuple[bytes, bool]:
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
        type_k, type_v: the KV cache's element types (llama.cpp's ``-ctk`` /
            ``-ctv``; :class:`~ringserve.core.sizing.CacheType`). A quantized V
            cache needs flash attention: with ``flash_attn=None`` it is turned on
            (and logged), with ``flash_attn=False`` the engine refuses.
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
        ValueError: a size argument is out of range, or a quantized ``type_v``
            with ``flash_attn=False``.
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
        type_k: CacheType = CacheType.F16,
        type_v: CacheType = CacheType.F16,
        model_id: str | None = None,
        chat_template: str | None = None,
        chat_format: str | None = None,
        vocab: LlamaVocab | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch: _Batch | None = None
        self._closed = False
        path = check_model_file(path)
        _init_backend()
        _check_sizes(n_slots, n_ctx, n_batch, n_threads)
        flash_attn = _flash_attn_for(type_v, flash_attn)
        self.path = path
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

        devices = gpu_devices()
        self._model = _load_model(path, n_gpu_layers, use_extra_bufts, devices, progress)
        try:
            self.offload = plan_offload(n_gpu_layers, lc.llama_model_n_layer(self._model), devices)
            self._vocab = lc.llama_model_get_vocab(self._model)
            self.vocab = vocab if vocab is not None else LlamaVocab(
                self._model, path, model_id=model_id, chat_template=chat_template, chat_format=chat_format)
            self.model_id = self.vocab.model_id
            self.n_ctx_train = lc.llama_model_n_ctx_train(self._model)
            n_ctx = self.n_ctx = n_ctx or self.n_ctx_train
            if n_ctx > n_slots * self.n_ctx_train > 0:
                # Refused before llama.cpp allocates the KV cells (GBs for a typo).
                raise EngineError(
                    f"a context of {n_ctx} tokens is more than {n_slots} slot(s) of the model's trained context of "
                    f"{self.n_ctx_train} tokens (n_ctx_train of {path})"
                )
            self._create_context(flash_attn, type_k, type_v)
            self._batch = _Batch(n_batch)  # one batch for the engine's life
        except BaseException:
            self.close()
            raise

    def _create_context(self, flash_attn: bool | None, type_k: CacheType, type_v: CacheType) -> None:
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
        cparams.type_k = _GGML_TYPES[type_k]
        cparams.type_v = _GGML_TYPES[type_v]
        if flash_attn is not None:
            cparams.flash_attn_type = (
                lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        cparams.kv_unified = self._kv_unified
        cparams.swa_full = False  # sliding-window layers keep their window, as llama-server's (a fraction of the memory)
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

    # -- the vocabulary ------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def max_token_bytes(self) -> int | None:
        return self.vocab.max_token_bytes

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.vocab.chat_template

    @property
    def chat_format(self) -> ChatFormat:
        return self.vocab.chat_format

    @property
    def reasoning_close(self) -> tuple[int, ...]:
        return self.vocab.reasoning_close

    def tokenize_chat(self, request: GenerationRequest) -> ChatPrompt:
        """:meth:`LlamaVocab.tokenize_chat` of the engine's vocabulary."""
        self._check_open()
        return self.vocab.tokenize_chat(request)

    def tokenize(self, text: str | bytes, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """:meth:`LlamaVocab.tokenize` of the engine's vocabulary."""
        self._check_open()
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_piece(self, token: int) -> bytes:
        """:meth:`LlamaVocab.token_piece` of the engine's vocabulary."""
        return self.vocab.token_piece(token)

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
        piece, eog = self.vocab.piece(token)
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


@attrs.frozen
class LlamaLoader:
    """The :class:`~ringserve.engine.loader.ModelLoader` of GGUF files.

    Its front reads the GGUF's metadata (``engine/gguf.py``), sizes the context and the GPU layers
    to the free memory (``core/sizing.py``: the context the model was trained with, lowered to what
    fits, keeping ``margin`` bytes free; GPU layers lowered when the weights do not fit) and loads the
    vocabulary alone (:meth:`LlamaVocab.load`); its engine loads the weights as sized.

    Args:
        margin: bytes left free on each device (``[router] memory_margin``).
        memory: the memory report (:func:`memory_report`; a test's own).
    """

    margin: int = 1024**3
    memory: Callable[[], MemoryReport] = memory_report

    def front(self, settings: ModelSettings) -> Front:
        """The model's vocabulary, sizing and sampling layers (``[model.sampling]``, then the GGUF's).

        Raises:
            ModelFileError: the file is missing or not GGUF, its template file cannot be read or
                its template does not load (one line).
            EngineError: it cannot be sized: a context above the trained one, or nothing fits
                the memory (one line: what it needs, what there is).
        """
        model, engine = settings.model, settings.engine
        path = check_model_file(model.path or default_model_path())
        info = read_gguf(path)
        template = _template_file(model.chat_template_file)
        report = self.memory()
        slots = engine.slots
        request = SizingRequest(
            n_ctx=model.ctx_size if model.kv_unified else _split_share(settings, info.n_ctx_train),
            n_gpu_layers=model.n_gpu_layers, type_k=model.cache_type_k, type_v=model.cache_type_v,
            # (None: llama.cpp's choice, on for the quantized V cache that needs it: _flash_attn_for)
            flash_attn=_flash_attn(model.flash_attn, model.cache_type_v, gpu=bool(report.gpus)) is not False,
            n_batch=engine.n_batch, n_ubatch=engine.n_batch, n_seq=slots, kv_unified=model.kv_unified,
            margin=self.margin)
        if request.n_ctx > info.n_ctx_train:  # (plan_sizing's check, said in the settings' terms)
            raise EngineError(f"{_context_setting(settings)} is above the model's trained context of"
                              f" {info.n_ctx_train} tokens (ctx_size = 0 takes it): {path}")
        try:
            sizing = plan_sizing(info, report, request)
        except SizingError as exc:
            raise EngineError(str(exc)) from None
        n_ctx = sizing.n_ctx if model.kv_unified else sizing.n_ctx * slots
        n_ctx_seq = min(sizing.n_ctx, info.n_ctx_train or sizing.n_ctx)
        vocab = LlamaVocab.load(path, model_id=model.name or None, chat_template=template,
                                chat_format=model.chat_format or None)
        estimate = sizing.estimate
        memory = estimate.gpu if report.gpus and sizing.gpu_layers else estimate.host
        log.info("model %s sized: %s", vocab.model_id, sizing.describe())
        return Front(vocab, n_ctx, context_window(settings.engine, n_ctx_seq), (model.sampling, gguf_sampling(info.sampling)),
                     memory, sizing)

    def engine(self, settings: ModelSettings, front: Front, progress: Callable[[float], None]) -> Engine:
        """The model's engine with its front's sizing and vocabulary.

        Raises:
            ModelFileError, EngineError: llama.cpp could not load it or make its context (one line).
        """
        model, engine = settings.model, settings.engine
        sizing = front.sizing
        assert sizing is not None and isinstance(front.tokenizer, LlamaVocab)
        gpu = bool(sizing.gpus)
        try:
            return LlamaEngine(
                front.tokenizer.path, n_slots=engine.slots, n_ctx=front.n_ctx, n_batch=engine.n_batch,
                kv_unified=model.kv_unified, n_gpu_layers=sizing.gpu_layers if gpu else 0,
                n_threads=model.n_threads, use_extra_bufts=model.use_extra_bufts,
                flash_attn=_flash_attn(model.flash_attn, model.cache_type_v, gpu=gpu),
                type_k=model.cache_type_k, type_v=model.cache_type_v, vocab=front.tokenizer, progress=progress,
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def free_memory(self) -> int | None:
        report = self.memory()
        free = sum(g.free for g in report.gpus) if report.gpus else report.host_available
        return max(0, free - self.margin)


def _split_share(settings: ModelSettings, n_ctx_train: int) -> int:
    """Each sequence's cells when the pool is split (``kv_unified`` false): its share of ``ctx_size``
    (llama-server's ``-c`` with ``-np``); without one, ``[engine] ctx_per_slot`` each, else a share
    of the trained context."""
    slots, cap = settings.engine.slots, settings.engine.ctx_per_slot
    return settings.model.ctx_size // slots if settings.model.ctx_size else cap or n_ctx_train // slots


def _context_setting(settings: ModelSettings) -> str:
    """The setting that asked for each sequence's context, as the operator wrote it."""
    model, engine = settings.model, settings.engine
    if model.kv_unified:
        return f"ctx_size = {model.ctx_size}"
    if model.ctx_size:
        return f"ctx_size = {model.ctx_size} split over {engine.slots} slots (kv_unified = false)"
    return f"ctx_per_slot = {engine.ctx_per_slot} (kv_unified = false)"


def _template_file(path: str) -> str | None:
    """The Jinja source of ``[model] chat_template_file`` (None when it is empty).

    Raises:
        ModelFileError: it cannot be read (one line naming it).
    """
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"[model] chat_template_file cannot be read: {exc}", path) from None


def _flash_attn(setting: Switch, type_v: CacheType, *, gpu: bool) -> bool | None:
    """``[model] flash_attn`` for the engine: ``on``/``off`` as said; ``auto`` on with a GPU,
    off on the CPU, where it was slower for the bundled model (0.35 to 0.71 times the decode
    rate; 1.14 to 1.18 times for gemma-3-270m: docs/benchmarks.md, "KV cache types") and makes a
    greedy reply after a prefix-cache hit differ (docs/prefix-cache.md); a quantized V cache turns
    it on (:func:`_flash_attn_for`)."""
    match setting:
        case Switch.ON:
            return True
        case Switch.OFF:
            return False
        case Switch.AUTO:
            return True if gpu else None if type_v.quantized else False
        case _:
            assert_never(setting)
