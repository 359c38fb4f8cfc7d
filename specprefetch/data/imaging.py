"""Shared pieces of the image generators: seeded RNGs, bundled fonts, backgrounds, text layers, PNG bytes.

Everything here is deterministic given its RNG: fonts come from matplotlib's bundled TTFs (never the system's
font config, which differs by machine), and PNGs are encoded with fixed options and no metadata, so the same
seed gives byte-identical files.
"""

from __future__ import annotations

import functools
import io
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

RGB = tuple[int, int, int]

# Font roles -> matplotlib-bundled TTF files. Computer Modern (cm*) fonts only map letters and digits
# reliably, so they are used only where the text is alphanumeric (see FONT_ALNUM_ONLY).
FONTS: dict[str, tuple[str, ...]] = {
    "sans": ("DejaVuSans.ttf",),
    "sans_bold": ("DejaVuSans-Bold.ttf",),
    "serif": ("DejaVuSerif.ttf", "STIXGeneral.ttf"),
    "serif_bold": ("DejaVuSerif-Bold.ttf", "STIXGeneralBol.ttf"),
    "mono": ("DejaVuSansMono.ttf",),
    "mono_bold": ("DejaVuSansMono-Bold.ttf",),
    "italic": ("DejaVuSans-Oblique.ttf", "STIXGeneralItalic.ttf", "DejaVuSerif-BoldItalic.ttf"),
    "hand": ("cmti10.ttf", "STIXGeneralItalic.ttf", "DejaVuSans-Oblique.ttf"),
}
FONT_ALNUM_ONLY = ("cmti10.ttf",)

PNG_OPTIONS = {"format": "PNG", "compress_level": 6, "optimize": False}


def sample_rng(generator: str, seed: int, index: int) -> random.Random:
    """One independent RNG per sample, so sample i does not depend on how many samples are drawn.

    Seeding ``random.Random`` with a str hashes it with SHA-512 (stable across runs and PYTHONHASHSEED).
    """
    return random.Random(f"specprefetch/{generator}/{seed}/{index}")


def np_rng(rng: random.Random) -> np.random.Generator:
    return np.random.default_rng(rng.getrandbits(64))


@functools.lru_cache(maxsize=None)
def font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


@functools.lru_cache(maxsize=512)
def load_font(filename: str, size: int) -> ImageFont.FreeTypeFont:
    # BASIC layout: no dependency on whether libraqm is installed, so glyph placement is the same everywhere.
    return ImageFont.truetype(str(font_dir() / filename), size=max(4, int(size)), layout_engine=ImageFont.Layout.BASIC)


def pick_font_file(rng: random.Random, role: str, text: str = "") -> str:
    """A font file for ``role``; skips fonts that cannot render ``text`` (non-alphanumeric in cm fonts)."""
    choices = [
        f for f in FONTS[role]
        if f not in FONT_ALNUM_ONLY or all(c.isalnum() or c == " " for c in text)
    ]
    return rng.choice(choices or list(FONTS["sans"]))


