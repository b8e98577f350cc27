"""The vocabulary's special tokens, and the pieces a rendered prompt is tokenized in: the template's
own special-token text parsed as tokens, the request's kept as text (:func:`prompt_fragments`)."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class RenderedPrompt:
    """A rendered prompt.

    ``text`` is the prompt; ``literal_spans`` are the ``[start, end)`` offsets (characters
    of ``text``, sorted, disjoint) of special-token text that came from the request rather
    than from the template: the engine must tokenize it as plain text
    (:func:`prompt_fragments`).
    """

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class SpecialToken:
    """A special token of the vocabulary, as llama.cpp's tokenizer splits the text at it.

    ``lstrip``/``rstrip``: the token swallows the whitespace before/after it (llama.cpp's
    ``LLAMA_TOKEN_ATTR_LSTRIP``/``RSTRIP``; Phi-3 vocabularies set ``rstrip``).
    """

    text: str = attrs.field(validator=attrs.validators.min_len(1))
    lstrip: bool = False
    rstrip: bool = False


class SpecialTokens:
    """A vocabulary's special tokens, indexed to be found in text fast (build once per model).

    Args:
        tokens: the tokens that only ``parse_special`` turns into tokens: llama.cpp's
            control and unknown tokens (``llama_vocab_get_attr``); user-defined tokens are
            split in both modes and may be left out. A text given twice counts once.
    """

    def __init__(self, tokens: Iterable[SpecialToken] = ()) -> None:
        by_text = {t.text: t for t in tokens}
        #: Longest first, as llama.cpp's ``cache_special_tokens`` is sorted.
        self.tokens = tuple(sorted(by_text.values(), key=lambda t: len(t.text), reverse=True))
        self._trie: dict[str, Any] = {}
        for text in by_text:
            node = self._trie
            for ch in text:
                node = node.setdefault(ch, {})
            node[""] = {}
        #: Matches the longest token at a position (empty vocabulary: nothing).
        self.pattern = re.compile(_trie_pattern(self._trie) if by_text else "(?!)")
        self._starts = re.compile(f"(?=(?:{self.pattern.pattern}))")

    def occurrences(self, text: str) -> dict[str, list[int]]:
        """Every occurrence (overlapping ones too) of every token: text -> offsets, ascending."""
        found: dict[str, list[int]] = {}
        for m in self._starts.finditer(text):
            at = m.start()
            node = self._trie
            for i in range(at, len(text)):
                child = node.get(text[i])
                if child is None:
                    break
                node = child
                if "" in node:
                    found.setdefault(text[at:i + 1], []).append(at)
        return found


def _trie_pattern(trie: dict[str, Any]) -> str:
    """A regular expression matching the longest string of ``trie`` at a position; chains
    of one child are written as one literal, so nesting grows with the branches only."""
    branches = []
    for ch, child in sorted(trie.items()):
        if not ch:
            continue
        run = ch
        while len(child) == 1 and "" not in child:
            (next_ch, child), = child.items()
            run += next_ch
        rest = _trie_pattern(child) if len(child) > 1 or "" not in child else ""
        branches.append(re.escape(run) + (f"(?:{rest})?" if rest and "" in child else rest))
    return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"


#: What C's ``isspace`` takes for whitespace (llama.cpp strips with it).
_C_SPACE = frozenset(" \t\n\v\f\r")


def prompt_fragments(prompt: RenderedPrompt, special_tokens: SpecialTokens) -> list[tuple[str, bool]]:
    """Cut a rendered prompt into ``(text, parse_special)`` pieces for the tokenizer.

    The prompt is split at the occurrences of special tokens outside its literal spans, as
    llama.cpp's ``tokenizer_st_partition`` splits a text tokenized with ``parse_special``
    (``src/llama-vocab.cpp``): longest tokens first, each one's occurrences left to right
    in the text no longer token has taken, with the whitespace that ``lstrip``/``rstrip``
    tokens swallow dropped. Each token becomes ``(token_text, True)``, each run of text
    between them ``(run, False)``. Tokenizing each piece with its ``parse_special`` flag
    (``llama_tokenize``, no BOS) and concatenating the ids gives llama-server's ids for a
    prompt whose request carried no special-token text, and keeps the special-token text of
    the request plain text.

    Args:
        prompt: a rendering (:meth:`ChatTemplate.render`).
        special_tokens: the vocabulary's special tokens.

    Returns:
        The pieces in order; their texts joined give the prompt less swallowed whitespace.
    """
    text, spans = prompt.text, prompt.literal_spans
    found = special_tokens.occurrences(text)
    raw = [(0, len(text))] if text else []  # the text no token has taken: sorted ranges
    taken: list[tuple[int, SpecialToken]] = []
    for token in special_tokens.tokens:
        for at in found.get(token.text, ()):
            end = at + len(token.text)
            k = bisect.bisect_right(raw, (at, len(text) + 1)) - 1
            if k < 0 or end > raw[k][1] or any(s < end and at < e for s, e in spans):
                continue  # taken by a longer token, or text of the request
            start, stop = raw[k]
            left, right = at, end
            while token.lstrip and left > start and text[left - 1] in _C_SPACE:
                left -= 1
            while token.rstrip and right < stop and text[right] in _C_SPACE:
                right += 1
            raw[k:k + 1] = [r for r in ((start, left), (right, stop)) if r[0] < r[1]]
            taken.append((at, token))
    pieces = [(start, (text[start:stop], False)) for start, stop in raw]
    pieces += [(at, (token.text, True)) for at, token in taken]
    return [piece for _, piece in sorted(pieces)]
