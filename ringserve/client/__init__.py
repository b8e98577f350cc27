"""A Python client for ringserve whose streams survive drops: sync :class:`Client`, Trio :class:`AsyncClient`.

Both stream one message, on the Anthropic surface (``POST /v1/messages``),
OpenAI Chat Completions (``POST /v1/chat/completions``), OpenAI Responses
(``POST /v1/responses``), or an existing message (``GET
/v1/messages/{id}/stream``), and hand out each event exactly once, with the
text, reasoning and tool-call pieces it adds::

    with Client("http://127.0.0.1:8080") as client:
        with client.stream("Say hello in French.", max_tokens=64) as stream:
            for text in stream.text_stream:
                print(text, end="", flush=True)
            final = stream.final_message()      # FinalMessage: text, stop_reason, usage, tool_calls

    async with AsyncClient(url) as client:       # under trio.run
        async with client.stream(prompt, surface="responses") as stream:
            async for text in stream.text_stream: ...
            final = await stream.final_message()

The package (httpcore's layout): ``_models.py`` and ``_errors.py`` hold the
values and errors; ``_wires.py`` reads each surface, chosen by its name;
``_resume.py`` is the resume core, which takes bytes and returns values (no
I/O, a :class:`Phase` table); ``_trio.py`` is the Trio shell and ``_sync.py``
the sync shell generated from it; ``cli.py`` the ``chat`` and ``tail``
commands. It imports nothing of the server but ``ringserve.core``.

How a stream resumes (the decisions live in :class:`ResumeState`; the two
shells only send what it asks for and feed it what arrives):

* The POST stream itself is the first connection; no ``Prefer:
  respond-async`` round trip first. The message id comes from its
  ``X-Message-Id`` header (or the first event's id). The POST carries an
  ``Idempotency-Key``, so a POST that fails before its answer names the
  message is sent again and gets the same message, replayed from the start.
  It also carries ``Ringserve-Disconnect-Policy: continue``, so a dropped
  connection does not cancel the generation; leaving the stream early
  instead cancels it explicitly (``POST /v1/messages/{id}/cancel``).
* A stream ends only at its terminal event: Anthropic ``message_stop`` or
  ``error``, OpenAI ``[DONE]`` or ``{"error": ...}``, Responses
  ``response.completed``, ``.incomplete`` or ``.failed``. A network error, an
  idle read timeout or a stream that closes before its terminal event is a
  drop: the client waits (exponential backoff with full jitter, see
  :class:`Backoff`; at least ``Retry-After`` on 429/503/529) and reconnects
  with ``GET /v1/messages/{id}/stream`` and ``Last-Event-ID: <id>:<seq>``.
* Event ids are ``<message_id>:<seq>`` with ``seq`` 0, 1, 2, ...; an event
  whose seq was already delivered is dropped, and a seq that skips ahead is
  an error (it would be a gap in the text).
* When the stream log has expired or no longer holds the next event (410),
  or the stream has ended at the last event received (204), the client reads
  the stored message instead (``GET /v1/messages/{id}``; a response's
  ``GET /v1/responses/{id}``): it delivers what was not streamed yet as one
  ``"fallback"`` event and polls while the message is still generating.
* ``follow(message_id)`` without a ``surface`` first reads
  ``GET /v1/messages/{id}``, whose ``surface`` names the wire to read.
* An in-band error event raises :class:`StreamError`. HTTP errors that a
  retry cannot fix raise :class:`APIError`; more than ``max_retries``
  consecutive failed attempts without progress raise :class:`ConnectionLost`.
  A refused connection before the client's server has ever answered it
  raises :class:`NoServer` at once (nothing listens at the URL); after the
  first answer it is a drop like any other (a server restarting).

Timeouts (seconds): ``idle_timeout`` is the longest silence allowed on a
connection between any two reads, heartbeats (``: ping``) included; hitting
it counts as a drop. ``timeout`` bounds the whole stream, every reconnect and
backoff wait included, and raises :class:`RequestTimeout`. The async client
enforces it exactly (a Trio cancel scope around each step); the sync client
checks it between reads and bounds every connect and read by the time left,
so it may end up to one ``idle_timeout`` late. Cancellation by an enclosing
Trio scope leaves an async stream unusable; leaving its ``async with`` block
then still cancels an owned, unfinished generation (shielded, at most 5 s).

Wire formats read here: ringserve's event streams (README "Talking to it", docs/api.md),
Anthropic "Streaming Messages", OpenAI "Chat Completions" streaming, the
OpenAI Responses streaming events, and WHATWG HTML "Server-sent events"
(decoded by ``ringserve.core.sse.SSEParser``, the server's own parser).
"""

from ringserve.client._errors import (
    APIError,
    ClientError,
    ConnectionLost,
    NoServer,
    RequestTimeout,
    StreamError,
)
from ringserve.client._models import (
    Backoff,
    FinalMessage,
    Reconnect,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from ringserve.client._resume import Phase, PhaseError, ResumeState
from ringserve.client._shell import DEFAULT_URL
from ringserve.client._sync import Client, MessageStream
from ringserve.client._trio import AsyncClient, AsyncMessageStream
from ringserve.client._wires import message_path

__all__ = [
    "DEFAULT_URL",
    "APIError",
    "AsyncClient",
    "AsyncMessageStream",
    "Backoff",
    "Client",
    "ClientError",
    "ConnectionLost",
    "FinalMessage",
    "MessageStream",
    "NoServer",
    "Phase",
    "PhaseError",
    "Reconnect",
    "RequestTimeout",
    "ResumeState",
    "StreamError",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "message_path",
]
