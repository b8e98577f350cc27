"""core/offload.py: the layers llama.cpp puts on a GPU for ``[model] n_gpu_layers``, and what the
``ready:`` line says of them (tests/engine/test_overlap.py: the line itself, and the overlap it decides)."""

from __future__ import annotations

import pytest

from ringserve.config import Config
from ringserve.core.offload import ALL_LAYERS, Offload, plan_offload

H200 = ("CUDA0 (NVIDIA H200)",)


@pytest.mark.parametrize(
    ("n_gpu_layers", "n_layer", "devices", "layers"),
    [
        (ALL_LAYERS, 30, H200, 31),  # every repeating layer and the output layer
        (-5, 30, H200, 31),  # any negative value is "all", as llama.cpp reads it
        (0, 30, H200, 0),
        (12, 30, H200, 12),
        (31, 30, H200, 31),
        (999, 30, H200, 31),  # more than the model has: all of them
        (ALL_LAYERS, 30, (), 0),  # no GPU device (a CPU build): none, whatever the setting
        (12, 30, (), 0),
        (ALL_LAYERS, 30, ("CUDA0 (A)", "CUDA1 (B)"), 31),
    ],
)
def test_plan_offload_is_llama_cpps_count(n_gpu_layers, n_layer, devices, layers):
    assert plan_offload(n_gpu_layers, n_layer, devices) == Offload(layers, n_layer + 1, devices)


@pytest.mark.parametrize(
    ("offload", "words"),
    [
        (Offload(31, 31, H200), "31 of 31 layers on CUDA0 (NVIDIA H200)"),
        (Offload(0, 31, H200), "0 of 31 layers on CUDA0 (NVIDIA H200)"),
        (Offload(31, 31, ("CUDA0 (A)", "CUDA1 (B)")), "31 of 31 layers on CUDA0 (A), CUDA1 (B)"),
        (Offload(0, 31), "none (no GPU device)"),
    ],
)
def test_describe(offload, words):
    assert offload.describe() == words


def test_the_default_setting_is_every_layer():
    """``[model] n_gpu_layers`` defaults to every layer: on a GPU box a GPU build uses the GPU without a
    config file; a CPU build ignores it (above)."""
    assert Config().model.n_gpu_layers == ALL_LAYERS
