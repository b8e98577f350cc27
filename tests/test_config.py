"""Config: TOML round trip, validation messages, CLI overrides."""

from pathlib import Path

import pytest

from ringserve.__main__ import load_config
from ringserve.config import Config

ROOT = Path(__file__).resolve().parent.parent


def test_default_toml_matches_the_defaults():
    assert Config.from_toml(ROOT / "configs" / "default.toml") == Config()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[engine]\nslots = 0\n", "slots"),
        ("[server]\nheartbeat_interval = 0.5\n", "heartbeat_interval"),
        ("[stream]\nring_max_bytes = 0\n", "ring_max_bytes"),
        ("[stream]\npersist_seconds = 0\n", "persist_seconds"),
        ("[policy]\nopenai = 'sometimes'\n", "openai"),
        ("[nope]\n", "[nope]"),
        ("[engine]\nslot = 3\n", "slot"),
        ("[engine\n", "config.toml"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, fragment):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=None) as info:
        Config.from_toml(path)
    assert fragment in str(info.value)


def test_api_keys_are_hidden_from_repr():
    config = Config.from_dict({"auth": {"api_keys": ["sk-secret"]}})
    assert config.auth.api_keys == ("sk-secret",)
    assert "sk-secret" not in repr(config)


def test_command_line_overrides(tmp_path):
    from ringserve.__main__ import _parser

    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 9000\n[engine]\nslots = 2\n")
    args = _parser().parse_args(["serve", "--config", str(path), "--host", "127.0.0.2", "--model", "/m.gguf", "--slots", "8"])
    config = load_config(args, {})
    assert (config.server.host, config.server.port) == ("127.0.0.2", 9000)
    assert config.model.path == "/m.gguf"
    assert config.engine.slots == 8


def test_the_flag_wins_over_the_environment_which_wins_over_the_file(tmp_path):
    from ringserve.__main__ import _parser

    path = tmp_path / "c.toml"
    path.write_text("[model]\nctx_size = 1000\nn_gpu_layers = 5\n[model.sampling]\ntemperature = 0.1\n")
    environ = {"RINGSERVE_CTX_SIZE": "2000", "RINGSERVE_N_GPU_LAYERS": "7", "RINGSERVE_TEMP": "0.5"}
    config = load_config(_parser().parse_args(["serve", "--config", str(path), "-c", "3000"]), environ)
    assert (config.model.ctx_size, config.model.n_gpu_layers, config.model.sampling.temperature) == (3000, 7, 0.5)
    config = load_config(_parser().parse_args(["serve", "--config", str(path)]), {})
    assert (config.model.ctx_size, config.model.n_gpu_layers, config.model.sampling.temperature) == (1000, 5, 0.1)


def test_a_model_file_on_the_command_line_is_the_model_named_by_its_stem_not_the_files(tmp_path):
    """The file's ``[model]`` name and ``hf`` described another model: a file given by flag or environment
    replaces them (``ringserve launch --model FILE`` asks the server it starts for the file's stem)."""
    from ringserve.__main__ import _parser

    path = tmp_path / "c.toml"
    path.write_text('[model]\nhf = "org/repo:Q4_K_M"\nname = "big"\nctx_size = 1000\n')
    config = load_config(_parser().parse_args(["serve", "--config", str(path), "/m/small.gguf"]), {})
    assert (config.model.path, config.model.hf, config.model.name, config.model.ctx_size) == ("/m/small.gguf", "", "", 1000)
    config = load_config(_parser().parse_args(["serve", "--config", str(path), "-a", "mine"]), {"RINGSERVE_MODEL": "/s.gguf"})
    assert (config.model.path, config.model.hf, config.model.name) == ("/s.gguf", "", "mine")
    config = load_config(_parser().parse_args(["serve", "--config", str(path)]), {})
    assert (config.model.hf, config.model.name) == ("org/repo:Q4_K_M", "big")


def test_llama_server_s_flags_set_their_keys():
    from ringserve.__main__ import _parser
    from ringserve.config import CacheType, Switch

    args = _parser().parse_args(["serve", "model.gguf", "-c", "32768", "-np", "2", "-ngl", "20", "-ctk", "q8_0",
                                 "-ctv", "q8_0", "-fa", "on", "--api-key", "k1", "--api-key", "k2", "--temp", "0.7",
                                 "--top-k", "30", "--min-p", "0.1", "-a", "mine"])
    config = load_config(args, {"RINGSERVE_API_KEYS": "ignored-here"})  # (the env's keys are added by http/auth.py)
    model = config.model
    assert (model.path, model.ctx_size, model.n_gpu_layers, model.name) == ("model.gguf", 32768, 20, "mine")
    assert (model.cache_type_k, model.cache_type_v, model.flash_attn) == (CacheType.Q8_0, CacheType.Q8_0, Switch.ON)
    assert (model.sampling.temperature, model.sampling.top_k, model.sampling.min_p) == (0.7, 30, 0.1)
    assert (config.engine.slots, config.auth.api_keys) == (2, ("k1", "k2"))


def test_printed_config_reads_back_as_the_same_config(tmp_path):
    from ringserve.__main__ import _parser, config_toml

    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "/a.gguf"\n[model.sampling]\ntop_k = 5\n[models.b]\npath = "/b.gguf"\nslots = 2\n'
                    '[models.b.sampling]\ntemperature = 0.2\n[policy]\nresponses = "continue"\n')
    config = load_config(_parser().parse_args(["serve", "--config", str(path), "-c", "4096"]), {})
    printed = tmp_path / "printed.toml"
    printed.write_text(config_toml(config))
    assert Config.from_toml(printed) == config