def png_bytes(img: Image.Image) -> bytes:
    """Encode an image as an RGB PNG with fixed options and no metadata (same pixels -> same bytes)."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, **PNG_OPTIONS)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ colours
NAMED_COLOURS: dict[str, RGB] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (245, 205, 30),
    "orange": (245, 135, 20),
    "purple": (130, 60, 170),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
    "brown": (130, 80, 40),
    "pink": (240, 120, 180),
}


def jitter(c: RGB, rng: random.Random, amount: int = 18) -> RGB:
    return tuple(max(0, min(255, v + rng.randint(-amount, amount))) for v in c)  # type: ignore[return-value]


def luminance(c: RGB) -> float:
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]


def contrasting(c: RGB, rng: random.Random) -> RGB:
    """A text colour readable on background ``c``."""
    if luminance(c) > 140:
        return jitter((25, 25, 30), rng, 20)
    return jitter((245, 245, 240), rng, 10)


def random_colour(rng: random.Random, lo: int = 0, hi: int = 255) -> RGB:
    return (rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi))


# ------------------------------------------------------------------------------------------ backgrounds
def gradient(size: int, c1: RGB, c2: RGB, rng: random.Random) -> Image.Image:
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(1, size - 1)
    t = (np.cos(angle) * (xx - 0.5) + np.sin(angle) * (yy - 0.5)) / 1.42 + 0.5
    arr = (np.asarray(c1, np.float32)[None, None] * (1 - t[..., None])
           + np.asarray(c2, np.float32)[None, None] * t[..., None])
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def noise_texture(size: int, base: RGB, rng: random.Random, strength: float = 40.0, cells: int = 6) -> Image.Image:
    """Low-frequency colour noise (walls, pavement, paper), upsampled bicubically from a coarse grid."""
    g = np_rng(rng)
    coarse = g.normal(0.0, strength, size=(cells, cells, 3)).astype(np.float32)
    coarse_img = Image.fromarray(np.clip(coarse + 128, 0, 255).astype(np.uint8), "RGB").resize(
        (size, size), Image.Resampling.BICUBIC)
    fine = g.normal(0.0, strength * 0.15, size=(size, size, 3)).astype(np.float32)
    arr = np.asarray(coarse_img, np.float32) - 128 + fine + np.asarray(base, np.float32)[None, None]
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def scene_background(size: int, rng: random.Random) -> Image.Image:
    """A street-like scene: sky/wall gradient, a few blurred blocks (buildings, windows, foliage)."""
    top = random_colour(rng, 90, 230)
    bottom = random_colour(rng, 40, 160)
    img = gradient(size, top, bottom, rng)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(3, 8)):
        x0, y0 = rng.randint(-size // 4, size), rng.randint(size // 4, size)
        w, h = rng.randint(size // 8, size // 2), rng.randint(size // 8, size)
        draw.rectangle([x0, y0, x0 + w, y0 + h], fill=random_colour(rng, 30, 200))
    for _ in range(rng.randint(0, 5)):
        x0, y0 = rng.randint(0, size), rng.randint(0, size)
        r = rng.randint(size // 20, size // 6)
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=random_colour(rng, 20, 220))
    img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(1.0, 3.0) * size / 224))
    noise = noise_texture(size, (0, 0, 0), rng, strength=12)
    return Image.blend(img, noise, 0.12)


def paper_background(size: int, rng: random.Random, lined: bool = False) -> Image.Image:
    base = jitter((246, 243, 232), rng, 8)
    img = noise_texture(size, base, rng, strength=4, cells=4)
    if lined:
        draw = ImageDraw.Draw(img)
        gap = max(10, size // rng.randint(7, 10))
        for y in range(gap, size, gap):
            draw.line([(0, y), (size, y)], fill=jitter((160, 185, 220), rng, 10), width=1)
        x = size // 9
        draw.line([(x, 0), (x, size)], fill=jitter((220, 120, 120), rng, 10), width=1)
    return img


# ------------------------------------------------------------------------------------------ text
def text_size(font: ImageFont.FreeTypeFont, text: str, stroke: int = 0) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of (possibly multi-line) ``text`` drawn at the origin."""
    if "\n" in text:
        probe = ImageDraw.Draw(Image.new("RGBA", (1, 1)))
        return probe.multiline_textbbox((0, 0), text, font=font, stroke_width=stroke)
    return font.getbbox(text, stroke_width=stroke)


def fit_font(filename: str, text: str, max_w: float, max_h: float, start: int, stroke_ratio: float = 0.0,
             min_size: int = 6) -> ImageFont.FreeTypeFont:
    """The largest font size <= ``start`` whose rendering of ``text`` fits in max_w x max_h."""
    size = start
    while size > min_size:
        font = load_font(filename, size)
        l, t, r, b = text_size(font, text, int(size * stroke_ratio))
        if r - l <= max_w and b - t <= max_h:
            return font
        size -= 1
    return load_font(filename, min_size)


