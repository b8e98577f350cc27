"""A model's own chat template, rendered as llama-server renders it (sans-I/O): see :mod:`.chat`."""

from ringserve.formats.template.chat import (
    DEFAULT_KWARGS,
    ChatTemplate,
    RenderedPrompt,
    SpecialToken,
    SpecialTokens,
    TemplateCaps,
    TemplateLoadError,
    TemplateRenderError,
    prompt_fragments,
)

__all__ = [
    "DEFAULT_KWARGS",
    "ChatTemplate",
    "RenderedPrompt",
    "SpecialToken",
    "SpecialTokens",
    "TemplateCaps",
    "TemplateLoadError",
    "TemplateRenderError",
    "prompt_fragments",
]
