"""``ringserve launch``: the settings each agent gets (pure functions, and ``--print``), and the whole
command with a fake agent (an executable that records its argv and environment) against a server on
the fake engine (``bench/fake_server.py``): started when none runs and stopped after, or used and
left running when one does."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from bench.common import ServerProcess
from ringserve import launch
from ringserve.__main__ import _parser
from ringserve.launch import AGENTS, Agent, Served, Settings

ROOT = Path(__file__).resolve().parent.parent
FAKE_SERVE = (sys.executable, str(ROOT / "bench" / "fake_server.py"))
SERVED = Served("http://127.0.0.1:8080", "qwen3-8b", 32768, "k-1", 1800.0)


def test_claude_code_gets_the_url_the_key_one_model_for_every_call_and_a_timeout():
    assert launch.claude_settings(SERVED, {}) == Settings({
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8080",
        "ANTHROPIC_API_KEY": "k-1",
        "ANTHROPIC_MODEL": "qwen3-8b",
        "ANTHROPIC_DEFAULT_OPUS_MODEL": "qwen3-8b",
        "ANTHROPIC_DEFAULT_SONNET_MODEL": "qwen3-8b",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "qwen3-8b",
        "ANTHROPIC_SMALL_FAST_MODEL": "qwen3-8b",
        "CLAUDE_CODE_SUBAGENT_MODEL": "qwen3-8b",
        "API_TIMEOUT_MS": "1800000",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "52768",  # the window and the 20,000 it keeps for a reply
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    })


def test_claude_codes_small_background_calls_go_to_the_small_model_when_one_is_named():
    env = launch.claude_settings(attrs.evolve(SERVED, small_model="smollm2"), {}).env
    assert {name for name, value in env.items() if value == "smollm2"} == {
        "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL"}
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == env["CLAUDE_CODE_SUBAGENT_MODEL"] == "qwen3-8b"
    printed = launch.render(Agent.CLAUDE, attrs.evolve(SERVED, small_model="smollm2"), Settings({}))
    assert printed.startswith("# Claude Code on ringserve at http://127.0.0.1:8080: model qwen3-8b (small model smollm2),")


def test_claude_code_is_told_a_window_that_it_fills_to_the_models_context():
    """Claude Code keeps min(its output cap, 20,000) of the window it is told for the reply; ringserve's
    context already holds the reply, so the two are added."""
    assert launch.claude_window(8192, {}) == 28192
    assert launch.claude_window(8192, {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}) == 8448
    assert launch.claude_window(8192, {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64000"}) == 28192
    assert launch.claude_window(8192, {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "lots"}) == 28192
    printed = launch.render(Agent.CLAUDE, SERVED, launch.claude_settings(SERVED, {}))
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=52768\n" in printed


def overrides(args: tuple[str, ...]) -> dict[str, Any]:
    """Codex's ``-c key=value`` arguments as the nested table they set (values parsed as TOML, as Codex does)."""
    table: dict[str, Any] = {}
    assert args[::2] == ("-c",) * (len(args) // 2)
    for pair in args[1::2]:
        key, value = pair.split("=", 1)
        *path, last = key.split(".")
        node = table
        for part in path:
            node = node.setdefault(part, {})
        node[last] = tomllib.loads(f"v = {value}")["v"]
    return table


CODEX_CONFIG = {
    "model": "qwen3-8b",
    "model_provider": "ringserve",
    "model_context_window": 32768,
    "model_catalog_json": "/cache/catalog.json",
    "model_providers": {"ringserve": {
        "name": "ringserve",
        "base_url": "http://127.0.0.1:8080/v1",
        "wire_api": "responses",
        "env_key": "RINGSERVE_API_KEY",
        "stream_idle_timeout_ms": 1800000,
    }},
}


def test_codex_gets_a_provider_and_the_model_as_overrides_that_say_what_the_printed_config_says():
    settings = launch.codex_settings(SERVED, Path("/cache/catalog.json"))
    assert settings.env == {"RINGSERVE_API_KEY": "k-1"}
    assert overrides(settings.args) == tomllib.loads(settings.config_toml) == CODEX_CONFIG
    without = launch.codex_settings(SERVED, None)
    assert "model_catalog_json" not in tomllib.loads(without.config_toml)
    assert overrides(without.args) == tomllib.loads(without.config_toml)


def test_a_model_name_that_needs_escaping_stays_one_toml_string():
    odd = Served('http://127.0.0.1:8080', 'a "b"\\c\u00e9', 8192, "k", 60.0)
    settings = launch.codex_settings(odd, None)
    assert overrides(settings.args)["model"] == tomllib.loads(settings.config_toml)["model"] == 'a "b"\\c\u00e9'


def test_the_served_model_gets_the_template_models_codex_metadata_under_its_own_name_and_window():
    template = {"slug": launch.CODEX_TEMPLATE, "display_name": "GPT", "description": "theirs", "context_window": 272000,
                "max_context_window": 272000, "apply_patch_tool_type": "freeform", "upgrade": {"model": "newer"},
                "default_reasoning_summary": "none",
                "service_tiers": [{"id": "priority"}], "base_instructions": "You are Codex."}
    catalog = {"models": [{"slug": "other", "apply_patch_tool_type": None}, template]}
    entry = launch.codex_model_entry(catalog, SERVED)
    assert entry == {**template, "slug": "qwen3-8b", "display_name": "qwen3-8b",
                     "description": "qwen3-8b, served by ringserve", "context_window": 32768,
                     "max_context_window": 32768, "upgrade": None, "service_tiers": [],
                     "default_reasoning_summary": "auto"}
    assert launch.codex_model_entry({"models": [{"slug": "other"}]}, SERVED) is None


@pytest.mark.parametrize(("context", "claude", "codex"), [
    (4096, "400", "400"), (8192, "400", "may not fit"), (12800, "may not fit", None), (16384, None, None)])
def test_a_context_smaller_than_the_agents_first_request_is_one_warning_line(context, claude, codex):
    """A 400 is promised only below the least measured size (Codex's 8,150-token request fitted 8,192);
    Claude Code's also names the larger request its error will show (about 21,000 tokens)."""
    served = Served("http://h:1", "m", context, "k", 60.0)
    for agent, verdict in ((Agent.CLAUDE, claude), (Agent.CODEX, codex)):
        warning = launch.context_warning(agent, served)
        assert (warning is None) is (verdict is None)
        if warning is not None:
            assert "\n" not in warning and f"context of {context:,}" in warning and AGENTS[agent].name in warning
            assert f"ringserve launch {agent.value} --model" in warning
            assert ("expect a 400" in warning) is (verdict == "400")
            assert ("may not fit" in warning) is (verdict == "may not fit")
            assert ("21,400 tokens" in warning) is (agent is Agent.CLAUDE and verdict == "400")


def test_print_is_export_lines_and_codexs_config_file():
    claude = launch.render(Agent.CLAUDE, SERVED, Settings({"A": "1", "B": "two words"}))
    assert claude == ("# Claude Code on ringserve at http://127.0.0.1:8080: model qwen3-8b, 32,768 tokens of context\n"
                      "export A=1\nexport B='two words'\n")
    settings = launch.codex_settings(SERVED, Path("/cache/catalog.json"))
    codex = launch.render(Agent.CODEX, SERVED, settings)
    assert codex.startswith("# Codex CLI on ringserve")
    assert "export RINGSERVE_API_KEY=k-1\n" in codex and codex.endswith(settings.config_toml)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_agent_is_found_on_path_first_then_in_the_pinned_copy(tmp_path):
    on_path, pinned, empty = tmp_path / "bin", tmp_path / "pinned", tmp_path / "empty"
    for folder in (on_path, pinned, empty):
        folder.mkdir()
    info = AGENTS[Agent.CODEX]
    executable(pinned / "codex", "#!/bin/sh\n")
    assert launch.find_agent(info, str(empty), pinned) == str(pinned / "codex")
    executable(on_path / "codex", "#!/bin/sh\n")
    assert launch.find_agent(info, f"{empty}:{on_path}", pinned) == str(on_path / "codex")
    assert launch.find_agent(info, str(empty), empty) is None


def test_a_missing_agent_is_one_line_with_the_npm_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(launch, "PINNED_BIN", tmp_path)
    assert launch.run(args("claude", "--url", "http://127.0.0.1:9")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "npm install -g @anthropic-ai/claude-code@2.1.332" in err


def test_the_pins_are_the_ci_agents():
    pinned = json.loads((ROOT / ".ci" / "agents" / "package.json").read_text())["dependencies"]
    assert pinned == {info.package: info.version for info in AGENTS.values()}


def test_arguments_after_the_first_double_dash_are_the_agents():
    assert launch.split_argv(["launch", "codex", "--print", "--", "exec", "--", "-x"]) == (
        ["launch", "codex", "--print"], ["exec", "--", "-x"])
    assert launch.split_argv(["chat", "--", "-x"]) == (["chat", "--", "-x"], [])


def test_launch_imports_nothing_of_the_server():
    code = ("import sys, ringserve.launch\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('quart', 'hypercorn', 'llama_cpp', 'trio')"
            " or m.startswith(('ringserve.http', 'ringserve.engine', 'ringserve.server', 'ringserve.live')))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# --- the whole command -----------------------------------------------------------------------------

FAKE_AGENT = """#!{python}
import json, os, sys, urllib.request
if sys.argv[1:] == ["debug", "models", "--bundled"]:
    sys.stdout.write(open(os.environ["FAKE_CATALOG"]).read())
    sys.exit(0)
url = os.environ.get("ANTHROPIC_BASE_URL") or "http://127.0.0.1:" + os.environ["FAKE_PORT"]
ready = urllib.request.urlopen(url + "/ready").status
with open(os.environ["FAKE_AGENT_OUT"] + ".part", "w") as out:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "ready": ready, "pid": os.getpid()}}, out)
os.rename(os.environ["FAKE_AGENT_OUT"] + ".part", os.environ["FAKE_AGENT_OUT"])
if os.environ.get("FAKE_AGENT_WAIT"):
    sys.stdin.read()  # until a signal ends it
sys.exit(3)
"""


def args(*argv: str) -> argparse.Namespace:
    argv_, agent_args = launch.split_argv(["launch", *argv])
    parsed = _parser().parse_args(argv_)
    parsed.agent_args = agent_args or parsed.agent_args
    return parsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent_env(tmp_path, monkeypatch) -> dict[str, Path]:
    """A fake ``claude`` and ``codex`` first on PATH, the log and cache folders in ``tmp_path``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("claude", "codex"):
        executable(bin_dir / program, FAKE_AGENT.format(python=sys.executable))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_AGENT_OUT", str(tmp_path / "agent.json"))
    monkeypatch.delenv("RINGSERVE_API_KEY", raising=False)
    monkeypatch.delenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", raising=False)
    return {"out": tmp_path / "agent.json", "bin": bin_dir}


def config_file(tmp_path: Path, port: int, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n{extra}')
    return path


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/ready", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_launch_starts_a_server_runs_the_agent_with_its_settings_and_stops_the_server(tmp_path, agent_env, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = config_file(tmp_path, port, "[engine]\nctx_per_slot = 16384\n")
    model = tmp_path / "tiny-model.gguf"  # a link (a Hugging Face snapshot's are): its own name, not its target's
    (tmp_path / "blob.gguf").write_bytes(b"GGUF")  # (the fake engine does not read it)
    model.symlink_to(tmp_path / "blob.gguf")
    status = launch.run(args("claude", "--config", str(config), "--model", str(model), "--", "-p", "Say hi", "--", "x"),
                        serve=FAKE_SERVE)
    assert status == 3  # the agent's
    seen = json.loads(agent_env["out"].read_text())
    assert seen["ready"] == 200  # the server ran while the agent did
    assert seen["argv"] == ["-p", "Say hi", "--", "x"]
    expected = launch.claude_settings(Served(url, "tiny-model", 16384, launch.PLACEHOLDER_KEY, launch.AGENT_TIMEOUT_S),
                                      os.environ).env
    assert {k: seen["env"][k] for k in expected} == expected
    assert seen["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "36384"  # not the 1,000,000 it would assume
    assert refused(url)  # and stopped after it
    err = capsys.readouterr().err
    assert f"no server at {url}; starting one" in err and "warning" not in err
    assert (tmp_path / "state" / "ringserve" / "log" / f"server-{port}.log").read_text().count("ready: model tiny-model") == 1


def test_launch_uses_a_running_server_and_leaves_it_running(tmp_path, agent_env, monkeypatch, capsys):
    """Codex on a server that needs a key (the config's), ``--print``: settings with the model's metadata, and
    the server that was running before is running after."""
    port = free_port()
    config = config_file(tmp_path, port, '[auth]\napi_keys = ["key-1"]\n[model]\nctx_size = 4096\n')
    server = ServerProcess([*FAKE_SERVE, "--config", str(config)])
    try:
        catalog = {"models": [{"slug": launch.CODEX_TEMPLATE, "apply_patch_tool_type": "freeform", "base_instructions": "B"}]}
        (tmp_path / "catalog.json").write_text(json.dumps(catalog))
        monkeypatch.setenv("FAKE_CATALOG", str(tmp_path / "catalog.json"))
        assert launch.run(args("codex", "--config", str(config), "--print"), serve=FAKE_SERVE) == 0
        out, err = capsys.readouterr()
        config_toml = tomllib.loads(out.split("passes these as -c overrides):\n", 1)[1])
        assert config_toml["model"] == "fake" and config_toml["model_context_window"] == 4096
        assert config_toml["model_providers"]["ringserve"]["base_url"] == f"{server.url}/v1"
        assert "export RINGSERVE_API_KEY=key-1\n" in out
        assert json.loads(Path(config_toml["model_catalog_json"]).read_text()) == {"models": [{
            **catalog["models"][0], "slug": "fake", "display_name": "fake", "description": "fake, served by ringserve",
            "context_window": 4096, "max_context_window": 4096, "default_reasoning_summary": "auto"}]}
        assert "starting one" not in err
        assert err.count("\n") == 1 and "context of 4,096" in err  # the context warning only
        assert httpx.get(f"{server.url}/ready").status_code == 200
        assert launch.run(args("codex", "--url", server.url, "--print"), serve=FAKE_SERVE) == 2  # no key
        assert "wants an API key" in capsys.readouterr().err
    finally:
        server.stop()


def test_launch_names_a_model_and_a_small_model_of_the_servers_loading_them_and_an_unknown_one_is_one_line(
        tmp_path, agent_env, capsys):
    port = free_port()
    config = config_file(tmp_path, port, f'[model]\npath = "{tmp_path / "big.gguf"}"\n'
                                         f'[models.small]\npath = "{tmp_path / "small.gguf"}"\nctx_size = 2048\n'
                                         '[router]\nhf_cache = false\n')
    for name in ("big", "small"):  # (the fake engine does not read them)
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    server = ServerProcess([*FAKE_SERVE, "--config", str(config)])
    try:
        assert httpx.get(f"{server.url}/v1/models/small").json()["status"]["value"] == "unloaded"
        assert launch.run(args("claude", "--url", server.url, "--small-model", "small", "--print")) == 0
        out, err = capsys.readouterr()
        assert "export ANTHROPIC_MODEL=big\n" in out and "export ANTHROPIC_DEFAULT_HAIKU_MODEL=small\n" in out
        big = httpx.get(f"{server.url}/v1/models/big").json()["max_input_tokens"]
        assert f"export CLAUDE_CODE_MAX_CONTEXT_TOKENS={big + 20_000}\n" in out  # one variable: the main model's
        assert httpx.get(f"{server.url}/v1/models/small").json()["status"]["value"] == "loaded"  # loaded for it
        assert launch.run(args("codex", "--url", server.url, "--model", "small", "--print")) == 0
        out, err = capsys.readouterr()
        assert "context of 2,048" in err.splitlines()[0]  # the warning names the model launched on
        assert tomllib.loads(out.split("-c overrides):\n", 1)[1])["model"] == "small"
        assert launch.run(args("claude", "--url", server.url, "--model", "gpt-5", "--print")) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"ringserve: {server.url}: no model 'gpt-5' there (a request for it gets big); the models are: big, small"]
        other = tmp_path / "gemma.gguf"  # a file this server may serve under a preset's name: it gives no files
        other.write_bytes(b"GGUF")
        assert launch.run(args("claude", "--url", server.url, "--model", str(other), "--print")) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"ringserve: {server.url}: no model 'gemma' there (a request for it gets big); the models"
                               " are: big, small (--model ") and str(other) in line
        assert "the server names its models, not their files" in line and "--model NAME" in line
    finally:
        server.stop()


def test_a_gguf_file_the_server_has_no_name_for_says_that_it_names_models_not_files():
    """A server with ``strict_model_name`` answers an unknown name 404 (its message lists the names); a
    file's stem is all the launcher can ask for, so the line says so."""
    message = "no model 'gemma' here; the models are: big, small"
    transport = httpx.MockTransport(lambda request: httpx.Response(404, json={"error": {"message": message}}))
    with httpx.Client(transport=transport) as client:
        with pytest.raises(launch.LaunchError) as raised:
            launch.served_model(client, "http://h:1", "k", None, "gemma", Path("../gemma.gguf"))
        assert str(raised.value) == (f"http://h:1: {message} (--model ../gemma.gguf asks for its file's name: the server"
                                     " names its models, not their files, and may serve that file under another; give"
                                     " that name, --model NAME)")
        with pytest.raises(launch.LaunchError) as raised:
            launch.served_model(client, "http://h:1", "k", None, "gemma")
        assert str(raised.value) == f"http://h:1: {message}"  # a name given as a name


def test_launch_reads_the_ringserve_variables_as_the_server_does(tmp_path, agent_env, monkeypatch, capsys):
    """``RINGSERVE_PORT`` beats the config's port, for the server a launch would start and so for the URL
    it looks at: here the running server's."""
    port = free_port()
    server = ServerProcess([*FAKE_SERVE, "--config", str(config_file(tmp_path, port))])
    try:
        other = tmp_path / "other.toml"
        other.write_text(f"[server]\nport = {free_port()}\n")
        monkeypatch.setenv("RINGSERVE_PORT", str(port))
        assert launch.run(args("claude", "--config", str(other), "--print")) == 0
        out, err = capsys.readouterr()
        assert f"export ANTHROPIC_BASE_URL={server.url}\n" in out and "starting one" not in err
    finally:
        server.stop()


def test_print_leaves_the_server_it_started_running_for_the_settings_it_printed(tmp_path, agent_env, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = config_file(tmp_path, port)
    assert launch.run(args("claude", "--config", str(config), "--print"), serve=FAKE_SERVE) == 0
    out, err = capsys.readouterr()
    try:
        assert f"export ANTHROPIC_BASE_URL={url}\n" in out and "starting one" in err
        assert "the server goes on at" in err
        assert httpx.get(f"{url}/ready").status_code == 200  # the printed settings work
    finally:
        pid = int(err.split("(pid ", 1)[1].split(";", 1)[0])
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not refused(url):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_server_that_cannot_start_is_one_line_with_its_own_last_line(tmp_path, agent_env, capsys):
    port = free_port()
    missing = tmp_path / "no-such-model.gguf"
    config = config_file(tmp_path, port, f'[model]\npath = "{missing}"\n')
    assert launch.run(args("claude", "--config", str(config))) == 2  # the real `ringserve serve`
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "starting one" in err[0]
    assert err[1].startswith("ringserve: the server exited with status 2: ") and str(missing) in err[1]
    assert not agent_env["out"].exists()  # the agent never ran


def test_a_launcher_told_to_stop_passes_it_to_the_agent_and_stops_the_server(tmp_path, agent_env, monkeypatch):
    port = free_port()
    config = config_file(tmp_path, port)
    monkeypatch.setenv("FAKE_AGENT_WAIT", "1")
    code = (f"import sys; from tests.test_launch import args, FAKE_SERVE; from ringserve import launch; "
            f"sys.exit(launch.run(args('claude', '--config', {str(config)!r}), serve=FAKE_SERVE))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not agent_env["out"].exists():  # the agent runs, so the server is ready
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read().decode()
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 128 + signal.SIGTERM  # the agent's status: the signal ended it
    finally:
        launcher.kill()
        launcher.wait()
    assert refused(f"http://127.0.0.1:{port}")


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which nobody has reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_agent_ends_with_a_launcher_killed_by_sigkill(tmp_path, agent_env, monkeypatch):
    """SIGKILL cannot be passed on: the agent gets SIGTERM from the kernel instead, where it would go
    on as an orphan reading its stream (its generation then keeps its slot to the reply's end). The
    server runs before, so the launcher starts none (one would outlive it too)."""
    port = free_port()
    config = config_file(tmp_path, port)
    server = ServerProcess([*FAKE_SERVE, "--config", str(config)])
    monkeypatch.setenv("FAKE_AGENT_WAIT", "1")  # it reads stdin, which this test holds open, until a signal
    code = (f"import sys; from tests.test_launch import args; from ringserve import launch; "
            f"sys.exit(launch.run(args('claude', '--config', {str(config)!r})))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not agent_env["out"].exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read().decode()
            time.sleep(0.05)
        pid = json.loads(agent_env["out"].read_text())["pid"]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while running(pid):
            assert time.monotonic() < deadline, "the agent outlived its launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait()
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGKILL)
        server.stop()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:0",  # a server started there listens on a random port: polling port 0 waited 600 s
    "ftp://127.0.0.1:21",  # a server was started on port 21
    "127.0.0.1:8080",  # no scheme
    "http://127.0.0.1:99999",  # a port out of range, a malformed IPv6 host: tracebacks
    "http://[::1:8080",
])
def test_a_url_no_server_can_have_is_one_line_and_starts_nothing(tmp_path, agent_env, capsys, url):
    started = tmp_path / "started"
    serve = (sys.executable, "-c", f"open({str(started)!r}, 'w')")  # what would have been started
    assert launch.run(args("claude", "--url", url, "--print"), serve=serve) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ringserve: the URL {url!r} (--url or $RINGSERVE_URL): ")
    assert not started.exists()


def test_models_dir_goes_to_the_server_launch_starts_as_run_passes_it(tmp_path, agent_env, capsys):
    port = free_port()
    config = config_file(tmp_path, port)
    argv = tmp_path / "argv.json"
    serve = (sys.executable, "-c", f"import json, sys; open({str(argv)!r}, 'w').write(json.dumps(sys.argv[1:]))")
    assert launch.run(args("claude", "--config", str(config), "--models-dir", str(tmp_path / "models"), "--print"),
                      serve=serve) == 2  # (that server exits at once)
    assert json.loads(argv.read_text()) == ["--models-dir", str(tmp_path / "models"), "--config", str(config)]
    assert "the server exited with status 0" in capsys.readouterr().err


def test_a_port_in_use_is_the_servers_one_line_and_leaves_no_server(tmp_path, agent_env, capsys):
    """The real ``ringserve serve`` cannot bind (the port is bound, not listening, so nothing answers
    there): the launcher says why in one line, and says no server goes on (none does)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = config_file(tmp_path, port)
        assert launch.run(args("claude", "--config", str(config), "--print")) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "starting one" in err[0]
    assert err[1].startswith(f"ringserve: the server exited with status 2: ringserve: cannot listen on 127.0.0.1:{port}:"
                             " Address already in use")


def test_a_refused_or_malformed_key_is_one_line_that_does_not_show_it(tmp_path, agent_env, capsys):
    port = free_port()
    config = config_file(tmp_path, port, '[auth]\napi_keys = ["key-1"]\n')
    server = ServerProcess([*FAKE_SERVE, "--config", str(config)])
    try:
        assert launch.run(args("claude", "--url", server.url, "--api-key", "wrong-key", "--print")) == 2
        assert capsys.readouterr().err == (f"ringserve: {server.url} refused the API key (--api-key or"
                                           " $RINGSERVE_API_KEY): give one of the server's keys\n")
        for key, bad in (("key-1\n", "'\\n' at position 5"), ("k\u00e9y", "'\u00e9' at position 1")):
            assert launch.run(args("claude", "--url", server.url, "--api-key", key, "--print")) == 2
            assert capsys.readouterr().err == (f"ringserve: the API key (--api-key or $RINGSERVE_API_KEY) has {bad}:"
                                               " a key is printable ASCII\n")
    finally:
        server.stop()


def test_a_launcher_that_fails_stops_the_server_it_started_even_with_print(tmp_path, agent_env, capsys):
    port = free_port()
    config = config_file(tmp_path, port, '[auth]\napi_keys = ["key-1"]\n')
    status = launch.run(args("claude", "--config", str(config), "--api-key", "wrong-key", "--print"), serve=FAKE_SERVE)
    assert status == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "starting one" in err[0] and "refused the API key" in err[1]
    assert refused(f"http://127.0.0.1:{port}")  # stopped: nothing the printed settings could use


def test_a_model_that_cannot_be_loaded_is_the_server_s_line_once():
    """GET /v1/models/{id} gives no context (not loaded), POST /models/load fails: the line is the
    server's message, not 'cannot be loaded: the model ... cannot be loaded: ...'."""
    message = "the model 'ghost' cannot be loaded: model file not found: /m/ghost.gguf"

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/models/load":
            return httpx.Response(503, json={"error": {"message": message}})
        return httpx.Response(200, json={"id": "ghost", "aliases": []})

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(launch.LaunchError) as raised:
            launch.served_model(client, "http://h:1", "k", None, "ghost")
    assert str(raised.value) == f"http://h:1: {message}"
