"""A seeded generator of GSM8K-style arithmetic word problems with exact integer answers.

    problem = generate(random.Random(7), num_ops=2)
    problem.text    # "Mia has $40. She buys 3 notebooks that cost $6 each. How many dollars ..."
    problem.tree    # ("-", 40, ("*", 3, 6)): the problem's arithmetic, every leaf stated in the text
    problem.answer  # 22 == evaluate(problem.tree)

Each problem comes from one of a few families of templates (a person's collection that grows and
shrinks, shopping where each item costs the same, rates over time, groups of people), with one to
three operations among + - * and exact division. Numbers are drawn so that every intermediate
value and the answer are non-negative integers of moderate size (<= MAX_VALUE / MAX_ANSWER);
a draw that breaks a bound is redrawn from the same random.Random, so a problem is a pure function
of the generator's state.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Union

Tree = Union[int, tuple]  # an int leaf, or (op, left, right) with op in "+-*/"
OPS = ("+", "-", "*", "/")
MAX_VALUE = 2000  # bound on every intermediate value
MAX_ANSWER = 1000
_MAX_TRIES = 1000  # redraws before giving up on a template (none needs more than a few)


class Reject(Exception):
    """A draw broke a bound (negative, inexact, too large): draw again."""


def evaluate(tree: Tree) -> int:
    """The value of an expression tree; division must be exact.

    Raises:
      Reject: a negative intermediate value, an inexact or zero division, or a value over MAX_VALUE.
    """
    if isinstance(tree, int):
        return tree
    op, left, right = tree
    a, b = evaluate(left), evaluate(right)
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    elif op == "/":
        if b == 0 or a % b:
            raise Reject(f"{a} / {b} is not an exact division")
        value = a // b
    else:
        raise ValueError(f"unknown operator {op!r}")
    if not 0 <= value <= MAX_VALUE:
        raise Reject(f"{a} {op} {b} = {value} is out of range")
    return value


def count_ops(tree: Tree) -> int:
    """Number of operations in a tree."""
    return 0 if isinstance(tree, int) else 1 + count_ops(tree[1]) + count_ops(tree[2])


def solution(tree: Tree) -> str:
    """A worked solution: one line per operation, innermost first, then the boxed answer."""
    lines: list[str] = []

    def walk(node: Tree) -> int:
        if isinstance(node, int):
            return node
        a, b = walk(node[1]), walk(node[2])
        value = evaluate((node[0], a, b))
        lines.append(f"{a} {node[0]} {b} = {value}")
        return value

    answer = walk(tree)
    return "\n".join(lines) + f"\nThe answer is \\boxed{{{answer}}}."


@dataclasses.dataclass(frozen=True)
class Problem:
    text: str
    tree: Tree
    answer: int
    family: str

    @property
    def ops(self) -> int:
        return count_ops(self.tree)


# ---- the words ----------------------------------------------------------------------------------
# (name, subject, object, possessive, reflexive)
PEOPLE = [("Mia", "she", "her", "her", "herself"), ("Liam", "he", "him", "his", "himself"),
          ("Sofia", "she", "her", "her", "herself"), ("Noah", "he", "him", "his", "himself"),
          ("Ava", "she", "her", "her", "herself"), ("Ethan", "he", "him", "his", "himself"),
          ("Zara", "she", "her", "her", "herself"), ("Omar", "he", "him", "his", "himself"),
          ("Lena", "she", "her", "her", "herself"), ("Kenji", "he", "him", "his", "himself"),
          ("Priya", "she", "her", "her", "herself"), ("Mateo", "he", "him", "his", "himself"),
          ("Chloe", "she", "her", "her", "herself"), ("Tomas", "he", "him", "his", "himself"),
          ("Amara", "she", "her", "her", "herself"), ("Jonah", "he", "him", "his", "himself")]
FRIENDS = ["a friend", "{poss} brother", "{poss} sister", "a classmate", "a neighbor", "{poss} cousin"]
COLLECTIONS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "seashells",
               "baseball cards", "balloons", "beads", "crayons", "toy cars"]
# (plural, singular)
ITEMS = [("notebooks", "notebook"), ("pens", "pen"), ("sandwiches", "sandwich"),
         ("movie tickets", "movie ticket"), ("cupcakes", "cupcake"), ("T-shirts", "T-shirt"),
         ("flower pots", "flower pot"), ("comic books", "comic book"), ("juice boxes", "juice box")]
SHOPS = ["the bakery", "the market", "the bookstore", "the school fair", "a toy store", "the mall"]
# (who, verb, past participle, things, unit of time)
WORKERS = [("A machine", "makes", "made", "toys", "hour"), ("A baker", "bakes", "baked", "loaves", "day"),
           ("A printer", "prints", "printed", "pages", "minute"),
           ("A farmer", "picks", "picked", "baskets of apples", "day"),
           ("A factory line", "fills", "filled", "bottles", "minute"),
           ("A kitchen", "cooks", "cooked", "meals", "hour")]
# (traveller, verb, lowest and highest speed in km per hour)
TRAVELLERS = [("A train", "travels", 40, 120), ("A cyclist", "rides", 8, 25), ("A car", "drives", 30, 90),
              ("A runner", "runs", 5, 15), ("A boat", "sails", 10, 40)]
# (place, groups, members, how members leave, how they come)
GROUPS = [("A school", "classes", "students", "are absent", "join"),
          ("A club", "teams", "players", "leave", "join"),
          ("An orchard", "rows", "trees", "are cut down", "are planted"),
          ("A theater", "rows", "seats", "are broken", "are added"),
          ("A parking garage", "floors", "parking spaces", "are closed", "are added")]


class _Words:
    """One draw of the fillers a template uses."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.name, self.subj, self.obj, self.poss, self.refl = rng.choice(PEOPLE)
        self.Subj = self.subj.capitalize()

    def friend(self) -> str:
        return self.rng.choice(FRIENDS).format(poss=self.poss)

    def n(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, options):
        return self.rng.choice(options)


