"""The harness's server process (bench/common.py ``ServerProcess``, the tests' and the benchmarks') reads
the server's log for as long as the server runs: a server whose stdout pipe fills (64 KiB on Linux) blocks on its next log write,
with its event loop, so a session-long server (``model_server``) would hang once its access log passed that."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from bench.common import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def test_a_server_that_logs_more_than_a_pipe_holds_keeps_serving(tmp_path):
    """40 requests whose access-log lines hold a 4 KiB query each (160 KiB of log, 2.5 pipes) all get
    their answer, and the last one's line is among the lines kept."""
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = 0\n[store]\npath = "{tmp_path / "store.sqlite3"}"\n')
    server = ServerProcess([sys.executable, str(ROOT / "bench" / "fake_server.py"), "--config", str(config)],
                           env={"PYTHONPATH": str(ROOT)})
    pad = "x" * 4096
    try:
        with httpx.Client(base_url=server.url, timeout=20) as client:
            statuses = [client.get("/health", params={"n": str(i), "pad": pad}).status_code for i in range(40)]
        assert statuses == [200] * 40
        server.wait_for_log(r'"query":"n=39&pad=x{4096}"', 20)
    finally:
        server.stop()
