"""The catalog (``ringserve/engine/catalog.py``): llama.cpp's file-name rules as values, discovery
from a config, a ``models_dir`` of small GGUF files and a Hugging Face cache laid out in a temporary
folder, and the order in which a request's ``model`` is resolved."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from ringserve.config import Config, ModelConfig, ModelSettings, RouterConfig
from ringserve.engine.catalog import (
    Catalog,
    CatalogEntry,
    CatalogError,
    GGUFName,
    HFSpec,
    Source,
    discover,
    find_mmproj,
    hf_name,
    parse_name,
    pick_file,
    quant_tags,
    split_parts,
)
from ringserve.engine.modelfile import ModelFileError
from tests.support.gguf_files import write_gguf
from tests.support.hf import cache_repo

GGUF = b"GGUF" + bytes(60)


# --- file names -------------------------------------------------------------------------------------

def test_a_file_name_gives_its_quant_tag_and_split_part_as_llama_cpp_reads_them():
    assert parse_name("Qwen3-8B-Q4_K_M.gguf") == GGUFName("Qwen3-8B-Q4_K_M", "Q4_K_M")
    assert parse_name("SmolLM2-135M-Instruct.Q4_1.gguf") == GGUFName("SmolLM2-135M-Instruct.Q4_1", "Q4_1")
    assert parse_name("big/Big-q8_0-00002-of-00003.gguf") == GGUFName("big/Big-q8_0", "Q8_0", 2, 3)
    assert parse_name("model.gguf") == GGUFName("model", "")
    assert parse_name("README.md") is None


REPO_FILES = [
    "README.md",
    "mmproj-model-f16.gguf",
    "model-IQ4_XS.gguf",
    "model-Q8_0.gguf",
    "model-f16.gguf",
    "mtp-model-Q4_K_M.gguf",
    "split/model-Q6_K-00001-of-00002.gguf",
    "split/model-Q6_K-00002-of-00002.gguf",
]


def test_a_quant_picks_the_first_model_file_that_names_it_in_any_case():
    assert pick_file(REPO_FILES, "q8_0") == "model-Q8_0.gguf"
    assert pick_file(REPO_FILES, "F16") == "model-f16.gguf"  # not the projector
    assert pick_file(REPO_FILES, "Q6_K") == "split/model-Q6_K-00001-of-00002.gguf"  # a split's first part
    assert pick_file(REPO_FILES, "Q4_K_M") is None  # only a draft head has it
    assert pick_file(REPO_FILES, "Q5_K_M") is None


def test_no_quant_picks_q4_k_m_then_q8_0_then_the_first_model_file():
    assert pick_file(["a-Q8_0.gguf", "a-Q4_K_M.gguf"]) == "a-Q4_K_M.gguf"
    assert pick_file(REPO_FILES) == "model-Q8_0.gguf"
    assert pick_file(["a-IQ4_XS.gguf", "a-F16.gguf"]) == "a-IQ4_XS.gguf"
    assert pick_file(["mmproj-F16.gguf", "README.md"]) is None


def test_a_split_model_is_all_its_parts_in_order_and_the_quants_are_the_model_files_tags():
    files = ["x-Q2_K-00002-of-00002.gguf", "x-Q2_K-00001-of-00002.gguf", "x-Q3_K-00001-of-00002.gguf"]
    assert split_parts(files, files[1]) == (files[1], files[0])
    assert split_parts(REPO_FILES, "model-Q8_0.gguf") == ("model-Q8_0.gguf",)
    assert quant_tags(REPO_FILES) == ("IQ4_XS", "Q8_0", "F16", "Q6_K")


def test_the_projector_is_the_nearest_one_of_the_closest_quant():
    files = ["mmproj-F32.gguf", "mmproj-F16.gguf", "sub/mmproj-Q8_0.gguf", "other/mmproj-F16.gguf"]
    assert find_mmproj(files, "sub/model-Q8_0.gguf") == "sub/mmproj-Q8_0.gguf"  # its own folder first
    assert find_mmproj(files, "model-F16.gguf") == "mmproj-F16.gguf"
    assert find_mmproj(files, "other2/model-F16.gguf") == "mmproj-F16.gguf"  # a folder above it
    assert find_mmproj(["model-F16.gguf"], "model-F16.gguf") is None


def test_an_hf_spec_is_a_repo_with_a_quant_or_a_file():
    assert HFSpec.parse("org/repo") == HFSpec("org/repo")
    assert HFSpec.parse("org/repo:q4_k_m") == HFSpec("org/repo", quant="q4_k_m")
    assert HFSpec.parse("org/repo:sub/Model Q4.gguf") == HFSpec("org/repo", file="sub/Model Q4.gguf")
    assert hf_name("org/repo:q4_k_m") == "org/repo:Q4_K_M" and hf_name("org/repo") == "org/repo"
    for bad in ("repo", "org/", "/repo", "a/b/c", "org/re po"):
        with pytest.raises(ValueError, match="USER/MODEL"):
            HFSpec.parse(bad)


# --- models_dir -------------------------------------------------------------------------------------

def models_dir(root: Path) -> Path:
    """Whole files, a projector alone, a draft head, a split model with a projector in a folder,
    a folder of one model, a folder of two, and a file that is not GGUF."""
    d = root / "models"
    write_gguf(d / "alpha.gguf", pad=100)
    write_gguf(d / "Beta-Q8_0.gguf")
    write_gguf(d / "mmproj-alpha-f16.gguf")
    write_gguf(d / "mtp-alpha.gguf")
    for i in (1, 2, 3):
        write_gguf(d / "big" / f"Big-Q4_K_M-{i:05d}-of-00003.gguf", split=(i, 3), pad=1000)
    write_gguf(d / "big" / "mmproj-Big-F16.gguf")
    write_gguf(d / "one" / "whatever-name.gguf")
    write_gguf(d / "two" / "a.gguf")
    write_gguf(d / "two" / "b.gguf")
    (d / "notes.txt").write_text("not a model")
    return d


def test_models_dir_gives_each_file_and_each_folder_of_one_model(tmp_path):
    d = models_dir(tmp_path)
    catalog = discover(Config().replace("router", models_dir=str(d), hf_cache=False))
    assert catalog.names() == ("Beta-Q8_0", "alpha", "big", "one", "two/a", "two/b")
    big = catalog.get("big")
    assert big is not None and big.source is Source.MODELS_DIR
    parts = tuple(d / "big" / f"Big-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3))
    assert big.path == parts[0] and big.files == parts and big.mmproj == d / "big" / "mmproj-Big-F16.gguf"
    assert big.size == sum(p.stat().st_size for p in parts)
    alpha = catalog.get("alpha")
    assert alpha is not None and alpha.mmproj is None  # a projector beside whole files belongs to none
    assert alpha.settings.model.path == str(d / "alpha.gguf") and alpha.settings.model.name == "alpha"


def test_a_models_dir_that_is_not_there_is_one_line(tmp_path):
    with pytest.raises(CatalogError, match=r"^\[router\] models_dir .*nowhere: No such file or directory$"):
        discover(Config().replace("router", models_dir=str(tmp_path / "nowhere"), hf_cache=False))


def config_with(tmp_path: Path, toml: str) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(toml)
    return Config.from_toml(path)


def test_a_preset_without_a_file_sets_up_the_discovered_model_of_its_name(tmp_path):
    d = models_dir(tmp_path)
    config = config_with(tmp_path, f"""
