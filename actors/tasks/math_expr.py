"""Allow-listed math answers: bounded evaluation and comparison of what math_parse.parse returns.

    same(parse("x^2+2x+1"), parse("(x+1)^2"))   # True
    same(parse("1"), parse("9^{9^9}"))          # raises Refused("too_large") in microseconds

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
import threading
import zlib
from fractions import Fraction

import mpmath

from cadence.actors.tasks.math_parse import Refused, parse  # noqa: F401 - parse: one import for callers

MAX_BITS = 16384  # numerator / denominator of an exact intermediate (~4,900 digits)
MAX_MAGNITUDE_BITS = 16384  # |log2| of an approximate intermediate
MAX_ROOT_INDEX = 64
MAX_TRIG_ARGUMENT = 10**6  # sin of a huge number costs precision proportional to its size
DPS = 40  # decimal digits of approximate evaluation


class _PerThread(threading.local):
    """mpmath contexts of our own, one per thread: mpmath's global one, and its precision (which
    its functions raise and restore while they work), would be shared by every actor thread."""

    def __init__(self):
        self.context = mpmath.MPContext()
        self.context.dps = DPS


_LOCAL = _PerThread()


class _Context:
    def __getattr__(self, name):
        return getattr(_LOCAL.context, name)


mp = _Context()
RELATIVE_TOLERANCE = mpmath.mpf(10) ** -25
DECIMAL_TOLERANCE = Fraction(1, 2_000_000)  # a written decimal counts to 6 places
POINTS = 3  # evaluations of an expression with variables


class Undefined(ArithmeticError):
    """A value that does not exist (division by zero, an even root of a negative, log of <= 0)."""


# ---- bounded evaluation ----------------------------------------------------------------------------

def _bits(q: Fraction) -> int:
    return max(q.numerator.bit_length(), q.denominator.bit_length())


def _check_bits(estimate: float) -> None:
    if estimate > MAX_BITS:
        raise Refused("too_large", f"an intermediate of ~{estimate:.3g} bits")


def _approx(x) -> mpmath.mpf:
    if isinstance(x, Fraction):
        return mp.mpf(x.numerator) / x.denominator
    return x


def _check_magnitude(x):
    if not isinstance(x, Fraction) and x != 0 and abs(mp.mag(x)) > MAX_MAGNITUDE_BITS:
        raise Refused("too_large", "an intermediate beyond 2^%d" % MAX_MAGNITUDE_BITS)
    return x


def _log2_abs(x) -> float:
    if isinstance(x, Fraction):
        return float(x.numerator.bit_length() - x.denominator.bit_length())
    return float(mp.mag(x))


def _iroot(n: int, k: int) -> int:
    """floor(n ** (1/k)) for n >= 0, by integer Newton steps (exact at any size)."""
    if n < 2:
        return n
    x = 1 << -(-n.bit_length() // k)  # >= the root
    while True:
        y = ((k - 1) * x + n // x ** (k - 1)) // k
        if y >= x:
            return x
        x = y


def _exact_root(q: Fraction, k: int) -> Fraction | None:
    """q^(1/k) when it is rational (q >= 0), else None."""
    num, den = _iroot(q.numerator, k), _iroot(q.denominator, k)
    return Fraction(num, den) if num ** k == q.numerator and den ** k == q.denominator else None


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
        return mp.mpf(0)
    if b < 0 and not mp.isint(e):
        raise Undefined("a negative base to a fractional power")
    if abs(_log2_abs(b) * e) > MAX_MAGNITUDE_BITS:  # mpmath would build the number
        raise Refused("too_large", "a power beyond 2^%d" % MAX_MAGNITUDE_BITS)
    return _check_magnitude(mp.power(b, e))


def _function(name: str, x):
    v = _approx(x)
    if name in ("sin", "cos", "tan"):
        if abs(v) > MAX_TRIG_ARGUMENT:
            raise Refused("too_large", f"{name} of a huge argument")
        if name == "tan" and abs(mp.cos(v)) < mp.mpf(10) ** -30:
            raise Undefined("tan at a pole")
        return getattr(mp, name)(v)
    if name in ("log", "ln"):
        if v <= 0:
            raise Undefined("log of a number <= 0")
        return mp.log(v) if name == "ln" else mp.log10(v)
    if name == "exp":
        return _pow(+mp.e, v)
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
        return +(mp.pi if node[1] == "pi" else mp.e)
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
    return mp.mpf(1) / 2 + mp.mpf(h % 1_000_003) / 500_001 + mp.sqrt(2) / 10**7


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
