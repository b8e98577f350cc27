"""The one-file executable (``packaging/ringserve.spec``), run where nothing else is.

The module builds the binary with PyInstaller (about a minute on 2 cores; ``[build]`` is part of
``[test]``), or takes the one ``$RINGSERVE_BINARY`` names (a CUDA build, a release to check). Each
run of it gets an empty working directory, ``HOME`` and ``TMPDIR`` fresh folders, and an
environment of those and ``PATH=/usr/bin:/bin`` alone: no ``PYTHONPATH``, no ``VIRTUAL_ENV``, no
Python package on any path. What it must do there as the installed package does: ``ready:``, one
streamed answer on each surface (Anthropic Messages, OpenAI Chat Completions, OpenAI Responses; the
official SDKs too) from the bundled model, a resume after a dropped connection, ``chat`` and
``tail``, the same exit codes and messages, and a drain on SIGTERM that exits 0 and leaves nothing
behind in ``TMPDIR``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from bench.common import RINGSERVE_READY, ServerProcess
from ringserve.core.sse import ServerSentEvent, SSEParser
from tests.support.helpers import anthropic_text
from tests.support.server import MODEL_TOML

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "packaging" / "ringserve.spec"
BINARY_ENV = "RINGSERVE_BINARY"
PROMPT = "Say hello in French."
MAX_TOKENS = 8
#: Enough time for a build on a loaded 2-core machine, and the runs after it.
pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    """``$RINGSERVE_BINARY``, or a binary built from this checkout into a temporary folder."""
    if given := os.environ.get(BINARY_ENV):
        path = Path(given).resolve()
        assert path.is_file() and os.access(path, os.X_OK), f"{BINARY_ENV}={given} is not an executable file"
        return path
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(f"the one-file build is made and tested on Linux x86-64, not {sys.platform} {platform.machine()}")
    pytest.importorskip("PyInstaller", reason=f"PyInstaller builds the binary: pip install -e '.[build]' (or set {BINARY_ENV})")
    out = tmp_path_factory.mktemp("build")
    build = subprocess.run(
        [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
         "--distpath", str(out / "dist"), "--workpath", str(out / "work"), str(SPEC)],
        capture_output=True, text=True, timeout=800,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out / "dist" / "ringserve"


class Clean:
    """An empty working directory, fresh ``HOME`` and ``TMPDIR``, and an environment of those alone."""

    def __init__(self, root: Path) -> None:
        self.cwd, self.home, self.tmp = root / "cwd", root / "home", root / "tmp"
        for folder in (self.cwd, self.home, self.tmp):
            folder.mkdir()
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "TMPDIR": str(self.tmp)}

    def run(self, binary: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Clean:
    return Clean(tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The config file the server reads: two slots of 1,024 tokens, a drain long enough to finish a reply."""
    path = tmp_path_factory.mktemp("config") / "ringserve.toml"
    path.write_text('[server]\nport = 0\ndrain_timeout = 120\n[engine]\nslots = 2\nctx_per_slot = 1024\n' + MODEL_TOML)
    return path


@pytest.fixture(scope="module")
def server(binary, clean, config):
    """``ringserve serve --config FILE`` from the binary, in the clean environment, for the module."""
    server = ServerProcess([str(binary), "serve", "--config", str(config)], env=clean.env,
                           inherit_env=False, cwd=clean.cwd)
    yield server
    server.stop()


def stream(client: httpx.Client, method: str, url: str, **kwargs) -> list[ServerSentEvent]:
    parser = SSEParser()
    events: list[ServerSentEvent] = []
    with client.stream(method, url, **kwargs) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            events += parser.feed(chunk)
    return events


def anthropic_body(max_tokens: int = MAX_TOKENS, prompt: str = PROMPT) -> dict:
    return {"model": "smollm2", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}]}


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_events(client) -> list[ServerSentEvent]:
    """The bundled model's greedy reply to :data:`PROMPT` on the Anthropic surface, as it streamed."""
    return stream(client, "POST", "/v1/messages", json=anthropic_body())


@pytest.fixture(scope="module")
def greedy_text(greedy_events) -> str:
    return anthropic_text(greedy_events)


def test_ready_line_names_the_model_the_config_and_the_offload(server):
    ready = server.wait_for_log(RINGSERVE_READY, 0)
    assert re.search(r"ready: model SmolLM2-135M-Instruct\.Q4_1, chat format generic, 2 slots sharing \d+ tokens of KV"
                     r" cache, context 1024 tokens per request", ready), ready
    assert re.search(r"GPU offload (none \(no GPU device\)|\d+ of 31 layers on .+), at http://127\.0\.0\.1:\d+", ready)


