"""Allow-listed math answers: the parser (math_expr.py evaluates and compares what it returns).

    node = parse("\\frac{\\sqrt{50}}{5}")   # ("div", ("sqrt", ("num", 50, False)), ("num", 5, False))

What parses: numbers (decimals, "1,000"), + - * / ^ (and **), implicit products ("2x", "2(3)"),
\\frac, \\sqrt (and \\sqrt[n]), postfix !, \\binom, the functions sin cos tan log ln exp sqrt,
\\pi and e, one-letter variables and Greek letters, parentheses and braces, a top-level list
("1, 2", "(1, 2)", "\\{1, 2\\}"), an equation's right-hand side, and trailing unit words ("72
clips", "10 \\text{cm}"). Everything else (other commands, _ | < : ; quotes, a name such as
``lambda``) is refused with Refused("syntax"): model text is never handed to a general parser, so
nothing in it can run. The answer's length, its literals' digits, its node count and its nesting
are bounded (Refused("too_large")), so parsing is linear in a short text.
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 400  # a final answer longer than this is not an answer
MAX_NODES = 256
MAX_DEPTH = 40  # nesting of brackets and operators (the parser recurses)
MAX_LITERAL_DIGITS = 400
MAX_ITEMS = 16  # elements of a top-level list

FUNCTIONS = ("sin", "cos", "tan", "log", "ln", "exp", "sqrt")
GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "sigma", "phi", "omega", "tau",
         "rho", "psi", "chi", "eta", "zeta", "nu", "xi", "kappa", "iota", "varepsilon", "varphi")
UNITS = ("cm", "mm", "km", "kg", "mg", "ml", "ft", "yd", "mi", "hr", "in", "oz", "lb", "lbs", "sq", "m2")


class Refused(ValueError):
    """The text is outside the allow-list (reason "syntax") or too big to evaluate ("too_large")."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---- normalization ---------------------------------------------------------------------------------

_REPLACE = [
    (re.compile(r"\\[dt]frac(?![a-zA-Z])"), r"\\frac"),
    (re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])\.?"), ""),
    (re.compile(r"\\(?:displaystyle|quad|qquad|,|;|:|!| )"), " "),
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![a-zA-Z])"), ""),
    (re.compile(r"\\(?:cdot|times)(?![a-zA-Z])|×|·|⋅"), "*"),
    (re.compile(r"\\div(?![a-zA-Z])|÷"), "/"),
    (re.compile(r"\\%|%|\\\$|\$"), ""),
    (re.compile(r"−|–"), "-"),
    (re.compile(r"\*\*"), "^"),
    (re.compile(r"~"), " "),
]
# \text{...} and friends: their content is a word (a unit) or a number.
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf|operatorname)\s*\{([^{}]*)\}")
_TRAILING_UNITS = re.compile(r"(?:\s*(?<![\\A-Za-z])(?:[A-Za-z]{3,}|" + "|".join(UNITS) + r")\b\.?)+\s*$")


def normalize(text: str) -> str:
    """The answer with typography, units and percent signs taken out (linear-time substitutions)."""
    s = _TEXT.sub(lambda m: " " + m.group(1) + " ", text)
    for pattern, repl in _REPLACE:
        s = pattern.sub(repl, s)
    s = s.strip().rstrip(".").strip()
    stripped = _TRAILING_UNITS.sub("", s).strip()
    return stripped if stripped else s


# ---- tokens ----------------------------------------------------------------------------------------

