"""Model formats: chat templates, output parsers and family detection (sans-I/O).

:mod:`~ringserve.formats.template` renders a model's chat template; each model family's
output format (its thinking markers, its tool-call syntax, the parser of its replies and the
grammar of its calls) is a :class:`~ringserve.formats.base.ChatFormat`
(:mod:`~ringserve.formats.families`), chosen from the template's text by
:func:`~ringserve.formats.detect.detect`. The parsers import only ``ringserve.core`` and the
standard library.
"""
