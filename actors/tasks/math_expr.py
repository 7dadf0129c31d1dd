"""Allow-listed math expressions: parse an answer, evaluate it under size bounds, compare two.

    node = parse("\\frac{\\sqrt{50}}{5}")   # raises Refused("syntax" | "too_large") for the rest
    same(parse("x^2+2x+1"), parse("(x+1)^2"))   # True

What parses: numbers (decimals, "1,000"), + - * / ^ (and **), implicit products ("2x", "2(3)"),
\\frac, \\sqrt (and \\sqrt[n]), postfix !, \\binom, the functions sin cos tan log ln exp sqrt, \\pi,
one-letter variables and Greek letters, parentheses and braces, a top-level list ("1, 2" or
"(1, 2)") and trailing unit words ("72 clips", "10 \\text{cm}"). Everything else (other commands,
_ | < : ; quotes, a name such as ``lambda``) is refused: model text is never handed to a general
parser, so nothing in it can run.

Why evaluation is bounded: every operation estimates the size of its result before computing it
(an exact rational's bit length, an approximate number's binary magnitude) and refuses when the
estimate exceeds MAX_BITS / MAX_MAGNITUDE_BITS, so 9^(9^9), (10^999)^999 or \\binom{10^6}{5*10^5}
cost microseconds. With at most MAX_NODES nodes, each step costs at most arithmetic on ~5,000-digit
integers or one 40-digit mpmath call.

Comparison: rationals exactly (Fractions); anything irrational at 40 digits (relative 1e-25);
when either side wrote a decimal, to 6 decimal places, as math-verify does ("0.3333333" = 1/3).
Expressions with variables are compared at a few fixed points (positive, so roots stay real).
"""
from __future__ import annotations

import math
import re
import zlib
from fractions import Fraction

import mpmath

MAX_ANSWER_CHARS = 400  # a final answer longer than this is not an answer
MAX_NODES = 256
MAX_DEPTH = 40  # nesting of brackets and operators (the parser recurses)
MAX_LITERAL_DIGITS = 400
MAX_BITS = 16384  # numerator / denominator of an exact intermediate (~4,900 digits)
MAX_MAGNITUDE_BITS = 16384  # |log2| of an approximate intermediate
MAX_ROOT_INDEX = 64
MAX_TRIG_ARGUMENT = 10**6  # sin of a huge number costs precision proportional to its size
MAX_ITEMS = 16  # elements of a top-level list
DPS = 40  # decimal digits of approximate evaluation
RELATIVE_TOLERANCE = mpmath.mpf(10) ** -25
DECIMAL_TOLERANCE = Fraction(1, 2_000_000)  # a written decimal counts to 6 places
POINTS = 3  # evaluations of an expression with variables

FUNCTIONS = ("sin", "cos", "tan", "log", "ln", "exp", "sqrt")
GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "sigma", "phi", "omega", "tau",
         "rho", "psi", "chi", "eta", "zeta", "nu", "xi", "kappa", "iota", "varepsilon", "varphi")
UNITS = ("cm", "mm", "km", "kg", "mg", "ml", "ft", "yd", "mi", "hr", "in", "oz", "lb", "lbs", "sq", "m2")


