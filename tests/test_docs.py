"""The docs (README.md and docs/*.md), read with markdown-it-py: every relative link and anchor
resolves, docs/compatibility.md says what each surface's FieldTables do with each field,
docs/operations.md has every ``serve`` flag (with its variable and key) and every config key, and
docs/models.md every preset key, ``[router]`` key and model status."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import attrs
import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from ringserve.__main__ import OPTIONS
from ringserve.config import Config, EngineConfig, ModelConfig, RouterConfig
from ringserve.core.events import SamplingParams
from ringserve.core.router import ModelStatus
from ringserve.surfaces.base import FieldTable
from ringserve.surfaces.registry import SURFACES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MD = MarkdownIt("commonmark").enable("table")


def inline_text(token: Token) -> str:
    """The text of an inline token as rendered (code spans without their backticks)."""
    return "".join(c.content for c in token.children or () if c.type in ("text", "code_inline"))


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-`` (github/cmark-gfm's anchors, as rendered on github.com)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets ``-1``, ``-2``, ...)."""
    tokens = MD.parse(path.read_text())
    seen: dict[str, int] = {}
    for opening, inline in itertools.pairwise(tokens):
        if opening.type == "heading_open":
            base = slug(inline_text(inline))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {base if n == 0 else f"{base}-{n}" for base, count in seen.items() for n in range(count)}


def links(path: Path) -> list[str]:
    """Every link and image target of a Markdown file (not those in code)."""
    found = []
    for token in MD.parse(path.read_text()):
        for child in token.children or ():
            if child.type == "link_open":
                found.append(str(child.attrs["href"]))
            elif child.type == "image":
                found.append(str(child.attrs["src"]))
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file does not exist, or whose anchor is no heading of
    the Markdown file it names. Links with a scheme (``https:``, ``mailto:``) are not followed."""
    broken = []
    for href in links(path):
        if urlsplit(href).scheme:
            continue
        file, _, fragment = href.partition("#")
        target = (path.parent / unquote(file)).resolve() if file else path
        if not target.exists():
            broken.append(f"{href}: no such file")
        elif fragment and target.suffix == ".md" and unquote(fragment) not in anchors(target):
            broken.append(f"{href}: no such heading in {target.name}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc) == []


def test_broken_links_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Context and max_tokens\n\n## Notes\n\n## Notes\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc: `the` title\n\n"
        "[ok](other.md#context-and-max_tokens) [ok](other.md#notes-1) [ok](#doc-the-title) [ok](https://x.org/#no)\n"
        "[bad](missing.md) [bad](other.md#notes-2) [bad](#nowhere) ![bad](gone.png) `[code](skipped.md)`\n"
    )
    assert broken_links(doc) == [
        "missing.md: no such file",
        "other.md#notes-2: no such heading in other.md",
        "#nowhere: no such heading in doc.md",
        "gone.png: no such file",
    ]


def test_readme_test_command_is_the_one_ci_runs() -> None:
    """``.ci/run`` ends with the README's test command, byte for byte, in one of its sh blocks."""
    command = (ROOT / ".ci" / "run").read_text().rstrip("\n").splitlines()[-1]
    blocks = [t.content for t in MD.parse((ROOT / "README.md").read_text()) if t.type == "fence" and t.info == "sh"]
    assert f"{command}\n" in blocks


#: The row of docs/compatibility.md's tables for each category of a FieldTable (an attribute of
#: :class:`FieldTable` holding field names).
CATEGORY_ROWS = {"supported": "supported", "ignored": "accepted and ignored", "refused": "refused (400)"}
#: The heading of each surface's section in docs/compatibility.md starts with this.
SURFACE_SECTIONS = {"anthropic": "Anthropic Messages", "openai": "OpenAI Chat Completions", "responses": "OpenAI Responses"}


