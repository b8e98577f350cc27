"""A scripted, deterministic engine for protocol, fault and load tests.

:class:`FakeEngine` implements :class:`ringserve.engine.protocol.Engine`
without a model. It keeps honest books, so tests can check what the runner
did to it:

* The prompt is the chat rendered as ``"<|role|>content\\n"`` lines and
  tokenized one token per UTF-8 byte (token id = byte value, 0..255).
* Each slot's KV cells are the tokens fed to it; :meth:`kv_cells_used`
  counts them. :meth:`begin` and :meth:`release` cut them to their first
  ``keep`` (the prompt-prefix cache), and :meth:`begin` with a ``source``
  copies that slot's cells first; every call is recorded in
  :attr:`FakeEngine.begins`. A batch keeps the rules of
  :func:`~ringserve.engine.protocol.check_feeds`, as on ``engine/llama.py``:
  positions continue the sequence, a slot is begun before it is fed, a batch
  holds at most ``n_batch`` tokens and one feed per slot (else
  ``ValueError``), a sequence never holds more than ``n_ctx_seq`` tokens
  (else :class:`KVCacheFull` for that slot), and the slots' cells, the
  cached ones of released slots included, never more than the pool's
  ``n_ctx`` (else :class:`KVCacheFull` for every fed slot, as
  ``llama_decode`` finds no cells).
* The reply is chosen when a slot's prompt is complete (its first sample),
  from the prompt bytes in its KV cells: the last user message's text after
  ``"echo:"`` if it starts so, else ``reply`` (a str, or a callable taking
  the last user message's text), else :data:`DEFAULT_REPLY`. It is model
  text: with a ``chat_format``, the runner reads it with that family's parser,
  so it may hold the family's thinking block and tool calls, written as the
  model writes them. Its UTF-8 bytes are cut into tokens of ``piece_bytes``
  bytes (or by ``split``), so multi-byte characters and markers are split
  across tokens, then one EOG token (empty piece) ends it. Sampling
  parameters are accepted and ignored; a slot begun with ``logprobs`` gets
  each token's :func:`fake_logprob`. A slot begun with a ``constraint``
  (a forced tool call, JSON output) replies the constraint's example
  instead: a text its grammar accepts, made from the schema on the decode
  thread, a call in the family's syntax
  (:func:`ringserve.engine.examples.example`). A slot begun with
  :class:`~ringserve.engine.gbnf.LazyCalls` replies the scripted text, but
  a :class:`~ringserve.engine.gbnf.CallWatch` follows it as on the real
  engine: each grammar it puts on or takes off is recorded in
  :attr:`FakeEngine.switches`, and when one goes on, the rest of the scripted
  unit of calls (as the family's parser reads it, or all the rest if it does
  not end) is replaced by that grammar's example, as a grammar would force a
  valid call (unless ``grammar_examples`` is False: then the script is
  played as written, a script of calls its grammar accepts, as the agents'
  tests write). A token forced by the runner (a reasoning budget's closing
  marker) comes back as sampled, and the script goes on after that text.
* The chat's tools and tool turns are rendered as text first
  (:func:`ringserve.core.toolcalls.plain_messages`), as on the real engine
  for a template without a call syntax; or by ``chat_template``.
* A failed :meth:`decode` changes nothing (no KV cells, no reply progress),
  so the runner may feed the same batch again.

Every decode call is appended to :attr:`FakeEngine.log` (its feeds and
whether it raised), so tests can see which slots were fed at which step, and
:attr:`FakeEngine.prefilled` counts the prompt tokens fed per slot.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from ringserve.core.batch import Sampled, SlotFeed
from ringserve.core.events import ChatMessage, GenerationRequest, TokenLogprob, TopLogprob
from ringserve.core.sampling import ResolvedSampling
from ringserve.core.toolcalls import CallEnd, Text, ToolCallError, plain_messages
from ringserve.engine.examples import example
from ringserve.engine.gbnf import CallWatch, Constraint, GrammarOff, GrammarOn, LazyCalls
from ringserve.core.offload import Offload
from ringserve.engine.protocol import ChatPrompt, EngineError, KVCacheFull, check_feeds
from ringserve.formats.base import ChatFormat
from ringserve.formats.detect import detect
from ringserve.formats.families import FAMILIES
from ringserve.formats.prompt import render_request
from ringserve.formats.template import ChatTemplate, TemplateRenderError

__all__ = ["DEFAULT_REPLY", "EOG_TOKEN", "Begin", "DecodeCall", "FakeEngine", "Switched", "fake_logprob"]

DEFAULT_REPLY = "The quick brown fox jumps over the lazy dog."
"""The reply when the request is not an ``echo:`` and no ``reply`` was given."""

EOG_TOKEN = 256
"""Token id of the fake end-of-generation token (its piece is empty)."""

_USER_MARK = "<|user|>"


def fake_logprob(piece: bytes, sample: int, n_top: int) -> TokenLogprob:
    """The fake's log probabilities of the token ``piece``, its slot's sample number ``sample``
    (0-based), with ``n_top`` alternatives: it is the most likely, of probability 1/2, 1/4 or 1/8
    in turn, and the alternative ``k`` (``b"alt<k>"`` after it) has half the probability of the one
    before it."""
    logprob = -math.log(2) * (1 + sample % 3)
    top = [TopLogprob(piece, logprob), *(TopLogprob(f"alt{k}".encode(), logprob - k * math.log(2))
                                         for k in range(1, n_top))]
    return TokenLogprob(piece, logprob, tuple(top[:n_top]))


@attrs.frozen
class DecodeCall:
    """One :meth:`FakeEngine.decode` call as the fake saw it.

    Attributes:
        index: 0-based count of decode calls.
        feeds: the batch.
        error: the exception's class name if the call raised, else None.
    """

    index: int
    feeds: tuple[SlotFeed, ...]
    error: str | None = None

    @property
    def slots(self) -> tuple[int, ...]:
        """Slots fed in this call."""
        return tuple(f.slot for f in self.feeds)


@attrs.frozen
class Begin:
    """One :meth:`FakeEngine.begin` call: the slot, the cells it kept, where they came from,
    its constraint; its sampler settings and how many prompt tokens it was given (not compared)."""

    slot: int
    keep: int
    source: int | None
    constraint: Constraint | LazyCalls | None = None
    sampling: ResolvedSampling | None = attrs.field(default=None, eq=False)
    prompt_tokens: int = attrs.field(default=0, eq=False)


@attrs.frozen
class Switched:
    """A tool call's grammar put on or taken off a slot's sampler (:class:`LazyCalls`),
    right after the slot's sample number ``sample`` (1-based)."""

    slot: int
    sample: int
    switch: GrammarOn | GrammarOff