def text_layer(text: str, font: ImageFont.FreeTypeFont, fill: RGB, stroke: int = 0,
               stroke_fill: RGB | None = None, spacing: int = 2, align: str = "left") -> Image.Image:
    """Render (possibly multi-line) text tightly onto a transparent RGBA layer."""
    probe = ImageDraw.Draw(Image.new("RGBA", (1, 1)))
    l, t, r, b = probe.multiline_textbbox((0, 0), text, font=font, stroke_width=stroke, spacing=spacing, align=align)
    pad = 2 + stroke
    layer = Image.new("RGBA", (r - l + 2 * pad, b - t + 2 * pad), (0, 0, 0, 0))
    ImageDraw.Draw(layer).multiline_text(
        (pad - l, pad - t), text, font=font, fill=fill + (255,), stroke_width=stroke,
        stroke_fill=(stroke_fill + (255,)) if stroke_fill else None, spacing=spacing, align=align)
    return layer


def paste_center(img: Image.Image, layer: Image.Image, cx: float, cy: float, angle: float = 0.0) -> None:
    """Paste an RGBA layer centred at (cx, cy), rotated by ``angle`` degrees (bicubic, expanded)."""
    if angle:
        layer = layer.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True)
    x = int(round(cx - layer.width / 2))
    y = int(round(cy - layer.height / 2))
    img.paste(layer, (x, y), layer)


def handwritten_layer(text: str, filename: str, size: int, ink: RGB, rng: random.Random) -> Image.Image:
    """Text whose characters wobble in size, slant and baseline, like handwriting."""
    placed: list[tuple[float, Image.Image | None]] = []  # (advance, glyph)
    for ch in text:
        font = load_font(filename, int(size * rng.uniform(0.9, 1.1)))
        advance = font.getlength(ch) * rng.uniform(0.92, 1.05)
        if ch == " ":
            placed.append((max(advance, size * 0.3), None))
            continue
        # Every glyph sits on a common baseline (anchor "ls") on a fixed-height canvas, so descenders
        # and ascenders stay where they belong; only a small rotation and jitter are added.
        g = Image.new("RGBA", (int(advance + size), int(size * 1.8)), (0, 0, 0, 0))
        ImageDraw.Draw(g).text((size / 2, size * 1.25), ch, font=font, fill=jitter(ink, rng, 12) + (255,), anchor="ls")
        placed.append((advance, g.rotate(rng.uniform(-7, 7), resample=Image.Resampling.BICUBIC)))
    height = max((g.height for _, g in placed if g is not None), default=size) + size // 3
    width = int(sum(a for a, _ in placed) + size)
    layer = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    x = size / 2
    for advance, g in placed:
        if g is not None:
            y = (height - g.height) // 2 + rng.randint(-max(1, size // 20), max(1, size // 20))
            layer.paste(g, (int(x + advance / 2 - g.width / 2), y), g)
        x += advance
    bbox = layer.getbbox()
    return layer.crop(bbox) if bbox else layer


def curved_layer(text: str, font: ImageFont.FreeTypeFont, fill: RGB, radius: float, arc_up: bool) -> Image.Image:
    """Characters placed along a circular arc (irregular scene text: badges, stamps, logos)."""
    widths = [max(1, text_size(font, ch)[2] - text_size(font, ch)[0]) if ch != " " else font.size // 3 for ch in text]
    total = sum(widths) + len(text) * 1
    span = total / radius  # radians
    side = int(2 * radius + 3 * font.size)
    layer = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    c = side / 2
    theta = -span / 2
    for ch, w in zip(text, widths):
        mid = theta + (w / 2) / radius
        theta += (w + 1) / radius
        if ch == " ":
            continue
        g = text_layer(ch, font, fill)
        if arc_up:  # letters on top of the circle, reading left to right
            x, y = c + radius * np.sin(mid), c - radius * np.cos(mid)
            g = g.rotate(-np.degrees(mid), resample=Image.Resampling.BICUBIC, expand=True)
        else:  # letters under the circle
            x, y = c + radius * np.sin(mid), c + radius * np.cos(mid)
            g = g.rotate(np.degrees(mid), resample=Image.Resampling.BICUBIC, expand=True)
        layer.paste(g, (int(x - g.width / 2), int(y - g.height / 2)), g)
    bbox = layer.getbbox()
    return layer.crop(bbox) if bbox else layer
