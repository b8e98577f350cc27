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
