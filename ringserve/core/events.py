"""Frozen values that flow between the surfaces, the runner and the stream log.

Core types know no JSON keys: ``surfaces/*`` map wire requests to a
:class:`GenerationRequest` and map :class:`TextDelta` / :class:`Finish` /
:class:`Failure` back to wire events. Every class here is a frozen, slotted
attrs value, so tests can assert ``events == [...]``.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import attrs

from ringserve.core.errors import ErrorKind


class StopReason(enum.StrEnum):
    """Why a generation ended; surfaces spell it in their own words (the store keeps the value).

    ``END`` is an end-of-generation token (Anthropic ``end_turn``, OpenAI
    ``stop``); ``MAX_TOKENS`` is the token budget (``max_tokens`` /
    ``length``); ``CONTEXT_FULL`` is the slot's context, full before the
    caller's ``max_tokens`` was reached or with no ``max_tokens`` given
    (``model_context_window_exceeded`` / ``length``); ``STOP_SEQUENCE`` is a
    caller's stop string (``stop_sequence`` / ``stop``); ``CANCELLED`` is a
    cancel or abort; ``REFUSAL`` is the safety stage (``refusal`` /
    ``content_filter``); ``TOOL_USE`` is a reply that ended after tool calls
    (``tool_use`` / ``tool_calls``).
    """

    END = "end"
    MAX_TOKENS = "max_tokens"
    CONTEXT_FULL = "context_full"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    REFUSAL = "refusal"
    TOOL_USE = "tool_use"


class BlockKind(enum.StrEnum):
    """The kind of one content block of a message.

    ``TEXT`` deltas are text; ``TOOL_CALL`` deltas are fragments of the call's
    arguments, JSON text (their concatenation is one JSON object);
    ``REASONING`` deltas are the text of the model's thinking (its markers removed).
    """

    TEXT = "text"
    TOOL_CALL = "tool_call"
    REASONING = "reasoning"


@attrs.frozen
class ToolCall:
    """A tool call of an earlier assistant turn (conversation history).

    ``call_id`` is the id as the client sent it (``toolu_...``, ``call_...``);
    ``arguments`` is JSON text of an object.
    """

    call_id: str
    name: str
    arguments: str


class Role(enum.StrEnum):
    """Who speaks a chat turn. A :class:`str` enum: its values are the roles' names on every
    surface and in every chat template, so a surface passes the name it read (checked against
    its own roles) and a template gets it as it is."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@attrs.frozen
class ChatMessage:
    """One chat turn. ``role`` is a :class:`Role`, given as one or by its name (``"user"``;
    another name raises ``ValueError``).

    ``tool_calls`` are an assistant turn's calls (after its ``content``);
    a ``tool`` turn is the result of the call ``tool_call_id`` (its
    ``content``), ``is_error`` when the tool failed. ``reasoning`` is an
    assistant turn's reasoning text (its thinking, before its ``content``).
    """

    role: Role = attrs.field(converter=Role)
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    is_error: bool = False
    reasoning: str = ""


#: The one argument of a freeform tool (:attr:`ToolSpec.grammar`): its input text.
FREEFORM_ARGUMENT = "input"


@attrs.frozen
class ToolSpec:
    """A tool the model may call: ``parameters`` is the JSON text of its arguments' JSON schema
    (an object schema); ``strict`` asks for arguments decoded under that schema's grammar.

    A freeform tool (the Responses API's ``custom`` tool) takes one text, which the model writes
    as the string argument :data:`FREEFORM_ARGUMENT` (its ``parameters`` say so); ``grammar`` is
    the Lark grammar that text must match (``core/lark.py``; "": any text). Its call's
    arguments are ``{"input": text}`` like any call's; the surface spells them as the text.
    """

    name: str
    description: str
    parameters: str
    strict: bool = False
    grammar: str = ""


class ToolChoiceMode(enum.StrEnum):
    """``AUTO``: the model decides; ``NONE``: no tool call; ``REQUIRED``: at least one call of
    any tool (Anthropic ``any``, OpenAI ``required``); ``NAMED``: a call of one named tool."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"


@attrs.frozen
class ToolChoice:
    """How the model may use the request's tools; ``name`` is the tool of ``NAMED``."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str = ""
    parallel: bool = True


