"""Config: TOML round trip, validation messages, CLI overrides."""

import argparse
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
    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 9000\n[engine]\nslots = 2\n")
    args = argparse.Namespace(config=path, host="127.0.0.2", port=None, model="/m.gguf", slots=8)
    config = load_config(args)
    assert (config.server.host, config.server.port) == ("127.0.0.2", 9000)
    assert config.model.path == "/m.gguf"
    assert config.engine.slots == 8


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