def test_the_server_uses_nothing_of_the_host_python(server, clean):
    """Python and llama.cpp are mapped into the server from what the binary unpacked into ``TMPDIR``, and
    nothing mapped into it or its bootloader comes from this Python's standard library, its packages or
    its virtual environment."""
    pids = [server.proc.pid, *map(int, Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split())]
    assert len(pids) == 2  # PyInstaller's bootloader and the Python process it runs
    mapped = {fields[5] for pid in pids for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
              if len(fields := line.split(maxsplit=5)) == 6 and fields[5].startswith("/")}
    unpacked = str(clean.tmp.resolve())
    for library in ("libpython3", "libllama.so", "_multiarray_umath"):
        paths = [path for path in mapped if library in path]
        assert paths and all(path.startswith(unpacked) for path in paths), (library, paths)
    paths = sysconfig.get_paths()
    host = {str(Path(paths[key]).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    if sys.prefix != sys.base_prefix:
        host.add(str(Path(sys.prefix).resolve()))
    assert [path for path in mapped if path.startswith(tuple(host))] == []


def test_anthropic_messages_stream(greedy_events, greedy_text):
    assert [e.event for e in greedy_events][:2] == ["message_start", "content_block_start"]
    assert greedy_events[-1].event == "message_stop"
    delta = json.loads(next(e.data for e in greedy_events if e.event == "message_delta"))
    assert (delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]) == ("max_tokens", MAX_TOKENS)
    assert json.loads(greedy_events[0].data)["message"]["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert greedy_text.strip()


def test_openai_chat_completions_stream_gives_the_same_greedy_text(client, greedy_text):
    body = {"model": "smollm2", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    events = stream(client, "POST", "/v1/chat/completions", json=body)
    assert events[-1].data == "[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == greedy_text


def test_openai_responses_stream_gives_the_same_greedy_text(client, greedy_text):
    body = {"model": "smollm2", "max_output_tokens": MAX_TOKENS, "stream": True, "temperature": 0, "input": PROMPT}
    events = stream(client, "POST", "/v1/responses", json=body)
    assert events[-1].event == "response.incomplete"
    assert json.loads(events[-1].data)["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    text = "".join(json.loads(e.data)["delta"] for e in events if e.event == "response.output_text.delta")
    assert text == greedy_text


def test_the_official_sdks_stream_from_it(server, greedy_text):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as a:
        # The SDK's stream() has no temperature argument (any more); the server takes the field.
        with a.messages.stream(model="smollm2", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": PROMPT}]) as s:
            assert "".join(s.text_stream) == greedy_text
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as o:
        chunks = o.chat.completions.create(model="smollm2", max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                           messages=[{"role": "user", "content": PROMPT}])
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy_text


def test_a_dropped_stream_resumes_with_last_event_id(client):
    """The first connection is dropped after the first text delta; the resume gives every event after
    it, to ``message_stop``, and the two parts make the stored message's text."""
    parser = SSEParser()
    first: list[ServerSentEvent] = []
    headers = {"Ringserve-Disconnect-Policy": "continue"}
    with client.stream("POST", "/v1/messages", json=anthropic_body(48), headers=headers) as resp:
        for chunk in resp.iter_raw():
            first += parser.feed(chunk)
            if any(e.event == "content_block_delta" for e in first):
                break  # leaving the block closes the connection mid-stream
    message_id, seq = first[-1].id.rsplit(":", 1)
    rest = stream(client, "GET", f"/v1/messages/{message_id}/stream", headers={"Last-Event-ID": first[-1].id})
    assert rest[0].id == f"{message_id}:{int(seq) + 1}"
    assert rest[-1].event == "message_stop"
    stored = client.get(f"/v1/messages/{message_id}").json()
    assert anthropic_text(first) + anthropic_text(rest) == stored["text"]
    assert len(stored["text"]) > len(anthropic_text(first))


def test_chat_and_tail(binary, clean, server, greedy_text):
    chat = clean.run(binary, "chat", "--url", server.url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", PROMPT)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == greedy_text + "\n"
    message_id = re.search(r"\b(msg_\w+)", chat.stderr + chat.stdout)
    assert message_id, chat.stderr
    tail = clean.run(binary, "tail", "--url", server.url, message_id.group(1))
    assert (tail.returncode, tail.stdout) == (0, chat.stdout), tail.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("serve", "--model", "/nonexistent/model.gguf", "--port", "0"),
        ("serve", "--config", "{config}"),
        ("serve", "--config", "/nonexistent/ringserve.toml"),
        ("chat", "--url", "http://127.0.0.1:9", "--timeout", "1", "hello"),
        # no server there: the launcher starts `ringserve serve` (the binary itself), prints, leaves it running
        ("launch", "claude", "--print", "--url", "http://127.0.0.1:{port}"),
    ],
    ids=["help", "missing-model", "bad-config", "missing-config", "no-server", "launch"],
)
def test_same_output_and_exit_status_as_the_package(binary, clean, tmp_path, args):
    """The same status, output and last line of the error output (the lines before it, if any, are the
    client's reconnect notes, whose delays are random)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nslots = -1\n")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    args = tuple(a.format(config=bad, port=port) for a in args)
    runs = [_stopping_its_server(clean.run(binary, *args)),
            _stopping_its_server(subprocess.run([sys.executable, "-m", "ringserve", *args], capture_output=True,
                                                text=True, timeout=120))]
    frozen, package = ((r.returncode, r.stdout, [_LEFT_RUNNING.sub("(pid; log)", line)
                                                 for line in r.stderr.strip().splitlines()[-1:]]) for r in runs)
    assert frozen == package
    assert "Traceback" not in runs[0].stderr


#: The launcher's last line when it leaves the server it started running: its pid and log differ per run.
_LEFT_RUNNING = re.compile(r"\(pid (\d+); log: [^)]*\)")


def _stopping_its_server(run: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``run``, once the server a ``launch --print`` started and left running is stopped (SIGTERM: it drains)."""
    left = _LEFT_RUNNING.search(run.stderr)
    if left is not None:
        pid = int(left.group(1))
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and b"zombie" not in _status(pid):
            assert time.monotonic() < deadline, f"the server {pid} did not stop"
            time.sleep(0.05)
    return run


def _status(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b"zombie"


#: What the one-file executable needs of the system: glibc's libraries (libm among them: libpython links
#: it), which PyInstaller leaves to it, and zlib, which the bootloader links. Everything else comes from
#: inside the file.
SYSTEM_LIBRARIES = ["/lib64/ld-linux-x86-64.so.2", *(f"/lib/x86_64-linux-gnu/{name}" for name in (
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libutil.so.1", "libz.so.1"))]
#: The environment in a root: PATH for unshare, mount and chroot (the root has none of them).
ROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/home", "TMPDIR": "/tmp"}


def make_root(tmp_path: Path, binary: Path, libraries: list[str] = SYSTEM_LIBRARIES) -> Path:
    """A root that holds the binary (``/ringserve``), ``libraries``, and the folders ``/tmp`` and ``/home``
    (anyone may write to them), ``/proc`` and ``/dev`` (empty: mount points)."""
    if os.geteuid() != 0:
        pytest.skip("the chroot and its mounts need root (CI runs as root)")
    root = tmp_path / "root"
    for folder in ("tmp", "proc", "home", "dev", "lib64", "lib/x86_64-linux-gnu"):
        (root / folder).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    (root / "home").chmod(0o777)
    for path in libraries:
        shutil.copy(path, root / path.lstrip("/"))  # with its mode: the loader must be executable
    shutil.copy(binary, root / "ringserve")
    return root


def chrooted(root: Path, *args: str, mounts: str = "mount --bind /dev/null {root}/dev/null", user: str = "") -> list[str]:
    """The command line that runs ``/ringserve ARGS`` in ``root``, after ``/proc`` and ``mounts`` (a shell
    command; ``{root}`` is the root), in a mount namespace of its own so that the mounts go with the process;
    as ``user`` (``UID:GID``), else root."""
    userspec = f"--userspec={user} " if user else ""
    script = f'mount -t proc proc {root}/proc && {mounts.format(root=root) or "true"} && exec chroot {userspec}{root} "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", script, "sh", "/ringserve", *args]


def test_it_serves_from_a_root_that_holds_only_the_c_library(binary, tmp_path, greedy_text):
    """In a chroot that holds the binary, glibc, zlib, ``/dev/null`` and ``/proc``, and nothing else (no
    Python, no shell, no compiler, no /usr): ready, the same greedy answer, a drain on SIGTERM."""
    root = make_root(tmp_path, binary)
    (root / "dev" / "null").touch()  # a mount point: llama-cpp-python opens /dev/null as it loads
    server = ServerProcess(chrooted(root, "serve", "--port", "0", "--log-level", "INFO"), env=ROOT_ENV,
                           inherit_env=False)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            events = stream(client, "POST", "/v1/messages", json=anthropic_body())
        assert anthropic_text(events) == greedy_text
        bootloader = int(Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()[0])
        os.kill(bootloader, signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert (root / "home" / ".local" / "share" / "ringserve" / "messages.sqlite3").is_file()
    assert list((root / "tmp").iterdir()) == []


NO_LIBM = [path for path in SYSTEM_LIBRARIES if not path.endswith("/libm.so.6")]
NO_ZLIB = [path for path in SYSTEM_LIBRARIES if not path.endswith("/libz.so.1")]


@pytest.mark.parametrize(("libraries", "mounts", "status", "message"), [
    # The bootloader's messages (docs/install.md, "What it runs on", keeps this list): it unpacks into
    # $TMPDIR, then loads libpython from there, and starts itself again with the unpacked libraries first
    # on its library path.
    (NO_LIBM, "", 255, r"\[PYI-\d+:ERROR\] Failed to load Python shared library '/tmp/_MEI\w+/libpython3\.11\.so\.1\.0': "
                       r"libm\.so\.6: cannot open shared object file: No such file or directory"),
    (NO_ZLIB, "", 127, r"/ringserve: error while loading shared libraries: libz\.so\.1: cannot open shared object file: "
                       r"No such file or directory"),
    (SYSTEM_LIBRARIES, "mount --bind -o ro {root}/tmp {root}/tmp", 255,
     r"\[PYI-\d+:ERROR\] Could not create temporary directory!"),
    (SYSTEM_LIBRARIES, "mount -t tmpfs -o noexec tmpfs {root}/tmp", 127,
     r"/ringserve: error while loading shared libraries: libz\.so\.1: failed to map segment from shared object"),
    (SYSTEM_LIBRARIES, "mount -t tmpfs -o size=60m tmpfs {root}/tmp", 255,
     r"\[PYI-\d+:ERROR\] Failed to extract entry: .*"),
], ids=["no libm", "no zlib", "read-only tmp", "noexec tmp", "full tmp"])
def test_what_the_root_lacks_gives_the_bootloaders_message(binary, tmp_path, libraries, mounts, status, message):
    root = make_root(tmp_path, binary, libraries)
    done = subprocess.run(chrooted(root, "--help", mounts=mounts), env=ROOT_ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == status, done.stderr
    assert re.fullmatch(message, done.stderr.strip().splitlines()[-1]), done.stderr


def test_a_root_without_dev_null_is_one_line_and_exit_2(binary, tmp_path):
    """As a user who cannot make one (root would create a plain file there): llama-cpp-python opens
    /dev/null as it loads, which was a traceback ending in a PermissionError."""
    root = make_root(tmp_path, binary)
    done = subprocess.run(chrooted(root, "serve", "--port", "0", mounts="", user="65534:65534"), env=ROOT_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "ringserve: /dev/null cannot be opened for writing (Permission denied), and llama-cpp-python needs it:"
        " the system (a chroot, a container image) must provide it"]


def test_ctrl_c_in_chat_cancels_the_generation_once(binary, clean, server):
    """Ctrl-C in a terminal signals the whole process group: PyInstaller's bootloader and the Python
    process, which the bootloader passes its copy on to. ``chat`` cancels the generation and exits 130,
    as the package does, instead of being interrupted again inside its cancel."""
    chat = subprocess.Popen(
        [str(binary), "chat", "--url", server.url, "--max-tokens", "200", "Write a long story about a dragon."],
        cwd=clean.cwd, env=clean.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert chat.stdout.read(1)  # the reply has begun
        os.killpg(chat.pid, signal.SIGINT)
        _, err = chat.communicate(timeout=60)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert chat.returncode == 130, err
    assert re.search(r"\[cancelled msg_\w+: cancelled, \d+ output tokens\]", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("to", ["bootloader", "both"])
def test_sigterm_drains_the_running_generation_and_exits_0(binary, tmp_path, config, to):
    """SIGTERM while a reply streams, sent to the bootloader alone (``docker stop``, ``kill PID``) or to it
    and the Python process (systemd's ``KillMode=control-group``, ``kill -- -PGID``): the drain begins
    while the request is open, the reply ends normally (within ``drain_timeout``), the process exits 0
    and removes what it unpacked."""
    own = Clean(tmp_path)
    server = ServerProcess([str(binary), "serve", "--config", str(config)], env=own.env,
                           inherit_env=False, cwd=own.cwd)
    try:
        children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        pids = [server.proc.pid, *map(int, children)] if to == "both" else [server.proc.pid]
        parser = SSEParser()
        events: list[ServerSentEvent] = []
        body = anthropic_body(64, "Write a long story about a dragon and a knight.")
        with httpx.Client(base_url=server.url, timeout=120) as client, client.stream("POST", "/v1/messages", json=body) as resp:
            for chunk in resp.iter_raw():
                if not events:
                    for pid in pids:
                        os.kill(pid, signal.SIGTERM)
                events += parser.feed(chunk)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert events[-1].event == "message_stop"  # a generation cut by the drain would end with an error event
    assert json.loads(next(e.data for e in events if e.event == "message_delta"))["delta"]["stop_reason"] == "max_tokens"
    message_id = events[0].id.split(":")[0]
    lines = [line for line in server.lines if "draining: refusing new generations" in line or message_id in line]
    assert "draining" in lines[0] and '"route":"/v1/messages"' in lines[1], lines  # the access log line comes at the end
    assert not any("second signal" in line for line in server.lines)
    assert list(own.tmp.iterdir()) == []