def table_cells(path: Path) -> dict[str, list[list[Token]]]:
    """Per second-level heading, the body rows of its tables, each the inline tokens of its cells."""
    sections: dict[str, list[list[Token]]] = {}
    heading, row = "", list[Token]()
    for prev, token in itertools.pairwise(MD.parse(path.read_text())):
        if token.type == "inline" and prev.type == "heading_open" and prev.tag == "h2":
            heading = inline_text(token)
        elif token.type == "tr_open":
            row = []
            sections.setdefault(heading, []).append(row)
        elif token.type == "inline" and prev.type == "td_open":
            row.append(token)
    return {heading: [row for row in rows if row] for heading, rows in sections.items()}


def span_words(token: Token) -> set[str]:
    """The words in an inline token's code spans: ``output_config.format`` and
    ``{"type": "json_schema"}`` give their field names."""
    return {word for child in token.children or () if child.type == "code_inline"
            for word in re.findall(r"[A-Za-z_]\w*", child.content)}


def table_rows(path: Path) -> dict[str, dict[str, set[str]]]:
    """Per second-level heading, per table row (its first cell), the words in the code spans of
    the row's other cells (:func:`span_words`)."""
    sections: dict[str, dict[str, set[str]]] = {}
    for heading, rows in table_cells(path).items():
        for first, *others in rows:
            words = sections.setdefault(heading, {}).setdefault(inline_text(first), set())
            for cell in others:
                words |= span_words(cell)
    return sections


def field_tables(module: object) -> list[FieldTable]:
    """The FieldTables of a surface's module, also those in a dict (``PART_FIELDS``)."""
    tables = []
    for value in vars(module).values():
        values = value.values() if isinstance(value, dict) else [value]
        tables += [v for v in values if isinstance(v, FieldTable)]
    return tables


def test_compatibility_tables_follow_the_field_tables() -> None:
    """Every field that a surface's FieldTables decide is named in the row of docs/compatibility.md
    for its category, in that surface's section. A new category of FieldTable, or a new surface,
    fails here until the doc has its row or section (add it to CATEGORY_ROWS, SURFACE_SECTIONS)."""
    assert set(CATEGORY_ROWS) == {f.name for f in attrs.fields(FieldTable)}
    assert set(SURFACE_SECTIONS) == {surface.name for surface in SURFACES.surfaces}
    sections = table_rows(ROOT / "docs" / "compatibility.md")
    missing = []
    for surface in SURFACES.surfaces:
        [heading] = [h for h in sections if h.startswith(SURFACE_SECTIONS[surface.name])]
        tables = field_tables(sys.modules[type(surface).__module__])
        assert tables, f"no FieldTable in {type(surface).__module__}"
        for category, row in CATEGORY_ROWS.items():
            named = sections[heading].get(row, set())
            for table in tables:
                missing += [f"{surface.name}: `{field}` is not in the row {row!r}"
                            for field in getattr(table, category) if field not in named]
    assert not missing, "\n".join(sorted(set(missing)))


def test_table_rows_reads_code_spans_per_section_and_row(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# T\n\n## A (`POST /a`)\n\n| | fields |\n|---|---|\n"
        '| supported | `model`, `output_config.format` (`{"type": "json_schema"}`), roles user |\n'
        "| refused (400) | `n` (unless `1`) |\n\n## B\n\n| | fields |\n|---|---|\n| supported | `x` |\n"
    )
    assert table_rows(doc) == {
        "A (POST /a)": {"supported": {"model", "output_config", "format", "type", "json_schema"}, "refused (400)": {"n"}},
        "B": {"supported": {"x"}},
    }


def first_cells(path: Path) -> dict[str, list[str]]:
    """Per second-level heading, the text of each table row's first cell, in order."""
    return {heading: [inline_text(first) for first, *_ in rows] for heading, rows in table_cells(path).items()}


def code_words(path: Path) -> set[str]:
    """The words in the code spans of a Markdown file (not in code blocks)."""
    return {word for token in MD.parse(path.read_text()) if token.type == "inline" for word in span_words(token)}


OPERATIONS = ROOT / "docs" / "operations.md"
MODELS = ROOT / "docs" / "models.md"
#: The ``[model.sampling]`` keys a config may set: the request's sampler fields but ``logit_bias``
#: (``config._sampling_table`` refuses it: token ids are a model's own).
SAMPLING_KEYS = [f.name for f in attrs.fields(SamplingParams) if f.name != "logit_bias"]


