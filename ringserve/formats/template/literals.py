"""The special-token text of a request, through a render: before it, each occurrence in a request
string becomes a private-use placeholder the template copies like any character; after it, the
placeholders become their text again and the spans of that text are recorded
(:class:`~ringserve.formats.template.fragments.RenderedPrompt`), so the engine tokenizes it as
text and a message cannot forge a turn."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ringserve.formats.template.base import Json, TemplateRenderError
from ringserve.formats.template.fragments import RenderedPrompt


class InputList(list[Json]):
    """A list of the request; the template may read it, not change it."""


class InputDict(dict[str, Json]):
    """An object of the request; the template may read it, not change it."""


#: The context variable holding a render's placeholder table (see :class:`Literals`).
LITERALS_VAR = "__ringserve_literals"



#: Placeholders are characters of Unicode's Supplementary Private Use Area-B.
_PLACEHOLDER_BASE = 0x100000
_PLACEHOLDER_LAST = 0x10FFFD
PLACEHOLDER_RE = re.compile("[\U00100000-\U0010fffd]")
_ESCAPED_PLACEHOLDER_RE = re.compile(r"\\udb(?:c[0-9a-f]|[d-f][0-9a-f])\\ud[c-f][0-9a-f]{2}")


class Literals:
    """One render's placeholders for the special-token text found in the request.

    Before rendering, each occurrence of a special token's text in a request string (a
    message, a tool, a kwarg) is swapped for one private-use character, a placeholder the
    template copies, cuts or compares like any other character; so is each private-use
    character of that range the request itself holds. After rendering, the placeholders
    are swapped back and the spans of the tokens' text recorded (:class:`RenderedPrompt`).
    Index ``i`` of :attr:`originals` is the placeholder ``chr(_PLACEHOLDER_BASE + i)``.
    """

    def __init__(self, tokens: Sequence[str], pattern: re.Pattern[str]) -> None:
        """``pattern`` finds the texts of ``tokens`` and the characters of the range."""
        self.originals = list(tokens)
        self._n_tokens = len(tokens)
        self._index = {t: i for i, t in enumerate(tokens)}
        self._pattern = pattern

    def protect(self, text: str) -> str:
        return self._pattern.sub(lambda m: self._placeholder(m.group()), text)

    def _placeholder(self, original: str) -> str:
        i = self._index.get(original)
        if i is None:
            i = self._index[original] = len(self.originals)
            self.originals.append(original)
            if _PLACEHOLDER_BASE + i > _PLACEHOLDER_LAST:
                raise TemplateRenderError("the request holds too many distinct private-use characters")
        return chr(_PLACEHOLDER_BASE + i)

    def fix_json(self, text: str, ensure_ascii: bool) -> str:
        """``tojson`` output: a placeholder stays one while its text needs no JSON escape,
        else becomes its text escaped (then no token's text any more)."""

        def fix(placeholder: str) -> str:
            i = ord(placeholder) - _PLACEHOLDER_BASE
            if i >= len(self.originals):  # U+10FFFE or U+10FFFF, no placeholder
                return json.dumps(placeholder, ensure_ascii=ensure_ascii)[1:-1]
            original = self.originals[i]
            escaped = json.dumps(original, ensure_ascii=ensure_ascii)[1:-1]
            return placeholder if escaped == original else escaped

        if ensure_ascii:
            text = _ESCAPED_PLACEHOLDER_RE.sub(lambda m: fix(json.loads(f'"{m.group()}"')), text)
        return PLACEHOLDER_RE.sub(lambda m: fix(m.group()), text)

    def restore(self, text: str) -> RenderedPrompt:
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        last = 0
        for m in PLACEHOLDER_RE.finditer(text):
            out.append(text[last:m.start()])
            length += m.start() - last
            i = ord(m.group()) - _PLACEHOLDER_BASE
            original = self.originals[i] if i < len(self.originals) else m.group()  # the template's own
            out.append(original)
            if i < self._n_tokens:
                spans.append((length, length + len(original)))
            length += len(original)
            last = m.end()
        out.append(text[last:])
        return RenderedPrompt("".join(out), tuple(spans))

    def protect_json(self, value: Json) -> Json:
        """``value`` with every string (keys included) protected, as read-only containers."""
        if isinstance(value, str):
            return self.protect(value)
        if isinstance(value, list):
            return InputList(self.protect_json(v) for v in value)
        if isinstance(value, dict):
            return InputDict((self.protect(k), self.protect_json(v)) for k, v in value.items())
        return value
