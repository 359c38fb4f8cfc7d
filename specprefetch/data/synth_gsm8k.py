"""GSM8K-format multi-step arithmetic word problems with worked solutions.

Each problem is built from a template (shopping, rates, ages, fractions, percentages, work time, distances,
sharing, profit, buses, harvests, overtime) whose numbers are drawn from the sample's RNG and redrawn until
every step is exact. Solutions follow GSM8K exactly: one sentence per step with a calculator annotation
``48/2 = <<48/2=24>>24`` and a final ``#### 72`` line; :func:`verify_gsm8k_solution` re-evaluates every
annotation, and the generator runs it on every sample it emits.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from fractions import Fraction

from specprefetch.data.draft import Draft
from specprefetch.data.imaging import sample_rng
from specprefetch.io import SpecPrefetchError

ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>([-0-9.]+)")
FINAL = re.compile(r"^#### (-?[0-9][0-9.,]*)\s*$", re.M)


class _Redraw(Exception):
    """The drawn numbers do not give an exact, positive, plausible problem; draw again."""


# ------------------------------------------------------------------------------------------ arithmetic
def evaluate_expression(expr: str) -> Fraction:
    """Exactly evaluate a calculator annotation (numbers, + - * /, parentheses) with fractions."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise SpecPrefetchError(f"annotation {expr!r} is not an arithmetic expression") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                if b == 0:
                    raise SpecPrefetchError(f"annotation {expr!r} divides by zero")
                return a / b
        raise SpecPrefetchError(f"annotation {expr!r} uses unsupported syntax {type(node).__name__}")

    return ev(tree)


def fmt_number(v: Fraction) -> str:
    """GSM8K-style number: integers plain, finite decimals minimal ("0.2", "2.5")."""
    if v.denominator == 1:
        return str(v.numerator)
    d = v.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        raise _Redraw
    s = f"{float(v):.6f}".rstrip("0").rstrip(".")
    if Fraction(s) != v:
        raise _Redraw
    return s


def verify_gsm8k_solution(solution: str) -> str:
    """Re-evaluate every ``<<expr=result>>result`` annotation and return the ``####`` answer.

    Raises SpecPrefetchError naming the first annotation whose expression does not equal its stated result.
    """
    found = 0
    for m in ANNOTATION.finditer(solution):
        expr, stated, shown = m.group(1), m.group(2), m.group(3)
        value = evaluate_expression(expr)
        if value != Fraction(stated) or Fraction(shown) != Fraction(stated):
            raise SpecPrefetchError(f"annotation <<{expr}={stated}>>{shown}: {expr} = {float(value):g}")
        found += 1
    finals = FINAL.findall(solution)
    if len(finals) != 1:
        raise SpecPrefetchError(f"solution must end with exactly one '#### answer' line, found {len(finals)}")
    if found == 0:
        raise SpecPrefetchError("solution has no <<expr=result>> annotation")
    return finals[0].replace(",", "")


