"""What llama.cpp's grammar sampler takes: its GBNF parser's rules, in Python (sans-I/O).

``llama_sampler_init_grammar`` parses GBNF (``llama_grammar_parser`` in ``src/llama-grammar.cpp``
of the llama.cpp that llama-cpp-python 0.3.36 vendors) into rules of elements: a group becomes a
rule of its own, ``S{m,n}`` is ``S`` written ``m`` times then ``n - m`` rules ``S'(x) ::= S
S'(x-1) |`` (``*``, ``+``, ``?`` and ``{m,}`` alike, ``S' ::= S S' |`` when unbounded). It
returns NULL (ringserve's "llama.cpp could not parse the grammar") for:

- a syntax error, or a rule used and not defined;
- ``{m,n}`` with ``m`` over :data:`MAX_REPETITIONS` (2,000), or a repetition whose count times
  the rules its item made is over it (``("a"{0,40}){0,50}``: 41 rules, 50 times);
- left recursion, as ``llama_grammar_detect_left_recursion`` finds it: a rule that leads back
  to itself through the first item of an alternative, or an item after rules that have an empty
  alternative (``a ::= a "x" | "y"``; ``a ::= b "x"``, ``b ::= a | "y"``).

Its detection misses left recursion through a rule that derives the empty string without an
empty alternative of its own (``s ::= a s "x" | "y"``, ``a ::= "b"?``): then
``llama_grammar_advance_stack`` grows its stack without end and the sampler never returns. And
a rule no finite string matches (``s ::= "a" s``) is taken, but the model can never finish it.
:func:`check` refuses all of these, and a grammar that llama.cpp would expand to more than
:data:`MAX_RULES` rules or :data:`MAX_ELEMENTS` elements (``"a...a"{2000}`` writes its literal
2,000 times). Rules are read into a compact form: a repetition's copies and its chain of
optional rules are kept two deep (what left recursion and finiteness depend on), and counted
whole.
"""

from __future__ import annotations

from enum import IntEnum

import attrs

__all__ = ["MAX_ELEMENTS", "MAX_REPETITIONS", "MAX_RULES", "GrammarError", "check"]

#: llama.cpp's ``MAX_REPETITION_THRESHOLD``.
MAX_REPETITIONS = 2000
#: The most rules a grammar may expand to in llama.cpp (each ``S{0,n}`` is ``n`` rules).
MAX_RULES = 50_000
#: The most elements (a character, a range's end, a rule reference...) its rules may hold in all.
MAX_ELEMENTS = 1_000_000


class GrammarError(ValueError):
    """A grammar llama.cpp's sampler refuses or cannot use: ``reason`` says why, of ``rule``, the
    name of the rule at fault (a rule llama.cpp made for a group or a repetition is named ``<its
    rule>_<n>``), or "" when none is; ``str(error)`` is ``"<rule>: <reason>"``."""

    def __init__(self, reason: str, rule: str = "") -> None:
        super().__init__(f"{rule}: {reason}" if rule else reason)
        self.reason = reason
        self.rule = rule


class Kind(IntEnum):
    """``llama_gretype``: what an element of a rule is."""

    END = 0
    ALT = 1
    RULE_REF = 2
    CHAR = 3
    CHAR_NOT = 4
    CHAR_RNG_UPPER = 5
    CHAR_ALT = 6
    CHAR_ANY = 7


Element = tuple[Kind, int]
Rule = list[Element]

_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX = {"x": 2, "u": 4, "U": 8}


def _word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or c == "-" or ("0" <= c <= "9")


