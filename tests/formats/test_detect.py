"""Each template of llama.cpp's corpus is detected as the family docs/formats.md says.

The corpus is ``models/templates/*.jinja`` of the pinned llama-cpp-python sdist
(:mod:`tests.support.llama_sdist`); the table of docs/formats.md ("The corpus") names each
template's family and what of it is served.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringserve.formats.detect import RULES, detect
from ringserve.formats.families import FAMILIES
from tests.support.llama_sdist import CorpusUnavailable, llama_cpp_templates

DOC = Path(__file__).resolve().parents[2] / "docs" / "formats.md"


def _documented() -> dict[str, tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8").split("## The corpus", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| (.+) \|$", text, re.M)
    return {t: (f, s) for t, f, s in rows if t not in ("template", "---")}


def test_every_corpus_template_is_detected_as_documented() -> None:
    documented = _documented()
    try:
        folder = llama_cpp_templates()
    except CorpusUnavailable as e:
        pytest.skip(f"llama.cpp's template corpus is not available: {e}")
    templates = {p.stem: p.read_text(encoding="utf-8") for p in folder.glob("*.jinja")}
    assert set(documented) == set(templates)
    assert {t: detect(src).name for t, src in templates.items()} == {t: f for t, (f, _) in documented.items()}


def test_the_families_named_in_the_issue_are_served() -> None:
    documented = _documented()
    served = {f for f, status in documented.values() if status.startswith("served")}
    issue = {"hermes", "qwen3-coder", "glm-4.5", "llama-3", "mistral", "mistral-nemo", "deepseek-r1", "deepseek-v3.1",
             "deepseek-v3.2", "gpt-oss", "kimi-k2", "granite-3", "command-r7b", "command-r-plus", "functionary-v3.1",
             "functionary-v3.2"}
    assert issue <= served


def test_every_rule_names_a_family() -> None:
    assert {name for _, name in RULES} <= set(FAMILIES)


@pytest.mark.parametrize(("source", "family"), [
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ("<think>{{ messages[-1].content }}", "generic-think"),
    ("{{ '<tool_call>' }}{{ '<think>' }}", "hermes"),
    ("<tool_call>\n<function=x>\n<parameter=y>", "qwen3-coder"),
])
def test_small_templates(source: str, family: str) -> None:
    assert detect(source).name == family
