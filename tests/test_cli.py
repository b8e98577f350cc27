"""The command line: clear one-line errors for a bad model file or config, not a traceback."""

import os
import re
import socket
import subprocess
import sys
import tomllib

import pytest

from ringserve.config import Config
from ringserve.core.frozen import SELF
from ringserve.engine.protocol import Engine, EngineError
from ringserve.server import run_process


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


def test_a_safety_checker_that_does_not_load_is_one_line_at_start(tmp_path):
    """Imported when the server starts (before it listens or loads the model), not by the config."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 0\n[store]\npath = ":memory:"\n[safety]\nwindow_tokens = 2\nchecker = "no_such_module_xyz:fn"\n')
    result = run("serve", "--config", str(cfg))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ringserve: [safety] checker 'no_such_module_xyz:fn' cannot be loaded: No module named 'no_such_module_xyz'"
    ]


@pytest.mark.model
def test_a_context_above_the_models_trained_context_is_one_line(tmp_path):
    """Refused before llama.cpp allocates 99999999 KV cells: exit 2, one line with setting and limit."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 0\n[store]\npath = ":memory:"\n[model]\nctx_size = 99999999\n')
    result = run("serve", "--config", str(cfg), "--log-level", "ERROR")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("ringserve: the model 'SmolLM2-135M-Instruct.Q4_1' cannot be loaded: ctx_size = 99999999"
                               " is above the model's trained context of 8192 tokens"), lines[0]


@pytest.mark.model
def test_a_chat_template_past_the_bounds_of_a_render_is_one_line_at_start(tmp_path):
    """Issue 43: nested ``range(100000)`` loops in the template hung the start (llama.cpp's
    capability probes render it); now exit 2 and one line that names the bound."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[server]\nport = 0\n[store]\npath = ":memory:"\n[model]\nchat_template_file = "{template}"\n')
    result = run("serve", "--config", str(cfg), "--log-level", "ERROR")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "chat template took more than its" in lines[0] and "steps" in lines[0]


def test_an_engine_that_fails_to_load_is_raised_bare(tmp_path):
    """The model loads inside serve's nursery; its one-line error leaves run_process unwrapped from the group."""
    config = Config().replace("server", port=0).replace("store", path=":memory:")

    def factory(_config: Config) -> Engine:
        raise EngineError("llama.cpp could not create a context of 4 x 99999 tokens")

    with pytest.raises(EngineError, match="could not create a context"):
        run_process(config, factory)


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path):
    """Exit 2 is a start-up mistake: the systemd unit does not restart it (RestartPreventExitStatus=2)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
        result = run("serve", "--config", str(cfg), "--log-level", "ERROR")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ringserve: cannot listen on 127.0.0.1:{port}: Address already in use: another process has that port"
        " (choose another: --port or [server] port)"
    ]


def test_an_unknown_log_level_is_one_line_and_exit_2():
    result = run("serve", "--log-level", "LOUD")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ringserve: --log-level LOUD: not a level (DEBUG, INFO, WARNING, ERROR or CRITICAL)"
    ]


def test_a_system_without_dev_null_is_one_line_and_exit_2():
    """llama-cpp-python opens os.devnull as it loads (a traceback before); tests/system/test_binary.py has the
    real case, a chroot without /dev/null."""
    code = ("import os, sys; os.devnull = '/nonexistent/null'; from ringserve.__main__ import main; "
            "sys.exit(main(['serve', '--port', '0']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "ringserve: /nonexistent/null cannot be opened for writing (No such file or directory), and llama-cpp-python"
        " needs it: the system (a chroot, a container image) must provide it"]


def test_bare_ringserve_prints_the_help_and_version_prints_the_versions():
    bare = run()
    assert bare.returncode == 0 and bare.stdout.startswith("usage: ringserve") and "serve" in bare.stdout
    version = run("--version")
    assert version.returncode == 0
    assert re.fullmatch(r"ringserve \S+ \(llama-cpp-python \S+\)\n", version.stdout), version.stdout


def test_serve_takes_the_model_as_its_argument_and_a_bad_variable_is_one_line(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run("serve", str(missing), "--port", "0")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"ringserve: model file not found: {missing}"]
    result = subprocess.run([sys.executable, "-m", "ringserve", "serve", "--print-config"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "RINGSERVE_CTX_SIZE": "lots"})
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "ringserve: RINGSERVE_CTX_SIZE='lots': not an integer"]
    result = run("serve", "-c", "-5", "--print-config")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == ["ringserve: [model] ctx_size must be >= 0, got -5"]


def test_a_server_started_beside_a_folder_named_ringserve_serves(tmp_path):
    """``launch`` and ``run`` start ``SELF serve`` from the user's folder, which may hold a checkout
    named ``ringserve``: with ``-m`` alone that folder came first on ``sys.path``, the package was a
    namespace package (before the editable install's finder), and the server died at start
    ("No root path can be found for the provided module 'ringserve'"). The package as installed
    (no ``PYTHONPATH``)."""
    (tmp_path / "ringserve").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 0\n[store]\npath = ":memory:"\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    server = subprocess.Popen([*SELF, "serve", "--config", str(cfg)], cwd=tmp_path, env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        lines = []
        for line in server.stderr:  # until the ready line, or its exit
            lines.append(line)
            if "ready:" in line:
                break
        assert "ready:" in lines[-1], "".join(lines[-20:])
    finally:
        server.terminate()
        server.wait(60)
def test_print_config_shows_the_keys_and_secret_the_environment_adds_hidden():
    """The server requires the keys of ``RINGSERVE_API_KEYS``/``RINGSERVE_API_KEY``: ``--print-config``
    must not say ``api_keys = []``, nor print them."""
    env = {**os.environ, "RINGSERVE_API_KEYS": "sekret-1, sekret-2", "RINGSERVE_API_KEY": "sekret-3",
           "RINGSERVE_STREAM_TOKEN_SECRET": "sekret-4"}
    result = subprocess.run([sys.executable, "-m", "ringserve", "serve", "--print-config", "--api-key", "sekret-0"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    auth = tomllib.loads(result.stdout)["auth"]
    assert auth["api_keys"] == ["<hidden>"] * 4 and auth["stream_token_secret"] == "<hidden>"
    assert "sekret" not in result.stdout
