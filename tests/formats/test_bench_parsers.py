"""``bench/format_parsers.py`` runs on a tiny workload and reports every family it has a call of;
``bench/chat_prompts.py`` reports each template it measures.

Only that it runs and reports is checked: no figure is compared with a speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chat_prompts import TEMPLATES
from bench.format_parsers import EXAMPLES
from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_templates

ROOT = Path(__file__).resolve().parents[2]


def test_the_parser_bench_reports_each_family(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "format_parsers.py"), "--words", "20", "--repeats", "1"],
        cwd=ROOT, env={**os.environ, "RINGSERVE_BENCH_RESULTS": str(tmp_path)},
        capture_output=True, text=True, check=False, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "format_parsers.json").read_text())
    assert set(out["results"]) == set(EXAMPLES)
    assert all(r["us_per_token"] > 0 and r["tokens"] > 0 for r in out["results"].values())
    assert (tmp_path / "format_parsers.png").stat().st_size > 0


@pytest.mark.model
def test_the_prompt_bench_reports_each_template(tmp_path: Path) -> None:
    try:
        templates = llama_cpp_templates()
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's template corpus is not available: {e}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chat_prompts.py"), "--templates", str(templates), "--repeats", "1"],
        cwd=ROOT, env={**os.environ, "RINGSERVE_BENCH_RESULTS": str(tmp_path)},
        capture_output=True, text=True, check=False, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "chat_prompts.json").read_text())
    assert set(out["results"]) == {"GGUF (SmolLM2)", *TEMPLATES}
    assert out["results"]["GGUF (SmolLM2)"]["short"]["tokens"] == 24
    assert all(r[kind]["ms"] > 0 for r in out["results"].values() for kind in ("short", "tools", "long"))