class OutputKind(enum.StrEnum):
    """The form of a text answer: free ``TEXT``, any ``JSON_OBJECT``, or ``JSON_SCHEMA``."""

    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"


@attrs.frozen
class OutputFormat:
    """Structured output: the answer's text is decoded under a grammar; ``schema`` is the
    JSON text of the schema for ``JSON_SCHEMA`` (empty otherwise)."""

    kind: OutputKind = OutputKind.TEXT
    schema: str = ""


#: llama.cpp's ``LLAMA_DEFAULT_SEED``: a seed of this value draws a random one (``llama.h``).
RANDOM_SEED = 0xFFFFFFFF


@attrs.frozen
class LogitBias:
    """One entry of a request's ``logit_bias``: ``bias`` added to the logit of ``token`` (a
    token id), or of each token of ``token``'s text (a string, tokenized as llama-server
    tokenizes it: no BOS, special-token text as plain text); ``-inf`` bans it (llama-server's
    ``false``). Text and ids become checked ids where the request is prepared
    (``core/sampling.py`` :func:`~ringserve.core.sampling.check_logit_bias`)."""

    token: int | str
    bias: float


def _optional(*validators: Any) -> Any:
    return attrs.validators.optional(list(validators))


_PROBABILITY = (attrs.validators.ge(0.0), attrs.validators.le(1.0))
_COUNT = attrs.validators.ge(0)


@attrs.frozen
class SamplingParams:
    """Sampler settings as one layer gives them: a request, the model's settings in the config,
    the GGUF's ``general.sampling.*``, or llama-server's defaults
    (:data:`~ringserve.core.sampling.LLAMA_SERVER_DEFAULTS`). ``None``: not set by this layer
    (the next one's value applies: :func:`~ringserve.core.sampling.resolve_sampling`).

    The fields are llama-server's request fields, with its meanings
    (``tools/server/server-schema.cpp``, ``common/common.h`` ``common_params_sampling``):
    ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1, ``min_p`` 0 and ``typical_p`` 1
    disable those samplers; ``repeat_penalty`` (> 0, 1 off), ``presence_penalty`` and
    ``frequency_penalty`` (0 off) penalize the last ``repeat_last_n`` tokens (0: none);
    DRY (``dry_multiplier`` 0 off; ``dry_base`` >= 1, ``dry_allowed_length``,
    ``dry_penalty_last_n``, ``dry_sequence_breakers``) and XTC (``xtc_probability`` 0 off,
    ``xtc_threshold`` above 0.5 off); ``logit_bias`` (:class:`LogitBias`, ``()``: none);
    ``seed`` 0..2**32-1 (:data:`RANDOM_SEED` draws one).

    Raises:
        ValueError: a value out of its range (the surfaces refuse them first, naming the field).
    """

    temperature: float | None = attrs.field(default=None, validator=_optional(attrs.validators.ge(0.0)))
    top_k: int | None = attrs.field(default=None, validator=_optional(_COUNT))
    top_p: float | None = attrs.field(default=None, validator=_optional(*_PROBABILITY))
    min_p: float | None = attrs.field(default=None, validator=_optional(*_PROBABILITY))
    typical_p: float | None = attrs.field(default=None, validator=_optional(*_PROBABILITY))
    repeat_penalty: float | None = attrs.field(default=None, validator=_optional(attrs.validators.gt(0.0)))
    repeat_last_n: int | None = attrs.field(default=None, validator=_optional(_COUNT))
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dry_multiplier: float | None = attrs.field(default=None, validator=_optional(attrs.validators.ge(0.0)))
    dry_base: float | None = attrs.field(default=None, validator=_optional(attrs.validators.ge(1.0)))
    dry_allowed_length: int | None = attrs.field(default=None, validator=_optional(_COUNT))
    dry_penalty_last_n: int | None = attrs.field(default=None, validator=_optional(_COUNT))
    dry_sequence_breakers: tuple[str, ...] | None = attrs.field(
        default=None, validator=_optional(attrs.validators.min_len(1)))
    xtc_probability: float | None = attrs.field(default=None, validator=_optional(*_PROBABILITY))
    xtc_threshold: float | None = attrs.field(default=None, validator=_optional(*_PROBABILITY))
    logit_bias: tuple[LogitBias, ...] | None = None
    seed: int | None = attrs.field(default=None,
                                   validator=_optional(_COUNT, attrs.validators.le(RANDOM_SEED)))


