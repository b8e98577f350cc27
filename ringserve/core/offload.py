"""How many of a model's layers llama.cpp puts on a GPU, as the ``ready:`` line says it.

Sans-I/O: the engine (``engine/llama.py``) reads the GPU devices and the layer count from
llama.cpp and hands them to :func:`plan_offload`; this module only does llama.cpp's
arithmetic and the wording.

llama.cpp counts a model's offloadable layers as ``n_layer + 1``: the repeating layers and the
output layer (the input embeddings always stay in host memory). ``n_gpu_layers`` below 0 means
all of them; with no GPU device it offloads none, whatever ``n_gpu_layers`` says (``load_tensors``
in ``src/llama-model.cpp``: ``act_gpu_layers = devices.empty() ? 0 : min(n_gpu_layers, n_layer
+ 1)``, the count its ``offloaded N/M layers to GPU`` log line gives). Its devices are the GPUs
that ggml registered (a CUDA, Metal, Vulkan, ... build finds them at start), or, when there is
none, the integrated GPUs (``llama_model_load_from_file_impl`` in ``src/llama.cpp``).
"""

from __future__ import annotations

import attrs

#: ``[model] n_gpu_layers`` meaning every layer (llama.cpp: "a negative value means all layers").
ALL_LAYERS = -1


@attrs.frozen
class Offload:
    """Where a loaded model's layers are.

    Attributes:
        layers: layers on the GPU devices (0 to ``total``).
        total: the model's offloadable layers, ``n_layer + 1`` (0 when not known, as for the
            fake engine).
        devices: the GPU devices llama.cpp offloads to, each ``NAME (DESCRIPTION)`` as ggml
            names it (``CUDA0 (NVIDIA H200)``); empty when it found none (a CPU-only build of
            llama.cpp, or a GPU build on a machine without a usable GPU).
    """

    layers: int
    total: int
    devices: tuple[str, ...] = ()

    def describe(self) -> str:
        """The ready line's words: ``30 of 31 layers on CUDA0 (NVIDIA H200)``, ``none (no GPU device)``."""
        if not self.devices:
            return "none (no GPU device)"
        return f"{self.layers} of {self.total} layers on {', '.join(self.devices)}"


def plan_offload(n_gpu_layers: int, n_layer: int, devices: tuple[str, ...]) -> Offload:
    """The layers llama.cpp offloads for ``[model] n_gpu_layers`` on a model of ``n_layer`` layers.

    Args:
        n_gpu_layers: the setting: a count, or a negative number for every layer
            (:data:`ALL_LAYERS`, the default).
        n_layer: the model's repeating layers (``llama_model_n_layer``).
        devices: the GPU devices llama.cpp found (empty: none).
    """
    total = n_layer + 1
    wanted = total if n_gpu_layers < 0 else n_gpu_layers
    return Offload(min(wanted, total) if devices else 0, total, devices)
