"""HallusionBench-style yes/no questions about rendered scenes, balanced between "Yes" and "No".

Scenes: coloured shapes (existence, colour, count, position, size), small tables (look-ups and comparisons),
mini bar charts, signs (does the sign say X?) and the Mueller-Lyer illusion with equal or unequal lines
(the classic HallusionBench probe: the answer follows the pixels, not the well-known illusion). Some questions
carry a deliberately false premise (they ask about an object or row that is not there); their answer is "No".
Sample ``i`` answers "Yes" iff ``i`` is even, so any prefix of a workload is balanced.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from specprefetch.data import imaging as im
from specprefetch.data.draft import Draft
from specprefetch.data.synth_ocr import SIGNS

POST_PROMPT = " Please answer yes or no."
SHAPES = ["circle", "square", "triangle", "star"]
COLOURS = ["red", "green", "blue", "yellow", "orange", "purple", "black", "pink"]


@dataclass(frozen=True)
class Obj:
    shape: str
    colour: str
    x: float  # centre, in [0, 1]
    y: float
    r: float  # radius, in [0, 1]


def _draw_obj(draw: ImageDraw.ImageDraw, o: Obj, size: int) -> None:
    cx, cy, r = o.x * size, o.y * size, o.r * size
    fill = im.NAMED_COLOURS[o.colour]
    outline = (30, 30, 30) if o.colour != "black" else (90, 90, 90)
    if o.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=outline, width=1)
    elif o.shape == "square":
        s = r * 0.9
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill, outline=outline, width=1)
    elif o.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r * 0.95, cy + r * 0.8), (cx + r * 0.95, cy + r * 0.8)],
                     fill=fill, outline=outline)
    else:  # five-pointed star
        pts = []
        for k in range(10):
            a = -math.pi / 2 + k * math.pi / 5
            rad = r if k % 2 == 0 else r * 0.45
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        draw.polygon(pts, fill=fill, outline=outline)


def _place(rng: random.Random, n: int) -> list[tuple[float, float, float]]:
    """n non-overlapping (x, y, r) placements on a 4x4 grid with jitter."""
    cells = rng.sample([(i, j) for i in range(4) for j in range(4)], n)
    out = []
    for i, j in cells:
        r = rng.uniform(0.06, 0.1)
        out.append(((i + 0.5) / 4 + rng.uniform(-0.03, 0.03), (j + 0.5) / 4 + rng.uniform(-0.03, 0.03), r))
    return out


def _objects(rng: random.Random, n: int) -> list[Obj]:
    pairs = rng.sample([(s, c) for s in SHAPES for c in COLOURS], n)
    return [Obj(s, c, x, y, r) for (s, c), (x, y, r) in zip(pairs, _place(rng, n))]


def _shapes_image(objs: list[Obj], size: int, rng: random.Random) -> Image.Image:
    bg = im.jitter(rng.choice([(250, 250, 250), (235, 240, 245), (245, 240, 225), (225, 235, 225)]), rng, 6)
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    for o in objs:
        _draw_obj(draw, o, size)
    return img


def _name(o: Obj) -> str:
    return f"{o.colour} {o.shape}"


# ------------------------------------------------------------------------------------------ question kinds
Result = tuple[Image.Image, str, dict[str, Any]]


def q_existence(rng: random.Random, size: int, yes: bool) -> Result:
    objs = _objects(rng, rng.randint(2, 5))
    if yes:
        target = rng.choice(objs)
        shape, colour = target.shape, target.colour
    else:  # a plausible absent object: a present shape in another colour, or a present colour on another shape
        present = {(o.shape, o.colour) for o in objs}
        cands = [(s, c) for s in SHAPES for c in COLOURS if (s, c) not in present
                 and (s in {o.shape for o in objs} or c in {o.colour for o in objs})]
        shape, colour = rng.choice(cands)
    q = rng.choice([f"Is there a {colour} {shape} in the image?", f"Does the image contain a {colour} {shape}?"])
    return _shapes_image(objs, size, rng), q, {"objects": [o.__dict__ for o in objs]}


def q_count(rng: random.Random, size: int, yes: bool) -> Result:
    shape = rng.choice(SHAPES)
    k = rng.randint(1, 5)
    others = rng.randint(0, 3)
    places = _place(rng, k + others)
    colours = [rng.choice(COLOURS) for _ in range(k)]
    other_shapes = [rng.choice([s for s in SHAPES if s != shape]) for _ in range(others)]
    objs = [Obj(shape, c, x, y, r) for c, (x, y, r) in zip(colours, places[:k])]
    objs += [Obj(s, rng.choice(COLOURS), x, y, r) for s, (x, y, r) in zip(other_shapes, places[k:])]
    asked = k
    if not yes:
        asked = max(1, k + rng.choice([-2, -1, 1, 2]))
        if asked == k:
            asked = k + 1
    q = (f"Is there exactly 1 {shape} in the image?" if asked == 1
         else f"Are there exactly {asked} {shape}s in the image?")
    return _shapes_image(objs, size, rng), q, {"objects": [o.__dict__ for o in objs], "count": k}


def q_position(rng: random.Random, size: int, yes: bool) -> Result:
    while True:
        objs = _objects(rng, rng.randint(2, 4))
        a, b = rng.sample(objs, 2)
        axis = rng.choice(["x", "y"])
        if abs(getattr(a, axis) - getattr(b, axis)) > 0.15:
            break
    if axis == "x":
        truth = a.x < b.x
        rel = "to the left of"
    else:
        truth = a.y < b.y
        rel = "above"
    if truth != yes:
        a, b = b, a
    return (_shapes_image(objs, size, rng), f"Is the {_name(a)} {rel} the {_name(b)}?",
            {"objects": [o.__dict__ for o in objs]})


def q_size(rng: random.Random, size: int, yes: bool) -> Result:
    objs = _objects(rng, rng.randint(2, 4))
    a, b = rng.sample(range(len(objs)), 2)
    big, small = rng.uniform(0.1, 0.12), rng.uniform(0.045, 0.065)
    objs[a] = Obj(objs[a].shape, objs[a].colour, objs[a].x, objs[a].y, big if yes else small)
    objs[b] = Obj(objs[b].shape, objs[b].colour, objs[b].x, objs[b].y, small if yes else big)
    return (_shapes_image(objs, size, rng), f"Is the {_name(objs[a])} larger than the {_name(objs[b])}?",
            {"objects": [o.__dict__ for o in objs]})


def q_false_premise(rng: random.Random, size: int, yes: bool) -> Result:
    """A question about an object that is not in the image (answer No); the Yes twin asks about present ones."""
    if yes:
        return q_position(rng, size, True)
    objs = _objects(rng, rng.randint(2, 4))
    present = {(o.shape, o.colour) for o in objs}
    shape, colour = rng.choice([(s, c) for s in SHAPES for c in COLOURS if (s, c) not in present])
    b = rng.choice(objs)
    q = rng.choice([f"Is the {colour} {shape} to the left of the {_name(b)}?",
                    f"Is the {colour} {shape} larger than the {_name(b)}?",
                    f"The {colour} {shape} is next to the {_name(b)}. Is it above the {_name(b)}?"])
    return _shapes_image(objs, size, rng), q, {"objects": [o.__dict__ for o in objs], "false_premise": True}


TABLES = [
    ("City", "Population (k)", ["Avon", "Brook", "Cliff", "Dale", "Elm", "Ford", "Glen", "Holt"], (50, 990)),
    ("Team", "Points", ["Lions", "Hawks", "Bears", "Wolves", "Sharks", "Owls", "Foxes", "Bulls"], (10, 99)),
    ("Product", "Price ($)", ["Pen", "Lamp", "Desk", "Chair", "Mug", "Bag", "Clock", "Fan"], (2, 250)),
    ("Student", "Score", ["Ana", "Ben", "Cara", "Dev", "Eli", "Finn", "Gia", "Hugo"], (40, 100)),
]


def _table_image(title: str, header: tuple[str, str], rows: list[tuple[str, int]], size: int,
                 rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (size, size), im.jitter((252, 252, 250), rng, 3))
    draw = ImageDraw.Draw(img)
    n = len(rows) + 1
    top, left, right = size * 0.2, size * 0.08, size * 0.92
    row_h = (size * 0.92 - top) / n
    font = im.load_font(im.FONTS["sans"][0], max(6, int(min(row_h * 0.5, size * 0.07))))
    bold = im.load_font(im.FONTS["sans_bold"][0], max(6, int(min(row_h * 0.5, size * 0.07))))
    tfont = im.fit_font(im.FONTS["sans_bold"][0], title, size * 0.9, size * 0.1, int(size * 0.075))
    draw.text((size / 2, size * 0.1), title, font=tfont, fill=(20, 20, 20), anchor="mm")
    head_fill = im.jitter(rng.choice([(200, 215, 235), (215, 235, 215), (235, 220, 200)]), rng, 8)
    for r in range(n):
        y0 = top + r * row_h
        fill = head_fill if r == 0 else ((245, 245, 245) if r % 2 else (255, 255, 255))
        draw.rectangle([left, y0, right, y0 + row_h], fill=fill, outline=(120, 120, 120))
        a, b = (header if r == 0 else (rows[r - 1][0], str(rows[r - 1][1])))
        f = bold if r == 0 else font
        draw.text((left + size * 0.03, y0 + row_h / 2), a, font=f, fill=(20, 20, 20), anchor="lm")
        draw.text((right - size * 0.03, y0 + row_h / 2), b, font=f, fill=(20, 20, 20), anchor="rm")
    return img


def q_table(rng: random.Random, size: int, yes: bool) -> Result:
    key, col, pool, (lo, hi) = rng.choice(TABLES)
    names = rng.sample(pool, rng.randint(3, 5))
    values = rng.sample(range(lo, hi + 1), len(names))
    rows = list(zip(names, values))
    titles = {"City": "City populations", "Team": "League table", "Product": "Price list", "Student": "Exam results"}
    title = titles[key]
    img = _table_image(title, (key, col), rows, size, rng)
    kind = rng.choice(["compare", "lookup", "absent"] if not yes else ["compare", "lookup", "max"])
    measure = {"Points": "number of points"}.get(col, col.split(" (")[0].lower())
    if kind == "compare":
        (a, va), (b, vb) = rng.sample(rows, 2)
        if (va > vb) != yes:
            (a, va), (b, vb) = (b, vb), (a, va)
        q = f"According to the table, is the {measure} of {a} higher than that of {b}?"
    elif kind == "lookup":
        a, va = rng.choice(rows)
        shown = va if yes else va + rng.choice([-1, 1]) * rng.randint(1, max(2, (hi - lo) // 10))
        q = f"Does the table show that the {measure} of {a} is {shown}?"
    elif kind == "max":
        a = max(rows, key=lambda r: r[1])[0]
        q = f"According to the table, does {a} have the highest {measure}?"
    else:  # false premise: a row that is not in the table
        a = rng.choice([p for p in pool if p not in names])
        b, _ = rng.choice(rows)
        q = f"According to the table, is the {measure} of {a} higher than that of {b}?"
    return img, q, {"table": {"header": [key, col], "rows": [[n_, v] for n_, v in rows]},
                    "false_premise": kind == "absent"}


def q_bars(rng: random.Random, size: int, yes: bool) -> Result:
    labels = rng.sample(["A", "B", "C", "D", "E", "F"], rng.randint(3, 5))
    labels.sort()
    values = rng.sample(range(2, 20), len(labels))
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    base, top, left, right = size * 0.85, size * 0.12, size * 0.12, size * 0.95
    draw.line([(left, top), (left, base), (right, base)], fill=(40, 40, 40), width=max(1, size // 150))
    font = im.load_font(im.FONTS["sans"][0], max(6, int(size * 0.06)))
    w = (right - left) / len(labels)
    colour = im.NAMED_COLOURS[rng.choice(["blue", "green", "orange", "purple", "red"])]
    for i, (lab, v) in enumerate(zip(labels, values)):
        h = (base - top) * v / 20
        x0 = left + i * w + w * 0.18
        draw.rectangle([x0, base - h, x0 + w * 0.64, base], fill=colour)
        draw.text((x0 + w * 0.32, base + size * 0.02), lab, font=font, fill=(20, 20, 20), anchor="mt")
    for t in (0, 5, 10, 15, 20):
        y = base - (base - top) * t / 20
        draw.text((left - size * 0.02, y), str(t), font=font, fill=(60, 60, 60), anchor="rm")
    best = labels[max(range(len(labels)), key=values.__getitem__)]
    if yes:
        q = rng.choice([f"Is bar {best} the tallest bar in the chart?",
                        f"Is the value of bar {best} higher than every other bar?"])
    else:
        other = rng.choice([lab for lab in labels if lab != best])
        q = rng.choice([f"Is bar {other} the tallest bar in the chart?",
                        f"Is the value of bar {other} higher than every other bar?"])
    return img, q, {"bars": dict(zip(labels, values))}


def q_sign(rng: random.Random, size: int, yes: bool) -> Result:
    text, other = rng.sample(SIGNS, 2)
    img = im.scene_background(size, rng)
    colour = im.NAMED_COLOURS[rng.choice(["red", "green", "blue", "black"])]
    w, h = size * 0.8, size * 0.32
    sign = Image.new("RGBA", (int(w), int(h)), colour + (255,))
    ImageDraw.Draw(sign).rectangle([0, 0, w - 1, h - 1], outline=(255, 255, 255, 255), width=max(2, size // 60))
    font = im.fit_font(im.FONTS["sans_bold"][0], text, w * 0.85, h * 0.6, int(size * 0.14))
    t = im.text_layer(text, font, (255, 255, 255))
    sign.paste(t, (int((w - t.width) / 2), int((h - t.height) / 2)), t)
    im.paste_center(img, sign, size / 2, size * 0.45, angle=rng.uniform(-5, 5))
    asked = text if yes else other
    return img, f'Does the sign in the image say "{asked}"?', {"text": text}


def q_illusion(rng: random.Random, size: int, yes: bool) -> Result:
    """Mueller-Lyer lines: the fins make equal lines look unequal; the answer follows the drawn lengths."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    base = size * rng.uniform(0.4, 0.55)
    lengths = [base, base] if yes else [base, base * rng.choice([0.75, 0.8, 1.2, 1.25])]
    width = max(2, size // 90)
    fin = size * 0.07
    for k, (length, y) in enumerate(zip(lengths, (size * 0.33, size * 0.67))):
        x0, x1 = size / 2 - length / 2, size / 2 + length / 2
        draw.line([(x0, y), (x1, y)], fill=(0, 0, 0), width=width)
        out = k == 0  # arrowheads outward on top, inward (tails) on the bottom
        d = -fin if out else fin
        for x, sgn in ((x0, 1), (x1, -1)):
            draw.line([(x, y), (x + sgn * -d, y - fin)], fill=(0, 0, 0), width=width)
            draw.line([(x, y), (x + sgn * -d, y + fin)], fill=(0, 0, 0), width=width)
    q = rng.choice(["Are the two horizontal lines the same length?", "Do the two horizontal lines have equal length?"])
    return img, q, {"lengths_px": [round(v, 1) for v in lengths]}


KINDS: dict[str, Callable[[random.Random, int, bool], Result]] = {
    "existence": q_existence, "count": q_count, "position": q_position, "size": q_size,
    "false_premise": q_false_premise, "table": q_table, "bars": q_bars, "sign": q_sign, "illusion": q_illusion,
}


def generate_hallusion(seed: int, index: int, image_size: int) -> Draft:
    """Sample ``index``: answer "Yes" iff index is even (balanced), question kind drawn from the sample's RNG."""
    rng = im.sample_rng("hallusion_synth", seed, index)
    yes = index % 2 == 0
    kind = rng.choice(sorted(KINDS))
    img, question, scene = KINDS[kind](rng, image_size, yes)
    answer = "Yes" if yes else "No"
    false_premise = bool(scene.pop("false_premise", False))
    meta = {"answer": answer, "question": question, "question_type": kind, "false_premise": false_premise,
            "scene": json.dumps(scene, sort_keys=True)}
    return Draft(prompt=question + POST_PROMPT, reference=answer, image=img.convert("RGB"), meta=meta)
