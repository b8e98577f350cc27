"""A request's sampler settings over the defaults (``core/sampling.py``), with plain values."""

from __future__ import annotations

import math

import attrs
import pytest

from ringserve.core.errors import ErrorKind, RingserveError
from ringserve.core.events import RANDOM_SEED, LogitBias, SamplingParams
from ringserve.core.sampling import (
    LLAMA_SERVER_DEFAULTS,
    ResolvedSampling,
    check_logit_bias,
    resolve_sampling,
)


def test_each_setting_comes_from_the_first_layer_that_sets_it():
    request = SamplingParams(temperature=0.0, logit_bias=(LogitBias(7, 5.0),))
    config = SamplingParams(temperature=0.3, top_k=10, repeat_penalty=1.2)
    gguf = SamplingParams(temperature=0.6, top_k=20, top_p=0.8, min_p=0.1, repeat_penalty=1.5,
                          logit_bias=(LogitBias(9, -1.0),))
    resolved = resolve_sampling(request, config, gguf, LLAMA_SERVER_DEFAULTS)
    assert (resolved.temperature, resolved.top_k, resolved.top_p, resolved.min_p) == (0.0, 10, 0.8, 0.1)
    assert resolved.repeat_penalty == 1.2
    assert resolved.logit_bias == (LogitBias(7, 5.0),)  # the request's replaces the others' whole
    assert resolved.repeat_last_n == 64 and resolved.typical_p == 1.0  # llama-server's
    # an empty bias is a setting: no bias, over the GGUF's
    assert resolve_sampling(SamplingParams(logit_bias=()), gguf, LLAMA_SERVER_DEFAULTS).logit_bias == ()


def test_a_request_that_sets_nothing_gets_llama_servers_defaults():
    """``common/common.h`` ``common_params_sampling``: what llama-server samples with when the
    request, the config and the GGUF say nothing."""
    resolved = resolve_sampling(SamplingParams(), LLAMA_SERVER_DEFAULTS)
    assert resolved == ResolvedSampling(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
        repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0, dry_multiplier=0.0, dry_base=1.75,
        dry_allowed_length=2, dry_penalty_last_n=64, dry_sequence_breakers=("\n", ":", '"', "*"),
        xtc_probability=0.0, xtc_threshold=0.1, logit_bias=(), seed=RANDOM_SEED)
    assert not (resolved.penalties or resolved.dry or resolved.xtc or resolved.plain_greedy)


def test_the_layers_must_end_with_one_that_sets_every_field():
    with pytest.raises(ValueError, match="no sampling layer sets top_k"):
        resolve_sampling(SamplingParams(temperature=0.5), SamplingParams(temperature=1.0))
    assert [f.name for f in attrs.fields(ResolvedSampling)] == [f.name for f in attrs.fields(SamplingParams)]


def test_only_plain_greedy_skips_the_chain():
    greedy = resolve_sampling(SamplingParams(temperature=0), LLAMA_SERVER_DEFAULTS)
    assert greedy.plain_greedy
    for changed in ({"repeat_penalty": 1.1}, {"presence_penalty": 0.5}, {"dry_multiplier": 0.8},
                    {"logit_bias": (LogitBias(3, 1.0),)}):
        assert not attrs.evolve(greedy, **changed).plain_greedy, changed
    assert attrs.evolve(greedy, repeat_penalty=1.5, repeat_last_n=0).plain_greedy  # no window: no penalty


def test_logit_bias_texts_become_their_tokens_and_ids_are_checked_against_the_vocabulary():
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    sampling = resolve_sampling(SamplingParams(logit_bias=(LogitBias(5, 2.0), LogitBias("ab", -math.inf))),
                                LLAMA_SERVER_DEFAULTS)
    checked = check_logit_bias(sampling, 100, tokenize)
    assert checked.logit_bias == (LogitBias(5, 2.0), LogitBias(97, -math.inf), LogitBias(98, -math.inf))
    for token in (100, -1):
        bad = attrs.evolve(sampling, logit_bias=(LogitBias(token, 1.0),))
        with pytest.raises(RingserveError) as err:
            check_logit_bias(bad, 100, tokenize)
        assert (err.value.kind, err.value.param) == (ErrorKind.INVALID_REQUEST, "logit_bias")
        assert f"token {token} is not in the model's vocabulary (ids 0..99)" in err.value.message


def test_sampling_values_out_of_range_are_refused():
    for bad in ({"temperature": -1.0}, {"top_p": 1.5}, {"repeat_penalty": 0.0}, {"dry_base": 0.5},
                {"seed": 2**32}, {"dry_sequence_breakers": ()}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