@pytest.mark.parametrize(
    "text, line",
    [
        ('[server]\nport = "abc"\n', "[server] port must be an integer, got 'abc'"),
        ('[stream]\nbackend = "mongo"\n', "[stream] backend must be one of 'memory', 'redis', got 'mongo'"),
        ('[policy]\nanthropic = "maybe"\n', "[policy] anthropic must be one of 'abort', 'continue', got 'maybe'"),
        ("[engine]\nprefix_cache = 1\n", "[engine] prefix_cache must be true or false, got 1"),
        ("[store]\nmax_age_seconds = true\n", "[store] max_age_seconds must be a number, got True"),
        ('[auth]\napi_keys = "sk-1"\n', "[auth] api_keys must be a list of strings, got 'sk-1'"),
    ],
)
def test_a_wrong_type_or_choice_is_one_clear_line(tmp_path, text, line):
    """Table, key, bad value and what is allowed; no Python internals (a TypeError's text, an attrs repr)."""
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Config.from_toml(path)
    assert str(info.value) == line


def test_policy_is_a_table_keyed_by_surface_name_and_responses_follows_openai():
    from ringserve.core.status import Policy
    from ringserve.surfaces.registry import ANTHROPIC, OPENAI, SURFACES
    from ringserve.surfaces.responses import RESPONSES

    config = Config.from_dict({"policy": {"openai": "continue", "grace_seconds": 2}})
    assert config.policy.grace_seconds == 2.0
    policies = {s.name: SURFACES.policy(config.policy, s) for s in (ANTHROPIC, OPENAI, RESPONSES)}
    assert policies == {"anthropic": Policy.ABORT, "openai": Policy.CONTINUE, "responses": Policy.CONTINUE}
    config = config.replace("policy", responses="abort")
    assert SURFACES.policy(config.policy, RESPONSES) is Policy.ABORT
    assert SURFACES.policy(config.policy, OPENAI) is Policy.CONTINUE


def test_a_policy_key_that_names_no_surface_is_refused_at_start(tmp_path, capsys):
    from ringserve.__main__ import main

    path = tmp_path / "c.toml"
    path.write_text('[policy]\nantropic = "continue"\n')
    assert main(["serve", "--config", str(path)]) == 2
    assert capsys.readouterr().err == "ringserve: unknown key(s) in [policy]: antropic\n"


def test_default_toml_lists_every_key_of_every_table():
    """configs/default.toml says it lists every key: each field of each table appears there, set or
    commented out (a key whose default is "not set" cannot be written in TOML), under its table."""
    import re

    import attrs

    from ringserve.config import _SECTIONS
    from ringserve.core.events import SamplingParams

    listed: dict[str, set[str]] = {}
    table = ""
    for line in (ROOT / "configs" / "default.toml").read_text().splitlines():
        if m := re.fullmatch(r"\[([a-z_.]+)\]", line):
            table = m.group(1)
        elif m := re.match(r"#? ?([a-z_]+) = ", line):
            listed.setdefault(table, set()).add(m.group(1))
    wanted = {name: {f.name for f in attrs.fields(section)} for name, section in _SECTIONS.items()}
    wanted["model"] -= {"sampling"}  # a table of its own
    wanted["model.sampling"] = {f.name for f in attrs.fields(SamplingParams)} - {"logit_bias"}
    wanted["policy"] = {"anthropic", "openai", "responses", "grace_seconds"}
    for name, keys in wanted.items():
        assert keys <= listed.get(name, set()), (name, keys - listed.get(name, set()))


def test_a_preset_takes_the_model_and_engine_tables_but_what_names_one_model():
    config = Config.from_dict({
        "model": {"path": "/default.gguf", "ctx_size": 8192, "aliases": ["x"], "sampling": {"temperature": 0.3, "top_k": 20}},
        "engine": {"slots": 3},
        "models": {"qwen": {"path": "/qwen.gguf", "slots": 2, "sampling": {"temperature": 0.6}}},
    })
    qwen = config.preset("qwen")
    assert (qwen.model.path, qwen.model.ctx_size, qwen.model.aliases, qwen.engine.slots) == ("/qwen.gguf", 8192, (), 2)
    assert (qwen.model.sampling.temperature, qwen.model.sampling.top_k) == (0.6, 20)
    # the command line's settings (applied to [model] after the file) reach the presets too
    assert config.replace("model", ctx_size=4096).preset("qwen").model.ctx_size == 4096


@pytest.mark.parametrize(
    "data, line",
    [
        ({"models": {"q": {"nope": 1}}}, "unknown key(s) in [models.q]: nope"),
        ({"models": {"q": {"ctx_size": "x"}}}, "[models.q] ctx_size must be an integer, got 'x'"),
        ({"models": {"q": {"sampling": {"temperature": "hot"}}}}, "[models.q.sampling] temperature must be a number, got 'hot'"),
        ({"model": {"sampling": {"tempp": 1}}}, "unknown key(s) in [model.sampling]: tempp"),
        ({"models": {"q": 3}}, "[models.q] must be a table (a model's settings)"),
        ({"model": {"cache_type_k": "q5"}}, "[model] cache_type_k must be one of 'f16', 'bf16', 'q8_0', 'q4_0', got 'q5'"),
    ],
)
def test_a_bad_preset_or_sampling_table_is_one_line_naming_it(data, line):
    with pytest.raises(ValueError) as info:
        Config.from_dict(data)
    assert str(info.value) == line
