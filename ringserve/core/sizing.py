"""How much context a model gets and how many of its layers go to the GPU, from its GGUF metadata
and the free memory, before anything is loaded.

Sans-I/O: pure functions of a :class:`~ringserve.core.modelinfo.GGUFInfo` (read by
:func:`ringserve.engine.gguf.read_gguf`), a :class:`MemoryReport` (read by
:func:`ringserve.engine.llama.memory_report`) and a :class:`SizingRequest`.

What llama.cpp allocates, and how this module counts it (the vendored llama.cpp of
llama-cpp-python 0.3.36; ``tests/engine/test_sizing_llama.py`` holds each estimate within 10 % of
the buffers llama.cpp reports on the bundled SmolLM2 and on gemma-3-270m):

- **Weights**: each tensor's bytes as it lies in the file. The input layer (``token_embd``) stays in
  host memory; with ``n_gpu_layers = N`` the last ``N`` of the ``n_layer + 1`` offloadable layers go
  to the GPU, the output layer first (``load_tensors`` in ``src/llama-model.cpp``: ``i_gpu_start =
  n_layer + 1 - N``); a tied output (no ``output.weight``) is a copy of ``token_embd`` there.
- **KV cache** (``llama_kv_cache``, ``src/llama-kv-cache.cpp``): per layer with KV, K and V rows
  of ``n_head_kv * key_length`` and ``n_head_kv * value_length`` elements per cell, in the cache
  types' bytes (:meth:`CacheType.row_bytes`); on the GPU for offloaded layers. The cells
  (``llama_context``, ``src/llama-context.cpp``): ``n_ctx`` rounded up to 256; with a unified KV
  cache one stream of that many, otherwise one stream per sequence of ``n_ctx / n_seq`` rounded up
  to 256. Sliding-window layers (``llama_kv_cache_iswa``, ``src/llama-kv-cache-iswa.cpp``) hold
  ``min(cells, n_swa * (n_seq if unified else 1) + n_ubatch)`` rounded up to 256, or every cell
  with ``swa_full`` (llama.cpp's library default; llama-server and ringserve's engine turn it off).
- **Compute buffer** (``sched_reserve``, ``src/llama-context.cpp``): the graph of one micro-batch of
  ``T = n_ubatch`` tokens with every token an output, at its peak: either the logits (``n_vocab * T``
  float32) or, without flash attention, one layer's attention scores (``n_kv * T * n_head``
  float32, plus the mask); with flash attention only the masks (float16). Plus a few activations
  of ``n_embd * T`` floats; fitted on SmolLM2 and gemma-3 (see :func:`compute_bytes`). The output
  buffer (``n_vocab`` floats per sequence) is host memory.

The plan (:func:`plan_sizing`) does what llama-server's ``--fit`` does (``common/fit.cpp``,
``common_params_fit_impl``), in the same order: with the context left to it (``n_ctx = 0``) it
first lowers the context, in multiples of 256, down to ``n_ctx_min`` (``--fit-ctx``, 4096, or the
trained context if smaller); only then, with the GPU layers left to it (``n_gpu_layers = -1``), it
lowers the layers, keeping the lowered context. A context or layer count that was asked for is
kept. A margin is left free on each device (``--fit-target``, 1 GiB by default). Unlike llama.cpp,
it also counts host memory (what the host has available, not its total), for a CPU-only machine
and for the layers left on the CPU, and where nothing fits it refuses with one line rather than
loading anyway.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import assert_never

import attrs
from attrs import validators as v

from ringserve.core.modelinfo import GGUFInfo

#: Bytes in a GiB.
GIB = 1 << 30

#: llama.cpp's cell granularity: ``n_ctx`` and each sequence's share are rounded up to it
#: (``GGML_PAD(n_ctx, 256)`` in ``llama_context``), and ``--fit`` lowers the context by it.
CTX_ALIGN = 256

#: The context asked when the model's trained context is wanted (llama.cpp's ``n_ctx = 0``).
AUTO_CONTEXT = 0

#: ``n_gpu_layers`` meaning every layer that fits (llama.cpp: a negative value means all).
AUTO_LAYERS = -1


def _pad(n: int, to: int = CTX_ALIGN) -> int:
    return -(-n // to) * to


class CacheType(enum.StrEnum):
    """A KV cache element type (llama.cpp's ``-ctk`` / ``-ctv``; ``enum ggml_type`` in ``ggml.h``)."""

    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"

    @property
    def block(self) -> tuple[int, int]:
        """(elements, bytes) of one block (ggml's ``type_traits``: f16 and bf16 2 bytes per element;
        ``block_q8_0`` 32 int8 and an f16 scale, 34 bytes; ``block_q4_0`` 32 nibbles and a scale, 18)."""
        match self:
            case CacheType.F16 | CacheType.BF16:
                return 1, 2
            case CacheType.Q8_0:
                return 32, 34
            case CacheType.Q4_0:
                return 32, 18
            case _:
                assert_never(self)

    @property
    def quantized(self) -> bool:
        """Whether llama.cpp needs flash attention for it as the V cache
        (``"quantized V cache was requested, but this requires Flash Attention"``)."""
        return self.block[0] > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of ``n`` elements (``ggml_row_size``; ``n`` a multiple of the block in practice)."""
        elements, size = self.block
        return -(-n // elements) * size


class ContextReason(enum.Enum):
    """Why the context is what it is."""

    TRAINED = "the model's trained context"
    ASKED = "as asked"
    MEMORY = "lowered to fit memory"


class LayersReason(enum.Enum):
    """Why that many layers are on the GPU."""

    ALL = "all"
    ASKED = "as asked"
    MEMORY = "lowered to fit memory"
    NO_GPU = "no GPU"


@attrs.frozen
class GpuMemory:
    """A GPU device's memory (``ggml_backend_dev_memory``).

    Attributes:
        name: ``NAME (DESCRIPTION)`` as ggml names it (``CUDA0 (NVIDIA H100)``).
        free, total: bytes.
    """

    name: str
    free: int
    total: int


@attrs.frozen
class MemoryReport:
    """The memory a model may use now.

    Attributes:
        gpus: the devices llama.cpp offloads layers to (empty: none).
        host_available: bytes the host can give without swapping (``MemAvailable``, or a
            container's limit less its use when that is lower).
    """

    gpus: tuple[GpuMemory, ...]
    host_available: int


@attrs.frozen
class SizingRequest:
    """What the configuration asks of the context, before the memory is counted.

    Attributes:
        n_ctx: tokens one sequence may hold (with ``kv_unified``, the pool every sequence
            shares); :data:`AUTO_CONTEXT` (0): the model's trained context, lowered to fit.
        n_gpu_layers: layers to offload; :data:`AUTO_LAYERS` (-1): all, lowered to fit.
        type_k, type_v: the KV cache types.
        flash_attn: whether the context uses flash attention (resolved: on or off).
        n_batch, n_ubatch: llama.cpp's logical and physical batch (tokens).
        n_seq: sequences decoded together (slots).
        kv_unified: one KV stream for all sequences (``kv_unified``) or one each.
        swa_full: sliding-window layers keep every cell (llama.cpp's library default) instead of
            the window (llama-server's default, and the engine's).
        margin: bytes left free on each GPU and on the host (``--fit-target``: 1 GiB).
        n_ctx_min: the lowest context the plan lowers to (``--fit-ctx``: 4096), or the trained
            context if smaller.
    """

    n_ctx: int = attrs.field(default=AUTO_CONTEXT, validator=v.ge(0))
    n_gpu_layers: int = attrs.field(default=AUTO_LAYERS, validator=v.ge(-1))
    type_k: CacheType = CacheType.F16
    type_v: CacheType = CacheType.F16
    flash_attn: bool = False
    n_batch: int = attrs.field(default=512, validator=v.ge(1))
    n_ubatch: int = attrs.field(default=512, validator=v.ge(1))
    n_seq: int = attrs.field(default=1, validator=v.ge(1))
    kv_unified: bool = True
    swa_full: bool = False
    margin: int = attrs.field(default=GIB, validator=v.ge(0))
    n_ctx_min: int = attrs.field(default=4096, validator=v.ge(1))


class SizingError(ValueError):
    """The model cannot be sized as asked: a context above the trained one, or nothing fits the
    memory. ``str()`` is one line saying what it needs and what there is."""


def kv_bytes_per_token(
    info: GGUFInfo, type_k: CacheType, type_v: CacheType, *, swa_full: bool = False
) -> int | None:
    """Bytes of KV cache one more token of context costs, summed over the layers with KV.

    A sliding-window layer costs a fixed window, not per token, unless ``swa_full`` (its cells
    are then counted by :func:`kv_cells`); see the module docstring.

    Returns:
        Bytes per token, or None when the architecture's memory is not estimated
        (:attr:`~ringserve.core.modelinfo.GGUFInfo.kv_unknown`).
    """
    if info.kv_unknown is not None:
        return None
    layers = [il for il in info.kv_layers if swa_full or not info.swa_layers[il]]
    return sum(_cell_bytes(info, il, type_k, type_v) for il in layers)


def _cell_bytes(info: GGUFInfo, il: int, type_k: CacheType, type_v: CacheType) -> int:
    k, v_ = info.kv_width(il)
    return type_k.row_bytes(k) + type_v.row_bytes(v_)


@attrs.frozen
class KVCells:
    """The cells llama.cpp gives the KV cache of a context (see the module docstring).

    Attributes:
        streams: KV streams (1 when unified, else one per sequence).
        full: cells per stream of a full-attention layer (``n_ctx_seq``).
        swa: cells per stream of a sliding-window layer.
        n_ubatch: the micro-batch llama.cpp uses (``min(n_ctx, n_batch, n_ubatch)``).
    """

    streams: int
    full: int
    swa: int
    n_ubatch: int


def kv_cells(info: GGUFInfo, request: SizingRequest, n_ctx: int) -> KVCells:
    """The KV cells of a context of ``n_ctx`` tokens per sequence (``llama_context``'s
    ``n_ctx_seq`` and ``llama_kv_cache_iswa``'s ``size_swa``)."""
    n_seq = request.n_seq
    total = n_ctx if request.kv_unified else n_ctx * n_seq  # llama.cpp's n_ctx
    n_ubatch = min(total, request.n_batch, request.n_ubatch)
    padded = _pad(total)
    full = padded if request.kv_unified else _pad(padded // n_seq)
    swa = full
    if info.n_swa and not request.swa_full:
        swa = _pad(min(full, info.n_swa * (n_seq if request.kv_unified else 1) + n_ubatch))
    return KVCells(1 if request.kv_unified else n_seq, full, swa, n_ubatch)


def compute_bytes(info: GGUFInfo, request: SizingRequest, n_ctx: int) -> int:
    """The compute buffer llama.cpp reserves for a context of ``n_ctx`` tokens per sequence
    (bytes, the graph's peak; see the module docstring).

    ``T`` is the micro-batch. The peak is the larger of the logits, ``4 * T * (n_vocab + 3 *
    n_embd)``, and one layer's attention: without flash attention its scores ``4 * n_kv * T *
    n_head`` (softmax works in place) and a float32 mask of ``n_kv * T`` per cache (two with
    sliding-window layers), with flash attention the masks in float16 only; plus ``4 * T * (5 *
    n_embd + 2 * n_head_kv * key_length)`` of activations. The activations' factors are fitted
    on SmolLM2-135M (exact at 6,144 and 8,192 tokens, n_ubatch 128-512, with and without flash
    attention) and gemma-3-270m; the logits' two or three ``n_embd`` rows depend on where
    ggml-alloc places them (3 counted).
    """
    cells = kv_cells(info, request, n_ctx)
    t = cells.n_ubatch
    logits = 4 * t * (info.n_vocab + 3 * info.n_embd)
    kv_width = max((info.kv_width(il)[0] for il in info.kv_layers), default=0)
    activations = 4 * t * (5 * info.n_embd + 2 * kv_width)
    has_swa = any(info.swa_layers[il] for il in info.kv_layers)
    has_full = not all(info.swa_layers[il] for il in info.kv_layers)
    masks = (cells.full if has_full else 0) + (cells.swa if has_swa else 0)
    if request.flash_attn:
        attention = 2 * t * masks
    else:
        n_kv = cells.full if has_full else cells.swa
        attention = 4 * t * (n_kv * max(info.n_head, default=0) + masks)
    return max(logits, attention + activations)


@attrs.frozen
class Estimate:
    """What a context of ``n_ctx`` tokens with ``gpu_layers`` layers offloaded takes (bytes).

    Attributes:
        n_ctx: tokens per sequence.
        gpu_layers: offloadable layers on the GPU (0 .. ``n_layer + 1``).
        kv_gpu, kv_host: the KV cache on the GPU and in host memory (0 when not estimated).
        weights_gpu, weights_host: the tensors.
        compute_gpu, compute_host: the compute buffers (the host's also holds the output buffer).
    """

    n_ctx: int
    gpu_layers: int
    kv_gpu: int
    kv_host: int
    weights_gpu: int
    weights_host: int
    compute_gpu: int
    compute_host: int

    @property
    def kv(self) -> int:
        return self.kv_gpu + self.kv_host

    @property
    def gpu(self) -> int:
        """Everything on the GPU."""
        return self.kv_gpu + self.weights_gpu + self.compute_gpu

    @property
    def host(self) -> int:
        """Everything in host memory."""
        return self.kv_host + self.weights_host + self.compute_host


def estimate(info: GGUFInfo, request: SizingRequest, n_ctx: int, gpu_layers: int) -> Estimate:
    """The memory of a context of ``n_ctx`` tokens per sequence with ``gpu_layers`` of the
    ``n_layer + 1`` offloadable layers on the GPU (see the module docstring).

    The KV cache counts 0 where the architecture's memory is not estimated
    (:attr:`~ringserve.core.modelinfo.GGUFInfo.kv_unknown`).
    """
    n_layer = info.n_layer
    first_gpu = n_layer + 1 - gpu_layers  # i_gpu_start; the output layer is number n_layer
    cells = kv_cells(info, request, n_ctx)
    kv_gpu = kv_host = 0
    if info.kv_unknown is None:
        for il in info.kv_layers:
            n = cells.streams * (cells.swa if info.swa_layers[il] else cells.full)
            size = n * _cell_bytes(info, il, request.type_k, request.type_v)
            if il >= first_gpu:
                kv_gpu += size
            else:
                kv_host += size
    layers_gpu = sum(b for il, b in enumerate(info.layer_bytes) if il >= first_gpu)
    output_gpu = gpu_layers > 0
    output = info.output_bytes + (info.token_embd_bytes if info.tied_output and output_gpu else 0)
    compute = compute_bytes(info, request, n_ctx)
    output_buffer = 4 * info.n_vocab * request.n_seq
    return Estimate(
        n_ctx=n_ctx,
        gpu_layers=gpu_layers,
        kv_gpu=kv_gpu,
        kv_host=kv_host,
        weights_gpu=layers_gpu + (output if output_gpu else 0),
        weights_host=info.weights_bytes - layers_gpu - (info.output_bytes if output_gpu else 0),
        compute_gpu=compute if output_gpu else 0,
        compute_host=output_buffer + (compute if first_gpu > 0 else 0),
    )


@attrs.frozen
class Sizing:
    """What :func:`plan_sizing` chose, and why.

    Attributes:
        n_ctx: tokens one sequence may hold (the pool, with a unified KV cache).
        reason: why that context.
        n_ctx_wanted: the context before memory was counted (the trained or the asked one).
        gpu_layers, total_layers: offloadable layers on the GPU, of ``n_layer + 1``.
        layers_reason: why that many.
        kv_bytes_per_token: KV bytes a token of context costs (None: not estimated).
        kv_unknown: why the KV cache is not estimated (None: it is).
        estimate: the memory of that choice.
        gpu_free, host_free: the free memory counted (bytes; the GPUs' summed).
        margin: left free on each device (bytes).
        gpus: the GPU devices' names.
        type_k, type_v: the KV cache types.
    """

    n_ctx: int
    reason: ContextReason
    n_ctx_wanted: int
    gpu_layers: int
    total_layers: int
    layers_reason: LayersReason
    kv_bytes_per_token: int | None
    kv_unknown: str | None
    estimate: Estimate
    gpu_free: int
    host_free: int
    margin: int
    gpus: tuple[str, ...]
    type_k: CacheType
    type_v: CacheType

    def describe(self) -> str:
        """One line for the ready log: context and why, KV per token and in all, weights, compute,
        layers, the free memory counted."""
        why = self.reason.value
        if self.reason is ContextReason.MEMORY:
            why = f"lowered from {self.n_ctx_wanted} to fit memory"
        e = self.estimate
        if self.kv_bytes_per_token is None:
            kv = f"KV cache not estimated ({self.kv_unknown})"
        else:
            kv = (f"KV cache {format_bytes(e.kv)} ({format_bytes(self.kv_bytes_per_token)} per token,"
                  f" {self.type_k}/{self.type_v})")
        weights = f"weights {format_bytes(e.weights_host)} in host memory"
        if self.gpus:
            weights += f", {format_bytes(e.weights_gpu)} on GPU"
            layers = f"{self.gpu_layers} of {self.total_layers} layers on GPU ({self.layers_reason.value})"
            free = f"free {format_bytes(self.gpu_free)} GPU, {format_bytes(self.host_free)} host"
        else:
            layers = "no GPU"
            free = f"available {format_bytes(self.host_free)} host"
        compute = f"compute ~{format_bytes(e.compute_gpu + e.compute_host)}"
        return (f"context {self.n_ctx} tokens ({why}); {kv}; {weights}; {compute}; {layers};"
                f" {free}, {format_bytes(self.margin)} margin")


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, one decimal: ``512 B``, ``18.0 KiB``, ``235.2 MiB``, ``7.5 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest ``x`` in ``lo..hi`` with ``ok(x)``, for an ``ok`` true up to some point and
    false after it; None when ``ok(lo)`` is false or the range is empty."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_sizing(info: GGUFInfo, report: MemoryReport, request: SizingRequest) -> Sizing:
    """The context and GPU layers for ``info`` on the memory of ``report`` (see the module docstring
    for the order of reductions).

    A context fits when, on the GPUs together, ``weights + KV + compute <= free - margin`` per
    device (with several GPUs, less half a layer per device and one more, as ``--fit`` leaves for
    whole layers), and in host memory ``weights + KV + compute <= available - margin``.

    Raises:
        SizingError: the context asked is above the model's trained context; or at the lowest
            context it may take and with the fewest layers it may put on the GPU, the model does
            not fit (the message says where and by how much).
    """
    trained = info.n_ctx_train
    if request.n_ctx > trained:
        raise SizingError(
            f"a context of {request.n_ctx} tokens is above the model's trained context of {trained} tokens:"
            f" {info.path}"
        )
    auto = request.n_ctx == AUTO_CONTEXT
    wanted = trained if auto else request.n_ctx
    total_layers = info.n_layer + 1
    gpus = report.gpus
    if not gpus:
        layers, layers_reason = 0, LayersReason.NO_GPU
    elif request.n_gpu_layers == AUTO_LAYERS:
        layers, layers_reason = total_layers, LayersReason.ALL
    else:
        layers, layers_reason = min(request.n_gpu_layers, total_layers), LayersReason.ASKED

    gpu_budget = sum(g.free for g in gpus) - request.margin * len(gpus)
    if len(gpus) > 1:  # common_params_fit_impl: whole layers leave about half a layer per device unused
        gpu_budget -= (len(gpus) + 1) * (sum(info.layer_bytes) // max(info.n_layer, 1)) // 2
    host_budget = report.host_available - request.margin

    def gpu_ok(n_ctx: int, n_layers: int) -> bool:
        return estimate(info, request, n_ctx, n_layers).gpu <= gpu_budget

    def host_ok(n_ctx: int, n_layers: int) -> bool:
        return estimate(info, request, n_ctx, n_layers).host <= host_budget

    def fits(n_ctx: int, n_layers: int) -> bool:
        memory = estimate(info, request, n_ctx, n_layers)  # (once: both sides)
        return memory.gpu <= gpu_budget and memory.host <= host_budget

    def sized(n_ctx: int, n_layers: int, lowered: bool) -> Sizing:
        reason = ContextReason.TRAINED if auto else ContextReason.ASKED
        if n_ctx < wanted:
            reason = ContextReason.MEMORY
        return Sizing(
            n_ctx=n_ctx,
            reason=reason,
            n_ctx_wanted=wanted,
            gpu_layers=n_layers,
            total_layers=total_layers,
            layers_reason=LayersReason.MEMORY if lowered else layers_reason,
            kv_bytes_per_token=kv_bytes_per_token(
                info, request.type_k, request.type_v, swa_full=request.swa_full
            ),
            kv_unknown=info.kv_unknown,
            estimate=estimate(info, request, n_ctx, n_layers),
            gpu_free=sum(g.free for g in gpus),
            host_free=report.host_available,
            margin=request.margin,
            gpus=tuple(g.name for g in gpus),
            type_k=request.type_k,
            type_v=request.type_v,
        )

    if fits(wanted, layers):
        return sized(wanted, layers, lowered=False)
    n_ctx = wanted
    if auto and info.kv_unknown is None:
        floor = min(request.n_ctx_min, wanted)
        lowest, highest = -(-floor // CTX_ALIGN), (wanted - 1) // CTX_ALIGN
        steps = _largest(lowest, highest, lambda k: fits(k * CTX_ALIGN, layers))
        if steps is not None:
            return sized(steps * CTX_ALIGN, layers, lowered=False)
        n_ctx = floor
    if gpus and request.n_gpu_layers == AUTO_LAYERS:
        most = _largest(0, layers, lambda n: gpu_ok(n_ctx, n))  # the most layers the GPUs hold
        if most is not None and host_ok(n_ctx, most):
            return sized(n_ctx, most, lowered=True)
        layers = most or 0
    raise SizingError(_shortfall(info, request, n_ctx, layers, gpu_budget, host_budget, len(gpus)))


def _shortfall(info: GGUFInfo, request: SizingRequest, n_ctx: int, layers: int, gpu_budget: int,
               host_budget: int, n_gpus: int) -> str:
    """The refusal's line: where the model does not fit at the smallest plan tried, and by how much."""
    e = estimate(info, request, n_ctx, layers)
    where = []
    if e.gpu > gpu_budget and n_gpus:
        where.append(f"{format_bytes(e.gpu)} on the GPU, which has {format_bytes(max(gpu_budget, 0))}"
                     " free beyond the margin")
    if e.host > host_budget:
        where.append(f"{format_bytes(e.host)} of host memory, which has {format_bytes(max(host_budget, 0))}"
                     " available beyond the margin")
    on_gpu = f"{layers} of {info.n_layer + 1} layers on the GPU" if n_gpus else "no GPU"
    return (f"the model does not fit in memory: with a context of {n_ctx} tokens and {on_gpu} it needs"
            f" {' and '.join(where)} (a smaller context, a q8_0 or q4_0 KV cache or a smaller quantization"
            f" would need less): {info.path}")
