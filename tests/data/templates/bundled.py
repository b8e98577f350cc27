"""Regenerate ``bundled.json``: llama-server's prompts and token ids for the bundled model.

The reference for ``tests/engine/test_engine_llama.py`` (``test_prompts_are_llama_servers``):
for each conversation of :data:`REQUESTS`, llama-server's ``POST /apply-template`` prompt for
the bundled SmolLM2 GGUF's own chat template, and ``POST /tokenize`` of that prompt as
llama-server tokenizes a prompt (special tokens parsed, BOS added if the vocabulary asks), as
one string of space-separated ids.
Start llama-server (built as ``generate.py`` says) on the bundled model, then::

    llama-server -m "$(python -c 'from ringserve.engine.modelfile import default_model_path as p; print(p())')" \\
        --jinja --port 8080 &
    python tests/data/templates/bundled.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent

REQUESTS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Name three fruits."}],
    "prefill": [{"role": "user", "content": "Count from 1 to 10."}, {"role": "assistant", "content": "1, 2, 3,"}],
    "unicode": [{"role": "user", "content": "Translate 🎉 and 日本語 and 😀👍🏽 please"}],
}
"""The conversations, in the OpenAI shape llama-server takes."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="llama-server's base URL")
    parser.add_argument("--out", type=Path, default=HERE / "bundled.json")
    args = parser.parse_args()
    out = {}
    with httpx.Client(base_url=args.url, timeout=60) as client:
        for name, messages in REQUESTS.items():
            prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
            tokens = client.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
            ids = " ".join(str(t) for t in tokens.json()["tokens"])
            out[name] = {"messages": messages, "prompt": prompt, "tokens": ids}
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
