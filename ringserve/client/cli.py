"""Terminal commands on :mod:`ringserve.client`: ``ringserve chat "PROMPT"`` and ``ringserve tail MESSAGE_ID``.

``chat`` creates a message and streams its text to stdout as it arrives;
``tail`` follows an existing message from its first event. Both resume by
themselves after a dropped connection (reconnects are noted on stderr), and
end with a summary line on stderr. Ctrl-C in ``chat`` cancels the generation
on the server (``POST /v1/messages/{id}/cancel``); in ``tail`` it only stops
following.

Exit status: 0 done, 1 a client error (the message is on stderr; at once, in one line, when nothing
listens at the URL), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from ringserve.client import (
    DEFAULT_URL,
    APIError,
    Client,
    ClientError,
    FinalMessage,
    MessageStream,
    NoServer,
    Reconnect,
)
from ringserve.client._wires import WIRES
from ringserve.core.errors import key_refused


def add_commands(sub: Any) -> None:
    """Register ``chat`` and ``tail`` on the CLI's subparsers; each sets ``client_command``."""
    chat = sub.add_parser("chat", help="stream a reply to PROMPT into the terminal")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--surface", choices=tuple(WIRES), default="anthropic",
                      help="API surface to use (default anthropic)")
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate (default 512)")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--temperature", type=float, help="sampling temperature")
    chat.set_defaults(client_command=run_chat)
    tail = sub.add_parser("tail", help="follow an existing message's stream")
    tail.add_argument("message_id", help="the message id (msg_..., chatcmpl-... or resp_...)")
    tail.set_defaults(client_command=run_tail)
    for parser in (chat, tail):
        parser.add_argument("--url", default=os.environ.get("RINGSERVE_URL", DEFAULT_URL),
                            help=f"server URL (default $RINGSERVE_URL or {DEFAULT_URL})")
        parser.add_argument("--api-key", default=os.environ.get("RINGSERVE_API_KEY"),
                            help="API key (default $RINGSERVE_API_KEY)")
        parser.add_argument("--timeout", type=float, default=600.0,
                            help="seconds the whole reply may take, reconnects included (default 600)")
        parser.add_argument("--idle-timeout", type=float, default=60.0,
                            help="seconds of silence before a connection counts as dropped (default 60)")


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, api_key=args.api_key, timeout=args.timeout, idle_timeout=args.idle_timeout)


def _note(err: TextIO) -> Any:
    def on_reconnect(reconnect: Reconnect) -> None:
        print(f"\n[{reconnect.cause}; reconnecting in {reconnect.delay:.2f} s]", file=err, flush=True)

    return on_reconnect


def _failed(exc: ClientError, args: argparse.Namespace, err: TextIO) -> int:
    """Say why the stream failed, in one line on ``err``; the exit status, 1."""
    if isinstance(exc, NoServer):
        line = (f"nothing listens at {args.url} (connection refused): start the server (ringserve serve), or "
                "give its URL (--url or $RINGSERVE_URL)")
    elif isinstance(exc, APIError) and exc.status == 401:
        line = key_refused(args.url, "--api-key or $RINGSERVE_API_KEY" if args.api_key else None)
    else:
        line = str(exc)
    print(f"\nringserve: {line}" if exc.text else f"ringserve: {line}", file=err)
    return 1


def _print_stream(stream: MessageStream, out: TextIO, err: TextIO) -> FinalMessage:
    for text in stream.text_stream:
        out.write(text)
        out.flush()
    final = stream.final_message()
    out.write("\n")
    out.flush()
    print(f"[{final.id}: {final.stop_reason}, {final.usage.input_tokens} input tokens, "
          f"{final.usage.output_tokens} output tokens]", file=err)
    return final


def run_chat(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """``ringserve chat``: stream the reply; Ctrl-C cancels the generation on the server."""
    params: dict[str, Any] = {} if args.temperature is None else {"temperature": args.temperature}
    with _client(args) as client:
        stream = client.stream(args.prompt, surface=args.surface, max_tokens=args.max_tokens,
                               system=args.system, on_reconnect=_note(err), **params)
        with stream:
            try:
                _print_stream(stream, out, err)
            except KeyboardInterrupt:
                status = stream.cancel()
                if status is None:
                    print("\n[cancelled before the server answered]", file=err)
                else:
                    usage = status.get("usage") or {}
                    print(f"\n[cancelled {stream.message_id}: {status.get('status')}, "
                          f"{usage.get('output_tokens', 0)} output tokens]", file=err)
                return 130
            except ClientError as exc:
                return _failed(exc, args, err)
    return 0


def run_tail(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """``ringserve tail``: print a message's text from its first event to its end."""
    with _client(args) as client, client.follow(args.message_id, on_reconnect=_note(err)) as stream:
        try:
            _print_stream(stream, out, err)
        except KeyboardInterrupt:
            return 130
        except ClientError as exc:
            return _failed(exc, args, err)
    return 0