#: The most alternatives a token's log probabilities list (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


@attrs.frozen
class TopLogprob:
    """One of the most likely tokens at a position: its bytes and its log probability."""

    piece: bytes
    logprob: float


@attrs.frozen
class TokenLogprob:
    """A sampled token's log probability, and the most likely tokens at its position.

    ``piece`` is the token's bytes (a token may hold part of a UTF-8 character); ``logprob`` the
    natural log of its probability under the model's raw logits (the log-softmax over the
    vocabulary, before any sampler: OpenAI's definition, llama-server's default
    ``post_sampling_probs: false``); ``top`` the ``n`` most likely tokens, most likely first
    (the request's ``top_logprobs``).
    """

    piece: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class Effort(enum.StrEnum):
    """How much the model should think: OpenAI's ``reasoning_effort`` (``minimal`` ..
    ``xhigh``; its ``none`` is :attr:`ReasoningConfig.enabled` false), Anthropic's
    ``output_config.effort`` (``low`` .. ``max``). The value goes to the chat template as its
    ``reasoning_effort`` (gpt-oss reads ``low``, ``medium`` and ``high``)."""

    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"
    MAX = "max"


def _budget(_inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class ReasoningConfig:
    """The request's reasoning controls.

    Args:
        enabled: thinking on or off (the chat template's ``enable_thinking``); None: the
            model's default (on for a model whose format has a thinking block).
        effort: how much to think (the template's ``reasoning_effort``); None: not given.
        budget_tokens: most tokens the thinking block may take; once they are spent the
            runner makes the model close the block (it forces the format's closing marker)
            and answer. None: no budget but ``max_tokens``.
    """

    enabled: bool | None = None
    effort: Effort | None = None
    budget_tokens: int | None = attrs.field(default=None, validator=_budget)


def _json_object(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value:
        return
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ValueError(f"{attribute.name} must be the JSON text of an object") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{attribute.name} must be the JSON text of an object")


class Trigger(enum.StrEnum):
    """What a :class:`ClearToolUses` trigger counts: the prompt's tokens, or the conversation's tool uses."""

    INPUT_TOKENS = "input_tokens"
    TOOL_USES = "tool_uses"


@attrs.frozen
class ClearThinking:
    """Drop the reasoning of all but the last ``keep_turns`` assistant turns that have some
    (None: keep all; Anthropic's default is 1)."""

    keep_turns: int | None = 1


@attrs.frozen
class ClearToolUses:
    """Clear old tool results once the prompt exceeds ``trigger`` (``core/context.py``).

    Defaults are Anthropic's: a trigger of 100,000 input tokens, 3 tool uses kept, nothing
    excluded, inputs kept.
    """

    trigger: int = 100_000
    trigger_kind: Trigger = Trigger.INPUT_TOKENS
    keep: int = 3
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False


ContextEdit = ClearThinking | ClearToolUses


@attrs.frozen
class AppliedEdit:
    """An edit that changed the prompt: ``cleared`` thinking turns or tool uses, and the prompt
    tokens that went with them."""

    edit: ContextEdit
    cleared: int
    cleared_input_tokens: int


@attrs.frozen
class GenerationRequest:
    """A surface-neutral request to generate a reply.

    Args:
        messages: the conversation, oldest first; rendered with the model's
            chat template (from the GGUF metadata) by the engine.
        max_tokens: upper bound on sampled tokens (>= 1); None means "as many
            as the slot's context leaves after the prompt", and so does a
            larger value (the runner resolves it in ``prepare``).
        sampling: the sampler settings.
        stop: stop strings; the first one matched ends the generation and is
            not emitted.
        priority: admission priority, smaller is served first (0 default).
        tools: the tools the model may call (names unique).
        tool_choice: how it may call them (ignored when ``tools`` is empty).
        output: the form of the text answer (structured output).
        reasoning: the reasoning controls (thinking on or off, effort, budget).
        template_kwargs: the JSON text of an object (``""``: none) whose members are
            variables of the model's chat template (OpenAI-style ``chat_template_kwargs``, as
            llama-server takes them: ``{"enable_thinking": false}``...); JSON values only.
        context_edits: history to trim before the prompt is rendered, in order
            (``core/context.py``; Anthropic's ``context_management``).
        cache_key: a hint that requests with the same key share a prompt prefix (the Responses
            API's ``prompt_cache_key``, else the client's session header): the prefix cache's
            slot choice prefers their slot (``core/scheduler.py`` ``choose_slot``); "": none.
        logprobs: report each text token's log probability with this many of the most likely
            tokens at its position (0..:data:`MAX_TOP_LOGPROBS`; :class:`TokenLogprob`); None:
            none (the engine computes them only for a request that asks).
    """

    messages: tuple[ChatMessage, ...]
    max_tokens: int | None = attrs.field(validator=attrs.validators.optional(attrs.validators.ge(1)))
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    stop: tuple[str, ...] = ()
    priority: int = 0
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    output: OutputFormat = OutputFormat()
    reasoning: ReasoningConfig = ReasoningConfig()
    template_kwargs: str = attrs.field(default="", validator=_json_object)
    context_edits: tuple[ContextEdit, ...] = ()
    cache_key: str = ""
    logprobs: int | None = attrs.field(
        default=None, validator=_optional(attrs.validators.ge(0), attrs.validators.le(MAX_TOP_LOGPROBS)))


@attrs.frozen
class Usage:
    """Token counts: prompt tokens, sampled tokens (EOG included), cached prompt tokens, and
    reasoning tokens.

    ``cached_tokens`` (<= ``input_tokens``) are the leading prompt tokens whose
    KV cells were reused from the prompt-prefix cache instead of being
    prefilled; ``input_tokens`` counts the whole prompt, cached or not.
    ``reasoning_tokens`` (<= ``output_tokens``) are the sampled tokens of the
    thinking block: those sampled while the reply's parser was inside it
    (its closing marker included, a reply's own opening marker not); OpenAI's
    ``completion_tokens_details.reasoning_tokens``.
    """

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@attrs.frozen
class BlockStart:
    """A content block begins. ``index`` counts the message's blocks from 0.

    For ``TOOL_CALL``: ``name`` is the tool and ``call_id`` a surface-neutral
    id (24 hex characters) that each surface spells (``toolu_<id>``,
    ``call_<id>``).

    Order every consumer may rely on: blocks are sequential, one open at a
    time (``BlockStart(i)``, ``BlockDelta(i)``..., ``BlockStop(i)`` for i = 0,
    1, ...), then exactly one :class:`Finish` or :class:`Failure`. Before a
    ``Finish`` every block is stopped and there is at least one block (an
    empty text block when nothing was generated); a ``Failure`` may come while
    a block is open.
    """

    index: int
    kind: BlockKind
    name: str = ""
    call_id: str = ""


@attrs.frozen
class BlockDelta:
    """More of block ``index``: text, or a fragment of a tool call's arguments.

    Text is whole UTF-8 characters, never a stop string. ``tokens`` is the
    number of sampled tokens decoded since the previous delta (it can be 0
    when held-back text is released late). ``logprobs``: for a request that asks
    (:attr:`GenerationRequest.logprobs`), a text delta's tokens, those whose text ends in it
    (``engine/generation.py`` ``Generation.feed`` says which).
    """

    index: int
    text: str
    tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class BlockStop:
    """Block ``index`` is complete."""

    index: int


@attrs.frozen
class ContentBlock:
    """A whole content block (non-stream answers, the store, ``GET``).

    ``text`` is the text, or a tool call's arguments (JSON text); ``name``
    and ``call_id`` as in :class:`BlockStart`; ``logprobs`` its deltas' (:class:`BlockDelta`).
    """

    kind: BlockKind
    text: str = ""
    name: str = ""
    call_id: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Finish:
    """Terminal event of a generation that ended normally (or was cancelled)."""

    stop_reason: StopReason
    usage: Usage
    stop_sequence: str | None = None


@attrs.frozen
class Failure:
    """Terminal event of a generation that failed mid-stream.

    ``kind`` is what went wrong, surface-neutral (each surface spells it);
    ``retryable`` tells a client whether the same request may succeed later.
    """

    kind: ErrorKind
    message: str
    usage: Usage
    retryable: bool = False


GenerationEvent = BlockStart | BlockDelta | BlockStop | Finish | Failure
