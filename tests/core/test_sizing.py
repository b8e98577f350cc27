"""core/sizing.py: KV bytes per token, the cells llama.cpp gives a cache, and the plan of context and
GPU layers on fake memory reports (a 24 GB card, an 8 GB card, two cards, no GPU), for a
7B-shaped 32k-context model, an 8B-shaped 128k one, a 70B-shaped one and gemma-3's sliding window.

The shapes are the models' own (``config.json``); the weights' bytes are their Q4_K_M files'."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from ringserve.core.modelinfo import GGUFInfo, SamplingDefaults, swa_layers
from ringserve.core.sizing import (
    GIB,
    CacheType,
    ContextReason,
    GpuMemory,
    LayersReason,
    MemoryReport,
    SizingError,
    SizingRequest,
    compute_bytes,
    estimate,
    kv_bytes_per_token,
    kv_cells,
    plan_sizing,
)

MIB = 1 << 20


def shape(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head: int,
    n_vocab: int,
    n_ctx_train: int,
    weights: int,
    tied: bool = False,
    n_swa: int = 0,
    swa_period: int = 0,
    arch: str = "llama",
    kv_unknown: str | None = None,
) -> GGUFInfo:
    """A model of this shape whose Q4_K_M weights take ``weights`` bytes: the embeddings at 4.5 bits
    a weight (token_embd, and the output unless ``tied``), the rest spread over the layers."""
    embd = n_vocab * n_embd * 9 // 16
    output = 0 if tied else embd
    per_layer = (weights - embd - output) // n_layer
    swa = swa_layers(swa_period, n_layer) if n_swa else (False,) * n_layer
    return GGUFInfo(
        paths=(Path(f"/models/{arch}.gguf"),),
        file_bytes=weights,
        architecture=arch,
        name=arch,
        basename=None,
        size_label=None,
        file_type="Q4_K_M",
        n_ctx_train=n_ctx_train,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_head=(n_head,) * n_layer,
        n_head_kv=(n_head_kv,) * n_layer,
        key_length=head,
        value_length=head,
        key_length_swa=head,
        value_length_swa=head,
        n_swa=n_swa,
        swa_layers=swa,
        n_layer_nextn=0,
        n_expert=0,
        kv_unknown=kv_unknown,
        ssm=None,
        layer_bytes=(per_layer,) * n_layer,
        input_bytes=embd,
        output_bytes=output,
        tied_output=tied,
        token_embd_bytes=embd,
        chat_template=None,
        sampling=SamplingDefaults(),
    )


#: Qwen2.5-7B-Instruct: 28 layers, 28 heads, 4 KV heads of 128, 32,768 tokens; Q4_K_M 4.68 GB.
QWEN_7B = shape(
    n_layer=28,
    n_embd=3584,
    n_head=28,
    n_head_kv=4,
    head=128,
    n_vocab=152064,
    n_ctx_train=32768,
    weights=4_683_073_536,
)
#: Llama-3.1-8B-Instruct: 32 layers, 32 heads, 8 KV heads of 128, 131,072 tokens; Q4_K_M 4.92 GB.
LLAMA_8B = shape(
    n_layer=32,
    n_embd=4096,
    n_head=32,
    n_head_kv=8,
    head=128,
    n_vocab=128256,
    n_ctx_train=131072,
    weights=4_920_734_016,
)
#: Llama-3.1-70B-Instruct: 80 layers, 64 heads, 8 KV heads of 128; Q4_K_M 42.5 GB.
LLAMA_70B = shape(
    n_layer=80,
    n_embd=8192,
    n_head=64,
    n_head_kv=8,
    head=128,
    n_vocab=128256,
    n_ctx_train=131072,
    weights=42_520_398_080,
)
#: gemma-3-270m: 18 layers, 4 heads, 1 KV head of 256, a 512-token window on 5 layers of 6.
GEMMA_270M = shape(
    n_layer=18,
    n_embd=640,
    n_head=4,
    n_head_kv=1,
    head=256,
    n_vocab=262144,
    n_ctx_train=32768,
    weights=246_587_904,
    tied=True,
    n_swa=512,
    swa_period=6,
    arch="gemma3",
)

CARD_24GB = GpuMemory("CUDA0 (NVIDIA GeForce RTX 4090)", free=int(23.5 * GIB), total=24 * GIB)
CARD_8GB = GpuMemory("CUDA0 (NVIDIA GeForce RTX 4060)", free=int(7.5 * GIB), total=8 * GIB)
HOST = 64 * GIB


def report(*gpus: GpuMemory, host: int = HOST) -> MemoryReport:
    return MemoryReport(gpus, host)


def gpu_budget(r: MemoryReport, request: SizingRequest) -> int:
    return sum(g.free for g in r.gpus) - request.margin * len(r.gpus)


# -- KV bytes and cells --------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "row"),
    [(CacheType.F16, 256), (CacheType.BF16, 256), (CacheType.Q8_0, 136), (CacheType.Q4_0, 72)],
)
def test_row_bytes_are_ggml_blocks(kind: CacheType, row: int) -> None:
    assert kind.row_bytes(128) == row  # 128 elements: 4 blocks of 32 for the quantized types
    assert kind.quantized == (kind in (CacheType.Q8_0, CacheType.Q4_0))


def test_kv_bytes_per_token_of_a_gqa_model() -> None:
    # 32 layers x (K + V) x 8 heads x 128 x 2 bytes = 128 KiB; q8_0 34/32 bytes per element, q4_0 18/32
    assert kv_bytes_per_token(LLAMA_8B, CacheType.F16, CacheType.F16) == 131072
    assert kv_bytes_per_token(LLAMA_8B, CacheType.Q8_0, CacheType.Q8_0) == 32 * 2 * 1024 * 34 // 32
    assert kv_bytes_per_token(LLAMA_8B, CacheType.Q4_0, CacheType.Q4_0) == 32 * 2 * 1024 * 18 // 32
    assert kv_bytes_per_token(LLAMA_8B, CacheType.Q8_0, CacheType.F16) == 32 * (1088 + 2048)


def test_sliding_window_layers_cost_a_window_not_tokens() -> None:
    # gemma-3: 3 of 18 layers attend to everything, 1 KV head of 256 -> 1 KiB per layer per token
    assert kv_bytes_per_token(GEMMA_270M, CacheType.F16, CacheType.F16) == 3 * 1024
    assert kv_bytes_per_token(GEMMA_270M, CacheType.F16, CacheType.F16, swa_full=True) == 18 * 1024


def test_kv_cells_as_llama_cpp_gives_them() -> None:
    # the window: 512 * sequences (unified) + the micro-batch, to 256; never more than the context
    unified = SizingRequest(swa_full=False, n_seq=4)
    assert kv_cells(GEMMA_270M, unified, 32768) == attrs.evolve(
        kv_cells(GEMMA_270M, unified, 32768), full=32768, swa=2560
    )
    per_seq = kv_cells(GEMMA_270M, attrs.evolve(unified, kv_unified=False), 8192)
    assert (per_seq.streams, per_seq.full, per_seq.swa) == (4, 8192, 1024)
    assert kv_cells(GEMMA_270M, SizingRequest(swa_full=False), 700).full == 768  # rounded up to 256
    assert kv_cells(GEMMA_270M, SizingRequest(swa_full=False), 700).swa == 768
    assert kv_cells(GEMMA_270M, SizingRequest(swa_full=True), 32768).swa == 32768
    assert kv_cells(GEMMA_270M, SizingRequest(n_ubatch=512), 100).n_ubatch == 100


def test_estimate_splits_layers_between_gpu_and_host() -> None:
    request = SizingRequest(flash_attn=True)
    all_layers = estimate(LLAMA_8B, request, 8192, 33)
    per_token = 131072
    assert all_layers.kv_gpu == 8192 * per_token and all_layers.kv_host == 0
    assert all_layers.weights_host == LLAMA_8B.input_bytes  # only token_embd stays
    assert all_layers.weights_gpu == sum(LLAMA_8B.layer_bytes) + LLAMA_8B.output_bytes
    assert all_layers.compute_host == 4 * LLAMA_8B.n_vocab  # the output buffer only
    half = estimate(LLAMA_8B, request, 8192, 17)  # the output layer and the last 16
    assert half.kv_gpu == half.kv_host == 16 * 8192 * per_token // 32
    assert half.compute_host > 0 and half.compute_gpu > 0
    none = estimate(LLAMA_8B, request, 8192, 0)
    assert none.gpu == 0 and none.weights_host == LLAMA_8B.weights_bytes


def test_a_tied_output_is_copied_to_the_gpu() -> None:
    e = estimate(GEMMA_270M, SizingRequest(), 4096, 1)  # the output layer only
    assert e.weights_gpu == GEMMA_270M.output_bytes + GEMMA_270M.token_embd_bytes
    assert e.weights_host == GEMMA_270M.weights_bytes - GEMMA_270M.output_bytes


def test_compute_buffer_peaks_at_logits_or_attention_scores() -> None:
    # gemma's 262,144-token vocabulary: the logits of 512 tokens dominate (llama.cpp: 514.50 MiB)
    assert compute_bytes(GEMMA_270M, SizingRequest(), 32768) == 4 * 512 * (262144 + 3 * 640)
    # 8B without flash attention at 128k: one layer's scores, 32 heads x 512 x 131072 floats
    scores = compute_bytes(LLAMA_8B, SizingRequest(flash_attn=False), 131072)
    assert scores > 4 * 512 * 131072 * 32
    assert compute_bytes(LLAMA_8B, SizingRequest(flash_attn=True), 131072) < scores / 20


# -- the plan ------------------------------------------------------------------


def test_24gb_card_holds_the_trained_128k_context_with_flash_attention() -> None:
    sizing = plan_sizing(LLAMA_8B, report(CARD_24GB), SizingRequest(flash_attn=True))
    assert (sizing.n_ctx, sizing.reason) == (131072, ContextReason.TRAINED)
    assert (sizing.gpu_layers, sizing.total_layers, sizing.layers_reason) == (33, 33, LayersReason.ALL)
    assert sizing.kv_bytes_per_token == 131072 and sizing.estimate.kv == 16 * GIB
    line = sizing.describe()
    assert "context 131072 tokens (the model's trained context)" in line
    assert "KV cache 16.0 GiB (128.0 KiB per token, f16/f16)" in line
    assert "33 of 33 layers on GPU (all)" in line and "free 23.5 GiB GPU" in line and "1.0 GiB margin" in line
    assert "\n" not in line


def test_24gb_card_without_flash_attention_lowers_the_context() -> None:
    request = SizingRequest(flash_attn=False)
    r = report(CARD_24GB)
    sizing = plan_sizing(LLAMA_8B, r, request)
    assert sizing.reason is ContextReason.MEMORY and sizing.layers_reason is LayersReason.ALL
    assert 4096 < sizing.n_ctx < 131072 and sizing.n_ctx % 256 == 0
    assert estimate(LLAMA_8B, request, sizing.n_ctx, 33).gpu <= gpu_budget(r, request)
    assert estimate(LLAMA_8B, request, sizing.n_ctx + 256, 33).gpu > gpu_budget(r, request)
    assert f"context {sizing.n_ctx} tokens (lowered from 131072 to fit memory)" in sizing.describe()


@pytest.mark.parametrize(
    ("model", "flash_attn"), [(QWEN_7B, False), (LLAMA_8B, True)], ids=["7B-32k", "8B-128k"]
)
def test_8gb_card_lowers_the_context_and_keeps_every_layer(model: GGUFInfo, flash_attn: bool) -> None:
    # the 7B's 32k fit with flash attention (6.1 of 6.5 GiB); without, its scores take 1.8 GiB more
    request = SizingRequest(flash_attn=flash_attn)
    r = report(CARD_8GB)
    sizing = plan_sizing(model, r, request)
    assert sizing.reason is ContextReason.MEMORY and sizing.gpu_layers == model.n_layer + 1
    assert 4096 <= sizing.n_ctx < model.n_ctx_train and sizing.n_ctx % 256 == 0
    assert estimate(model, request, sizing.n_ctx, sizing.gpu_layers).gpu <= gpu_budget(r, request)
    assert estimate(model, request, sizing.n_ctx + 256, sizing.gpu_layers).gpu > gpu_budget(r, request)


def test_a_quantized_cache_holds_about_twice_the_context() -> None:
    f16 = plan_sizing(LLAMA_8B, report(CARD_8GB), SizingRequest(flash_attn=True))
    q8 = plan_sizing(
        LLAMA_8B,
        report(CARD_8GB),
        SizingRequest(flash_attn=True, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0),
    )
    assert 1.8 < q8.n_ctx / f16.n_ctx < 2.0
    assert "(68.0 KiB per token, q8_0/q8_0)" in q8.describe()


def test_7b_32k_fits_a_24gb_card_whole() -> None:
    sizing = plan_sizing(QWEN_7B, report(CARD_24GB), SizingRequest())
    assert (sizing.n_ctx, sizing.reason, sizing.gpu_layers) == (32768, ContextReason.TRAINED, 29)


def test_no_gpu_counts_host_memory() -> None:
    request = SizingRequest(flash_attn=True)
    whole = plan_sizing(LLAMA_8B, report(), request)
    assert (whole.n_ctx, whole.reason, whole.gpu_layers, whole.layers_reason) == (
        131072,
        ContextReason.TRAINED,
        0,
        LayersReason.NO_GPU,
    )
    assert (
        whole.estimate.gpu == 0
        and "no GPU" in whole.describe()
        and "available 64.0 GiB host" in whole.describe()
    )
    small = plan_sizing(LLAMA_8B, report(host=12 * GIB), request)
    assert small.reason is ContextReason.MEMORY and 4096 <= small.n_ctx < 131072
    assert (
        estimate(LLAMA_8B, request, small.n_ctx, 0).host
        <= 11 * GIB
        < estimate(LLAMA_8B, request, small.n_ctx + 256, 0).host
    )


def test_weights_that_do_not_fit_the_card_lower_the_layers_at_the_floor_context() -> None:
    request = SizingRequest(flash_attn=True)
    r = report(CARD_24GB)
    sizing = plan_sizing(LLAMA_70B, r, request)
    assert (sizing.n_ctx, sizing.reason) == (4096, ContextReason.MEMORY)  # the context first, to --fit-ctx
    assert sizing.layers_reason is LayersReason.MEMORY and 0 < sizing.gpu_layers < 81
    assert estimate(LLAMA_70B, request, 4096, sizing.gpu_layers).gpu <= gpu_budget(r, request)
    assert estimate(LLAMA_70B, request, 4096, sizing.gpu_layers + 1).gpu > gpu_budget(r, request)
    assert f"{sizing.gpu_layers} of 81 layers on GPU (lowered to fit memory)" in sizing.describe()


def test_an_asked_context_is_kept_and_the_layers_lowered() -> None:
    sizing = plan_sizing(LLAMA_8B, report(CARD_8GB), SizingRequest(n_ctx=65536, flash_attn=True))
    assert (sizing.n_ctx, sizing.reason) == (65536, ContextReason.ASKED)
    assert sizing.layers_reason is LayersReason.MEMORY and sizing.gpu_layers < 33


def test_asked_layers_are_kept_or_refused() -> None:
    kept = plan_sizing(LLAMA_8B, report(CARD_24GB), SizingRequest(n_gpu_layers=10, flash_attn=True))
    assert (kept.gpu_layers, kept.layers_reason) == (10, LayersReason.ASKED)
    with pytest.raises(SizingError, match=r"needs .* on the GPU") as exc:
        plan_sizing(LLAMA_70B, report(CARD_24GB), SizingRequest(n_gpu_layers=81, flash_attn=True))
    assert "81 of 81 layers on the GPU" in str(exc.value) and "/models/llama.gguf" in str(exc.value)


def test_a_context_above_the_trained_one_is_refused() -> None:
    with pytest.raises(
        SizingError, match="200000 tokens is above the model's trained context of 131072 tokens"
    ):
        plan_sizing(LLAMA_8B, report(CARD_24GB), SizingRequest(n_ctx=200000))


def test_a_host_too_small_for_the_weights_is_refused_in_one_line() -> None:
    with pytest.raises(SizingError) as exc:
        plan_sizing(LLAMA_8B, report(host=4 * GIB), SizingRequest())
    text = str(exc.value)
    assert "\n" not in text and "a context of 4096 tokens and no GPU" in text and "of host memory" in text


def test_two_cards_leave_room_for_whole_layers() -> None:
    half = GpuMemory("CUDA1 (half)", free=CARD_24GB.free // 2, total=12 * GIB)
    one = plan_sizing(LLAMA_8B, report(CARD_24GB), SizingRequest())
    two = plan_sizing(LLAMA_8B, report(half, attrs.evolve(half, name="CUDA2 (half)")), SizingRequest())
    assert two.n_ctx < one.n_ctx and two.gpu_free == one.gpu_free


def test_gemma_on_the_cpu_takes_its_trained_context() -> None:
    sizing = plan_sizing(GEMMA_270M, report(host=8 * GIB), SizingRequest(swa_full=False))
    assert (sizing.n_ctx, sizing.reason) == (32768, ContextReason.TRAINED)
    assert sizing.estimate.kv == 3 * 32768 * 1024 + 15 * 1024 * 1024  # the windowed layers: 1024 cells


def test_an_architecture_not_estimated_says_so() -> None:
    mamba = attrs.evolve(LLAMA_8B, architecture="mamba", kv_unknown="mamba is a recurrent architecture")
    sizing = plan_sizing(mamba, report(CARD_8GB), SizingRequest())
    assert sizing.kv_bytes_per_token is None and sizing.estimate.kv == 0
    assert (sizing.n_ctx, sizing.reason) == (131072, ContextReason.TRAINED)
    assert "KV cache not estimated (mamba is a recurrent architecture)" in sizing.describe()