def flag_table_misses(path: Path) -> list[str]:
    """What the flag table of ``path``'s "Configuration" section lacks: a row per ``serve`` option
    (its first cell naming every spelling) that names its variable and its config key."""
    sections = table_rows(path)
    rows = sections.get("Configuration", {})
    missing = []
    for option in OPTIONS:
        found = [words for first, words in rows.items() if set(option.flags) <= set(re.findall(r"-{1,2}[\w-]+", first))]
        if not found:
            missing.append(f"no row for {', '.join(option.flags)}")
            continue
        # --api-key adds to the keys; its variable is the list's (comma-separated), which serve reads
        env = "RINGSERVE_API_KEYS" if option.key == "auth.api_keys" else option.env
        missing += [f"{option.long}: {want} not in its row" for want in (env, *option.key.split("."))
                    if want not in found[0]]
    return missing


def test_every_serve_flag_is_in_the_flag_table_with_its_variable_and_key() -> None:
    """docs/operations.md's flag table has a row for each of ``serve``'s options (``__main__.OPTIONS``),
    naming its spellings, its ``RINGSERVE_*`` variable and its config key."""
    assert flag_table_misses(OPERATIONS) == []


def config_table_misses(path: Path) -> list[str]:
    """The config keys the "Configuration" tables of ``path`` do not name in their table's row
    (``[server]``: ``host``, ...; ``[model.sampling]``'s keys; ``[policy]``'s surface names)."""
    rows = table_rows(path).get("Configuration", {})
    config = Config()
    wanted: dict[str, list[str]] = {}
    for field in attrs.fields(Config):
        section = getattr(config, field.name)
        if attrs.has(type(section)):
            wanted[field.name] = [f.name for f in attrs.fields(type(section)) if f.name != "sampling"]
    wanted["policy"] = [*(surface.name for surface in SURFACES.surfaces), "grace_seconds"]
    wanted["model.sampling"] = SAMPLING_KEYS
    missing = []
    for table, keys in wanted.items():
        row = rows.get(f"[{table}]")
        if row is None:
            missing.append(f"no row [{table}]")
            continue
        missing += [f"[{table}] {key}" for key in keys if key not in row]
    return missing


def test_every_config_key_is_in_the_configuration_tables() -> None:
    """docs/operations.md names every key of every config table (``[router]``'s too) in that table's
    row: a new key fails here until it is documented."""
    assert config_table_misses(OPERATIONS) == []


def test_every_preset_key_and_router_key_is_in_docs_models() -> None:
    """docs/models.md's preset table names every key a ``[models.NAME]`` table takes (``[model]``'s,
    ``[engine]``'s and the sampling keys), and the page names every ``[router]`` key and every
    status a model's ``status.value`` may have."""
    named = {word for first in first_cells(MODELS).get("Presets", []) for word in re.findall(r"[A-Za-z_]\w*", first)}
    keys = [*(f.name for f in attrs.fields(ModelConfig) if f.name != "sampling"),
            *(f.name for f in attrs.fields(EngineConfig)), *SAMPLING_KEYS]
    assert [key for key in keys if key not in named] == []
    words = code_words(MODELS)
    assert [f.name for f in attrs.fields(RouterConfig) if f.name not in words] == []
    assert [status.value for status in ModelStatus if status.value not in words] == []


def test_the_doc_checks_find_what_is_missing(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# T\n\n## Configuration\n\n| flag | variable | key |\n|---|---|---|\n"
        "| `-c`, `--ctx-size` | `RINGSERVE_CTX_SIZE` | `[model] ctx_size` |\n"
        "| `-m`, `--model` | `RINGSERVE_MODEL` | `[model] name` |\n\n"
        "| table | keys |\n|---|---|\n| `[router]` | `models_dir`, `hf_cache` |\n"
    )
    flags = flag_table_misses(doc)
    assert "--model: path not in its row" in flags and "no row for -np, --slots, --parallel" in flags
    assert not any(m.startswith("--ctx-size") for m in flags)
    keys = config_table_misses(doc)
    assert "[router] presets_only" in keys and "[router] models_dir" not in keys and "no row [server]" in keys