class _Solution:
    """Accumulates GSM8K solution lines; each step computes its own value from its expression."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def step(self, before: str, expr: str, after: str, money: bool = False) -> Fraction:
        value = evaluate_expression(expr)
        if value <= 0:
            raise _Redraw
        shown = fmt_number(value)
        self.lines.append(f"{before}{expr} = {'$' if money else ''}<<{expr}={shown}>>{shown}{after}")
        return value

    def finish(self, answer: Fraction) -> tuple[str, str]:
        if answer.denominator != 1 or answer <= 0:
            raise _Redraw
        text = "\n".join(self.lines) + f"\n#### {answer.numerator}"
        return text, str(answer.numerator)


def n(v: Fraction | int) -> str:
    """A number inside an annotation expression."""
    return fmt_number(Fraction(v))


# ------------------------------------------------------------------------------------------ vocabulary
NAMES = [
    ("Natalia", "she", "her"), ("Weng", "she", "her"), ("Betty", "she", "her"), ("Julie", "she", "her"),
    ("James", "he", "his"), ("Albert", "he", "his"), ("Tina", "she", "her"), ("Mark", "he", "his"),
    ("Randy", "he", "his"), ("Joy", "she", "her"), ("Alexis", "she", "her"), ("Carlos", "he", "his"),
    ("Priya", "she", "her"), ("Kenji", "he", "his"), ("Fatima", "she", "her"), ("Liam", "he", "his"),
    ("Sofia", "she", "her"), ("Mateo", "he", "his"), ("Aisha", "she", "her"), ("Noah", "he", "his"),
    ("Mei", "she", "her"), ("Omar", "he", "his"), ("Grace", "she", "her"), ("Diego", "he", "his"),
    ("Hannah", "she", "her"), ("Ravi", "he", "his"), ("Chloe", "she", "her"), ("Tomas", "he", "his"),
    ("Ingrid", "she", "her"), ("Kwame", "he", "his"), ("Lucia", "she", "her"), ("Ethan", "he", "his"),
]
ITEMS = [  # (singular, plural, price range)
    ("notebook", "notebooks", (2, 6)), ("pencil", "pencils", (1, 3)), ("apple", "apples", (1, 2)),
    ("muffin", "muffins", (2, 5)), ("shirt", "shirts", (8, 25)), ("book", "books", (5, 20)),
    ("candle", "candles", (3, 9)), ("toy car", "toy cars", (4, 12)), ("bag of rice", "bags of rice", (6, 15)),
    ("bottle of juice", "bottles of juice", (2, 5)), ("pack of gum", "packs of gum", (1, 3)),
    ("flower pot", "flower pots", (5, 14)), ("sandwich", "sandwiches", (4, 9)), ("puzzle", "puzzles", (7, 18)),
    ("comic book", "comic books", (3, 8)), ("pair of socks", "pairs of socks", (2, 7)),
]
BAKED = ["cupcakes", "cookies", "loaves of bread", "pies", "bagels", "brownies", "croissants", "donuts"]
COLLECT = ["marbles", "stickers", "stamps", "seashells", "baseball cards", "coins", "beads", "postcards"]
PLANTS = [("tomato", "tomatoes"), ("pepper", "peppers"), ("cucumber", "cucumbers"), ("strawberry", "strawberries")]
VEHICLES = ["car", "van", "truck", "motorcycle"]


def _person(rng: random.Random, exclude: tuple[str, ...] = ()) -> tuple[str, str, str]:
    return rng.choice([p for p in NAMES if p[0] not in exclude])


def _hours(k: int | Fraction) -> str:
    return f"{n(k)} hour" if k == 1 else f"{n(k)} hours"


def _obj(she: str) -> str:
    return "her" if she == "she" else "him"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# ------------------------------------------------------------------------------------------ templates
def t_shopping(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    (i1, p1s, r1), (i2, p2s, r2) = rng.sample(ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    pa, pb = rng.randint(*r1), rng.randint(*r2)
    discount = rng.choice([None, None, 10, 20, 25, 50])
    sol = _Solution()
    x = sol.step(f"{_cap(she)} spends ", f"{a}*{pa}", f" on {p1s}.", money=True)
    y = sol.step(f"{_cap(she)} spends ", f"{b}*{pb}", f" on {p2s}.", money=True)
    total = sol.step("In total, the items cost ", f"{n(x)}+{n(y)}", ".", money=True)
    q = f"{name} buys {a} {p1s} for ${pa} each and {b} {p2s} for ${pb} each."
    if discount and rng.random() < 0.5:
        q += f" The store takes {discount}% off the total price. How much does {she} pay?"
        d = sol.step(f"The {discount}% discount is ", f"{n(total)}*{discount}/100", ".", money=True)
        paid = sol.step(f"So {she} pays ", f"{n(total)}-{n(d)}", " after the discount.", money=True)
        return q, *sol.finish(paid)
    if rng.random() < 0.6:
        bill = next(v for v in (20, 50, 100, 200, 500) if v > total)
        change = sol.step(f"{_cap(her)} change is ", f"{bill}-{n(total)}", ".", money=True)
        q += f" If {she} pays with a ${bill} bill, how much change does {she} get back?"
        return q, *sol.finish(change)
    q += f" How much does {she} spend in total?"
    return q, *sol.finish(total)


def t_reading(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    rate, h1 = rng.randint(8, 40), rng.randint(1, 4)
    twice = rng.random() < 0.5
    sol = _Solution()
    q = f"{name} can read {rate} pages of a book in an hour. {_cap(she)} reads for {_hours(h1)} on Saturday"
    if twice:
        h2 = sol.step(f"On Sunday {she} reads for ", f"{h1}*2", " hours.")
        q += " and for twice as long on Sunday."
    else:
        h2 = Fraction(rng.randint(1, 5))
        q += f" and for {_hours(h2)} on Sunday."
    p1 = sol.step(f"On Saturday {she} reads ", f"{rate}*{h1}", " pages.")
    p2 = sol.step(f"On Sunday {she} reads ", f"{rate}*{n(h2)}", " pages.")
    read = sol.step(f"Altogether {she} reads ", f"{n(p1)}+{n(p2)}", " pages.")
    if rng.random() < 0.6:
        book = int(read) + rng.randint(10, 200)
        left = sol.step(f"{_cap(she)} still has ", f"{book}-{n(read)}", " pages left to read.")
        q += f" If the book has {book} pages, how many pages does {she} still have to read?"
        return q, *sol.finish(left)
    q += f" How many pages does {she} read over the weekend?"
    return q, *sol.finish(read)


def t_ages(rng: random.Random) -> tuple[str, str, str]:
    (a, _, _), (b, _, _), (c, _, _) = rng.sample(NAMES, 3)
    c_age, d, k, y = rng.randint(3, 15), rng.randint(2, 9), rng.randint(2, 3), rng.randint(2, 12)
    sol = _Solution()
    b_age = sol.step(f"{b} is ", f"{c_age}+{d}", " years old.")
    a_age = sol.step(f"{a} is ", f"{n(b_age)}*{k}", " years old.")
    times = {2: "twice", 3: "three times"}[k]
    q = f"{a} is {times} as old as {b}. {b} is {d} years older than {c}, who is {c_age} years old."
    if rng.random() < 0.5:
        future = sol.step(f"In {y} years, {a} will be ", f"{n(a_age)}+{y}", " years old.")
        q += f" How old will {a} be in {y} years?"
        return q, *sol.finish(future)
    ab = sol.step(f"{a} and {b} together are ", f"{n(a_age)}+{n(b_age)}", " years old.")
    total = sol.step("The sum of all three ages is ", f"{n(ab)}+{c_age}", " years.")
    q += " What is the sum of their ages?"
    return q, *sol.finish(total)


def t_fractions(rng: random.Random) -> tuple[str, str, str]:
    thing = rng.choice(BAKED)
    num, den = rng.choice([(1, 2), (1, 3), (2, 3), (1, 4), (3, 4), (2, 5), (3, 5), (1, 6), (5, 6), (3, 8)])
    total = den * rng.randint(4, 30)
    sol = _Solution()
    morning = sol.step("In the morning the bakery sold ", f"{total}*{num}/{den}", f" {thing}.")
    after = rng.randint(2, max(3, int(total - morning) - 2))
    rest = sol.step("That leaves ", f"{total}-{n(morning)}", f" {thing}.")
    left = sol.step("After the afternoon, ", f"{n(rest)}-{after}", f" {thing} are left.")
    q = (f"A bakery made {total} {thing} on Monday. It sold {num}/{den} of them in the morning and {after} more "
         f"in the afternoon.")
    if rng.random() < 0.4:
        if int(left) % 2:
            raise _Redraw
        given = sol.step("They give half of the rest to a shelter, which is ", f"{n(left)}/2", f" {thing}.")
        q += (f" At closing time they give half of the remaining {thing} to a shelter."
              f" How many {thing} does the shelter get?")
        return q, *sol.finish(given)
    q += f" How many {thing} are left?"
    return q, *sol.finish(left)


def t_savings(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    pct = rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
    wage = rng.randint(6, 60) * 10
    weeks = rng.randint(2, 12)
    sol = _Solution()
    per_week = sol.step(f"{_cap(she)} saves ", f"{wage}*{pct}/100", " per week.", money=True)
    saved = sol.step(f"In {weeks} weeks {she} saves ", f"{n(per_week)}*{weeks}", ".", money=True)
    q = f"{name} earns ${wage} a week and saves {pct}% of it."
    if rng.random() < 0.6:
        cost = rng.randint(1, max(1, int(saved) - 1))
        left = sol.step(f"After buying the gift {she} has ", f"{n(saved)}-{cost}", " left.", money=True)
        q += f" After {weeks} weeks {she} spends ${cost} of the savings on a gift. How much of the savings is left?"
        return q, *sol.finish(left)
    q += f" How much money does {she} save in {weeks} weeks?"
    return q, *sol.finish(saved)


def t_car_wash(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    wash, dry = rng.randint(5, 40), rng.randint(5, 30)
    vehicle = rng.choice(VEHICLES)
    k = rng.randint(2, 12)
    sol = _Solution()
    each = sol.step(f"Each {vehicle} takes ", f"{wash}+{dry}", " minutes.")
    minutes = sol.step(f"All {k} take ", f"{n(each)}*{k}", " minutes.")
    q = (f"It takes {name} {wash} minutes to wash a {vehicle} and {dry} minutes to dry it. "
         f"How many hours does it take {_obj(she)} to wash and dry {k} {vehicle}s?")
    if int(minutes) % 60:
        raise _Redraw
    hours = sol.step("That is ", f"{n(minutes)}/60", " hours.")
    return q, *sol.finish(hours)


def t_trip(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    v1, t1, v2, t2 = rng.randint(3, 14) * 5, rng.randint(1, 5), rng.randint(3, 14) * 5, rng.randint(1, 4)
    sol = _Solution()
    d1 = sol.step("The first part of the trip is ", f"{v1}*{t1}", " miles.")
    d2 = sol.step("The second part is ", f"{v2}*{t2}", " miles.")
    total = sol.step("One way is ", f"{n(d1)}+{n(d2)}", " miles.")
    q = (f"{name} drives at {v1} miles per hour for {_hours(t1)} and then at {v2} miles per hour for "
         f"{_hours(t2)}.")
    mode = rng.random()
    if mode < 0.35:
        q += " How many miles does {she} drive?".format(she=she)
        return q, *sol.finish(total)
    rt = sol.step("The round trip is ", f"{n(total)}*2", " miles.")
    if mode < 0.7:
        q += f" {_cap(she)} returns home along the same route. How many miles does {she} drive in all?"
        return q, *sol.finish(rt)
    mpg = rng.choice([10, 15, 20, 25, 30, 40])
    gallons = sol.step(f"{_cap(she)} uses ", f"{n(rt)}/{mpg}", " gallons of gas.")
    q += (f" {_cap(she)} returns home along the same route, and {her} car goes {mpg} miles per gallon. "
          f"How many gallons of gas does {she} use?")
    return q, *sol.finish(gallons)


def t_sharing(rng: random.Random) -> tuple[str, str, str]:
    (a, _, _), (b, _, _), (c, _, _) = rng.sample(NAMES, 3)
    thing = rng.choice(COLLECT)
    x, k = rng.randint(5, 60), rng.randint(1, 15)
    sol = _Solution()
    dbl = sol.step(f"Twice as many as {a} is ", f"{x}*2", f" {thing}.")
    bb = sol.step(f"{b} has ", f"{n(dbl)}+{k}", f" {thing}.")
    if int(bb) % 2:
        raise _Redraw
    cc = sol.step(f"{c} has ", f"{n(bb)}/2", f" {thing}.")
    total = sol.step("Together they have ", f"{x}+{n(bb)}+{n(cc)}", f" {thing}.")
    q = (f"{a} has {x} {thing}. {b} has {k} more than twice as many {thing} as {a}. {c} has half as many "
         f"{thing} as {b}. How many {thing} do they have altogether?")
    return q, *sol.finish(total)


def t_profit(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    single, plural, (lo, hi) = rng.choice(ITEMS)
    k, cost = rng.randint(5, 40), rng.randint(lo, hi)
    price = cost + rng.randint(1, 6)
    broken = rng.choice([0, 0, rng.randint(1, 4)])
    sol = _Solution()
    spent = sol.step(f"{_cap(she)} spends ", f"{k}*{cost}", f" on the {plural}.", money=True)
    q = f"{name} buys {k} {plural} for ${cost} each to resell."
    sold = Fraction(k)
    if broken:
        sold = sol.step(f"{_cap(she)} sells ", f"{k}-{broken}", f" {plural}.")
        q += f" {broken} of them get damaged and cannot be sold."
    revenue = sol.step(f"{_cap(she)} earns ", f"{n(sold)}*{price}", " from sales.", money=True)
    profit = sol.step(f"{_cap(her)} profit is ", f"{n(revenue)}-{n(spent)}", ".", money=True)
    q += f" {_cap(she)} sells the rest for ${price} each. How much profit does {she} make?"
    return q, *sol.finish(profit)


def t_buses(rng: random.Random) -> tuple[str, str, str]:
    classes, per, teachers = rng.randint(3, 12), rng.randint(18, 32), rng.randint(2, 12)
    seats = rng.choice([20, 25, 30, 40, 45, 50, 60])
    sol = _Solution()
    students = sol.step("There are ", f"{classes}*{per}", " students.")
    people = sol.step("With the teachers there are ", f"{n(students)}+{teachers}", " people.")
    if int(people) % seats:
        raise _Redraw
    buses = sol.step("They need ", f"{n(people)}/{seats}", " buses.")
    q = (f"A school has {classes} classes with {per} students each. All the students and {teachers} teachers "
         f"go on a field trip in buses with {seats} seats each. If every seat is filled, how many buses do they need?")
    return q, *sol.finish(buses)


def t_harvest(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    single, plural = rng.choice(PLANTS)
    rows, per, yld = rng.randint(2, 10), rng.randint(3, 12), rng.randint(4, 20)
    sol = _Solution()
    plants = sol.step(f"{_cap(she)} has ", f"{rows}*{per}", f" {single} plants.")
    picked = sol.step(f"{_cap(she)} picks ", f"{n(plants)}*{yld}", f" {plural}.")
    q = (f"{name} planted {rows} rows of {single} plants with {per} plants in each row. "
         f"Each plant produced {yld} {plural}.")
    if rng.random() < 0.6:
        frac = rng.choice([2, 4, 5, 10])
        if int(picked) % frac:
            raise _Redraw
        given = sol.step(f"{_cap(she)} gives away ", f"{n(picked)}/{frac}", f" {plural}.")
        kept = sol.step(f"{_cap(she)} keeps ", f"{n(picked)}-{n(given)}", f" {plural}.")
        part = {2: "half", 4: "a quarter", 5: "a fifth", 10: "a tenth"}[frac]
        q += f" {_cap(she)} gives {part} of them to {her} neighbours. How many {plural} does {she} keep?"
        return q, *sol.finish(kept)
    q += f" How many {plural} did {she} pick?"
    return q, *sol.finish(picked)


def t_overtime(rng: random.Random) -> tuple[str, str, str]:
    name, she, her = _person(rng)
    rate = rng.randint(5, 20) * 2
    regular = rng.choice([35, 40])
    extra = rng.randint(2, 15)
    sol = _Solution()
    base = sol.step(f"For the regular hours {she} earns ", f"{regular}*{rate}", ".", money=True)
    orate = sol.step(f"{_cap(her)} overtime rate is ", f"{rate}*1.5", " per hour.", money=True)
    over = sol.step(f"For overtime {she} earns ", f"{n(orate)}*{extra}", ".", money=True)
    total = sol.step(f"In total {she} earns ", f"{n(base)}+{n(over)}", ".", money=True)
    q = (f"{name} earns ${rate} an hour for the first {regular} hours of a week and 1.5 times that rate for every "
         f"hour after that. How much does {she} earn in a week in which {she} works {regular + extra} hours?")
    return q, *sol.finish(total)


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "shopping": t_shopping, "reading_rate": t_reading, "ages": t_ages, "fractions": t_fractions,
    "percent_savings": t_savings, "work_time": t_car_wash, "distance": t_trip, "sharing": t_sharing,
    "profit": t_profit, "buses": t_buses, "harvest": t_harvest, "overtime": t_overtime,
}


def gsm8k_prompt(question: str) -> str:
    """lm-eval's ``gsm8k`` doc_to_text, so synthetic prompts look like the harness's."""
    return f"Question: {question}\nAnswer:"


def generate_gsm8k(seed: int, index: int, image_size: int = 0) -> Draft:
    """Sample ``index`` of the GSM8K-format generator with ``seed`` (image_size is unused: text only)."""
    rng = sample_rng("gsm8k_synth", seed, index)
    template = rng.choice(sorted(TEMPLATES))
    for _ in range(200):
        try:
            question, solution, answer = TEMPLATES[template](rng)
            break
        except _Redraw:
            continue
    else:  # pragma: no cover - each template succeeds with high probability per draw
        raise SpecPrefetchError(f"gsm8k_synth: template {template!r} found no exact problem "
                                f"for seed {seed}, index {index}")
    checked = verify_gsm8k_solution(solution)
    if checked != answer:
        raise SpecPrefetchError(f"gsm8k_synth: template {template!r} produced answer {answer} but checks {checked}")
    n_steps = len(ANNOTATION.findall(solution))
    return Draft(prompt=gsm8k_prompt(question), reference=solution,
                 meta={"answer": answer, "question": question, "template": template, "n_steps": n_steps})