@attrs.define
class _Parser:
    """``llama_grammar_parser::parse`` over ``src``, keeping the rules compact (see the module
    docstring) and counting what llama.cpp would make."""

    src: str
    pos: int = 0
    symbols: dict[str, int] = attrs.Factory(dict)
    rules: dict[int, Rule] = attrs.Factory(dict)
    #: Symbols llama.cpp would have made so far (its ``symbol_ids.size()``).
    made: int = 0
    #: Elements llama.cpp's rules would hold.
    elements: int = 0

    def fail(self, what: str) -> GrammarError:
        return GrammarError(f"{what} at {self.src[self.pos:self.pos + 20]!r}")

    def peek(self, ahead: int = 0) -> str:
        at = self.pos + ahead
        return self.src[at] if at < len(self.src) else ""

    def space(self, newline_ok: bool) -> None:
        src, pos = self.src, self.pos
        while pos < len(src) and (src[pos] in " \t#" or (newline_ok and src[pos] in "\r\n")):
            if src[pos] == "#":
                while pos < len(src) and src[pos] not in "\r\n":
                    pos += 1
            else:
                pos += 1
        self.pos = pos

    def name(self) -> str:
        start = self.pos
        while self.pos < len(self.src) and _word(self.src[self.pos]):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting name")
        return self.src[start:self.pos]

    def number(self) -> int:
        start = self.pos
        while self.peek().isdigit() and self.peek().isascii():
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting an int")
        return int(self.src[start:self.pos])

    def char(self) -> int:
        c = self.peek()
        if c == "\\":
            e = self.peek(1)
            if e in _HEX:
                digits = self.src[self.pos + 2:self.pos + 2 + _HEX[e]]
                if len(digits) != _HEX[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                    raise self.fail(f"expecting {_HEX[e]} hex chars")
                self.pos += 2 + _HEX[e]
                return int(digits, 16)
            if e in _ESCAPES:
                self.pos += 2
                return _ESCAPES[e]
            raise self.fail("unknown escape")
        if not c:
            raise self.fail("unexpected end of input")
        self.pos += 1
        return ord(c)

    def symbol(self, name: str) -> int:
        """``get_symbol_id``."""
        if name not in self.symbols:
            self.symbols[name] = len(self.symbols)
            self.made += 1
        return self.symbols[name]

    def generated(self, base: str) -> int:
        """``generate_symbol_id``: a rule of its own, for a group or a repetition, named as
        llama.cpp names it."""
        self.made += 1
        name = f"{base}_{self.made - 1}"
        self.symbols[name] = len(self.symbols)
        return self.symbols[name]

    def add(self, rule_id: int, rule: Rule, counted: int) -> None:
        self.rules[rule_id] = rule
        self.elements += counted
        if self.made > MAX_RULES or self.elements > MAX_ELEMENTS:
            raise GrammarError(f"llama.cpp would expand it to more than {MAX_RULES:,} rules or"
                               f" {MAX_ELEMENTS:,} elements (a long item repeated many times)")

    def parse(self) -> dict[int, Rule]:
        self.space(True)
        while self.pos < len(self.src):
            self.rule()
        for name, rule_id in self.symbols.items():
            if rule_id not in self.rules:
                raise GrammarError("used and not defined", name)
        return self.rules

    def rule(self) -> None:
        name = self.name()
        self.space(False)
        if not self.src.startswith("::=", self.pos):
            raise self.fail("expecting ::=")
        self.pos += 3
        self.space(True)
        self.alternates(name, self.symbol(name), nested=False)
        if self.peek() == "\r":
            self.pos += 2 if self.peek(1) == "\n" else 1
        elif self.peek() == "\n":
            self.pos += 1
        elif self.peek():
            raise self.fail("expecting newline or end")
        self.space(True)

    def alternates(self, name: str, rule_id: int, nested: bool) -> None:
        rule: Rule = []
        counted = self.sequence(name, rule, nested)
        while self.peek() == "|":
            rule.append((Kind.ALT, 0))
            self.pos += 1
            self.space(True)
            counted += 1 + self.sequence(name, rule, nested)
        rule.append((Kind.END, 0))
        self.add(rule_id, rule, counted + 1)

    def sequence(self, name: str, rule: Rule, nested: bool) -> int:
        """``parse_sequence``: the items of one alternative onto ``rule``; the elements llama.cpp
        would have written there."""
        last = len(rule)  # where the last item starts
        last_counted = 0  # its elements in llama.cpp
        counted = 0
        n_prev_rules = 1
        while self.pos < len(self.src):
            c = self.peek()
            if c == '"':
                self.pos += 1
                last, last_counted, n_prev_rules = len(rule), 0, 1
                while self.peek() != '"':
                    rule.append((Kind.CHAR, self.char()))
                    last_counted += 1
                self.pos += 1
                counted += last_counted
                self.space(nested)
            elif c == "[":
                self.pos += 1
                kind = Kind.CHAR
                if self.peek() == "^":
                    self.pos += 1
                    kind = Kind.CHAR_NOT
                last, last_counted, n_prev_rules = len(rule), 0, 1
                while self.peek() != "]":
                    rule.append((kind if len(rule) == last else Kind.CHAR_ALT, self.char()))
                    last_counted += 1
                    if self.peek() == "-" and self.peek(1) != "]":
                        if not self.peek(1):
                            raise self.fail("unexpected end of input")
                        self.pos += 1
                        rule.append((Kind.CHAR_RNG_UPPER, self.char()))
                        last_counted += 1
                self.pos += 1
                counted += last_counted
                self.space(nested)
            elif _word(c):
                ref = self.symbol(self.name())
                self.space(nested)
                last, last_counted, n_prev_rules = len(rule), 1, 1
                rule.append((Kind.RULE_REF, ref))
                counted += 1
            elif c == "(":
                self.pos += 1
                self.space(True)
                before = self.made
                sub = self.generated(name)
                self.alternates(name, sub, nested=True)
                n_prev_rules = max(1, self.made - before)
                last, last_counted = len(rule), 1
                rule.append((Kind.RULE_REF, sub))
                counted += 1
                if self.peek() != ")":
                    raise self.fail("expecting ')'")
                self.pos += 1
                self.space(nested)
            elif c == ".":
                last, last_counted, n_prev_rules = len(rule), 1, 1
                rule.append((Kind.CHAR_ANY, 0))
                counted += 1
                self.pos += 1
                self.space(nested)
            elif c in "*+?{":
                self.pos += 1
                self.space(nested)
                if c == "*":
                    low, high = 0, None
                elif c == "+":
                    low, high = 1, None
                elif c == "?":
                    low, high = 0, 1
                else:
                    low, high = self.braces(nested)
                if last == len(rule):
                    raise self.fail("expecting preceding item to */+/?/{")
                n_prev_rules, added = self.repeat(name, rule, last, last_counted, n_prev_rules, low, high)
                counted += added
                last_counted += added
            else:
                break
        return counted

    def braces(self, nested: bool) -> tuple[int, int | None]:
        low = self.number()
        self.space(nested)
        high: int | None
        if self.peek() == "}":
            high = low
        elif self.peek() == ",":
            self.pos += 1
            self.space(nested)
            high = self.number() if self.peek().isdigit() else None
            self.space(nested)
            if self.peek() != "}":
                raise self.fail("expecting '}'")
        else:
            raise self.fail("expecting ','")
        self.pos += 1
        self.space(nested)
        if low > MAX_REPETITIONS:
            raise GrammarError(f"{{{low}}}: repeated more than {MAX_REPETITIONS:,} times"
                               " (llama.cpp's \"number of repetitions exceeds sane defaults\")")
        if high is not None and high > MAX_REPETITIONS:
            high = None  # llama.cpp reads it as unbounded
        return low, high

    def repeat(self, name: str, rule: Rule, last: int, last_counted: int, n_prev_rules: int, low: int,
               high: int | None) -> tuple[int, int]:
        """``handle_repetitions`` on the item at ``rule[last:]`` (``last_counted`` elements in
        llama.cpp): its ``n_prev_rules`` after, and the elements llama.cpp adds to ``rule``. The
        item is kept at most twice, and of the chain of optional rules ``S'(x) ::= S S'(x-1) |``
        the first two and the last (what left recursion and finiteness depend on).

        Raises:
            GrammarError: the count times the rules the item made is over :data:`MAX_REPETITIONS`.
        """
        total = high if high is not None and high > 0 else low if low > 0 else 1
        if n_prev_rules * total > MAX_REPETITIONS:
            raise GrammarError(f"a repetition of {total:,} times an item of {n_prev_rules:,} rules is over"
                               f" {MAX_REPETITIONS:,} (llama.cpp's \"number of rules that are going to be"
                               " repeated multiplied by the new repetition exceeds sane defaults\")")
        item = rule[last:]
        del rule[last:]
        rule.extend(item * min(low, 2))
        added = last_counted * (low - 1)
        optional = 1 if high is None else high - low
        kept: list[int] = []
        for i in range(optional):
            if i < 2 or i == optional - 1:
                rule_id = self.generated(name)
                if high is None:
                    tail = [(Kind.RULE_REF, rule_id)]
                else:
                    tail = [(Kind.RULE_REF, kept[-1])] if kept else []
                self.add(rule_id, [*item, *tail, (Kind.ALT, 0), (Kind.END, 0)], last_counted + len(tail) + 2)
                kept.append(rule_id)
            else:  # in llama.cpp only
                self.made += 1
                self.elements += last_counted + 3
        if kept:
            rule.append((Kind.RULE_REF, kept[-1]))
            added += 1
        return n_prev_rules * total, added


def _alternatives(rule: Rule) -> list[Rule]:
    out: list[Rule] = [[]]
    for element in rule:
        if element[0] is Kind.ALT:
            out.append([])
        elif element[0] is not Kind.END:
            out[-1].append(element)
    return out


Alternatives = dict[int, list[Rule]]


def _llama_left_recursion(alts: Alternatives) -> int | None:
    """``llama_grammar_detect_left_recursion`` over every rule, as ``llama_grammar_init_impl``
    runs it: a rule found left-recursive, or None. Iterative; a rule done is not walked again
    (walking it again could not find more)."""
    done: set[int] = set()
    in_progress: set[int] = set()
    may_be_empty = {rule_id for rule_id, rule_alts in alts.items() if [] in rule_alts}
    for start in alts:
        if start in done:
            continue
        in_progress.add(start)
        stack = [(start, 0, 0, True)]  # rule, alternative, element, whether its references are leftmost
        while stack:
            rule_id, a, i, recurse = stack.pop()
            rule_alts = alts[rule_id]
            descended = False
            while a < len(rule_alts):
                alt = rule_alts[a]
                while i < len(alt):
                    kind, value = alt[i]
                    if kind is not Kind.RULE_REF or not recurse:
                        recurse = False
                        break
                    if value in in_progress:
                        return value
                    if value not in done:
                        stack.append((rule_id, a, i, recurse))
                        stack.append((value, 0, 0, True))
                        in_progress.add(value)
                        descended = True
                        break
                    recurse = value in may_be_empty
                    i += 1
                if descended:
                    break
                a, i, recurse = a + 1, 0, True
            if descended:
                continue
            in_progress.discard(rule_id)
            done.add(rule_id)
            if stack:  # the parent waits at its reference to this rule
                parent, a, i, _ = stack.pop()
                stack.append((parent, a, i + 1, rule_id in may_be_empty))
    return None


def _derived(alts: Alternatives, terminals: bool) -> set[int]:
    """The rules with an alternative whose references are all to such rules: with
    ``terminals``, the rules some finite text matches; without, those that match the empty
    text (an alternative with a character is none of these). Counting, in time linear in the
    rules' size."""
    waiting: dict[int, list[list[int]]] = {}  # a rule: the counters of the alternatives that refer to it
    ready: list[int] = []
    for rule_id, rule_alts in alts.items():
        for alt in rule_alts:
            if not terminals and any(kind is not Kind.RULE_REF for kind, _ in alt):
                continue
            refs = [value for kind, value in alt if kind is Kind.RULE_REF]
            counter = [len(refs), rule_id]
            for value in refs:
                waiting.setdefault(value, []).append(counter)
            if not refs:
                ready.append(rule_id)
    found: set[int] = set()
    while ready:
        rule_id = ready.pop()
        if rule_id in found:
            continue
        found.add(rule_id)
        for counter in waiting.get(rule_id, ()):
            counter[0] -= 1
            if counter[0] == 0:
                ready.append(counter[1])
    return found


def _growing_left_cycle(alts: Alternatives) -> int | None:
    """A rule on a left-recursive cycle along which llama.cpp's stack grows (a reference on it
    is followed by more of its alternative), or None."""
    nullable = _derived(alts, terminals=False)
    edges: dict[int, list[tuple[int, bool]]] = {}
    for rule_id, rule_alts in alts.items():
        for alt in rule_alts:
            for i, (kind, value) in enumerate(alt):
                if kind is not Kind.RULE_REF:
                    break
                edges.setdefault(rule_id, []).append((value, i + 1 < len(alt)))
                if value not in nullable:
                    break
    for component in _cycles(alts, edges):
        inside = set(component)
        for rule_id in component:
            if any(grows and target in inside for target, grows in edges.get(rule_id, ())):
                return rule_id
    return None


def _cycles(alts: Alternatives, edges: dict[int, list[tuple[int, bool]]]) -> list[list[int]]:
    """The strongly connected components of ``edges`` that hold a cycle (Tarjan's, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    for root in alts:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = edges.get(node, [])
            if i < len(targets):
                work.append((node, i + 1))
                target = targets[i][0]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or any(target == node for target, _ in edges.get(node, ())):
                    out.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def _unfinishable(alts: Alternatives, root: int) -> int | None:
    """A rule reachable from ``root`` that no finite text matches, or None: one on the cycle of
    such rules that keeps it from ending (each of its alternatives refers to such a rule)."""
    finite = _derived(alts, terminals=True)
    seen, todo = {root}, [root]
    while todo:
        rule_id = todo.pop()
        if rule_id not in finite:
            on_the_way: set[int] = set()
            while rule_id not in on_the_way:
                on_the_way.add(rule_id)
                rule_id = next(value for alt in alts[rule_id] for kind, value in alt
                               if kind is Kind.RULE_REF and value not in finite)
            return rule_id
        for alt in alts[rule_id]:
            for kind, value in alt:
                if kind is Kind.RULE_REF and value not in seen:
                    seen.add(value)
                    todo.append(value)
    return None


def check(text: str, root: str = "root") -> None:
    """Whether llama.cpp's grammar sampler takes ``text`` (GBNF) with start rule ``root``, and
    can finish it (see the module docstring).

    Raises:
        GrammarError: llama.cpp's parser refuses it (a syntax error, a rule used and not
            defined, a repetition past :data:`MAX_REPETITIONS`, left recursion), or it would
            expand past :data:`MAX_RULES` or :data:`MAX_ELEMENTS`, loop llama.cpp's sampler
            (left recursion its check misses), or holds a rule reachable from ``root`` that no
            finite string matches; ``error.rule`` names the rule.
    """
    parser = _Parser(text)
    alts = {rule_id: _alternatives(rule) for rule_id, rule in parser.parse().items()}
    names = {rule_id: name for name, rule_id in parser.symbols.items()}
    if root not in parser.symbols:
        raise GrammarError(f"grammar does not contain a '{root}' symbol")
    found = _llama_left_recursion(alts)
    if found is None:
        found = _growing_left_cycle(alts)
    if found is not None:
        raise GrammarError("leads back to itself before it matches any text (left recursion)", names[found])
    found = _unfinishable(alts, parser.symbols[root])
    if found is not None:
        raise GrammarError("no finite text matches it", names[found])
