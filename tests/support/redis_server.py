"""A throwaway Debian ``redis-server`` on a free loopback port, for the Redis backend's tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")

#: Skip marker for tests that need the program (``.ci/run`` installs it: apt-get install redis-server).
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server; .ci/run does)"
)


def free_port() -> int:
    """A loopback port free right now (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` with no persistence on ``127.0.0.1:<free port>``, in ``workdir``, until :meth:`stop`.

    ``extra`` are more ``--option value`` arguments (e.g. a small ``stream-node-max-entries``);
    ``port`` restarts one on the port of a stopped one.
    """

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test (small stream nodes, so that MAXLEN ~ trims at small sizes)."""
    server = RedisServer(tmp_path, "--stream-node-max-entries", "4")
    yield server
    server.stop()
