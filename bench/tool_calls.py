"""Forced tool calls under the schema grammar: how many arguments fail to parse or validate.

For ``--calls`` random object schemas from :func:`random_schema` (strings, with
and without length bounds, numbers, integers, booleans, enums, nested objects,
arrays with item bounds, required fields; seeded), one request each on the
real model through a :class:`ringserve.engine.runner.Runner` owning a
:class:`ringserve.engine.llama.LlamaEngine`: the tool is forced (``NAMED``),
greedy, at most ``--max-tokens`` tokens, ``--slots`` requests decoded together.
Each reply's ``TOOL_CALL`` block is joined, parsed with ``json.loads`` and
validated with ``jsonschema`` against its schema.

Counted: calls whose arguments do not parse, do not validate, replies without
exactly one call, and replies cut by the token budget (those cannot parse and
are reported apart: the grammar does not shorten a reply to fit the budget).

Run from the repository root::

    .venv/bin/python bench/tool_calls.py [--calls 100] [--seed 0] [--slots 8]

Writes ``bench/results/tool_calls.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import trio

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, machine_line, table, write_json  # noqa: E402
from ringserve.config import EngineConfig  # noqa: E402
from ringserve.core.events import (  # noqa: E402
    BlockKind,
    ChatMessage,
    Finish,
    GenerationRequest,
    SamplingParams,
    StopReason,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
)
from ringserve.engine.runner import Runner  # noqa: E402

NAMES = ["name", "city", "count", "price", "tags", "when", "kind", "notes", "items", "owner", "size", "level"]
WORDS = ["red", "green", "blue", "small", "large", "fast", "slow", "north", "south", "open", "closed"]
PROMPTS = [
    "Book a table for four at an Italian restaurant in Rome tomorrow evening.",
    "Add three red apples and a loaf of bread to my shopping list.",
    "Create a ticket: the login page is slow for users in the north region.",
    "Record a blue bicycle, large size, owned by Ana, price 250.",
]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random object schema: 1..4 properties (1..3 nested), each required with probability 0.6."""
    names = rng.sample(NAMES, rng.randint(1, 4 if depth == 0 else 3))
    schema: dict[str, Any] = {"type": "object", "properties": {n: _random_value(rng, depth) for n in names}}
    required = [n for n in names if rng.random() < 0.6]
    if required:
        schema["required"] = required
    return schema


def _random_value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "bounded", "number", "integer", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"]
    match rng.choice(kinds):
        case "bounded":
            return {"type": "string", "minLength": rng.randint(1, 3), "maxLength": rng.randint(4, 16)}
        case "enum":
            return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
        case "object":
            return random_schema(rng, depth + 1)
        case "array":
            item = _random_value(rng, 2)
            low = rng.randint(0, 2)
            return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(1, 2)}
        case simple:
            return {"type": simple}


def request(rng: random.Random, max_tokens: int) -> tuple[GenerationRequest, dict[str, Any]]:
    """One forced call of a tool with a random schema, and that schema."""
    schema = random_schema(rng)
    tool = ToolSpec("record", "Record the details of the user's request.", json.dumps(schema))
    req = GenerationRequest(
        (ChatMessage("user", rng.choice(PROMPTS)),),
        max_tokens,
        SamplingParams(temperature=0),
        tools=(tool,),
        tool_choice=ToolChoice(ToolChoiceMode.NAMED, "record"),
    )
    return req, schema


async def run_calls(runner: Runner, calls: int, seed: int, max_tokens: int, *, progress: bool = False) -> dict[str, Any]:
    """Run ``calls`` forced calls on a running runner; return the counts and every failure
    (``progress``: a line per call on stderr)."""
    counts = {"calls": calls, "ok": 0, "unparsable": 0, "invalid": 0, "not_one_call": 0, "truncated": 0}
    failures: list[dict[str, Any]] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        req, schema = request(random.Random(seed * 100_003 + i), max_tokens)
        async with runner.submit(await runner.prepare(req)) as gen:
            content, terminal = await gen.collect()
        tokens += terminal.usage.output_tokens
        found = [b for b in content if b.kind is BlockKind.TOOL_CALL]
        problem = None
        if isinstance(terminal, Finish) and terminal.stop_reason in (StopReason.MAX_TOKENS, StopReason.CONTEXT_FULL):
            problem = "truncated"
        elif len(found) != 1 or not isinstance(terminal, Finish) or terminal.stop_reason is not StopReason.TOOL_USE:
            problem = "not_one_call"
        else:
            try:
                jsonschema.validate(json.loads(found[0].text), schema)
            except json.JSONDecodeError:
                problem = "unparsable"
            except jsonschema.ValidationError:
                problem = "invalid"
        if progress:
            print(f"call {i}: {problem or 'ok'} ({terminal.usage.output_tokens} tokens)", file=sys.stderr, flush=True)
        if problem is None:
            counts["ok"] += 1
        else:
            counts[problem] += 1
            failures.append({"i": i, "problem": problem, "schema": schema, "content": [b.text for b in content]})

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(calls):
            nursery.start_soon(one, i)
    seconds = time.perf_counter() - started
    return {**counts, "output_tokens": tokens, "seconds": seconds, "failures": failures}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from ringserve.engine.llama import LlamaEngine  # the real model only here
    from ringserve.engine.modelfile import default_model_path

    engine = LlamaEngine(args.model or default_model_path(), n_slots=args.slots, n_ctx=args.slots * 1024, n_batch=1024)
    try:
        runner = Runner(engine, EngineConfig(slots=args.slots, queue_size=args.calls))
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            result = await run_calls(runner, args.calls, args.seed, args.max_tokens, progress=True)
            nursery.cancel_scope.cancel()
    finally:
        engine.close()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    info = machine()
    result = trio.run(_main, args)
    keys = ("calls", "ok", "unparsable", "invalid", "not_one_call", "truncated")
    print(machine_line(info))
    print(table(keys, [[str(result[k]) for k in keys]]))
    print(f"{result['output_tokens']} tokens in {result['seconds']:.0f} s")
    write_json("tool_calls", {"args": vars(args), "machine": info, **result})
    return result


if __name__ == "__main__":
    main()