@attrs.define(eq=False)
class _SlotState:
    kv: list[int] = attrs.Factory(list)
    pieces: list[bytes] | None = None
    samples: int = 0
    begun: bool = True
    constraint: Constraint | LazyCalls | None = None
    watch: CallWatch | None = None
    logprobs: int | None = None


def _after_unit(calls: LazyCalls, script: str) -> str:
    """What a scripted reply holds after the unit of calls it starts with (at its trigger): the
    format's parser, fed it a character at a time, completes a call and then gives text or
    opens the next unit. Nothing where units hold several calls (the grammar then stays on,
    and only lets the reply end after the unit) or the unit does not end."""
    if not calls.one_call_units:
        return ""
    parser = calls.chat_format.parser(calls.tools)
    ended = False
    for i, char in enumerate(script):
        try:
            pieces = parser.feed(char)
        except ToolCallError:
            return ""
        for piece in pieces:
            if isinstance(piece, CallEnd):
                ended = True
            elif ended and isinstance(piece, Text):
                return script[i + 1 - len(piece.text) :]
        if ended and parser.in_call:
            return script[script.rfind(calls.trigger, 0, i + 1) :]
    return ""


def _last_user_text(prompt: bytes) -> str:
    text = prompt.decode("utf-8", "replace")
    i = text.rfind(_USER_MARK)
    if i < 0:
        return ""
    rest = text[i + len(_USER_MARK) :]
    j = rest.find("\n<|")
    if j >= 0:
        rest = rest[:j]
    elif rest.endswith("\n"):
        rest = rest[:-1]
    return rest


