"""Token bytes in, whole UTF-8 characters out (case C6).

A token's piece is a byte string that may end inside a multi-byte UTF-8
character: an emoji, a flag, a CJK or Cyrillic character can be split across
two, three or four tokens. Decoding each piece on its own would turn every
half into U+FFFD. :class:`Detokenizer` keeps the bytes of an unfinished
character until the rest arrives, so the joined output equals the UTF-8
decoding of all the bytes at once, whatever the split.

It releases whole code points, not grapheme clusters: 👍🏽 (two code points)
may come out in two deltas, but never as U+FFFD.

A generation that ends (``max_tokens``, the context, a stop, a cancel, a
refusal) with a character still incomplete drops its bytes at
:meth:`Detokenizer.flush` instead of turning them into U+FFFD: the token that
would have finished the character was never sampled, and the text for N tokens
stays a prefix of the text for N + 1 (issue 12). The token still counts in the
usage.
"""

from __future__ import annotations

import codecs

import attrs

__all__ = ["Detokenizer"]

_utf8_decoder = codecs.getincrementaldecoder("utf-8")


@attrs.define(eq=False)
class Detokenizer:
    """Incremental UTF-8 decoder for one generation's token pieces.

    Built on Python's incremental UTF-8 decoder with ``errors="replace"``
    (Unicode's "maximal subpart" substitution, the same as the WHATWG
    Encoding standard). A U+FFFD appears only for bytes that are really
    invalid UTF-8 (a stray continuation byte, an impossible lead byte, an
    overlong or surrogate encoding, a sequence cut short by a byte that
    cannot continue it). A valid character split across pieces never gives
    one, and neither does the end of the generation: :meth:`flush` drops an
    incomplete character still pending.

    For every split of a byte string ``b`` into pieces, with ``n = d.flush()``
    after the feeds, ``"".join(d.feed(p) for p in pieces) ==
    b[: len(b) - n].decode("utf-8", "replace")``.
    """

    _decoder: codecs.IncrementalDecoder = attrs.field(
        init=False, factory=lambda: _utf8_decoder(errors="replace")
    )

    @property
    def pending_bytes(self) -> int:
        """Bytes held back as the start of an unfinished character (0 to 3)."""
        return len(self._decoder.getstate()[0])

    def feed(self, piece: bytes) -> str:
        """Decode the next token piece.

        Args:
            piece: the token's bytes (empty is fine).

        Returns:
            The text of every character completed by ``piece``; the bytes of
            a character not yet complete are held for the next feed.
        """
        return self._decoder.decode(piece)

    def flush(self) -> int:
        """Finish the generation: drop the bytes of an incomplete character.

        Everything complete was already released by :meth:`feed`; what is
        held is the start of a character whose remaining bytes were never
        sampled. It is dropped, never released as U+FFFD.

        Returns:
            How many bytes were dropped (0 to 3). The detokenizer is then
            back in its initial state.
        """
        dropped = self.pending_bytes
        self._decoder.reset()
        return dropped