# ---- family 1: a collection that grows and shrinks ("how many are left") -------------------------

def _collection(w: _Words, num_ops: int) -> tuple[str, Tree]:
    things = w.pick(COLLECTIONS)
    acc: Tree = w.n(5, 60)
    value = acc
    sentences = [w.pick([f"{w.name} has {value} {things}.", f"{w.name} collected {value} {things}.",
                         f"{w.name} had {value} {things} in a box."])]
    ops = [w.pick(OPS) for _ in range(num_ops)]
    for i, op in enumerate(ops):
        last = i == num_ops - 1
        if op == "+":
            n = w.n(2, 30)
            sentences.append(w.pick([f"{w.Subj} buys {n} more.", f"{w.Subj} finds {n} more {things}.",
                                     f"{w.friend().capitalize()} gives {w.obj} {n} more {things}."]))
        elif op == "-":
            if value < 3:
                raise Reject("too few to take some away")
            n = w.n(2, min(value - 1, 40))
            sentences.append(w.pick([f"{w.Subj} gives {n} {things} to {w.friend()}.",
                                     f"{w.Subj} loses {n} of them.",
                                     f"{w.Subj} sells {n} of them at a yard sale."]))
        elif op == "*":
            n = w.n(2, 4)
            sentences.append(f"By the end of the month, {w.subj} has {n} times as many {things} as before.")
        else:
            divisors = [d for d in range(2, 10) if value % d == 0 and d < value]
            if not divisors:
                raise Reject("no exact split")
            n = w.pick(divisors)
            sentences.append(f"{w.Subj} puts all of them into {n} bags, with the same number in each."
                             if last else
                             f"{w.Subj} shares them equally among {n} people, {w.refl} included, and "
                             f"keeps {w.poss} share.")
        acc = (op, acc, n)
        value = evaluate(acc)
    question = {"/": f"How many {things} are in each bag?",
                "-": w.pick([f"How many {things} does {w.name} have left?", f"How many {things} are left?"]),
                }.get(ops[-1], f"How many {things} does {w.name} have now?")
    return " ".join([*sentences, question]), acc


# ---- family 2: shopping, each item costs the same --------------------------------------------

