"""A model's requests made ready for its runner: rendered, tokenized, checked against its context
window, their grammar made and their samplers resolved (issue 40, 41).

A :class:`Prompter` needs only a model's :class:`~ringserve.engine.protocol.Tokenizer` (its
vocabulary and chat template) and its context window, not its weights: a model of the catalog
that is still loading prepares its requests with it (``live/models.py``), and they wait in its
stream, with keepalives, for the runner. The :class:`~ringserve.engine.runner.Runner` of a loaded
model prepares through one too (its engine is its tokenizer).

Everything blocking runs on worker threads: the prepares one at a time under one limiter (llama.cpp's
tokenizer reads only the immutable vocabulary, so this runs beside a decode step), the counts and
renders under another (:data:`COUNT_THREADS`), so a burst of counts neither waits behind the
prepares nor holds them up.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ringserve.core.context import cleared_input_tokens, edit_prompt
from ringserve.core.errors import PROMPT_PARAM, invalid
from ringserve.core.events import AppliedEdit, GenerationRequest, SamplingParams, ToolChoiceMode
from ringserve.core.limits import message_texts, tool_texts
from ringserve.core.sampling import (
    LLAMA_SERVER_DEFAULTS,
    ResolvedSampling,
    check_logit_bias,
    resolve_sampling,
)
from ringserve.engine.gbnf import Constraint, LazyCalls, constraint_for
from ringserve.engine.generation import Count, Prepared
from ringserve.engine.protocol import ChatPrompt, Tokenizer

__all__ = ["COUNT_THREADS", "Prompter"]

#: Prompts :meth:`Prompter.count` tokenizes at once (llama.cpp's tokenizer keeps its state per call).
COUNT_THREADS = 2


class Prompter:
    """Prepares, counts and renders one model's requests.

    Args:
        tokenizer: the model's vocabulary and chat template.
        context_window: the most tokens one request may hold, prompt and reply (the runner's
            KV pool share, at most the trained context and ``[engine] ctx_per_slot``).
        sampling_defaults: the model's sampling layers between a request's and llama-server's
            defaults, in order (the config's ``[model.sampling]``, then the GGUF's
            ``general.sampling.*``): :func:`~ringserve.core.sampling.resolve_sampling`.
    """

    def __init__(self, tokenizer: Tokenizer, context_window: int,
                 sampling_defaults: Sequence[SamplingParams] = ()) -> None:
        self._tokenizer = tokenizer
        self.context_window = context_window
        self._defaults = tuple(sampling_defaults)
        self._tokenize_limiter = trio.CapacityLimiter(1)  # tokenize_chat, beside a decode step
        self._count_limiter = trio.CapacityLimiter(COUNT_THREADS)  # count(): apart from prepare()
        self._tokenizing = 0  # prepare() calls waiting for or inside tokenize_chat
        self._tokenize_ended = 0  # prepare() calls whose tokenize_chat has returned or raised
        self._tokenized = trio.Event()  # set (and replaced) each time one of them ends

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's vocabulary and chat template."""
        return self._tokenizer

    @property
    def tokenizing(self) -> int:
        """:meth:`prepare` calls waiting for or inside the tokenizer now."""
        return self._tokenizing

    async def wait_tokenized(self) -> None:
        """Wait until as many tokenizations have ended as were in flight when called (later
        arrivals do not extend the wait): the runner's first batch after idle takes them all."""
        target = self._tokenize_ended + self._tokenizing
        while self._tokenize_ended < target:
            await self._tokenized.wait()

    async def prepare(self, request: GenerationRequest) -> Prepared:
        """Make a request's grammar and tokenize it on a worker thread, and check it fits a slot (C4).

        The grammar (:func:`~ringserve.engine.gbnf.constraint_for`) is made first, on a
        thread under the tokenizer's limiter: its cost grows with the schemas' bounds, which
        the event loop must not wait on. Text longer than ``context_window * max_token_bytes``
        bytes (UTF-8, the tokenizer's)
        cannot fit and is refused before it is tokenized: the message texts
        (contents, and the tool calls in the history) and, unless the tool
        choice is ``NONE``, the tool definitions
        (:func:`~ringserve.core.limits.message_texts`, :func:`~ringserve.core.limits.tool_texts`). Otherwise
        the tokenizer's ``tokenize_chat`` runs on a thread under the tokenizer's own
        ``CapacityLimiter(1)``, not the engine thread: the decode loop goes on
        while a prompt is tokenized, and prompts are tokenized one at a time.
        Cancelling the caller takes effect once the tokenizer returns (the
        thread is not abandoned).

        Args:
            request: the parsed request.

        Returns:
            The request with its prompt tokens and resolved ``max_tokens``; with its
            ``context_edits`` applied (:meth:`_prompt_sync`).

        A ``max_tokens`` larger than what the context window leaves after the
        prompt is accepted (issue 22: clients send large defaults, such as
        pydantic-ai's 16384): the budget is then what the window leaves, and
        a generation that uses it all ends with
        :attr:`StopReason.CONTEXT_FULL`. So a request never claims more cells
        than the pool holds; the scheduler shares the pool (module docstring
        of ``core/scheduler.py``).

        Raises:
            RingserveError: ``INVALID_REQUEST`` with ``param=PROMPT_PARAM`` (``"messages"``) when
                the prompt is empty, cannot be rendered (the engine raised
                ``ValueError``) or fills the context window by itself (at
                least 1 token must be left to generate). The message gives the
                numbers (tokens, or bytes when refused
                before tokenizing). ``INVALID_REQUEST`` from
                :func:`~ringserve.engine.gbnf.constraint_for` first, when
                the reply's grammar cannot be made (a schema keyword it
                does not enforce, a forced tool that is not among the tools
                or of a format whose calls cannot be forced); it is made in
                the model's format, right after the prompt (which says
                whether it opened the thinking block), in the same hop to the
                tokenizer's thread. Nothing is enqueued.

        The tools are rendered into the prompt by the engine (by the model's
        chat template, or :func:`ringserve.core.toolcalls.plain_messages`), so
        the prompt tokens (``usage.input_tokens``) count them. The prepared
        request carries the model's format and whether the prompt opened its
        thinking block, for the reply's parser.
        """
        self._check_bytes(request)
        self._tokenizing += 1
        try:
            request, prompt, constraint, applied, sampling = await trio.to_thread.run_sync(
                self._prompt_sync, request, limiter=self._tokenize_limiter, abandon_on_cancel=False
            )
        finally:
            self._tokenizing -= 1
            self._tokenize_ended += 1
            self._tokenized.set()
            self._tokenized = trio.Event()
        return self._fitted(request, prompt, applied, constraint, sampling)

    async def count(self, request: GenerationRequest) -> Count:
        """The prompt :meth:`prepare` would give ``request``, counted, enqueuing nothing: the
        counting routes (``POST /v1/messages/count_tokens``, ``/v1/responses/input_tokens``),
        whose ``input_tokens`` equals the generation's ``usage.input_tokens``. A prompt longer
        than a slot is counted too (as Anthropic's API counts one longer than the model's
        window): the count is how a client learns how much to trim; its size is bounded by the
        request limits (``[limits]``), as the render routes'.

        It tokenizes on a worker thread under a limiter of its own (:data:`COUNT_THREADS` at
        once), so a burst of counts neither waits behind the generations' prepares nor holds
        them up, and never waits for a decode step (the engine's tokenizer runs beside it).

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming ``messages``: the request cannot be
                rendered (as :meth:`render`).
        """
        _, prompt, applied = await trio.to_thread.run_sync(
            edit_prompt, request, request.context_edits, self._tokenize_sync,
            limiter=self._count_limiter, abandon_on_cancel=False,
        )
        return Count(len(prompt.tokens), len(prompt.tokens) + cleared_input_tokens(applied))

    def _check_bytes(self, request: GenerationRequest) -> None:
        """Refuse text that cannot fit a slot, before it is tokenized (see :meth:`prepare`)."""
        ctx = self.context_window
        per_token = self._tokenizer.max_token_bytes
        rendered = request.tool_choice.mode is not ToolChoiceMode.NONE  # the tools go into the prompt
        if per_token is not None:
            texts = [*message_texts(request), *(tool_texts(request) if rendered else ())]
            n_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
            if n_bytes > ctx * per_token:
                raise invalid(
                    f"the messages{' and tools' if rendered and request.tools else ''} hold {n_bytes} bytes"
                    f" of text, at least {-(-n_bytes // per_token)} tokens, but the context is {ctx} tokens",
                    PROMPT_PARAM,
                )

    def _fitted(self, request: GenerationRequest, prompt: ChatPrompt, applied: tuple[AppliedEdit, ...],
                constraint: Constraint | LazyCalls | None, sampling: ResolvedSampling) -> Prepared:
        """The prepared request, once its prompt is known to fit the context window with a token to spare
        (see :meth:`prepare`)."""
        ctx = self.context_window
        tokens = prompt.tokens
        n_prompt = len(tokens)
        if n_prompt == 0:
            raise invalid("the prompt is empty", PROMPT_PARAM)
        if n_prompt >= ctx:
            raise invalid(
                f"the prompt is {n_prompt} tokens, but the context is {ctx} tokens"
                f" and at least 1 must be left to generate",
                PROMPT_PARAM,
            )
        room = ctx - n_prompt
        asked = request.max_tokens
        budget = room if asked is None or asked > room else asked
        return Prepared(
            request, tokens, budget, sampling, context_bound=budget != asked, constraint=constraint,
            chat_format=self._tokenizer.chat_format, reasoning_open=prompt.reasoning_open,
            reasoning_budget=self._reasoning_budget(request, constraint), applied_edits=applied,
            turn_ends=prompt.turn_ends,
        )

    def _reasoning_budget(self, request: GenerationRequest,
                          constraint: Constraint | LazyCalls | None) -> int | None:
        """The request's reasoning budget, where the runner can force the end of the thinking
        block: the format has one, and its closing text is one the reply's grammar takes (a
        forced call's grammar goes on from the block's end marker to the calls, where gpt-oss's
        closing opens its final channel: no budget there)."""
        markers = self._tokenizer.chat_format.reasoning
        if markers is None or not self._tokenizer.reasoning_close:
            return None
        if isinstance(constraint, Constraint) and constraint.call is not None and markers.close:
            return None
        return request.reasoning.budget_tokens

    async def render(self, request: GenerationRequest) -> ChatPrompt:
        """The request's prompt as the model gets it: the rendered text (special tokens as
        text) and its token ids, as :meth:`prepare` makes them, context edits applied
        (llama-server's ``/apply-template`` and ``/tokenize`` in one, for people debugging a
        model's prompt: the render routes). Nothing is generated or enqueued; the prompt may be
        longer than a slot's context.

        Runs ``engine.tokenize_chat`` on a worker thread under the counts' limiter (as
        :meth:`count`: beside decoding, not behind the prepares); cancelling the caller takes
        effect once it returns.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming ``messages``: the request cannot be
                rendered (the template refused it, a call's arguments are not JSON...).
        """
        _, prompt, _ = await trio.to_thread.run_sync(
            edit_prompt, request, request.context_edits, self._tokenize_sync,
            limiter=self._count_limiter, abandon_on_cancel=False,
        )
        return prompt

    def _prompt_sync(
        self, request: GenerationRequest
    ) -> tuple[GenerationRequest, ChatPrompt, Constraint | LazyCalls | None, tuple[AppliedEdit, ...],
               ResolvedSampling]:
        """Worker thread: the request with its context edits applied (``core/context.py``
        ``edit_prompt``: a trigger measured in tokens tokenizes it again after each edit that
        clears something), its prompt, then the grammar its reply is decoded under (in the
        model's format; whether the prompt opened the thinking block decides how it starts), the
        edits applied, and its sampler settings (:meth:`_sampling_sync`).

        Raises:
            RingserveError: ``INVALID_REQUEST``: as :meth:`_tokenize_sync`,
                :func:`~ringserve.engine.gbnf.constraint_for` and :meth:`_sampling_sync`.
        """
        sampling = self._sampling_sync(request)
        request, prompt, applied = edit_prompt(request, request.context_edits, self._tokenize_sync)
        constraint = constraint_for(request, self._tokenizer.chat_format, prompt.reasoning_open)
        return request, prompt, constraint, applied, sampling

    def _sampling_sync(self, request: GenerationRequest) -> ResolvedSampling:
        """Worker thread: the request's sampler settings over the defaults
        (``core/sampling.py`` :func:`~ringserve.core.sampling.resolve_sampling`), its
        ``logit_bias`` by token id and checked against the vocabulary
        (:func:`~ringserve.core.sampling.check_logit_bias`).

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming ``logit_bias``: a token id out of the vocabulary.
        """
        sampling = resolve_sampling(request.sampling, *self._defaults, LLAMA_SERVER_DEFAULTS)
        return check_logit_bias(sampling, self._tokenizer.n_vocab, self._tokenizer.tokenize)

    def _tokenize_sync(self, request: GenerationRequest) -> ChatPrompt:
        """Worker thread: the tokenizer's ``tokenize_chat``.

        Raises:
            RingserveError: ``INVALID_REQUEST`` naming ``messages``: the engine cannot
                render the request (it says why).
        """
        try:
            return self._tokenizer.tokenize_chat(request)
        except ValueError as exc:  # the engine's "cannot render these messages"
            raise invalid(f"the messages cannot be rendered: {exc}", PROMPT_PARAM) from None
