"""The synchronous engine interface that the runner drives from its worker thread.

Two implementations: ``engine/llama.py`` (llama.cpp through llama-cpp-python's
low-level API; the only module that imports ``llama_cpp``) and
``engine/fake.py`` (scripted, deterministic, for protocol and load tests).

Threading contract: the runner calls every method except the attributes from
a worker thread, never from the Trio thread, and methods may block. All but
``tokenize_chat`` run one at a time (``trio.to_thread.run_sync`` under the
runner's decode ``CapacityLimiter(1)``); ``tokenize_chat`` runs under a
limiter of its own, so it may run while another thread decodes and must
touch nothing but the vocabulary and the chat template (llama.cpp's
``llama_tokenize`` reads only the immutable ``llama_vocab``, and its own
server tokenizes on HTTP threads while its main loop decodes).

Slots are integers ``0 .. n_slots-1`` and double as llama.cpp sequence ids.
They share one KV pool of ``n_ctx`` cells (llama.cpp's unified KV cache): a
sequence may hold up to ``n_ctx_seq`` of them, and the runner's scheduler keeps
the sum within the pool (``core/scheduler.py``).
A slot's life on the engine side: ``begin`` (fresh sampler; KV cells removed
except a reused prefix of ``keep`` cells, its own or copied from another slot)
→ one or more ``decode`` calls that feed the rest of its prompt in chunks and
then one token per step → ``release`` (sampler freed, KV cells removed with
``llama_memory_seq_rm`` except the first ``keep``, which stay as the slot's
prompt-prefix cache entry). With ``keep`` always 0 (the runner's prefix cache
off, or an engine whose ``prefix_cache`` is False) every sequence starts empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from ringserve.core.batch import Sampled, SlotFeed
from ringserve.core.events import GenerationRequest
from ringserve.core.offload import Offload
from ringserve.core.sampling import ResolvedSampling
from ringserve.engine.gbnf import Constraint, LazyCalls
from ringserve.formats.base import ChatFormat


@attrs.frozen
class ChatPrompt:
    """A request's prompt as the engine renders it.

    Attributes:
        text: the rendered prompt (the chat template's output; special tokens as text).
        tokens: its token ids, as decoded.
        reasoning_open: the prompt opens the model's thinking block and leaves it open
            (:meth:`~ringserve.formats.base.ReasoningMarkers.opened_by`), so the reply starts
            inside it.
        turn_ends: texts that end the model's turn in this prompt's format where no
            end-of-generation token does (llama.cpp's built-in ChatML for a model whose
            vocabulary has no ``<|im_end|>`` token: the model writes it as text); the reply ends
            there as at its end-of-generation token.
    """

    text: str
    tokens: tuple[int, ...]
    reasoning_open: bool = False
    turn_ends: tuple[str, ...] = ()


class EngineError(Exception):
    """A decode step failed. ``slots`` names the slots it affects (all fed slots if unknown)."""

    def __init__(self, message: str, slots: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.slots = tuple(slots)


class KVCacheFull(EngineError):
    """llama_decode found no KV cells for the batch (return code 1)."""


def check_feeds(
    feeds: Sequence[SlotFeed], *, n_slots: int, n_batch: int, n_ctx_seq: int, held: Sequence[int | None]
) -> None:
    """The rules of :meth:`Engine.decode`'s batch, which every engine checks before it decodes anything.

    A batch holds 1..``n_batch`` tokens in all; each feed is for a slot in
    ``0 .. n_slots-1``, at most one feed per slot, holds at least one token,
    is for a slot begun since its last release (it has a sampler, whether or
    not the feed samples), and starts at the position that continues the
    slot's sequence (the cells it holds). A feed that would take its sequence past
    ``n_ctx_seq`` cells is no caller error: the sequence is full.

    Args:
        feeds: the batch (not empty).
        n_slots: slots of the engine.
        n_batch: most tokens one decode carries.
        n_ctx_seq: most KV cells one sequence may hold.
        held: per slot, the cells its sequence holds, or None for a slot not begun.

    Raises:
        ValueError: more than ``n_batch`` tokens, then (feed by feed) a slot out of range,
            an empty feed, a slot fed twice, a slot not begun, or a position that does
            not continue the slot's sequence. The message names the rule.
        KVCacheFull: otherwise, feeds that would take their sequences past ``n_ctx_seq``
            (``slots`` = those slots).
    """
    total = sum(len(f.tokens) for f in feeds)
    if total > n_batch:
        raise ValueError(f"{total} tokens exceed n_batch={n_batch}")
    seen: set[int] = set()
    full: list[int] = []
    for f in feeds:
        slot = f.slot
        if not 0 <= slot < n_slots:
            raise ValueError(f"slot must be 0..{n_slots - 1}, got {slot}")
        if not f.tokens:
            raise ValueError(f"empty feed for slot {slot}")
        if slot in seen:
            raise ValueError(f"slot {slot} fed twice in one decode")
        seen.add(slot)
        cells = held[slot]
        if cells is None:
            raise ValueError(f"slot {slot} has no sampler; call begin() first")
        if f.pos != cells:
            raise ValueError(f"slot {slot}: feed at position {f.pos}, the sequence holds {cells} cells")
        if f.pos + len(f.tokens) > n_ctx_seq:
            full.append(slot)
    if full:
        raise KVCacheFull(f"slot(s) {full} would exceed n_ctx_seq={n_ctx_seq} tokens", full)


class Tokenizer(Protocol):
    """A model's vocabulary and chat template: what a request needs before the model decodes
    (``engine/prompter.py``). An :class:`Engine` is one; ``engine/llama.py``'s ``LlamaVocab`` is
    one without the weights (a vocabulary-only load), which a catalog model has before it loads."""

    @property
    def model_id(self) -> str:
        """Name reported to clients (the GGUF file's stem)."""

    @property
    def max_token_bytes(self) -> int | None:
        """Most UTF-8 bytes of message text that one prompt token stands for (None: not known).

        Message text of more than ``window * max_token_bytes`` bytes cannot fit a
        request's context window, so the prompter refuses it without tokenizing it."""

    @property
    def n_vocab(self) -> int:
        """Tokens in the vocabulary (ids ``0 .. n_vocab-1``)."""

    @property
    def chat_format(self) -> ChatFormat:
        """The model's output format (its family: thinking markers, call syntax, parser and
        call grammar), chosen once at load (:func:`ringserve.formats.detect.detect`)."""

    @property
    def reasoning_close(self) -> tuple[int, ...]:
        """The tokens of the format's :attr:`~ringserve.formats.base.ReasoningMarkers.closing`
        (what a spent reasoning budget forces); empty for a format without a thinking block."""

    def tokenize_chat(self, request: GenerationRequest) -> ChatPrompt:
        """Render the request's conversation with the model's chat template (generation prompt
        added, or the last assistant turn left open) and tokenize it.

        The tools go to the template where the format has a call syntax of its own;
        otherwise ``tool`` turns, assistant ``tool_calls`` and the tools (unless the tool
        choice is ``NONE``) are first rendered as text in ringserve's generic format
        (:func:`ringserve.core.toolcalls.plain_messages`).

        Raises:
            ValueError: the request cannot be rendered (the message says why: a template
                that refused it, a call's arguments that are not JSON...).
        """

    def tokenize(
        self, text: str | bytes, *, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """Plain text's tokens (no chat template): BOS/EOS where ``add_special`` and the model
        adds them; special-token text as its token where ``parse_special``, else as text.
        Safe beside a decode, as :meth:`tokenize_chat`."""

    def close(self) -> None:
        """Free what it holds."""


class Engine(Tokenizer, Protocol):
    """What the runner needs from an inference backend: a :class:`Tokenizer` that also decodes."""

    n_slots: int
    """Number of sequences decoded together (llama.cpp ``n_seq_max``)."""
    n_ctx: int
    """KV cells (tokens) of the pool every slot shares (llama.cpp ``n_ctx``, unified KV cache)."""
    n_ctx_seq: int
    """Most KV cells one sequence may hold (prompt + generated): the pool, at most the model's
    trained context."""
    n_batch: int
    """Most tokens one ``decode`` call may carry, summed over slots."""
    offload: Offload
    """The model's layers on GPU devices (the ready line says it; ``[engine] overlap`` ``auto`` reads it)."""
    prefix_cache: bool
    """Whether ``begin`` and ``release`` may keep a prefix of a slot's cells (``keep > 0``)
    and ``begin`` may copy one from another slot; False for models whose memory cannot
    drop a sequence's tail (recurrent, hybrid or sliding-window attention)."""

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
        """Prepare ``slot`` for a new sequence: build its sampler chain and set up its KV cells.

        Args:
            slot: the slot.
            sampling: the sampler settings (``logit_bias`` by token id:
                :func:`~ringserve.core.sampling.check_logit_bias`).
            keep: cells (tokens at positions ``0 .. keep-1``) the new
                sequence reuses; every other cell of the slot is removed
                (``llama_memory_seq_rm(mem, slot, keep, -1)``), so the next
                feed is at position ``keep``.
            source: when given, the slot's cells are first replaced by a copy
                of ``source``'s (``llama_memory_seq_cp``), of which the first
                ``keep`` stay; ``source`` itself is unchanged.
            constraint: when given, every token sampled for the sequence
                keeps its text within ``constraint.grammar`` (llama.cpp's
                grammar sampler; the fake engine replies
                ``engine/examples.py`` example); end-of-generation is sampled once
                the grammar is complete. With :class:`LazyCalls`, the text is
                free but each tool call, from the token after its
                ``<tool_call>`` marker to the one that completes it, is
                decoded under :meth:`LazyCalls.after`'s grammar: the engine
                feeds a :class:`~ringserve.engine.gbnf.CallWatch` each token
                it samples and applies the switches before it samples the
                next.
            replay: tokens already sampled for this request before it gave its cells up
                (a preemption, ``core/scheduler.py``), in order: the new chain accepts each
                as if it had sampled it (penalties' history, a grammar's state, a call
                watch), so the request goes on where it was.
            prompt: the sequence's prompt tokens: the repetition penalties and DRY count its
                last ones as llama-server's do (it accepts the prompt into its sampler).
            logprobs: each token sampled for the sequence comes with its
                :class:`~ringserve.core.events.TokenLogprob` and this many alternatives
                (:attr:`Sampled.logprob <ringserve.core.batch.Sampled>`); None: none.

        Raises:
            ValueError: a slot out of range, ``keep > 0`` on an engine without
                ``prefix_cache``, or fewer than ``keep`` cells there to keep.
            EngineError: llama.cpp refused to remove or copy the cells.
        """

    def decode(self, feeds: Sequence[SlotFeed]) -> list[Sampled]:
        """Decode one batch holding every feed; return one :class:`Sampled` per feed with ``sample``
        (its ``forced`` token, where it has one: taken as if sampled).

        Raises:
            ValueError: the batch breaks a rule of :func:`check_feeds`; nothing was decoded.
            KVCacheFull: no room in the KV pool (or the sequence) for this batch.
            EngineError: any other decode failure.
        """

    def release(self, slot: int, keep: int = 0) -> None:
        """Free the slot's sampler and remove its KV cells from position ``keep`` on.

        ``keep`` 0 removes them all (``llama_memory_seq_rm(mem, slot, -1, -1)``);
        otherwise the first ``keep`` cells stay for a later :meth:`begin`.
        Idempotent.
        """

    def kv_cells_used(self, slot: int | None = None) -> int:
        """KV cells holding tokens of ``slot`` (of every slot when None)."""

    def close(self) -> None:
        """Free the context and the model (and the vocabulary it was given)."""
