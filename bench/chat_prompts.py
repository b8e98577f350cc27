"""The cost of a request's prompt: rendering the chat template and tokenizing, per request.

``LlamaEngine.tokenize_chat`` on the bundled model's vocabulary (what ``Runner.prepare`` runs on
the tokenizer's thread, beside decoding) for three requests: ``short`` (a system and a user
turn), ``tools`` (two tools, a call and its result, four turns) and ``long`` (42 turns, about
25,000 characters); with the GGUF's own template (SmolLM2's: its generic format renders tools
with ringserve's tools prompt) and with corpus templates given as ``[model]
chat_template_file`` would (``--templates``: llama.cpp's ``models/templates`` folder; the
families then render the tools themselves). The figure is the median of ``--repeats``
calls, in milliseconds.

Run from the repository root::

    .venv/bin/python bench/chat_prompts.py [--templates DIR] [--repeats 50]

Writes ``bench/results/chat_prompts.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, machine_line, table, write_json  # noqa: E402
from ringserve.core.events import ChatMessage, GenerationRequest, ToolCall, ToolSpec  # noqa: E402
from ringserve.engine.llama import LlamaEngine  # noqa: E402
from ringserve.engine.modelfile import default_model_path  # noqa: E402

TEMPLATES = ("Qwen-Qwen3-0.6B", "openai-gpt-oss-120b", "meta-llama-Llama-3.1-8B-Instruct",
             "Mistral-Small-3.2-24B-Instruct-2506", "GLM-4.6", "deepseek-ai-DeepSeek-V3.1")
"""Corpus templates measured besides the GGUF's own."""

_WEATHER = ToolSpec("get_weather", "Current weather in a city.", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}))
_TIME = ToolSpec("get_time", "Local time in a city.", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
_CALL = ToolCall("call_0123456789abcdef01234567", "get_weather", '{"city": "Paris"}')

REQUESTS = {
    "short": GenerationRequest((ChatMessage("system", "Be brief."), ChatMessage("user", "What is the capital of France?")),
                               None),
    "tools": GenerationRequest((
        ChatMessage("system", "You help with travel."), ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=(_CALL,)), ChatMessage("tool", "Sunny, 21 C", tool_call_id=_CALL.call_id),
    ), None, tools=(_WEATHER, _TIME)),
    "long": GenerationRequest(tuple(
        [ChatMessage("system", "You are a careful assistant.")]
        + [ChatMessage("user" if i % 2 == 0 else "assistant", f"Turn {i}: " + "a sentence of some words. " * 23)
           for i in range(41)]
    ), None),
}


def timed(engine: LlamaEngine, request: GenerationRequest, repeats: int) -> tuple[float, int]:
    """Median milliseconds of ``tokenize_chat`` and the prompt's tokens."""
    times = []
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = len(engine.tokenize_chat(request).tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", type=Path, help="llama.cpp's models/templates folder")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    info = machine()
    print(machine_line(info))
    sources: dict[str, str | None] = {"GGUF (SmolLM2)": None}
    if args.templates is not None:
        sources |= {name: (args.templates / f"{name}.jinja").read_text() for name in TEMPLATES}
    rows, results = [], {}
    for name, source in sources.items():
        engine = LlamaEngine(default_model_path(), n_slots=1, n_ctx=8192, n_batch=64, chat_template=source)
        try:
            figures = {kind: timed(engine, request, args.repeats) for kind, request in REQUESTS.items()}
        finally:
            engine.close()
        results[name] = {"family": engine.chat_format.name,
                         **{kind: {"ms": ms, "tokens": n} for kind, (ms, n) in figures.items()}}
        rows.append([name, engine.chat_format.name, *(f"{ms:.2f} ({n})" for ms, n in figures.values())])
    print(table(["template", "family", *(f"{kind} ms (tokens)" for kind in REQUESTS)], rows))
    print(f"wrote {write_json('chat_prompts', {'machine': info, 'repeats': args.repeats, 'results': results})}")


if __name__ == "__main__":
    main()