class FakeEngine:
    """A deterministic :class:`~ringserve.engine.protocol.Engine` with scripted faults.

    Args:
        n_slots: sequences decoded together.
        n_ctx: KV cells (tokens) of the pool the slots share (the default: four slots of
            4,096 tokens, ringserve's default before the pool).
        n_ctx_seq: most cells one sequence holds; None: ``n_ctx``.
        n_batch: most tokens per decode call.
        piece_bytes: bytes per reply token (>= 1).
        split: cuts a reply's UTF-8 bytes into its tokens' pieces (tests give random
            splits); None: ``piece_bytes`` each.
        step_seconds: blocking sleep in every decode call (seconds).
        prefill_seconds: blocking sleep once per prompt fed from position 0,
            in the decode call that feeds its first chunk (seconds); a prompt
            whose prefix came from the cache skips it.
        fail_after_tokens: a slot's sample number ``fail_after_tokens + 1``
            raises :class:`EngineError` naming that slot (nothing in the batch
            is applied). None: never.
        crash_after_steps: decode call number ``crash_after_steps + 1``
            (1-based) raises ``RuntimeError``, once, as a bug would. None: never.
        reply: the reply text, or a callable from the last user message's
            text to it; None: :data:`DEFAULT_REPLY`. ``echo:`` requests
            ignore it.
        tokenize_hook: called (blocking) on the tokenizing thread at the
            start of every :meth:`tokenize_chat`, e.g. a
            ``threading.Event.wait`` that scripts a slow tokenizer. None: none.
        grammar_examples: when a lazy call grammar goes on, the rest of the scripted call is
            that grammar's example (True), or as scripted (False).
        record: keep every decode call in :attr:`log`, every begin in :attr:`begins` and
            every grammar switch in :attr:`switches`, for the tests that read them; False
            for a long run, which they would grow without bound (``bench/fake_server.py``:
            about 13 KiB per short response).
        chat_format: the name of the model family whose output format the runner reads
            the replies with (:data:`~ringserve.formats.families.FAMILIES`); None: the one
            detected from ``chat_template``, else ``generic``.
        chat_template: a chat template's Jinja source: the prompt is then rendered with it
            (:func:`~ringserve.formats.prompt.render_request`) and tokenized one token per
            byte; None: the ``"<|role|>content\\n"`` lines.
        generation_prompt: text after those lines (``"<think>\\n"`` opens the thinking
            block of a ``<think>`` format).

    Thread safety: every method but :meth:`tokenize_chat` takes one lock, so
    a test may read :meth:`kv_cells_used` while the runner's worker thread
    decodes; :meth:`tokenize_chat` reads no state, like llama.cpp's
    tokenizer, and may run while another thread decodes.
    """

    max_token_bytes = 1
    """Bytes of message text one prompt token stands for, at most (one token per byte)."""
    n_vocab = 1 << 16
    """Token ids: the bytes, :data:`EOG_TOKEN`, then the reply pieces of more than one byte."""
    offload = Offload(0, 0)
    """No layers and no GPU device."""

    def __init__(
        self,
        *,
        n_slots: int = 4,
        n_ctx: int = 16384,
        n_ctx_seq: int | None = None,
        n_batch: int = 512,
        piece_bytes: int = 4,
        split: Callable[[bytes], list[bytes]] | None = None,
        step_seconds: float = 0.0,
        prefill_seconds: float = 0.0,
        fail_after_tokens: int | None = None,
        crash_after_steps: int | None = None,
        reply: str | Callable[[str], str] | None = None,
        tokenize_hook: Callable[[], object] | None = None,
        grammar_examples: bool = True,
        record: bool = True,
        chat_format: str | None = None,
        chat_template: str | None = None,
        generation_prompt: str = "",
    ) -> None:
        if n_slots < 1 or n_ctx < 1 or n_batch < 1 or piece_bytes < 1:
            raise ValueError("n_slots, n_ctx, n_batch and piece_bytes must be >= 1")
        self.model_id = "fake"
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.n_ctx_seq = n_ctx if n_ctx_seq is None else min(n_ctx_seq, n_ctx)
        self.n_batch = n_batch
        self.piece_bytes = piece_bytes
        self.split = split
        self.step_seconds = step_seconds
        self.prefill_seconds = prefill_seconds
        self.fail_after_tokens = fail_after_tokens
        self.crash_after_steps = crash_after_steps
        self.reply = reply
        self.tokenize_hook = tokenize_hook
        self.grammar_examples = grammar_examples
        self.prefix_cache = True
        self.record = record
        self.log: list[DecodeCall] = []
        self._calls = 0
        self.begins: list[Begin] = []
        self.switches: list[Switched] = []
        self.prefilled: list[int] = [0] * n_slots
        self.closed = False
        self._lock = threading.Lock()
        self._slots: list[_SlotState | None] = [None] * n_slots
        self._vocab: dict[bytes, int] = {}
        self._pieces: dict[int, bytes] = {EOG_TOKEN: b""}
        self._crashed = False
        self.chat_template = None if chat_template is None else ChatTemplate(chat_template)
        self.generation_prompt = generation_prompt
        if chat_format is not None:
            self.chat_format: ChatFormat = FAMILIES[chat_format]
        else:
            self.chat_format = detect(chat_template) if chat_template is not None else FAMILIES["generic"]
        markers = self.chat_format.reasoning
        self.reasoning_close = () if markers is None else (self._token_for(markers.closing.encode("utf-8")),)

    # -- tokens --------------------------------------------------------------

    @staticmethod
    def render_chat(messages: Sequence[ChatMessage]) -> str:
        """The prompt text: one ``"<|role|>content\\n"`` line per message."""
        return "".join(f"<|{m.role}|>{m.content}\n" for m in messages)

    def tokenize_chat(self, request: GenerationRequest) -> ChatPrompt:
        """One token per UTF-8 byte (token id = byte value) of :meth:`render_chat` of the
        :func:`plain_messages` and the ``generation_prompt``, or of the ``chat_template``'s
        rendering; the prompt opened the format's thinking block where its end is that
        block's opening marker (:meth:`~ringserve.formats.base.ReasoningMarkers.opened_by`).

        Raises:
            ValueError: as :func:`plain_messages`, or the template refused the request.
        """
        self._check_open()
        if self.tokenize_hook is not None:
            self.tokenize_hook()
        if self.chat_template is not None:
            try:
                rendered = render_request(self.chat_template, self.chat_format, request)
            except TemplateRenderError as exc:
                raise ValueError(str(exc)) from None
            text, opened = rendered.prompt.text, rendered.reasoning_open
        else:
            plain = plain_messages(request.messages, request.tools, request.tool_choice)
            text = self.render_chat(plain) + self.generation_prompt
            markers = self.chat_format.reasoning
            opened = markers is not None and markers.opened_by(text)
        return ChatPrompt(text, tuple(text.encode("utf-8")), opened)

    def tokenize(self, text: str | bytes, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """One token per UTF-8 byte (no special tokens)."""
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def reply_for(self, last_user_text: str) -> str:
        """The reply the fake gives to a last user message (see the module docstring)."""
        if last_user_text.startswith("echo:"):
            return last_user_text[len("echo:") :]
        if callable(self.reply):
            return self.reply(last_user_text)
        return DEFAULT_REPLY if self.reply is None else self.reply

    def reply_tokens(self, last_user_text: str) -> int:
        """How many tokens the reply to ``last_user_text`` takes, EOG included."""
        return len(self._cut(self.reply_for(last_user_text).encode("utf-8"))) + 1

    def _token_for(self, piece: bytes) -> int:
        if len(piece) == 1:
            return piece[0]
        token = self._vocab.get(piece)
        if token is None:
            token = EOG_TOKEN + 1 + len(self._vocab)
            self._vocab[piece] = token
            self._pieces[token] = piece
        return token

    # -- slots ---------------------------------------------------------------

    def begin(
        self,
        slot: int,
        sampling: ResolvedSampling,
        keep: int = 0,
        source: int | None = None,
        constraint: Constraint | LazyCalls | None = None,
        *,
        prompt: Sequence[int] = (),
        logprobs: int | None = None,
        replay: Sequence[int] = (),
    ) -> None:
        """Start a sequence in ``slot`` holding the first ``keep`` cells of its own, or of ``source``'s, KV cells;
        with a :class:`Constraint` its reply is ``example(constraint)`` (:class:`LazyCalls`: see the module docstring);
        with ``logprobs`` its tokens come with :func:`fake_logprob`. ``sampling`` and ``prompt`` are recorded.
        ``replay``: the tokens the request sampled before a preemption; its reply goes on after them
        (chosen again at the next sample from the prompt, which its cells then hold before them).

        Raises:
            ValueError: a slot out of range, or fewer than ``keep`` cells
                there (nothing changes).
        """
        with self._lock:
            self._check_open()
            self._check_slot(slot)
            origin = self._slots[slot if source is None else source]
            if source is not None:
                self._check_slot(source)
            cells = [] if origin is None else origin.kv
            if keep > len(cells):
                raise ValueError(f"slot {slot}: cannot keep {keep} cells of {len(cells)}")
            watch = CallWatch(constraint) if isinstance(constraint, LazyCalls) else None
            state = _SlotState(cells[:keep], constraint=constraint, watch=watch, logprobs=logprobs,
                               samples=len(replay))
            if watch is not None:
                for token in replay:
                    watch.feed(self._pieces[token] if token >= 256 else bytes([token]))
            self._slots[slot] = state
            if self.record:
                self.begins.append(Begin(slot, keep, source, constraint, sampling, len(prompt)))

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        """Apply one batch; one :class:`Sampled` per feed with ``sample``, in feed order.

        Raises:
            ValueError: the batch breaks a rule of :func:`~ringserve.engine.protocol.check_feeds`.
            KVCacheFull: a feed would pass ``n_ctx_seq`` (names those slots), or the batch the
                pool's ``n_ctx`` (names every fed slot).
            EngineError: scripted ``fail_after_tokens``.
            RuntimeError: scripted ``crash_after_steps``.
        """
        feeds = tuple(feeds)
        with self._lock:
            self._check_open()
            call, self._calls = self._calls, self._calls + 1
            try:
                result = self._decode(call, feeds)
            except Exception as exc:
                self._note(DecodeCall(call, feeds, type(exc).__name__))
                raise
            self._note(DecodeCall(call, feeds))
        return result

    def _note(self, call: DecodeCall) -> None:
        if self.record:
            self.log.append(call)

    def _decode(self, call: int, feeds: tuple[SlotFeed, ...]) -> list[Sampled]:
        if self.crash_after_steps is not None and call == self.crash_after_steps and not self._crashed:
            self._crashed = True
            raise RuntimeError(f"fake engine crash at decode call {call + 1}")
        held = [None if s is None or not s.begun else len(s.kv) for s in self._slots]
        check_feeds(feeds, n_slots=self.n_slots, n_batch=self.n_batch, n_ctx_seq=self.n_ctx_seq, held=held)
        in_pool = sum(len(s.kv) for s in self._slots if s is not None) + sum(len(f.tokens) for f in feeds)
        if in_pool > self.n_ctx:
            raise KVCacheFull(f"no KV cells for the batch: {in_pool} of a pool of {self.n_ctx}", [f.slot for f in feeds])
        # Work out every sample before changing anything, so a failure leaves no trace.
        planned = [(f, *self._plan(f)) for f in feeds if f.sample]
        if self.step_seconds:
            time.sleep(self.step_seconds)
        prefills = sum(f.pos == 0 for f in feeds)
        if prefills and self.prefill_seconds:
            time.sleep(self.prefill_seconds * prefills)
        for f in feeds:
            state = self._slot(f.slot)
            if state.pieces is None:  # its prompt is not complete yet
                self.prefilled[f.slot] += len(f.tokens)
            state.kv.extend(f.tokens)
        result = []
        for f, pieces, piece, eog in planned:
            state = self._slot(f.slot)
            state.pieces = pieces
            state.samples += 1
            if state.watch is not None:
                self._watch(f.slot, state, piece)
            token = f.forced if f.forced is not None else EOG_TOKEN if eog else self._token_for(piece)
            n_top = state.logprobs
            logprob = None if n_top is None else fake_logprob(piece, state.samples - 1, n_top)
            result.append(Sampled(f.slot, token, piece, eog, logprob))
        return result

    def _slot(self, slot: int) -> _SlotState:
        """The state of a begun slot."""
        state = self._slots[slot]
        assert state is not None
        return state

    def _plan(self, f: SlotFeed) -> tuple[list[bytes], bytes, bool]:
        """What a sampling feed samples, changing nothing: the slot's reply as pieces (chosen at
        its first sample), the piece sampled and whether it ends the reply.

        Raises:
            EngineError: scripted ``fail_after_tokens``.
        """
        state = self._slot(f.slot)
        pieces = state.pieces
        if pieces is None:
            cells = (*state.kv, *f.tokens)
            prompt = bytes(t for t in cells[: len(cells) - state.samples] if t < 256)  # (samples: a replay's)
            if isinstance(state.constraint, Constraint):
                data = example(state.constraint).encode("utf-8")
            else:
                data = self.reply_for(_last_user_text(prompt)).encode("utf-8")
            pieces = self._cut(data)
        if self.fail_after_tokens is not None and state.samples >= self.fail_after_tokens:
            raise EngineError(f"fake engine failure on slot {f.slot} after {state.samples} tokens", [f.slot])
        i = state.samples
        if f.forced is not None:
            pieces = self._forced(pieces, i, self._pieces[f.forced])
        piece, eog = (pieces[i], False) if i < len(pieces) else (b"", True)
        return pieces, piece, eog

    def _cut(self, data: bytes) -> list[bytes]:
        """A reply's bytes as its tokens' pieces."""
        if self.split is not None:
            return [piece for piece in self.split(data) if piece]
        step = self.piece_bytes
        return [data[i : i + step] for i in range(0, len(data), step)]

    def _forced(self, pieces: list[bytes], i: int, piece: bytes) -> list[bytes]:
        """The reply when its token number ``i`` is forced to ``piece`` (a thinking block's
        closing marker): the script goes on after that text where it holds it (the model
        answers), else with what it had."""
        rest = b"".join(pieces[i:])
        at = rest.find(piece)
        return pieces[:i] + [piece] + self._cut(rest[at + len(piece) :] if at >= 0 else rest)

    def _watch(self, slot: int, state: _SlotState, piece: bytes) -> None:
        """Feed the slot's call watch; record its switch, and script a valid call when it goes on."""
        assert state.watch is not None and state.pieces is not None
        switch = state.watch.feed(piece)
        if switch is None:
            return
        if self.record:
            self.switches.append(Switched(slot, state.samples, switch))
        if isinstance(switch, GrammarOn) and self.grammar_examples:
            assert isinstance(state.constraint, LazyCalls)
            done = state.pieces[: state.samples]
            written = b"".join(done)
            unit = written[written.rfind(state.constraint.trigger.encode("utf-8")) :]
            script = (unit + b"".join(state.pieces[state.samples :])).decode("utf-8", "replace")
            after = _after_unit(state.constraint, script).encode("utf-8")
            state.pieces = done + self._cut(example(switch.constraint).encode("utf-8") + after)

    def release(self, slot: int, keep: int = 0) -> None:
        """Keep the slot's first ``keep`` KV cells (0: none), remove the rest, forget its reply. Idempotent."""
        with self._lock:
            self._check_open()
            self._check_slot(slot)
            state = self._slots[slot]
            if state is None or keep == 0:
                self._slots[slot] = None
            else:
                self._slots[slot] = _SlotState(state.kv[:keep], begun=False)

    def kv_cells_used(self, slot: int | None = None) -> int:
        """Tokens held by ``slot`` (by every slot when None)."""
        with self._lock:
            if slot is not None:
                self._check_slot(slot)
                state = self._slots[slot]
                return 0 if state is None else len(state.kv)
            return sum(len(s.kv) for s in self._slots if s is not None)

    def close(self) -> None:
        """Mark the engine closed; later calls raise :class:`EngineError`."""
        self.closed = True

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot must be 0..{self.n_slots - 1}, got {slot}")

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError("the engine is closed")

    def __repr__(self) -> str:
        return f"<FakeEngine slots={self.n_slots} ctx={self.n_ctx} batch={self.n_batch}>"