_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?![\d])(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+")
_WORD = re.compile(r"[A-Za-z]+")
_OPS = set("+-*/^()[]{},!=")


def tokenize(s: str) -> list[tuple[str, object]]:
    """(kind, value) pairs: num (Fraction, decimal?), sym, const (pi, e), fn, frac, sqrt, binom, op, lset/rset."""
    out: list[tuple[str, object]] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c.isspace():
            i += 1
        elif c.isdigit() or (c == "." and i + 1 < n and s[i + 1].isdigit()):
            m = _NUMBER.match(s, i)
            digits = m.group().replace(",", "")
            if len(digits) > MAX_LITERAL_DIGITS:
                raise Refused("too_large", "a literal of more than %d digits" % MAX_LITERAL_DIGITS)
            out.append(("num", (Fraction(digits.rstrip(".") or "0"), "." in digits)))
            i = m.end()
        elif c == "\\":
            if s.startswith("\\{", i) or s.startswith("\\}", i):
                out.append(("lset" if s[i + 1] == "{" else "rset", None))
                i += 2
                continue
            m = _WORD.match(s, i + 1)
            if m is None:
                raise Refused("syntax", f"command {s[i:i + 2]!r}")
            name = m.group()
            if name in ("frac", "sqrt", "binom"):
                out.append((name, None))
            elif name in FUNCTIONS:
                out.append(("fn", name))
            elif name == "pi":
                out.append(("const", "pi"))
            elif name in GREEK:
                out.append(("sym", name))
            else:
                raise Refused("syntax", f"command \\{name}")
            i = m.end()
        elif c.isalpha() and c.isascii():
            m = _WORD.match(s, i)
            word = m.group()
            if word in FUNCTIONS:
                out.append(("fn", word))
            elif word == "pi":
                out.append(("const", "pi"))
            elif len(word) <= 2:  # "xy" is x times y; e is Euler's number, as SymPy reads it
                out.extend(("const", "e") if ch == "e" else ("sym", ch) for ch in word)
            else:
                raise Refused("syntax", f"name {word!r}")
            i = m.end()
        elif c in _OPS:
            out.append(("op", c))
            i += 1
        else:
            raise Refused("syntax", f"character {c!r}")
    return out


# ---- parser ----------------------------------------------------------------------------------------

_CLOSE = {"(": ")", "[": "]", "{": "}"}


class _Parser:
    """Recursive descent over the tokens; builds tuples ("op", *children)."""

    def __init__(self, tokens):
        self.t, self.i, self.depth, self.nodes = tokens, 0, 0, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else ("end", None)

    def take(self, kind, value=None):
        k, v = self.peek()
        if k != kind or (value is not None and v != value):
            raise Refused("syntax", f"expected {value or kind}, got {v or k}")
        self.i += 1
        return v

    def node(self, *parts):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise Refused("too_large", f"more than {MAX_NODES} nodes")
        return parts

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused("too_large", f"nested deeper than {MAX_DEPTH}")

    def expr(self):
        self.enter()
        left = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take("op")
            left = self.node("add" if op == "+" else "sub", left, self.term())
        self.depth -= 1
        return left

    def _starts_primary(self):
        k, v = self.peek()
        return k in ("num", "sym", "const", "fn", "frac", "sqrt", "binom") or (k == "op" and v in "([{")

    def term(self):
        left = self.unary()
        while True:
            k, v = self.peek()
            if k == "op" and v in "*/":
                self.i += 1
                left = self.node("mul" if v == "*" else "div", left, self.unary())
            elif self._starts_primary():
                if k == "num" and left[0] == "num":
                    raise Refused("syntax", "two numbers side by side")
                left = self.node("mul", left, self.power())
            else:
                return left

    def unary(self):
        k, v = self.peek()
        if k == "op" and v in "+-":
            self.i += 1
            self.enter()
            inner = self.unary()
            self.depth -= 1
            return inner if v == "+" else self.node("neg", inner)
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() == ("op", "^"):
            self.i += 1
            self.enter()
            exponent = self.unary()  # right-associative: a^b^c = a^(b^c)
            self.depth -= 1
            return self.node("pow", base, exponent)
        return base

    def postfix(self):
        node = self.primary()
        while self.peek() == ("op", "!"):
            self.i += 1
            node = self.node("fact", node)
        return node

    def group(self):
        """A bracketed expression: ( ), [ ] or { }."""
        opener = self.take("op")
        if opener not in _CLOSE:
            raise Refused("syntax", f"unexpected {opener!r}")
        inner = self.expr()
        self.take("op", _CLOSE[opener])
        return inner

    def primary(self):
        k, v = self.peek()
        if k == "num":
            self.i += 1
            node = self.node("num", v[0], v[1])
            if self.peek()[0] == "frac" and not v[1]:  # a mixed number: 3\frac{1}{2} is 3.5
                start = self.i
                frac = self.primary()
                if frac[1][0] == "num" and frac[2][0] == "num":
                    return self.node("add", node, frac)
                self.i, node = start, node  # not a mixed number: the product is parsed by term()
            return node
        if k == "sym":
            self.i += 1
            return self.node("sym", v)
        if k == "const":
            self.i += 1
            return self.node("const", v)
        if k == "op" and v in "([{":
            self.enter()
            inner = self.group()
            self.depth -= 1
            return inner
        if k == "frac":
            self.i += 1
            return self.node("div", self.braced(), self.braced())
        if k == "binom":
            self.i += 1
            return self.node("binom", self.braced(), self.braced())
        if k == "sqrt":
            self.i += 1
            if self.peek() == ("op", "["):
                index = self.group()
                return self.node("root", self.braced(), index)
            return self.node("sqrt", self.braced())
        if k == "fn":
            self.i += 1
            if self.peek() == ("op", "^"):  # \sin^2 x
                raise Refused("syntax", "a power of a function name")
            self.enter()
            arg = self.power() if self.peek()[0] != "op" else self.group()
            self.depth -= 1
            return self.node("sqrt" if v == "sqrt" else "fn", *((arg,) if v == "sqrt" else (v, arg)))
        raise Refused("syntax", f"unexpected {v or k}")

    def braced(self):
        """A LaTeX argument: {expr}, or one token (\\frac12)."""
        if self.peek() == ("op", "{"):
            self.enter()
            inner = self.group()
            self.depth -= 1
            return inner
        k, v = self.peek()
        if k == "num":  # \frac12: one digit each
            self.i += 1
            value, decimal = v
            if not decimal and value.denominator == 1 and value.numerator >= 10:
                digits = str(value.numerator)
                self.t.insert(self.i, ("num", (Fraction(digits[1:]), False)))
                return self.node("num", Fraction(int(digits[0])), False)
            return self.node("num", value, decimal)
        return self.primary()


def _split_top(tokens, sep=("op", ",")):
    parts, depth, cur = [], 0, []
    for tok in tokens:
        if tok[0] == "op" and tok[1] in "([{" or tok[0] == "lset":
            depth += 1
        elif tok[0] == "op" and tok[1] in ")]}" or tok[0] == "rset":
            depth -= 1
        if depth == 0 and tok == sep:
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    parts.append(cur)
    return parts


def _parse_one(tokens):
    if not tokens:
        raise Refused("syntax", "empty")
    p = _Parser(list(tokens))
    node = p.expr()
    if p.i != len(p.t):
        raise Refused("syntax", f"unexpected {p.peek()[1] or p.peek()[0]}")
    return node, p.nodes


def parse(text: str):
    """The allow-listed AST of one answer: ("list", ordered, items) or an expression node.

    An equation answers with its right-hand side ("x = 5" is 5). Raises Refused."""
    if len(text) > MAX_ANSWER_CHARS:
        raise Refused("too_large", f"an answer longer than {MAX_ANSWER_CHARS} characters")
    tokens = tokenize(normalize(text))
    eq = _split_top(tokens, ("op", "="))
    tokens = eq[-1]
    ordered = None
    if tokens and tokens[0][0] == "lset" and tokens[-1][0] == "rset":
        tokens, ordered = tokens[1:-1], False
    elif tokens and tokens[0] in (("op", "("), ("op", "[")) and tokens[-1] == ("op", _CLOSE[tokens[0][1]]):
        inner = _split_top(tokens[1:-1])
        if len(inner) > 1:
            tokens, ordered = tokens[1:-1], True
    items = _split_top(tokens)
    if any(t[0] in ("lset", "rset") for t in tokens):
        raise Refused("syntax", "a set inside an expression")
    if len(items) == 1 and ordered is None:
        return _parse_one(items[0])[0]
    if len(items) > MAX_ITEMS:
        raise Refused("too_large", f"a list of more than {MAX_ITEMS} items")
    total, nodes = 0, []
    for item in items:
        node, count = _parse_one(item)
        total += count
        if total > MAX_NODES:
            raise Refused("too_large", f"more than {MAX_NODES} nodes")
        nodes.append(node)
    return ("list", bool(ordered), tuple(nodes))
