"""A request's sampler settings, resolved over the defaults (sans-I/O).

A sequence is sampled with one setting per sampler, each taken from the first of these layers
that sets it (issue 40): the request, the model's settings in the config, the GGUF's
``general.sampling.*``, then llama-server's defaults (:data:`LLAMA_SERVER_DEFAULTS`).
:func:`resolve_sampling` does that with plain values; :func:`check_logit_bias` then turns a
``logit_bias``'s token texts into token ids and checks every id against the vocabulary (the
vocabulary is the engine's: the runner calls it where the request is prepared).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from ringserve.core.errors import invalid
from ringserve.core.events import RANDOM_SEED, LogitBias, SamplingParams

__all__ = ["LLAMA_SERVER_DEFAULTS", "ResolvedSampling", "check_logit_bias", "resolve_sampling"]


@attrs.frozen
class ResolvedSampling:
    """The sampler settings a sequence is decoded with: every field of
    :class:`~ringserve.core.events.SamplingParams` set (its meanings); ``logit_bias`` holds
    token ids once :func:`check_logit_bias` checked it (the engine takes it then)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: tuple[str, ...]
    xtc_probability: float
    xtc_threshold: float
    logit_bias: tuple[LogitBias, ...]
    seed: int

    @property
    def penalties(self) -> bool:
        """Whether the repetition penalties change anything (llama.cpp's penalties sampler is a
        no-op otherwise: ``llama_sampler_penalties_apply``)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def dry(self) -> bool:
        """Whether DRY changes anything (a multiplier and a window)."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def xtc(self) -> bool:
        """Whether XTC changes anything (``llama_sampler_xtc_apply``: a probability, a threshold
        of at most 0.5)."""
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first (no bias, penalty or DRY): the
        token is the first highest raw logit."""
        return self.temperature == 0 and not self.logit_bias and not self.penalties and not self.dry


#: llama-server's defaults (``common/common.h`` ``common_params_sampling``, llama.cpp as
#: llama-cpp-python 0.3.36 vendors it): temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
#: typical-p 1 (off), repeat penalty 1 (off) over the last 64 tokens, presence and frequency
#: penalties 0, DRY off (multiplier 0; base 1.75, allowed length 2, last 64 tokens, breakers
#: ``\n``, ``:``, ``"``, ``*``), XTC off (probability 0, threshold 0.1), no logit bias, a random seed.
LLAMA_SERVER_DEFAULTS = SamplingParams(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    typical_p=1.0,
    repeat_penalty=1.0,
    repeat_last_n=64,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    dry_multiplier=0.0,
    dry_base=1.75,
    dry_allowed_length=2,
    dry_penalty_last_n=64,
    dry_sequence_breakers=("\n", ":", '"', "*"),
    xtc_probability=0.0,
    xtc_threshold=0.1,
    logit_bias=(),
    seed=RANDOM_SEED,
)

_FIELDS = tuple(f.name for f in attrs.fields(SamplingParams))


def resolve_sampling(*layers: SamplingParams) -> ResolvedSampling:
    """Each setting from the first layer that sets it (not None), the layers in order of
    precedence: the request, the model's settings in the config, the GGUF's, and last
    :data:`LLAMA_SERVER_DEFAULTS` (or another layer that sets every field). A layer's
    ``logit_bias`` replaces the later ones' whole, as a request's replaces llama-server's.

    Raises:
        ValueError: no layer sets some field (the last must set them all).
    """
    values = {}
    for name in _FIELDS:
        value = next((v for layer in layers if (v := getattr(layer, name)) is not None), None)
        if value is None:
            raise ValueError(f"no sampling layer sets {name} (the last must set every field)")
        values[name] = value
    return ResolvedSampling(**values)


def check_logit_bias(sampling: ResolvedSampling, n_vocab: int,
                     tokenize: Callable[[str], Sequence[int]]) -> ResolvedSampling:
    """``sampling`` with its ``logit_bias`` by token id: a text's tokens (``tokenize(text)``:
    no BOS, special-token text as plain text, as llama-server's ``common_tokenize(vocab, text,
    false)``) each get its bias; an id must be a token of the vocabulary (``0..n_vocab-1``).

    Raises:
        RingserveError: ``INVALID_REQUEST`` with ``param="logit_bias"``: an id out of the
            vocabulary (llama-server skips it; an answer that silently ignores the bias is worse).
    """
    if not sampling.logit_bias:
        return sampling
    checked = []
    for entry in sampling.logit_bias:
        if isinstance(entry.token, str):
            checked += [LogitBias(token, entry.bias) for token in tokenize(entry.token)]
            continue
        if not 0 <= entry.token < n_vocab:
            raise invalid(f"logit_bias: token {entry.token} is not in the model's vocabulary"
                          f" (ids 0..{n_vocab - 1})", param="logit_bias")
        checked.append(entry)
    return attrs.evolve(sampling, logit_bias=tuple(checked))
