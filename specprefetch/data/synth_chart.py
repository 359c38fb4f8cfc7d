"""ChartQA-style charts (bar, horizontal bar, grouped bar, line, pie) rendered with matplotlib (Agg).

Values are drawn from the sample's RNG, printed on the chart as data labels (as in ChartQA's Statista-style
charts), and every question is answered exactly from the same data: value look-ups, extremes, differences,
sums, averages, ratios, counts above a threshold and yes/no comparisons. ``meta`` keeps the data so the
answer can be re-derived.
"""

from __future__ import annotations

import functools
import random
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from specprefetch.data.draft import Draft
from specprefetch.data.imaging import sample_rng

TITLE_WRAP = 36
POST_PROMPT = "\nAnswer the question using a single word or phrase."

# (title, category noun, category pool, unit label, value range, decimals)
BAR_TOPICS: list[tuple[str, str, list[str], str, tuple[float, float], int]] = [
    ("Smartphone ownership by country", "country",
     ["USA", "Japan", "Brazil", "India", "France", "Kenya", "Mexico", "Canada", "Spain", "Chile", "Norway", "Peru"],
     "Share of adults (%)", (12, 95), 0),
    ("Annual revenue by company", "company",
     ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay", "Stark", "Wayne", "Tyrell", "Cyberdyne"],
     "Revenue (billion USD)", (1, 80), 1),
    ("Average coffee price by city", "city",
     ["Oslo", "Paris", "Tokyo", "Lima", "Cairo", "Rome", "Seoul", "Dubai", "Delhi", "Berlin", "Austin"],
     "Price (USD)", (1, 7), 1),
    ("Museum visitors by month", "month",
     ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"],
     "Visitors (thousands)", (5, 120), 0),
    ("Favourite sport among students", "sport",
     ["Soccer", "Tennis", "Cricket", "Hockey", "Rugby", "Golf", "Cycling", "Boxing", "Judo"],
     "Share of respondents (%)", (3, 45), 0),
    ("Renewable share of electricity", "country",
     ["Sweden", "Italy", "Poland", "Greece", "Austria", "Ireland", "Latvia", "Denmark", "Portugal"],
     "Share (%)", (8, 80), 1),
    ("Hours of TV watched per week", "age group",
     ["16-24", "25-34", "35-44", "45-54", "55-64", "65+"],
     "Hours", (5, 40), 1),
    ("Units sold by product line", "product",
     ["Laptops", "Tablets", "Phones", "Watches", "Cameras", "Drones", "Consoles"],
     "Units (millions)", (2, 90), 0),
]
LINE_TOPICS: list[tuple[str, str, str, tuple[float, float], int]] = [
    ("Unemployment rate", "unemployment rate", "Rate (%)", (2, 14), 1),
    ("Number of passengers", "number of passengers", "Passengers (millions)", (10, 95), 0),
    ("Average house price", "average house price", "Price (thousand USD)", (150, 480), 0),
    ("Internet users", "share of internet users", "Share of population (%)", (20, 95), 0),
    ("Annual rainfall", "annual rainfall", "Rainfall (cm)", (40, 160), 0),
    ("Inflation rate", "inflation rate", "Rate (%)", (0.5, 9.5), 1),
]
PIE_TOPICS: list[tuple[str, str, list[str]]] = [
    ("Smartphone market share", "brand", ["Apple", "Samsung", "Xiaomi", "Oppo", "Vivo", "Other"]),
    ("How people commute to work", "mode", ["Car", "Bus", "Train", "Bicycle", "Walking", "Other"]),
    ("Household budget", "category", ["Housing", "Food", "Transport", "Health", "Leisure", "Savings"]),
    ("Energy sources", "source", ["Gas", "Coal", "Nuclear", "Wind", "Solar", "Hydro"]),
    ("Preferred pet", "pet", ["Dogs", "Cats", "Fish", "Birds", "Rabbits", "None"]),
]
GROUPS = [("Men", "Women"), ("2021", "2022"), ("Urban", "Rural"), ("Online", "In store")]
PALETTES = ["tab10", "Set2", "Dark2", "tab20b", "Paired"]
SINGLE_COLOURS = ["#1f77b4", "#2b8cbe", "#31a354", "#d95f0e", "#756bb1", "#3182bd", "#e6550d", "#393b79"]