class Refused(ValueError):
    """The text is outside the allow-list (reason "syntax") or too big to evaluate ("too_large")."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Undefined(ArithmeticError):
    """A value that does not exist (division by zero, an even root of a negative, log of <= 0)."""


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


# ---- bounded evaluation ----------------------------------------------------------------------------

def _bits(q: Fraction) -> int:
    return max(q.numerator.bit_length(), q.denominator.bit_length())


def _check_bits(estimate: float) -> None:
    if estimate > MAX_BITS:
        raise Refused("too_large", f"an intermediate of ~{estimate:.3g} bits")


def _approx(x) -> mpmath.mpf:
    if isinstance(x, Fraction):
        return mpmath.mpf(x.numerator) / x.denominator
    return x


def _check_magnitude(x):
    if not isinstance(x, Fraction) and x != 0 and abs(mpmath.mag(x)) > MAX_MAGNITUDE_BITS:
        raise Refused("too_large", "an intermediate beyond 2^%d" % MAX_MAGNITUDE_BITS)
    return x


def _log2_abs(x) -> float:
    if isinstance(x, Fraction):
        return float(x.numerator.bit_length() - x.denominator.bit_length())
    return float(mpmath.mag(x))


def _exact_root(q: Fraction, k: int) -> Fraction | None:
    """q^(1/k) when it is rational (q >= 0), else None."""
    def iroot(n: int) -> int | None:
        r = round(n ** (1.0 / k)) if n.bit_length() < 1000 else int(mpmath.nint(mpmath.root(n, k)))
        for c in (r - 1, r, r + 1):
            if c >= 0 and c ** k == n:
                return c
        return None
    num, den = iroot(q.numerator), iroot(q.denominator)
    return None if num is None or den is None else Fraction(num, den)


def _integer(x) -> int | None:
    return x.numerator if isinstance(x, Fraction) and x.denominator == 1 else None


def _pow(base, exponent):
    if isinstance(base, Fraction) and isinstance(exponent, Fraction):
        if base == 0:
            if exponent <= 0:
                raise Undefined("0 to a power <= 0")
            return Fraction(0)
        if base in (1, -1) and exponent.denominator == 1:
            return base ** (exponent.numerator % 2 or 2)
        if exponent.numerator.bit_length() > 64:
            raise Refused("too_large", "a huge exponent")
        _check_bits(abs(exponent.numerator) * _bits(base) / exponent.denominator)
        if exponent.denominator == 1:
            return base ** exponent.numerator
        if base > 0 and exponent.denominator <= MAX_ROOT_INDEX:
            root = _exact_root(base, exponent.denominator)
            if root is not None:
                return root ** exponent.numerator
    b, e = _approx(base), _approx(exponent)
    if b == 0:
        if e <= 0:
            raise Undefined("0 to a power <= 0")
        return mpmath.mpf(0)
    if b < 0 and not mpmath.isint(e):
        raise Undefined("a negative base to a fractional power")
    if abs(_log2_abs(b) * e) > MAX_MAGNITUDE_BITS:  # mpmath would build the number
        raise Refused("too_large", "a power beyond 2^%d" % MAX_MAGNITUDE_BITS)
    return _check_magnitude(mpmath.power(b, e))


def _function(name: str, x):
    v = _approx(x)
    if name in ("sin", "cos", "tan"):
        if abs(v) > MAX_TRIG_ARGUMENT:
            raise Refused("too_large", f"{name} of a huge argument")
        if name == "tan" and abs(mpmath.cos(v)) < mpmath.mpf(10) ** -30:
            raise Undefined("tan at a pole")
        return getattr(mpmath, name)(v)
    if name in ("log", "ln"):
        if v <= 0:
            raise Undefined("log of a number <= 0")
        return mpmath.log(v) if name == "ln" else mpmath.log10(v)
    if name == "exp":
        return _pow(+mpmath.e, v)
    raise Refused("syntax", name)


def evaluate(node, env: dict):
    """The value of an expression node: a Fraction when exact, else an mpf. Raises Refused when an
    intermediate would be too big, Undefined when it does not exist. env: variable -> mpf."""
    op = node[0]
    if op == "num":
        return node[1]
    if op == "sym":
        return env[node[1]]
    if op == "const":
        return +(mpmath.pi if node[1] == "pi" else mpmath.e)
    if op == "neg":
        return -evaluate(node[1], env)
    if op in ("add", "sub", "mul", "div"):
        a, b = evaluate(node[1], env), evaluate(node[2], env)
        if op == "div" and b == 0:
            raise Undefined("division by zero")
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            _check_bits(_bits(a) + _bits(b) + 1)
            return {"add": a.__add__, "sub": a.__sub__, "mul": a.__mul__, "div": a.__truediv__}[op](b)
        a, b = _approx(a), _approx(b)
        return _check_magnitude({"add": a.__add__, "sub": a.__sub__, "mul": a.__mul__, "div": a.__truediv__}[op](b))
    if op == "pow":
        return _pow(evaluate(node[1], env), evaluate(node[2], env))
    if op == "sqrt":
        return _pow(evaluate(node[1], env), Fraction(1, 2))
    if op == "root":
        k = _integer(evaluate(node[2], env))
        if k is None or not 1 <= k <= MAX_ROOT_INDEX:
            raise Refused("syntax", "a root index that is not an integer in 1..%d" % MAX_ROOT_INDEX)
        x = evaluate(node[1], env)
        if k % 2 and x < 0:  # an odd root of a negative is real
            return -_pow(-x, Fraction(1, k))
        return _pow(x, Fraction(1, k))
    if op == "fact":
        n = _integer(evaluate(node[1], env))
        if n is None or n < 0:
            raise Undefined("factorial of a non-natural number")
        _check_bits(n * math.log2(max(n, 2)) if n < MAX_BITS else float("inf"))
        return Fraction(math.factorial(n))
    if op == "binom":
        n, k = _integer(evaluate(node[1], env)), _integer(evaluate(node[2], env))
        if n is None or k is None or n < 0:
            raise Undefined("binomial of non-natural numbers")
        if not 0 <= k <= n:
            return Fraction(0)
        small = min(k, n - k)
        _check_bits(min(n, small * math.log2(max(n, 2))) if n.bit_length() < 64 else float("inf"))
        return Fraction(math.comb(n, k))
    if op == "fn":
        return _check_magnitude(_function(node[1], evaluate(node[2], env)))
    raise Refused("syntax", op)


# ---- comparison ------------------------------------------------------------------------------------

def _walk(node):
    yield node
    for child in node[1:]:
        if isinstance(child, tuple) and child and isinstance(child[0], str):
            yield from _walk(child)
        elif isinstance(child, tuple):  # a list's items
            for item in child:
                yield from _walk(item)


def symbols(node) -> set[str]:
    return {n[1] for n in _walk(node) if n[0] == "sym"}


def has_decimal(node) -> bool:
    return any(n[0] == "num" and n[2] for n in _walk(node))


def _close(a, b, decimal: bool) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if not decimal:
            return a == b
        _check_bits(_bits(a) + _bits(b) + 1)
        return abs(a - b) <= DECIMAL_TOLERANCE
    x, y = _approx(a), _approx(b)
    diff = abs(x - y)
    return bool(diff <= RELATIVE_TOLERANCE * max(1, abs(x), abs(y))
                or (decimal and diff <= _approx(DECIMAL_TOLERANCE)))


def _point(name: str, k: int) -> mpmath.mpf:
    """A fixed irrational-looking point in (0.5, 2.5) for variable `name`, evaluation k."""
    h = zlib.crc32(f"{name}/{k}".encode())
    return mpmath.mpf(1) / 2 + mpmath.mpf(h % 1_000_003) / 500_001 + mpmath.sqrt(2) / 10**7


def _equal_values(a, b, env, decimal) -> bool:
    try:
        va, vb = evaluate(a, env), evaluate(b, env)
    except Undefined:
        return False
    return _close(va, vb, decimal)


def _equal_expr(a, b, decimal: bool) -> bool:
    names = sorted(symbols(a) | symbols(b))
    if not names:
        return _equal_values(a, b, {}, decimal)
    return all(_equal_values(a, b, {n: _point(n, k) for n in names}, decimal) for k in range(POINTS))


def same(a, b) -> bool:
    """Are two parsed answers the same value (lists: item by item; unordered unless both are
    ordered tuples)? Raises Refused when evaluating either needs too big a number."""
    decimal = has_decimal(a) or has_decimal(b)
    with mpmath.workdps(DPS):
        if a[0] != "list" and b[0] != "list":
            return _equal_expr(a, b, decimal)
        if a[0] != "list" or b[0] != "list" or len(a[2]) != len(b[2]):
            return False
        if a[1] and b[1]:
            return all(_equal_expr(x, y, decimal) for x, y in zip(a[2], b[2]))
        if a[1] != b[1]:
            return False
        left = list(b[2])
        for x in a[2]:
            match = next((j for j, y in enumerate(left) if _equal_expr(x, y, decimal)), None)
            if match is None:
                return False
            left.pop(match)
        return True