def _shop(w: _Words, num_ops: int) -> tuple[str, Tree]:
    (items, item), (items2, item2) = w.rng.sample(ITEMS, 2)
    shop = w.pick(SHOPS)
    c, p = w.n(2, 12), w.n(1, 15)
    at = f"At {shop}, {w.name}"
    if num_ops == 1:
        kind = w.pick(["total", "unit", "left"])
        if kind == "total":
            return (f"{at} buys {c} {items}. Each {item} costs ${p}. "
                    f"How many dollars does {w.subj} spend?"), ("*", c, p)
        if kind == "unit":
            return (f"{at} pays ${c * p} for {c} {items}. Each {item} costs the same. "
                    f"How many dollars does one {item} cost?"), ("/", c * p, c)
        m, s = w.n(10, 100), w.n(1, 60)
        return (f"{w.name} has ${m}. {w.Subj} spends ${s} at {shop}. "
                f"How many dollars does {w.subj} have left?"), ("-", m, s)
    q = w.n(1, 20)
    if num_ops == 2:
        kind = w.pick(["plus", "left", "split"])
        if kind == "plus":
            return (f"{at} buys {c} {items} at ${p} each and a {item2} for ${q}. "
                    f"How many dollars does {w.subj} spend in all?"), ("+", ("*", c, p), q)
        if kind == "left":
            m = w.n(c * p, c * p + 60)
            return (f"{w.name} has ${m}. {w.Subj} buys {c} {items} that cost ${p} each. "
                    f"How many dollars does {w.subj} have left?"), ("-", m, ("*", c, p))
        k = w.n(2, 6)
        return (f"{at} buys {c} {items} at ${p} each for a group of {k} people, who split the cost "
                f"equally. How many dollars does each person pay?"), ("/", ("*", c, p), k)
    kind = w.pick(["two kinds", "change", "split"])
    if kind == "two kinds":
        d = w.n(2, 9)
        return (f"{at} buys {c} {items} at ${p} each and {d} {items2} at ${q} each. "
                f"How many dollars does {w.subj} spend?"), ("+", ("*", c, p), ("*", d, q))
    if kind == "change":
        m = w.pick([20, 50, 100, 200])
        return (f"{at} buys {c} {items} at ${p} each and a {item2} for ${q}. {w.Subj} pays with a "
                f"${m} bill. How many dollars of change does {w.subj} get?"), ("-", m, ("+", ("*", c, p), q))
    k = w.n(2, 6)
    return (f"{at} buys {c} {items} at ${p} each and pays ${q} for delivery. The {k} people in "
            f"{w.poss} family split the cost equally. How many dollars does each person pay?"), \
        ("/", ("+", ("*", c, p), q), k)


# ---- family 3: rates over time (work and distance) ----------------------------------------------

def _rate(w: _Words, num_ops: int) -> tuple[str, Tree]:
    if w.rng.random() < 0.3:
        return _distance(w, num_ops)
    who, verb, done, things, unit = w.pick(WORKERS)
    r, h = w.n(2, 25), w.n(2, 12)
    made = f"{who} {verb} {r} {things} every {unit}."
    if num_ops == 1:
        if w.rng.random() < 0.5:
            return f"{made} How many {things} are {done} in {h} {unit}s?", ("*", r, h)
        return (f"{who} {verb} {r * h} {things} in {h} {unit}s, working at a steady rate. "
                f"How many {things} are {done} each {unit}?"), ("/", r * h, h)
    k = w.n(1, 40)
    if num_ops == 2:
        kind = w.pick(["sold", "boxes", "stock"])
        if kind == "sold":
            gone = w.pick(["sold", "given away", "shipped"])
            return (f"{made} After {h} {unit}s, {k} of them are {gone}. How many are left?"), \
                ("-", ("*", r, h), k)
        if kind == "boxes":
            b = w.pick([2, 3, 4, 5, 6, 8, 10])
            return (f"{made} After {h} {unit}s, all of them are packed in boxes of {b}. "
                    f"How many boxes are filled?"), ("/", ("*", r, h), b)
        return (f"There are {k} {things} in storage. {made} How many {things} are in storage "
                f"after {h} {unit}s?"), ("+", k, ("*", r, h))
    if w.rng.random() < 0.5:
        s, t = w.n(2, 25), w.n(2, 12)
        return (f"{who} {verb} {r} {things} every {unit} for {h} {unit}s, then {s} {things} every "
                f"{unit} for {t} more {unit}s. How many {things} are {done} in all?"), \
            ("+", ("*", r, h), ("*", s, t))
    b = w.pick([2, 3, 4, 5, 6, 8, 10])
    return (f"{made} After {h} {unit}s, {k} of them are given away and the rest are packed in "
            f"boxes of {b}. How many boxes are filled?"), ("/", ("-", ("*", r, h), k), b)


