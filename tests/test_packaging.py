"""What ships beside the code: the systemd unit (packaging/ringserve.service) and the container's build
context (.dockerignore for packaging/Dockerfile)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "packaging" / "ringserve.service"


def unit_settings() -> dict[str, list[str]]:
    """The unit's ``Key=value`` lines, by key (a key may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if re.match(r"[A-Za-z]+=", line):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_waits_for_the_model_and_does_not_restart_a_start_up_mistake():
    """Type=notify: ringserve sends READY=1 once the model is loaded (tests/http/test_drain.py); in the
    one-file executable from the bootloader's child, hence NotifyAccess=all. Exit 2 (a bad config, a port
    in use) is not restarted."""
    settings = unit_settings()
    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["all"]
    assert settings["Restart"] == ["on-failure"] and settings["RestartPreventExitStatus"] == ["2"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (Debian: systemd)")
def test_the_unit_is_sandboxed():
    """``systemd-analyze security`` rated the unit 8.4 EXPOSED; it must stay under 2.0 (its scale's "OK"
    ends at 3.9). ``--offline`` reads the file alone (systemd 250 and later), so it runs without systemd
    as PID 1."""
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=20", str(UNIT)],
                          capture_output=True, text=True, timeout=60)
    if "--offline" in done.stderr and "unrecognized" in done.stderr:
        pytest.skip(f"this systemd-analyze has no --offline: {done.stderr.strip()}")
    overall = re.search(r"Overall exposure level for ringserve.service: ([0-9.]+)", done.stdout)
    assert overall is not None, done.stdout + done.stderr
    assert done.returncode == 0 and float(overall.group(1)) < 2.0, done.stdout


def test_the_docker_build_context_is_what_the_dockerfile_copies():
    """An allow-list: everything is left out but the sources of the Dockerfile's COPY lines (a build
    context of about 620 MB after the quick start without it: .venv, build/, dist/)."""
    copied = set()
    for line in (ROOT / "packaging" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(word.startswith("--from") for word in words):
            copied.update(words[1:-1])
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*"
    kept = {pattern[1:] for pattern in patterns if pattern.startswith("!")}
    assert kept == copied == {"pyproject.toml", "README.md", "constraints.txt", "ringserve", "packaging"}
