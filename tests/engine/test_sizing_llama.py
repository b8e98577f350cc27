"""The memory estimate of core/sizing.py against what llama.cpp allocates: the engine, loaded on the
bundled SmolLM2 and on gemma-3-270m (sliding-window layers, a 262,144-token vocabulary) at two
contexts with f16, q8_0 and q4_0 KV caches, and the buffers llama.cpp logs (model, KV, compute and
output; :func:`bench.kv_types.allocations`, in a child process) within 10 % of the estimate from
the GGUF's metadata alone."""

from __future__ import annotations

import functools

import pytest

from bench.kv_types import Allocation, Case, allocations
from ringserve.core.sizing import CacheType, estimate
from ringserve.engine.gguf import read_gguf
from tests.support.models import gemma_path, smollm2_path

pytest.importorskip("ringserve.engine.llama")

pytestmark = pytest.mark.model

MODELS = {"smollm2": smollm2_path, "gemma": gemma_path}

#: At 8,192 tokens without flash attention SmolLM2's compute buffer peaks at one layer's attention
#: scores (166 MiB), at 1,024 at its logits (98 MiB); a quantized V cache needs flash attention.
CASES = [
    Case(n_ctx, type_k, type_v, flash_attn)
    for n_ctx in (1024, 8192)
    for type_k, type_v, flash_attn in (
        (CacheType.F16, CacheType.F16, False),
        (CacheType.Q8_0, CacheType.Q8_0, True),
        (CacheType.Q4_0, CacheType.Q4_0, True),
    )
]


@functools.cache
def allocated(model: str) -> list[Allocation]:
    """Every case's buffers on ``model``, from one child process (about 1.5 s a case on gemma)."""
    return allocations(MODELS[model](), CASES)


def within(estimated: int, actual: int, tolerance: float = 0.10) -> bool:
    return abs(estimated - actual) <= tolerance * actual


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.n_ctx}-{c.type_k}-{c.type_v}")
def test_estimate_within_10_percent_of_llama_cpp(model: str, case: Case) -> None:
    path = MODELS[model]()
    actual = allocated(model)[CASES.index(case)]
    e = estimate(read_gguf(path), case.request(), case.n_ctx, 0)  # a CPU build: every layer on the host
    assert actual.kv > 0 and actual.compute > 0
    assert within(e.weights_host, actual.model), (e.weights_host, actual.model)
    assert within(e.kv, actual.kv), (e.kv, actual.kv)
    assert within(e.compute_host, actual.compute + actual.output), (
        e.compute_host,
        actual.compute,
        actual.output,
    )
    assert within(e.host, actual.model + actual.kv + actual.compute + actual.output)