def _distance(w: _Words, num_ops: int) -> tuple[str, Tree]:
    who, verb, lo, hi = w.pick(TRAVELLERS)
    s, h = w.n(lo, hi), w.n(2, 8)
    if num_ops == 1:
        return (f"{who} {verb} at {s} km per hour for {h} hours. How many km is that?"), ("*", s, h)
    if num_ops == 2:
        total = w.n(s * h, s * h + 200)
        return (f"A trip is {total} km long. {who} {verb} at {s} km per hour for {h} hours. "
                f"How many km of the trip are left?"), ("-", total, ("*", s, h))
    s2, h2 = w.n(lo, hi), w.n(2, 8)
    return (f"{who} {verb} at {s} km per hour for {h} hours, then at {s2} km per hour for {h2} hours. "
            f"How many km is that in all?"), ("+", ("*", s, h), ("*", s2, h2))


# ---- family 4: groups of people or things -----------------------------------------------------

def _groups(w: _Words, num_ops: int) -> tuple[str, Tree]:
    place, groups, members, leave, come = w.pick(GROUPS)
    g, m = w.n(2, 12), w.n(3, 30)
    has = f"{place} has {g} {groups} with {m} {members} in each."
    if num_ops == 1:
        kind = w.pick(["product", "split", "extra"])
        if kind == "product":
            return f"{has} How many {members} are there in all?", ("*", g, m)
        if kind == "split":
            return (f"{place} has {g * m} {members}, divided equally into {g} {groups}. "
                    f"How many {members} are in each?"), ("/", g * m, g)
        a, b = w.n(10, 400), w.n(5, 200)
        return (f"{place} has {a} {members}. Then {b} more {members} {come}. "
                f"How many {members} does it have now?"), ("+", a, b)
    k = w.n(1, 30)
    if num_ops == 2:
        if w.rng.random() < 0.5:
            return (f"{has} Another {k} {members} {come}. How many {members} are there now?"), \
                ("+", ("*", g, m), k)
        return (f"{has} {k} of the {members} {leave}. How many {members} are left?"), \
            ("-", ("*", g, m), k)
    t = w.pick([2, 3, 4, 5, 6])
    if w.rng.random() < 0.5:
        return (f"{has} {k} of the {members} {leave}, and the rest are split into {t} equal "
                f"parts. How many {members} are in each part?"), ("/", ("-", ("*", g, m), k), t)
    g2, m2 = w.n(2, 12), w.n(3, 30)
    return (f"{has} It also has {g2} smaller {groups} with {m2} {members} in each. "
            f"How many {members} does it have in all?"), ("+", ("*", g, m), ("*", g2, m2))


FAMILIES: dict[str, Callable[[_Words, int], tuple[str, Tree]]] = {
    "collection": _collection, "shop": _shop, "rate": _rate, "groups": _groups}


def generate(rng: random.Random, num_ops: int) -> Problem:
    """One problem with exactly num_ops operations (1..3), from a family chosen by rng.

    Raises:
      ValueError: num_ops outside 1..3.
    """
    if not 1 <= num_ops <= 3:
        raise ValueError(f"num_ops: must be in 1..3, got {num_ops}")
    family = rng.choice(sorted(FAMILIES))
    for _ in range(_MAX_TRIES):
        try:
            text, tree = FAMILIES[family](_Words(rng), num_ops)
            answer = evaluate(tree)
        except Reject:
            continue
        if answer <= MAX_ANSWER:
            assert count_ops(tree) == num_ops, (family, tree)
            return Problem(text, tree, answer, family)
    raise RuntimeError(f"{family}: no valid problem with {num_ops} operations in {_MAX_TRIES} draws")
