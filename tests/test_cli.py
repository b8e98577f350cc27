"""The command line: clear one-line errors for a bad model file or config, not a traceback."""

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ringserve", *args], capture_output=True, text=True, timeout=60)


def test_missing_model_is_one_line_naming_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run("serve", "--model", str(missing), "--port", "0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0]
    assert "Traceback" not in result.stderr


def test_not_a_gguf_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    result = run("serve", "--model", str(bad), "--port", "0")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and str(bad) in result.stderr


def test_bad_config_is_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[engine]\nslots = -1\n")
    result = run("serve", "--config", str(cfg))
    assert result.returncode == 2
    assert "slots" in result.stderr and len(result.stderr.strip().splitlines()) == 1