def fmt(v: float, decimals: int) -> str:
    """How a value is printed on the chart and given as answer (ChartQA labels carry no units)."""
    return f"{v:.{decimals}f}" if decimals else str(int(round(v)))


def fmt_derived(v: float, decimals: int = 2) -> str:
    """Answers computed from the data (averages, ratios): at most ``decimals`` decimals, no trailing zeros."""
    s = f"{round(v, decimals):.{decimals}f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def draw_values(rng: random.Random, k: int, lo: float, hi: float, decimals: int) -> list[float]:
    """k distinct values (distinct after rounding, so max/min/compare questions have one answer)."""
    scale = 10 ** decimals
    pool = range(int(lo * scale), int(hi * scale) + 1)
    return [v / scale for v in rng.sample(pool, k)]


@functools.lru_cache(maxsize=1)
def _rc() -> dict[str, Any]:
    """matplotlib defaults (never the user's matplotlibrc), so rendering is the same on every machine."""
    import matplotlib

    rc = {k: v for k, v in matplotlib.rcParamsDefault.items() if not k.startswith("backend")}
    rc.update({"font.family": "DejaVu Sans", "svg.hashsalt": "specprefetch", "axes.spines.top": False,
               "axes.spines.right": False})
    return rc


def render(plot: Callable[[Any, Any, float], None], size: int) -> Image.Image:
    """Draw ``plot(fig, ax, scale)`` on a size x size Agg canvas and return the RGB pixels."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(rc=_rc()):
        fig = Figure(figsize=(size / 100, size / 100), dpi=100)
        canvas = FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        plot(fig, ax, size / 224)
        canvas.draw()
        arr = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    return Image.fromarray(arr, "RGB")


def _text_px(text: str, points: float) -> float:
    """Width in pixels (at 100 dpi, scale 1) of ``text`` in DejaVu Sans at ``points``."""
    from specprefetch.data.imaging import load_font

    return load_font("DejaVuSans.ttf", round(points * 100 / 72)).getlength(text)


def margins(spec: dict[str, Any]) -> dict[str, float]:
    """Subplot margins (figure fractions) from the label lengths: a fixed-cost replacement for tight_layout,
    which measures every artist and dominated rendering time. Fractions do not depend on the image size
    because fonts scale with it."""
    base = 224.0
    cats = spec["categories"]
    title_lines = len(textwrap.wrap(spec["title"], TITLE_WRAP))
    top = 1 - (12 + title_lines * 11.5) / base
    widest = max(_text_px(c, 6) for c in cats)
    kind = spec["chart_type"]
    if kind == "pie":
        return {"left": 0.16, "right": 0.84, "bottom": 0.08, "top": top - 0.06}
    tick_values = _text_px("000.0" if spec["decimals"] else "000", 6)
    if kind == "hbar":
        return {"left": (widest + 10) / base, "right": 0.96, "bottom": 32 / base, "top": top}
    if kind == "line" or max(map(len, cats)) > 5:
        angle = np.radians(45 if kind == "line" else 30)
        drop = widest * np.sin(angle) + 9 * np.cos(angle)
    else:
        drop = 9
    return {"left": (tick_values + 27) / base, "right": 0.97, "bottom": (drop + 8) / base, "top": top}


def _title(fig: Any, title: str, s: float) -> None:
    """The title centred on the figure (not the axes, which sit right of the y labels), wrapped."""
    fig.text(0.5, 1 - 5 / 224, textwrap.fill(title, TITLE_WRAP), ha="center", va="top", fontsize=7.5 * s,
             fontweight="bold", linespacing=1.1)


def _style(ax: Any, s: float, title: str, ylabel: str | None, fig: Any) -> None:
    _title(fig, title, s)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=6.2 * s)
    ax.tick_params(labelsize=6 * s, length=2 * s, pad=1.5 * s)


# ------------------------------------------------------------------------------------------ chart kinds
def walk_values(rng: random.Random, k: int, lo: float, hi: float, decimals: int) -> list[float]:
    """A time series: a bounded random walk, distinct after rounding (so extremes are unique)."""
    scale = 10 ** decimals
    span = (hi - lo) * scale
    while True:
        v = rng.uniform(lo * scale, hi * scale)
        out = []
        for _ in range(k):
            out.append(round(min(hi * scale, max(lo * scale, v))))
            v += rng.gauss(0, span * 0.15)
        if len(set(out)) == k:
            return [x / scale for x in out]


def pick_categories(rng: random.Random, noun: str, pool: list[str], k: int) -> list[str]:
    """k categories; ordinal ones (months, age groups) keep their natural order."""
    if noun == "month":
        start = rng.randint(0, len(pool) - k)
        return pool[start:start + k]
    cats = rng.sample(pool, k)
    return sorted(cats, key=pool.index) if noun == "age group" else cats


def bar_chart(rng: random.Random, horizontal: bool) -> dict[str, Any]:
    title, noun, pool, unit, (lo, hi), dec = rng.choice(BAR_TOPICS)
    k = rng.randint(3, 6)
    cats = pick_categories(rng, noun, pool, k)
    values = draw_values(rng, k, lo, hi, dec)
    return {"chart_type": "hbar" if horizontal else "bar", "title": title, "noun": noun, "unit": unit,
            "decimals": dec, "categories": cats, "series": [{"name": unit, "values": values}]}


def grouped_chart(rng: random.Random) -> dict[str, Any]:
    title, noun, pool, unit, (lo, hi), dec = rng.choice(BAR_TOPICS)
    k = rng.randint(3, 4)
    cats = pick_categories(rng, noun, pool, k)
    names = rng.choice(GROUPS)
    vals = draw_values(rng, 2 * k, lo, hi, dec)
    return {"chart_type": "grouped_bar", "title": title, "noun": noun, "unit": unit, "decimals": dec,
            "categories": cats,
            "series": [{"name": names[0], "values": vals[:k]}, {"name": names[1], "values": vals[k:]}]}


def line_chart(rng: random.Random) -> dict[str, Any]:
    title, measure, unit, (lo, hi), dec = rng.choice(LINE_TOPICS)
    k = rng.randint(4, 7)
    start = rng.randint(2005, 2024 - k)
    cats = [str(y) for y in range(start, start + k)]
    values = walk_values(rng, k, lo, hi, dec)
    place = rng.choice(["Canada", "Japan", "Germany", "Brazil", "Australia", "Kenya", "Mexico", "Sweden"])
    return {"chart_type": "line", "title": f"{title} in {place}, {cats[0]}-{cats[-1]}", "noun": "year",
            "measure": measure, "unit": unit, "decimals": dec, "categories": cats,
            "series": [{"name": unit, "values": values}]}


def pie_chart(rng: random.Random) -> dict[str, Any]:
    title, noun, pool = rng.choice(PIE_TOPICS)
    k = rng.randint(3, 5)
    cats = rng.sample(pool[:-1], k - 1) + [pool[-1]]
    while True:  # integer shares summing to 100, distinct, each >= 4
        cuts = sorted(rng.sample(range(4, 97), k - 1))
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, 100])]
        if min(shares) >= 4 and len(set(shares)) == k:
            break
    return {"chart_type": "pie", "title": title, "noun": noun, "unit": "%", "decimals": 0, "categories": cats,
            "series": [{"name": "Share (%)", "values": [float(v) for v in shares]}]}


def plot_chart(spec: dict[str, Any], rng: random.Random) -> Callable[[Any, Any, float], None]:
    """A matplotlib drawing function for ``spec`` (colours and grid chosen by ``rng``)."""
    import matplotlib

    kind, cats, dec = spec["chart_type"], spec["categories"], spec["decimals"]
    series = spec["series"]
    cmap = matplotlib.colormaps[rng.choice(PALETTES)]
    single = rng.choice(SINGLE_COLOURS)
    grid = rng.random() < 0.5
    multicolour = rng.random() < 0.3

    def plot(fig: Any, ax: Any, s: float) -> None:
        x = np.arange(len(cats))
        label_kw = {"fontsize": 5.8 * s, "padding": 1.5 * s}
        if kind in ("bar", "hbar"):
            vals = series[0]["values"]
            colours = [cmap(i % cmap.N) for i in range(len(cats))] if multicolour else single
            if kind == "bar":
                bars = ax.bar(x, vals, color=colours, width=0.65)
                ax.set_xticks(x, cats, rotation=30 if max(map(len, cats)) > 5 else 0,
                              ha="right" if max(map(len, cats)) > 5 else "center")
                ax.set_ylim(0, max(vals) * 1.18)
            else:
                bars = ax.barh(x, vals, color=colours, height=0.65)
                ax.set_yticks(x, cats)
                ax.invert_yaxis()
                ax.set_xlim(0, max(vals) * 1.25)
            ax.bar_label(bars, labels=[fmt(v, dec) for v in vals], **label_kw)
            _style(ax, s, spec["title"], spec["unit"] if kind == "bar" else None, fig)
            if kind == "hbar":
                ax.set_xlabel(spec["unit"], fontsize=6.2 * s)
        elif kind == "grouped_bar":
            w = 0.38
            for j, ser in enumerate(series):
                bars = ax.bar(x + (j - 0.5) * w, ser["values"], width=w, label=ser["name"], color=cmap(j * 2 % cmap.N))
                ax.bar_label(bars, labels=[fmt(v, dec) for v in ser["values"]], fontsize=5 * s, padding=1 * s)
            ax.set_xticks(x, cats, rotation=30 if max(map(len, cats)) > 5 else 0,
                          ha="right" if max(map(len, cats)) > 5 else "center")
            top = max(max(ser["values"]) for ser in series)
            ax.set_ylim(0, top * 1.3)
            ax.legend(fontsize=5.5 * s, frameon=False, loc="upper left", ncol=2, handlelength=1, borderaxespad=0.1)
            _style(ax, s, spec["title"], spec["unit"], fig)
        elif kind == "line":
            vals = series[0]["values"]
            ax.plot(x, vals, marker="o", markersize=3 * s, linewidth=1.4 * s, color=single)
            for xi, v in zip(x, vals):
                ax.annotate(fmt(v, dec), (xi, v), textcoords="offset points", xytext=(0, 3.5 * s), ha="center",
                            fontsize=5.6 * s)
            ax.set_xticks(x, cats, rotation=45, ha="right")
            lo, hi = min(vals), max(vals)
            ax.set_ylim(max(0.0, lo - (hi - lo) * 0.25), hi + (hi - lo) * 0.3)
            ax.set_xlim(-0.4, len(cats) - 0.6)
            _style(ax, s, spec["title"], spec["unit"], fig)
        else:  # pie
            vals = series[0]["values"]
            colours = [cmap(i % cmap.N) for i in range(len(cats))]
            ax.pie(vals, labels=[f"{c}\n{fmt(v, 0)}%" for c, v in zip(cats, vals)], colors=colours,
                   startangle=rng_angle, counterclock=False, labeldistance=1.18,
                   textprops={"fontsize": 5.6 * s}, wedgeprops={"linewidth": 0.6 * s, "edgecolor": "white"})
            ax.set_aspect("equal")
            _title(fig, spec["title"], s)
        if grid and kind != "pie":
            ax.grid(axis="x" if kind == "hbar" else "y", linewidth=0.4 * s, alpha=0.6)
            ax.set_axisbelow(True)
        fig.subplots_adjust(**margins(spec))

    rng_angle = rng.choice([90, 0, 45, 135])
    return plot


# ------------------------------------------------------------------------------------------ questions
def ask(spec: dict[str, Any], rng: random.Random) -> tuple[str, str, str]:
    """(question, exact answer, question type) about ``spec``'s data."""
    cats, dec, noun = spec["categories"], spec["decimals"], spec["noun"]
    kind = spec["chart_type"]
    if kind == "grouped_bar":
        j = rng.randrange(2)
        ser = spec["series"][j]
        vals = ser["values"]
        qtype = rng.choice(["value", "value", "max", "compare_series", "diff_pair"])
        if qtype == "value":
            i = rng.randrange(len(cats))
            return f"What is the value for {ser['name']} in {cats[i]}?", fmt(vals[i], dec), "value"
        if qtype == "max":
            return (f"For {ser['name']}, which {noun} has the highest value?",
                    cats[int(np.argmax(vals))], "argmax")
        if qtype == "compare_series":
            i = rng.randrange(len(cats))
            a, b = spec["series"][0], spec["series"][1]
            ans = "Yes" if a["values"][i] > b["values"][i] else "No"
            return f"In {cats[i]}, is the value for {a['name']} greater than the value for {b['name']}?", ans, "compare"
        i = rng.randrange(len(cats))
        a, b = spec["series"][0], spec["series"][1]
        return (f"What is the difference between {a['name']} and {b['name']} in {cats[i]}?",
                fmt(abs(a["values"][i] - b["values"][i]), dec), "difference")
    vals = spec["series"][0]["values"]
    if kind == "pie":
        qtype = rng.choice(["value", "value", "max", "min", "sum_pair", "diff_pair", "compare"])
    elif kind == "line":
        qtype = rng.choice(["value", "value", "max", "min", "diff_max_min", "diff_pair", "average", "compare"])
    else:
        qtype = rng.choice(["value", "value", "max", "min", "diff_max_min", "diff_pair", "sum_pair", "average",
                            "count_above", "compare", "ratio"])
    i, j = rng.sample(range(len(cats)), 2)
    if qtype == "value":
        if kind == "line":
            return f"What was the {spec['measure']} in {cats[i]}?", fmt(vals[i], dec), "value"
        if kind == "pie":
            return f"What percentage of the chart does {cats[i]} represent?", fmt(vals[i], 0), "value"
        return f"What is the value of {cats[i]}?", fmt(vals[i], dec), "value"
    if qtype in ("max", "min"):
        pick = int(np.argmax(vals)) if qtype == "max" else int(np.argmin(vals))
        word = {"max": "highest", "min": "lowest"}[qtype]
        if kind == "line":
            return f"In which year was the {spec['measure']} the {word}?", cats[pick], "arg" + qtype
        if kind == "pie":
            word = {"max": "largest", "min": "smallest"}[qtype]
            return f"Which {noun} has the {word} share?", cats[pick], "arg" + qtype
        return f"Which {noun} has the {word} value?", cats[pick], "arg" + qtype
    if qtype == "diff_max_min":
        return ("What is the difference between the highest and the lowest value?",
                fmt(max(vals) - min(vals), dec), "difference")
    if qtype == "diff_pair":
        return (f"What is the difference between {cats[i]} and {cats[j]}?",
                fmt(abs(vals[i] - vals[j]), dec), "difference")
    if qtype == "sum_pair":
        return f"What is the sum of {cats[i]} and {cats[j]}?", fmt(vals[i] + vals[j], dec), "sum"
    if qtype == "average":
        return "What is the average of all the values?", fmt_derived(sum(vals) / len(vals)), "average"
    if qtype == "ratio":
        return f"What is the ratio of {cats[i]} to {cats[j]}?", fmt_derived(vals[i] / vals[j]), "ratio"
    if qtype == "count_above":
        srt = sorted(vals)
        m = rng.randrange(len(srt) - 1)
        threshold = (srt[m] + srt[m + 1]) / 2
        threshold = round(threshold) if dec == 0 and round(threshold) not in srt else round(threshold, dec + 1)
        count = sum(v > threshold for v in vals)
        return f"How many {noun_plural(noun)} have a value greater than {threshold:g}?", str(count), "count"
    # compare
    ans = "Yes" if vals[i] > vals[j] else "No"
    return f"Is the value of {cats[i]} greater than the value of {cats[j]}?", ans, "compare"


def noun_plural(noun: str) -> str:
    irregular = {"country": "countries", "city": "cities", "company": "companies", "category": "categories"}
    return irregular.get(noun, noun + "s")


def generate_chart(seed: int, index: int, image_size: int) -> Draft:
    """Sample ``index`` of the ChartQA-style generator: (chart, question) -> exact answer."""
    rng = sample_rng("chartqa_synth", seed, index)
    kind = rng.choice(["bar", "bar", "hbar", "grouped_bar", "line", "line", "pie"])
    if kind in ("bar", "hbar"):
        spec = bar_chart(rng, horizontal=kind == "hbar")
    elif kind == "grouped_bar":
        spec = grouped_chart(rng)
    elif kind == "line":
        spec = line_chart(rng)
    else:
        spec = pie_chart(rng)
    img = render(plot_chart(spec, rng), image_size)
    question, answer, qtype = ask(spec, rng)
    meta = {"answer": answer, "question": question, "question_type": qtype, "chart_type": spec["chart_type"],
            "title": spec["title"], "unit": spec["unit"], "decimals": spec["decimals"],
            "categories": list(spec["categories"]), "series": spec["series"]}
    return Draft(prompt=question + POST_PROMPT, reference=answer, image=img, meta=meta)
