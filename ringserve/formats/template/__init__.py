"""A model's own chat template, rendered as llama-server renders it (sans-I/O).

:class:`ChatTemplate` (``chat.py``) renders a GGUF's Jinja template with jinja2's sandbox and
reproduces what llama-server feeds the same template; one module per job:

- ``environment.py``: the Jinja environment (Hugging Face's conventions, llama.cpp's
  differences) and the variables llama-server gives every template;
- ``caps.py`` (with ``probe.py``'s counting values): the template's capabilities, probed at load;
- ``shaping.py``: the messages as llama-server shapes them for the template's capabilities and
  for the families it knows;
- ``literals.py``: the request's special-token text kept text through a render;
- ``fragments.py``: the vocabulary's special tokens and the pieces a prompt is tokenized in;
- ``base.py``: the JSON value type and the errors.
"""

from ringserve.formats.template.base import TemplateLoadError, TemplateRenderError
from ringserve.formats.template.caps import TemplateCaps
from ringserve.formats.template.chat import DEFAULT_KWARGS, ChatTemplate
from ringserve.formats.template.fragments import RenderedPrompt, SpecialToken, SpecialTokens, prompt_fragments

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
