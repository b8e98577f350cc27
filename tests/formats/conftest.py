"""The fixtures of the template tests: llama.cpp's template corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_templates


@pytest.fixture(scope="module")
def corpus() -> Path:
    """The folder of llama.cpp's corpus templates (``models/templates/*.jinja``); the test is
    skipped where the source distribution cannot be downloaded."""
    try:
        return llama_cpp_templates()
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's template corpus is not available: {e}")