[model]
ctx_size = 1024
[router]
models_dir = "{d}"
hf_cache = false
[models.big]
ctx_size = 8192
slots = 2
aliases = ["claude-*"]
""")
    catalog = discover(config)
    big = catalog.get("big")
    assert big is not None and big.source is Source.MODELS_DIR and big.preset == "big"
    assert big.settings.model.ctx_size == 8192 and big.settings.engine.slots == 2
    assert big.aliases == ("claude-*",) and big.settings.model.path == str(big.path)
    alpha = catalog.get("alpha")
    assert alpha is not None and alpha.settings.model.ctx_size == 1024 and alpha.preset == ""
    assert big.settings.model.load_on_startup is False and alpha.settings.model.load_on_startup is False
    assert catalog.resolve("claude-sonnet-4-5") == big


def test_presets_only_keeps_the_model_table_and_the_presets(tmp_path):
    d = models_dir(tmp_path)
    write_gguf(tmp_path / "elsewhere" / "main.gguf")
    write_gguf(tmp_path / "elsewhere" / "extra.gguf")
    config = config_with(tmp_path, f"""
[model]
path = "{tmp_path / 'elsewhere' / 'main.gguf'}"
[router]
models_dir = "{d}"
presets_only = true
hf_cache = false
[models.extra]
path = "{tmp_path / 'elsewhere' / 'extra.gguf'}"
[models.alpha]
n_gpu_layers = 0
""")
    catalog = discover(config)
    assert catalog.names() == ("main", "extra", "alpha")
    assert [e.source for e in catalog.entries] == [Source.MODEL, Source.PRESET, Source.MODELS_DIR]


def test_a_preset_that_names_no_file_and_matches_no_model_is_one_line(tmp_path):
    config = config_with(tmp_path, f'[router]\nmodels_dir = "{models_dir(tmp_path)}"\nhf_cache = false\n'
                                   "[models.gamma]\nctx_size = 4096\n")
    with pytest.raises(CatalogError, match=r"^\[models\.gamma\] sets no path or hf, and no model named 'gam"):
        discover(config)


def test_two_models_of_one_name_is_one_line_naming_both_sources(tmp_path):
    d = models_dir(tmp_path)
    write_gguf(tmp_path / "other" / "alpha.gguf")
    config = config_with(tmp_path, f'[router]\nmodels_dir = "{d}"\nhf_cache = false\n'
                                   f'[models.alpha]\npath = "{tmp_path / "other" / "alpha.gguf"}"\n')
    with pytest.raises(CatalogError) as caught:
        discover(config)
    assert str(caught.value) == f"two models named 'alpha': [models.alpha] and models_dir {d / 'alpha.gguf'}"


def test_the_file_of_the_model_table_is_not_listed_again_from_models_dir(tmp_path):
    d = models_dir(tmp_path)
    config = config_with(tmp_path, f'[model]\npath = "{d / "alpha.gguf"}"\nname = "main"\n'
                                   f'[router]\nmodels_dir = "{d}"\nhf_cache = false\n')
    catalog = discover(config)
    assert "alpha" not in catalog.names() and catalog.names()[0] == "main"


def test_the_bundled_model_comes_only_when_nothing_else_does(tmp_path):
    bundled = write_gguf(tmp_path / "bundled" / "Small.Q4_1.gguf")
    config = config_with(tmp_path, '[model]\nname = "small"\naliases = ["gpt-*"]\nctx_size = 512\n'
                                   "[router]\nhf_cache = false\n")
    catalog = discover(config, bundled=lambda: bundled)
    (entry,) = catalog.entries
    assert entry.source is Source.BUNDLED and entry.name == "small" and entry.path == bundled
    assert entry.settings.model.ctx_size == 512 and entry.aliases == ("gpt-*",)
    assert entry.settings.model.load_on_startup is True  # not set: the [model] table's model is
    assert catalog.resolve("anything") == entry  # the [model] table's model is the fallback
    d = models_dir(tmp_path)

    def no_bundled() -> Path:
        raise AssertionError("the bundled model is not looked up when there are models")

    assert "small" not in discover(config.replace("router", models_dir=str(d)), bundled=no_bundled).names()


# --- the Hugging Face cache -------------------------------------------------------------------------

def test_the_hf_cache_gives_repo_quant_names_as_llama_server_does(tmp_path):
    cache = tmp_path / "hub"
    cache_repo(cache, "org/Model-GGUF", {
        "Model-Q4_K_M.gguf": GGUF, "Model-q8_0.gguf": GGUF + b"8", "mmproj-Model-F16.gguf": GGUF,
        "Model.gguf": GGUF, "README.md": b"hi",
        "Q2/Model-Q2_K-00001-of-00002.gguf": GGUF, "Q2/Model-Q2_K-00002-of-00002.gguf": GGUF + b"2",
    })
    cache_repo(cache, "org/Other", {"other-F16.gguf": GGUF}, ref=None)  # a revision no ref names
    catalog = discover(Config(), hf_cache_dir=cache)
    assert catalog.names() == ("org/Model-GGUF:Q4_K_M", "org/Model-GGUF:Q8_0", "org/Model-GGUF:Model.gguf",
                               "org/Model-GGUF:Q2_K", "org/Other:F16")
    q2 = catalog.get("org/Model-GGUF:Q2_K")
    assert q2 is not None and q2.source is Source.HF_CACHE and q2.hf == "org/Model-GGUF:Q2_K"
    assert [p.name for p in q2.files] == ["Model-Q2_K-00001-of-00002.gguf", "Model-Q2_K-00002-of-00002.gguf"]
    assert q2.size == 2 * len(GGUF) + 1
    assert q2.mmproj is not None and q2.mmproj.name == "mmproj-Model-F16.gguf"
    assert q2.origin == "the Hugging Face cache (org/Model-GGUF)"
    assert discover(Config().replace("router", hf_cache=False), hf_cache_dir=cache,
                    bundled=lambda: tmp_path / "b.gguf").names() == ("b",)


def test_an_hf_preset_is_found_in_the_cache_or_says_how_to_pull_it(tmp_path):
    cache = tmp_path / "hub"
    files = {"Model-Q4_K_M.gguf": GGUF, "Model-Q8_0.gguf": GGUF + b"8"}
    snapshot = cache_repo(cache, "org/Model-GGUF", files)
    config = config_with(tmp_path, '[router]\nhf_cache = false\n'
                                   '[models.fast]\nhf = "org/Model-GGUF:q8_0"\n'
                                   '[models.missing]\nhf = "org/Absent-GGUF"\n')
    catalog = discover(config, hf_cache_dir=cache)
    fast, missing = catalog.entries
    assert fast.name == "fast" and fast.source is Source.PRESET and fast.path == snapshot / "Model-Q8_0.gguf"
    assert missing.path is None and missing.files == () and missing.size == 0
    pull = r"^missing \(org/Absent-GGUF\) is not in the Hugging Face cache: run ringserve pull org/Absent-"
    with pytest.raises(ModelFileError, match=pull):
        missing.model_file()
    # with the cache listed too, the preset's file is not listed twice
    assert discover(config.replace("router", hf_cache=True), hf_cache_dir=cache).names() == (
        "fast", "missing", "org/Model-GGUF:Q4_K_M")


def test_an_hf_spec_that_is_not_one_is_a_start_up_error(tmp_path):
    config = config_with(tmp_path, '[models.x]\nhf = "just-a-name"\n')
    with pytest.raises(CatalogError, match=r"^\[models\.x\] hf: 'just-a-name' is not a Hugging Face model"):
        discover(config, hf_cache_dir=tmp_path)


# --- resolving a request's model (values) -----------------------------------------------------------

def entry(name: str, *aliases: str, source: Source = Source.MODELS_DIR) -> CatalogEntry:
    model = ModelConfig(path=f"/m/{name}.gguf", name=name, aliases=aliases)
    return CatalogEntry(name, Path(model.path), source, ModelSettings(model, Config().engine), aliases)


MAIN = entry("main", "default", source=Source.MODEL)
CODER = entry("coder", "gpt-5*", "claude-*")
SMALL = entry("small", "claude-haiku-*", "haiku")
ENTRIES = (MAIN, CODER, SMALL)


def test_a_name_resolves_by_name_then_alias_then_the_first_pattern_then_the_fallback():
    catalog = Catalog.of(ENTRIES)
    assert catalog.resolve("small") == SMALL
    assert catalog.resolve("haiku") == SMALL  # an exact alias
    assert catalog.resolve("default") == MAIN
    assert catalog.resolve("claude-haiku-4-5") == CODER  # the first pattern that matches, in config order
    assert catalog.resolve("gpt-5.5") == CODER
    assert catalog.resolve("llama") == MAIN  # the [model] table's model
    assert catalog.find("llama") is None


def test_default_model_is_the_fallback_and_strict_has_none():
    assert Catalog.of(ENTRIES, RouterConfig(default_model="haiku")).resolve("llama") == SMALL
    strict = Catalog.of(ENTRIES, RouterConfig(default_model="small", strict_model_name=True))
    assert strict.resolve("llama") is None and strict.resolve("gpt-5") == CODER
    assert Catalog.of((CODER, SMALL)).resolve("llama") is None  # no [model] model, no default_model
    assert Catalog.of((SMALL,)).resolve("llama") == SMALL  # the only model (one `ringserve pull`)
    unknown = r"^\[router\] default_model 'gpt-5' names no model \(one of: main, coder, small\)$"
    with pytest.raises(CatalogError, match=unknown):
        Catalog.of(ENTRIES, RouterConfig(default_model="gpt-5"))  # a pattern is no default


def test_an_alias_given_twice_or_shadowing_a_name_is_one_line():
    with pytest.raises(CatalogError, match="^'haiku' is an alias of models_dir /m/small.gguf and an alias"):
        Catalog.of((MAIN, SMALL, entry("tiny", "haiku")))
    with pytest.raises(CatalogError, match="^'small' is a model's name of models_dir /m/small.gguf and an"):
        Catalog.of((SMALL, entry("tiny", "small")))
    overlapping = Catalog.of((entry("a", "x-*"), entry("b", "x-*")))  # patterns may overlap: the first wins
    assert overlapping.resolve("x-1") == overlapping.entries[0]


def test_names_list_every_model_in_order():
    assert Catalog.of(ENTRIES).names() == ("main", "coder", "small")
    assert attrs.evolve(MAIN, preset="main").origin == "[model]"
