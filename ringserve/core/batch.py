"""What one decode step carries between the scheduler and an engine: the tokens fed to each
slot, and the token sampled for it (values; ``core/scheduler.py`` plans the feeds,
``engine/protocol.py`` ``Engine.decode`` takes them and returns the samples).
"""

from __future__ import annotations

import attrs

from ringserve.core.events import TokenLogprob


@attrs.frozen
class SlotFeed:
    """Tokens to append to one slot's sequence in a decode step.

    Args:
        slot: the slot (sequence id).
        tokens: token ids to feed, at positions ``pos .. pos+len-1``.
        pos: position of the first token in the slot's sequence.
        sample: sample a next token from the logits of the last fed token.
        forced: with ``sample``, the token to take instead of sampling one, as if
            sampled (the sampler chain accepts it: a grammar advances over it): the
            closing marker of a thinking block whose reasoning budget is spent. None:
            sample.
    """

    slot: int
    tokens: tuple[int, ...]
    pos: int
    sample: bool
    forced: int | None = None


@attrs.frozen
class Sampled:
    """A token sampled for a slot: its id, its raw bytes, whether it ends generation, and its
    log probabilities where the slot's request asks for them (``Engine.begin``'s ``logprobs``)."""

    slot: int
    token: int
    piece: bytes
    eog: bool
    logprob: TokenLogprob | None = None
