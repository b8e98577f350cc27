"""A chat template's render is bounded in steps and in memory (``formats/template/bounds.py``):
issue 43's templates and their kin are refused at load (on llama.cpp's capability probes) or on
the one request that sets them off, in one line that names the bound, and the template goes on
rendering other requests as before. llama.cpp's own templates stay far inside the bounds
(``test_template_corpus.py``)."""

from __future__ import annotations

import pytest

from ringserve.core.events import ChatMessage
from ringserve.formats.template import ChatTemplate, TemplateLoadError, TemplateRenderError, bounds
from ringserve.formats.template.bounds import RenderBounds

#: ``{% set ns.a = [ns.a, ns.a] %}`` 40 times: a list 40 levels deep holding its level below twice,
#: 2**40 members when written out or compared (a few hundred bytes of memory).
SHARED = ("{% set ns = namespace(a=['x'], b=['x']) %}{% for i in range(40) %}"
          "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}")
#: Doubles a string 40 times: ``'x'`` becomes 2**40 characters.
DOUBLED = "{% set ns = namespace(s='x') %}{% for i in range(40) %}"

#: Each goes past a bound on llama.cpp's capability probes; the bound its message names.
PAST_A_BOUND_AT_LOAD = {
    "a string doubled 40 times by ~": (DOUBLED + "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                                       "memory"),
    "a string doubled 40 times by +": (DOUBLED + "{% set ns.s = ns.s + ns.s %}{% endfor %}", "memory"),
    "a string doubled 40 times by a block": (
        DOUBLED + "{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}", "memory"),
    "nested range(100000) loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "'x' * 100000000": ("{{ 'x' * 100000000 }}", "memory"),
    "[1] * 10**9": ("{% set l = [1] * 1000000000 %}", "memory"),
    "a list extended by itself 40 times": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set _ = ns.l.extend(ns.l) %}{% endfor %}",
        "memory"),
    "a padding filter": ("{{ 'x' | center(1000000000) }}", "memory"),
    "a padding method": ("{{ 'x'.rjust(1000000000) }}", "memory"),
    "a % width": ("{{ '%1000000000d' % 1 }}", "memory"),
    "a format width": ("{{ '{:>1000000000}'.format(1) }}", "memory"),
    "replace on every character": ("{{ ('x' * 1000) | replace('', 'y' * 100000) }}", "memory"),
    "indent by a long string": ("{{ ('\n' * 100000) | indent('y' * 100000) }}", "memory"),
    "join of 100,000 references to one long string": (
        "{% set ns = namespace(l=[]) %}{% set s = 'x' * 100000 %}{% for i in range(100000) %}"
        "{% set _ = ns.l.append(s) %}{% endfor %}{{ ns.l | join }}", "memory"),
    "a long string kept per iteration": (
        "{% set ns = namespace(l=none) %}{% set s = 'x' * 1000000 %}{% for i in range(100000) %}"
        "{% set ns.l = [ns.l, s ~ i] %}{% endfor %}", "memory"),
    "a string scanned 100,000 times": (
        "{% set s = 'x' * 4000000 %}{% for i in range(100000) %}{% if 'y' in s %}{% endif %}{% endfor %}",
        "steps"),
    "shared levels written out": (SHARED + "{{ ns.a }}", "steps"),
    "shared levels compared": (SHARED + "{{ ns.a == ns.b }}", "steps"),
    "shared levels hashed": (
        "{% set ns = namespace(t=('x',)) %}{% for i in range(40) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}"
        "{{ ns.t in {} }}", "steps"),
    "2 ** 10**8": ("{{ 2 ** 100000000 }}", "bits"),
    "an integer squared 64 times": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "bits"),
}


@pytest.mark.parametrize("source, bound", PAST_A_BOUND_AT_LOAD.values(), ids=PAST_A_BOUND_AT_LOAD)
def test_a_template_past_a_bound_is_refused_at_load_in_one_line(source, bound):
    with pytest.raises(TemplateLoadError) as exc:
        ChatTemplate(source)
    message = str(exc.value)
    assert "\n" not in message and bound in message and "capability probes" in message


#: Writes 300 MB (or loops 10**10 times) for a last user message ``boom`` only, as issue 43's did.
BOOM = {
    "memory": "{% for i in range(100000) %}{{ 'y' * 3000 }}{% endfor %}",
    "steps": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("bound", BOOM)
def test_a_template_past_a_bound_on_one_request_refuses_that_request_only(bound):
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        f"{{% if messages[-1].content == 'boom' %}}{BOOM[bound]}{{% endif %}}"
    )
    hello = [ChatMessage("user", "hello")]
    before = template.render(hello)
    with pytest.raises(TemplateRenderError) as exc:
        template.render([ChatMessage("user", "boom")])
    assert "\n" not in str(exc.value) and bound in str(exc.value) and "this request" in str(exc.value)
    after = template.render(hello)
    assert after == before and type(after.text) is str and after.text == "<user>hello"


def test_text_a_render_made_and_let_go_is_given_back():
    """A template that adds each message to a string it keeps (Reka Edge's does) makes far more
    text than its memory bound in all (each ``~`` copies what came before), but holds only the
    last string: it renders."""
    template = ChatTemplate(
        "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content %}{% endfor %}"
        "{{ ns.s }}"
    )
    messages = [ChatMessage("user", str(i % 10) * 100_000) for i in range(100)]
    made = sum(range(1, 101)) * 100_000
    assert made > RenderBounds.of([[m.content for m in messages]], len(messages)).memory
    assert template.render(messages).text == "".join(m.content for m in messages)


def test_the_bounds_grow_with_the_request(monkeypatch):
    """A template that looks back over the earlier messages at each message (as Gemma 4's does)
    takes steps quadratic in the messages: past the base, within the bound of its request; a
    third loop deep is not."""
    monkeypatch.setattr(bounds, "STEPS_BASE", 1_000)
    look_back = "{% for m in messages %}{% for n in messages %}{{ n.role[0] }}{% endfor %}{% endfor %}"
    messages = [ChatMessage("user", "x")] * 40
    assert len(ChatTemplate(look_back).render(messages).text) == 40 * 40
    deeper = ("{% for m in messages %}{% for n in messages %}{% for o in messages %}"
              "{% endfor %}{% endfor %}{% endfor %}")
    with pytest.raises(TemplateRenderError, match="steps"):
        ChatTemplate(deeper).render(messages)
    # the list, each object, its keys and values; the characters of its strings
    values, chars = 1 + 40 * 5, 40 * len("role" "user" "content" "x")
    steps = RenderBounds.of([[{"role": "user", "content": "x"}] * 40], 40).steps
    assert steps == (1_000 + bounds.STEPS_PER_ITEM_PAIR * 40 * 40 + bounds.STEPS_PER_VALUE * values
                     + bounds.STEPS_PER_ITEM_KIB * 40 * chars // 1024)


def test_lipsum_is_not_given():
    """jinja2's ``lipsum(n)`` writes n paragraphs; no real template calls it (llama.cpp's Jinja has none)."""
    with pytest.raises(TemplateRenderError, match="'lipsum' is undefined"):
        ChatTemplate("{{ lipsum(100000, min=1000, max=1000) }}").render([ChatMessage("user", "hi")])
