"""Hugging Face stand-ins for tests: a cache laid out as ``huggingface_hub`` lays it out
(:func:`cache_repo`), and a local HTTP server that answers the Hub endpoints ``huggingface_hub``
calls to download (:class:`FakeHub`), so no test touches the network.

The endpoints (huggingface_hub 2.x: ``HfApi.model_info``, ``file_download.get_hf_file_metadata``
and ``http_get``):

* ``GET /api/models/{repo}/revision/{revision}`` (``?blobs=true``): the repository's commit
  (``sha``) and files (``siblings``: ``rfilename``, ``size``, ``blobId``, and ``lfs`` with
  ``sha256``, ``size`` and ``pointerSize``);
* ``HEAD`` and ``GET /{repo}/resolve/{revision}/{file}``: the file, with the headers the
  downloader reads: ``X-Repo-Commit``, ``ETag`` and ``X-Linked-Etag`` (an LFS file's SHA-256),
  ``X-Linked-Size``, ``Content-Length``; a ``Range: bytes=N-`` request gets a 206 from byte N.

Errors come with the ``X-Error-Code`` header ``huggingface_hub.utils.hf_raise_for_status`` reads
(``RepoNotFound``, ``GatedRepo``, ``EntryNotFound``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import attrs

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: Mapping[str, bytes], *, commit: str = COMMIT,
               ref: str | None = "main") -> Path:
    """Lay ``files`` (path in the repository -> bytes) out in the cache ``cache`` as
    ``huggingface_hub`` does: blobs named by their SHA-256, the snapshot of ``commit`` linking to
    them, and ``refs/REF`` naming the commit. Returns the snapshot folder."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@attrs.define(eq=False)
class FakeHub:
    """A Hub of model repositories in memory, served on ``127.0.0.1`` by :meth:`serving`.

    Attributes:
        repos: repository -> {path in it: bytes}.
        gated: repositories that answer only a request with ``Authorization: Bearer <token>``.
        token: the token the gated ones take.
        corrupt: path -> the bytes served for it instead of its own (its metadata and ETag stay its
            own's: a mirror or a proxy that damaged it).
        drop_after: path -> bytes after which the next GET of it is cut (once).
        gets: (path, Range header or "") of every GET of a file, in order.
    """

    repos: dict[str, dict[str, bytes]]
    gated: set[str] = attrs.Factory(set)
    token: str = "hf_test_token"
    corrupt: dict[str, bytes] = attrs.Factory(dict)
    drop_after: dict[str, int] = attrs.Factory(dict)
    gets: list[tuple[str, str]] = attrs.Factory(list)
    url: str = ""

    @contextmanager
    def serving(self) -> Iterator[FakeHub]:
        """Serve on a free port (:attr:`url`) until the block ends."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, head=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
            thread.join()

    def _error(self, handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _answer(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (info or resolve)[1] if (info or resolve) else ""
        if repo not in self.repos:
            return self._error(handler, 401, "RepoNotFound")
        if repo in self.gated and handler.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(handler, 401, "GatedRepo")
        files = self.repos[repo]
        if info is not None:
            siblings = [{"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest(),
                         "lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                 "pointerSize": 134}}
                        for name, data in files.items()]
            body = json.dumps({"id": repo, "sha": COMMIT, "siblings": siblings}).encode()
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return None
        assert resolve is not None
        name = resolve[3]
        if name not in files:
            return self._error(handler, 404, "EntryNotFound")
        etag = f'"{hashlib.sha256(files[name]).hexdigest()}"'
        data = self.corrupt.get(name, files[name])
        start = 0
        ranged = handler.headers.get("Range", "")
        if match := re.fullmatch(r"bytes=(\d+)-", ranged):
            start = int(match[1])
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", etag)
        handler.send_header("X-Linked-Etag", etag)
        handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if head:
            return None
        self.gets.append((name, ranged))
        cut = self.drop_after.pop(name, None)
        if cut is not None:
            handler.wfile.write(data[start:start + cut])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)  # mid-body: the client sees the connection end early
            return None
        handler.wfile.write(data[start:])
        return None
