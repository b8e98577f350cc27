"""The output parsers' cost per token, per model family (``ringserve/formats``).

For each family a reply of a thinking block (where the family has one), text, and one tool
call (:data:`EXAMPLES`, the form the family's call grammar forces) is cut into tokens of
``--chars`` characters (about an English BPE token) and fed to a fresh parser token by
token, ``--repeats`` times; the figure is the median of the total parsing time divided by
the tokens. The thinking block and the text are ``--words`` words each.

For comparison, the same reply re-parsed whole at every token (what llama.cpp does: its
``common_chat_peg_parse`` runs over the whole reply so far at each step) with the same parser:
the cost per token then grows with the reply.

Run from the repository root::

    .venv/bin/python bench/format_parsers.py [--words 300] [--chars 4] [--repeats 20]

Writes ``bench/results/format_parsers.json`` and ``.png``.
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

from bench.common import figure, machine, machine_line, save_figure, table, write_json  # noqa: E402
from ringserve.core.events import ToolSpec  # noqa: E402
from ringserve.formats.base import ChatFormat  # noqa: E402
from ringserve.formats.families import FAMILIES  # noqa: E402

WEATHER = ToolSpec("get_weather", "", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"],
}))
PYTHON = ToolSpec("python", "", json.dumps({"type": "object", "properties": {"code": {"type": "string"}},
                                            "required": ["code"]}))
TOOLS = [WEATHER, PYTHON]

EXAMPLES = {
    "generic": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "generic-think": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "qwen3-coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "seed-oss": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
                "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>",
    "glm-4.5": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "ling": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "minimax-m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                  '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
    "deepseek-r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek-v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek-v3.2": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                     "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    "deepseek-v4": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
                   '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                   '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                   "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "functionary-v3.1": '<function=get_weather>{"city": "Paris", "days": 3}</function>',
    "functionary-v3.2": 'get_weather\n{"city": "Paris", "days": 3}',
    "firefunction-v2": 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "granite-3": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    "command-r7b": '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
                   "<|END_ACTION|>",
    "cohere2-moe": '<|START_ACTION|>[{"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
                   "<|END_ACTION|>",
    "command-r-plus": 'Action:```json[{"tool_name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]```',
    "nemotron-nano-v2": '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</TOOLCALL>',
    "apriel": '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</tool_calls>',
    "minimax-m1": '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_calls>',
    "apertus": '<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}]<|tools_suffix|>',
    "llama-3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
    "gpt-oss": ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>',
    "gigachat-3": '<|message_sep|>function call<|role_sep|>{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"days": 3}}',
    "gigachat-3.1": '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "lfm2": '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
    "gemma-4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
}
"""One call of get_weather(city="Paris", days=3) in each family's syntax, the form its grammar
forces where it has one (tests/formats/test_families.py checks them)."""

_WORDS = ("the weather in Paris depends on the season so I should look it up with the tool and "
          "answer with the temperature and a short forecast for the next days").split()


def reply(name: str, fmt: ChatFormat, words: int) -> str:
    """A reply in ``fmt``'s syntax: thinking (if any), text, then the example call."""
    prose = " ".join(_WORDS[i % len(_WORDS)] for i in range(words))
    call = EXAMPLES[name]
    if name == "gpt-oss":
        return (f"<|channel|>analysis<|message|>{prose}<|end|><|start|>assistant<|channel|>commentary<|message|>"
                f"{prose}<|end|><|start|>assistant{call}")
    if name == "functionary-v3.2":
        return f"all\n{prose}>>>{call}"
    if name == "llama-3":
        return call  # a Llama 3.x call is the whole reply
    thinking = ""
    if fmt.reasoning is not None:
        thinking = f"{fmt.reasoning.start}{prose}{fmt.reasoning.end}\n"
    return f"{thinking}{prose}\n{call}"


def tokens(text: str, chars: int) -> list[str]:
    return [text[i : i + chars] for i in range(0, len(text), chars)]


def incremental(fmt: ChatFormat, pieces: list[str]) -> float:
    """Seconds to parse ``pieces`` token by token."""
    start = time.perf_counter()
    parser = fmt.parser(TOOLS)
    for piece in pieces:
        parser.feed(piece)
    parser.flush()
    return time.perf_counter() - start


def reparsed(fmt: ChatFormat, pieces: list[str]) -> float:
    """Seconds to parse the whole reply so far at every token (with a fresh parser each time)."""
    start = time.perf_counter()
    text = ""
    for piece in pieces:
        text += piece
        parser = fmt.parser(TOOLS)
        parser.feed(text)
        parser.flush()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=300, help="words of the thinking block and of the text")
    ap.add_argument("--chars", type=int, default=4, help="characters per token")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    info = machine()
    results = {}
    for name, fmt in FAMILIES.items():
        if name not in EXAMPLES:
            continue
        pieces = tokens(reply(name, fmt, args.words), args.chars)
        inc = statistics.median(incremental(fmt, pieces) for _ in range(args.repeats))
        whole = statistics.median(reparsed(fmt, pieces) for _ in range(max(1, args.repeats // 10)))
        results[name] = {"tokens": len(pieces), "us_per_token": inc / len(pieces) * 1e6,
                         "reparse_us_per_token": whole / len(pieces) * 1e6}
    print(machine_line(info))
    print(table(["family", "tokens", "µs/token", "re-parse µs/token"],
                [[n, str(r["tokens"]), f"{r['us_per_token']:.1f}", f"{r['reparse_us_per_token']:.0f}"]
                 for n, r in results.items()]))
    write_json("format_parsers", {"machine": info, "args": vars(args), "results": results})
    fig, axes = figure(width=12, height=4.5)
    ax = axes[0][0]
    names = list(results)
    ax.bar(names, [results[n]["us_per_token"] for n in names])
    ax.set_ylabel("µs per token (incremental)")
    ax.set_title(f"Output parser cost per token ({args.chars} chars/token, {args.words}+{args.words} words + 1 call)")
    ax.tick_params(axis="x", rotation=70)
    save_figure(fig, "format_parsers", info)


if __name__ == "__main__":
    main()
