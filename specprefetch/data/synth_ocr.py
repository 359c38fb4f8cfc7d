"""OCRBench-style text images rendered with Pillow, with the transcription (or the read-off field) as answer.

Scene kinds mirror OCRBench's question types: regular, irregular (curved, rotated), artistic (outlined,
coloured) and non-semantic text recognition, handwriting recognition, digit strings, scene-text VQA (signs,
licence plates, shop fronts), key information extraction (receipts) and document VQA (titled notes).
The answer is always text that is actually drawn in the image, so a model has to read the image.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from PIL import Image, ImageDraw, ImageFilter

from specprefetch.data import imaging as im
from specprefetch.data.draft import Draft

WORDS = (
    "garden river coffee window market winter summer harbor silver planet forest bridge castle museum "
    "library station pocket ticket orange yellow purple violet basket candle letter mirror rocket "
    "school sunset island valley meadow thunder breeze shadow lantern compass journey voyage anchor "
    "falcon tiger dolphin rabbit penguin giraffe panda eagle cactus maple bamboo pepper ginger honey "
    "butter cookie bakery pizza noodle salad pasta cheese lemon mango cherry melon peach grape "
    "guitar violin piano melody rhythm poetry novel chapter canvas marble copper velvet cotton "
    "engine motor signal circuit battery magnet crystal nectar pebble quartz ember glacier canyon "
    "desert prairie tundra lagoon summit harvest festival parade carnival theater gallery studio"
).split()
SIGNS = [
    "EXIT", "STOP", "NO PARKING", "ONE WAY", "OPEN", "CLOSED", "PUSH", "PULL", "PRIVATE", "DANGER",
    "KEEP OUT", "WET FLOOR", "FIRE EXIT", "BUS STOP", "TAXI", "PHARMACY", "HOTEL", "BAKERY", "POLICE",
    "ENTRANCE", "RESTROOMS", "SCHOOL ZONE", "SLOW DOWN", "NO ENTRY", "LOADING ZONE", "STAFF ONLY",
    "PARKING", "INFORMATION", "TICKETS", "PLATFORM 4", "GATE 12", "ROUTE 66", "SALE", "FRESH BREAD",
    "OPEN 24 HOURS", "SPEED LIMIT 30", "DEAD END", "YIELD", "DETOUR", "CASH ONLY",
]
STREET_NAMES = ["Oak", "Maple", "Cedar", "Elm", "Pine", "Lake", "Hill", "Park", "Main", "Church", "Mill",
                "River", "Sunset", "King", "Queen", "Station", "Harbor", "Bridge", "Market", "Spring"]
STREET_TYPES = ["St", "Ave", "Rd", "Blvd", "Lane", "Way", "Drive"]
SHOP_ADJ = ["Golden", "Blue", "Little", "Green", "Happy", "Royal", "Corner", "Sunny", "Old", "Silver", "Red"]
SHOP_NOUN = ["Leaf", "Oak", "Moon", "Star", "Lantern", "Kettle", "Spoon", "Fox", "Anchor", "Rose", "Bee"]
SHOP_KIND = ["Cafe", "Bakery", "Market", "Books", "Diner", "Deli", "Grocery", "Pharmacy", "Florist", "Pizza"]
GROCERIES = ["MILK", "BREAD", "EGGS", "APPLES", "RICE", "COFFEE", "TEA", "BUTTER", "CHEESE", "PASTA",
             "TOMATOES", "BANANAS", "YOGURT", "JUICE", "CEREAL", "ONIONS", "CHICKEN", "SOAP", "WATER", "OIL"]
DOC_TITLES = ["Meeting Notes", "Project Plan", "Weekly Report", "Shopping List", "Travel Plans", "Reading List",
              "Lab Results", "Class Schedule", "Budget Summary", "Recipe Card", "Packing List", "Event Agenda"]

REGULAR_QUESTIONS = ["What is written in the image?", "What text is shown in the image?",
                     "Read the text in the image.", "What does the text in the image say?"]


def _shop_name(rng: random.Random) -> str:
    return f"{rng.choice(SHOP_ADJ)} {rng.choice(SHOP_NOUN)} {rng.choice(SHOP_KIND)}"


def _street(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(STREET_NAMES)} {rng.choice(STREET_TYPES)}"


def _word_case(rng: random.Random, word: str) -> str:
    return rng.choice([word, word.upper(), word.capitalize()])


def _phrase(rng: random.Random, k: int) -> str:
    return " ".join(_word_case(rng, w) if i == 0 else w for i, w in enumerate(rng.sample(WORDS, k)))


# ------------------------------------------------------------------------------------------ scene kinds
def regular_text(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """Printed words on a plain or paper background, horizontal."""
    text = _phrase(rng, rng.randint(1, 3))
    bg = rng.choice([im.random_colour(rng, 170, 255), im.random_colour(rng, 0, 90)])
    img = im.noise_texture(size, bg, rng, strength=6, cells=3)
    role = rng.choice(["sans", "serif", "sans_bold", "serif_bold", "mono"])
    font = im.fit_font(im.pick_font_file(rng, role, text), text, size * 0.86, size * 0.3, int(size * 0.2))
    layer = im.text_layer(text, font, im.contrasting(bg, rng))
    im.paste_center(img, layer, size / 2 + rng.uniform(-0.05, 0.05) * size, size / 2 + rng.uniform(-0.2, 0.2) * size)
    return img, rng.choice(REGULAR_QUESTIONS), text, "Regular Text Recognition"


def irregular_text(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """A curved (badge, stamp) or strongly rotated word over a scene."""
    text = _word_case(rng, rng.choice(WORDS)).upper() if rng.random() < 0.6 else _word_case(rng, rng.choice(WORDS))
    img = (im.scene_background(size, rng) if rng.random() < 0.5
           else im.noise_texture(size, im.random_colour(rng, 150, 250), rng, 10))
    ink = im.NAMED_COLOURS[rng.choice(["red", "blue", "black", "green", "purple", "brown"])]
    if rng.random() < 0.6:
        cx, cy = size / 2, size / 2
        radius = size * rng.uniform(0.26, 0.36)
        disk = rng.random() < 0.7
        draw = ImageDraw.Draw(img)
        if disk:  # a round badge behind the text
            r = radius + size * 0.12
            fill = im.jitter((245, 240, 225), rng, 10)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=ink, width=max(2, size // 70))
            ink = im.contrasting(fill, rng) if rng.random() < 0.3 else ink
        fsize = int(min(size * 0.13, 2.6 * radius / max(3, len(text)) * 1.6))
        font = im.load_font(im.pick_font_file(rng, rng.choice(["sans_bold", "serif_bold"]), text), fsize)
        layer = im.curved_layer(text, font, ink, radius, arc_up=rng.random() < 0.75)
        im.paste_center(img, layer, cx, cy)
    else:
        font = im.fit_font(im.pick_font_file(rng, "sans_bold", text), text, size * 0.7, size * 0.25, int(size * 0.18))
        layer = im.text_layer(text, font, ink, stroke=max(1, size // 112), stroke_fill=(255, 255, 255))
        im.paste_center(img, layer, size / 2, size / 2, angle=rng.choice([-1, 1]) * rng.uniform(20, 50))
    return img, rng.choice(REGULAR_QUESTIONS), text, "Irregular Text Recognition"


def artistic_text(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """Poster-like lettering: bold, outlined, shadowed, on a gradient."""
    text = _word_case(rng, rng.choice(WORDS))
    c1, c2 = im.random_colour(rng, 0, 255), im.random_colour(rng, 0, 255)
    img = im.gradient(size, c1, c2, rng)
    fill = im.random_colour(rng, 0, 255)
    if abs(im.luminance(fill) - im.luminance(c1)) < 60:
        fill = im.contrasting(c1, rng)
    outline = (0, 0, 0) if im.luminance(fill) > 110 else (255, 255, 255)
    role = rng.choice(["sans_bold", "serif_bold", "italic"])
    stroke = max(1, size // 75)
    font = im.fit_font(im.pick_font_file(rng, role, text), text, size * 0.86, size * 0.35, int(size * 0.26), 1 / 12)
    if rng.random() < 0.5:  # drop shadow
        shadow = im.text_layer(text, font, (30, 30, 30), stroke=stroke, stroke_fill=(30, 30, 30))
        shadow = shadow.filter(ImageFilter.GaussianBlur(radius=max(1, size // 110)))
        im.paste_center(img, shadow, size / 2 + size * 0.015, size / 2 + size * 0.02)
    layer = im.text_layer(text, font, fill, stroke=stroke, stroke_fill=outline)
    im.paste_center(img, layer, size / 2, size / 2, angle=rng.uniform(-8, 8))
    return img, rng.choice(REGULAR_QUESTIONS), text, "Artistic Text Recognition"


def handwriting(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """Wobbly italic script in pen ink on lined paper."""
    words = rng.sample(WORDS, rng.randint(1, 2))
    text = " ".join(words)
    img = im.paper_background(size, rng, lined=rng.random() < 0.7)
    ink = im.jitter(rng.choice([(25, 35, 120), (20, 20, 25), (30, 60, 150)]), rng, 10)
    fname = im.pick_font_file(rng, "hand", text)
    fsize = int(size * 0.2)
    layer = im.handwritten_layer(text, fname, fsize, ink, rng)
    while layer.width > size * 0.92 and fsize > 8:
        fsize = int(fsize * 0.9)
        layer = im.handwritten_layer(text, fname, fsize, ink, rng)
    im.paste_center(img, layer, size / 2, size / 2 + rng.uniform(-0.15, 0.15) * size, angle=rng.uniform(-5, 5))
    return img, rng.choice(REGULAR_QUESTIONS), text, "Handwriting Recognition"


def digit_string(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """Phone numbers, meter readings, serial numbers."""
    kind = rng.choice(["phone", "serial", "meter"])
    if kind == "phone":
        text = f"{rng.randint(200, 989)}-{rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
        label = rng.choice(["CALL", "TEL", "PHONE", "ORDER NOW"])
        question = "What is the phone number shown in the image?"
    elif kind == "serial":
        text = "".join(rng.choice(string.digits) for _ in range(rng.randint(6, 10)))
        label = rng.choice(["S/N", "No.", "ID", "LOT"])
        question = "What is the number shown in the image?"
    else:
        text = f"{rng.randint(0, 99999):05d}"
        label = rng.choice(["kWh", "m3", "km"])
        question = "What is the reading on the meter?"
    bg = im.random_colour(rng, 0, 255)
    img = im.noise_texture(size, bg, rng, strength=8, cells=3)
    draw = ImageDraw.Draw(img)
    panel = im.jitter((235, 235, 230), rng, 15) if kind != "meter" else (20, 20, 20)
    ink = (15, 15, 15) if kind != "meter" else im.jitter((240, 240, 240), rng, 8)
    x0, y0, x1, y1 = size * 0.06, size * 0.3, size * 0.94, size * 0.7
    draw.rounded_rectangle([x0, y0, x1, y1], radius=size // 30, fill=panel, outline=(60, 60, 60),
                           width=max(1, size // 110))
    small = im.load_font(im.FONTS["sans_bold"][0], max(7, int(size * 0.07)))
    draw.text((x0 + size * 0.03, y0 + size * 0.02), label, font=small, fill=ink)
    font = im.fit_font(im.pick_font_file(rng, rng.choice(["mono_bold", "sans_bold"]), text), text,
                       (x1 - x0) * 0.9, (y1 - y0) * 0.5, int(size * 0.16))
    im.paste_center(img, im.text_layer(text, font, ink), (x0 + x1) / 2, (y0 + y1) / 2 + size * 0.04)
    return img, question, text, "Digit String Recognition"


def non_semantic(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """Random letter strings: no language prior helps, only reading."""
    alphabet = rng.choice([string.ascii_lowercase, string.ascii_uppercase, string.ascii_letters])
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 8)))
    bg = im.random_colour(rng, 180, 255)
    img = im.noise_texture(size, bg, rng, strength=10, cells=4)
    font = im.fit_font(im.pick_font_file(rng, rng.choice(["sans", "serif", "mono"]), text), text,
                       size * 0.8, size * 0.3, int(size * 0.2))
    im.paste_center(img, im.text_layer(text, font, im.contrasting(bg, rng)), size / 2, size / 2,
                    angle=rng.uniform(-6, 6))
    return img, rng.choice(REGULAR_QUESTIONS), text, "Non-Semantic Text Recognition"


def street_sign(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """A sign, shop front or street-name plate in a street scene (scene-text VQA)."""
    img = im.scene_background(size, rng)
    draw = ImageDraw.Draw(img)
    kind = rng.choice(["sign", "shop", "street"])
    if kind == "sign":
        text = rng.choice(SIGNS)
        colour = im.NAMED_COLOURS[rng.choice(["red", "green", "blue", "black", "brown", "yellow"])]
        question = rng.choice(["What is written on the sign?", "What does the sign say?"])
    elif kind == "shop":
        text = _shop_name(rng)
        colour = im.random_colour(rng, 0, 255)
        question = rng.choice(["What is the name of the shop?", "What is the name of the store in the image?"])
    else:
        text = _street(rng)
        colour = im.NAMED_COLOURS[rng.choice(["green", "blue", "black"])]
        question = "What is the address shown on the sign?"
    w, h = size * rng.uniform(0.7, 0.9), size * rng.uniform(0.28, 0.4)
    cx, cy = size / 2 + rng.uniform(-0.05, 0.05) * size, size * rng.uniform(0.35, 0.6)
    if kind == "sign" and " " in text and len(text) > 9:
        shown = text.replace(" ", "\n", 1)
        h = size * 0.45
    else:
        shown = text
    sign = Image.new("RGBA", (int(w), int(h)), (0, 0, 0, 0))
    sd = ImageDraw.Draw(sign)
    border = im.contrasting(colour, rng)
    sd.rounded_rectangle([0, 0, w - 1, h - 1], radius=int(size * 0.03), fill=colour + (255,), outline=border + (255,),
                         width=max(2, size // 60))
    font = im.fit_font(im.pick_font_file(rng, rng.choice(["sans_bold", "serif_bold"]), text), shown,
                       w * 0.86, h * 0.72, int(size * 0.16))
    t = im.text_layer(shown, font, border, align="center")
    sign.paste(t, (int((w - t.width) / 2), int((h - t.height) / 2)), t)
    draw.rectangle([cx - size * 0.012, cy, cx + size * 0.012, size], fill=(90, 90, 95))  # the post
    im.paste_center(img, sign, cx, cy, angle=rng.uniform(-7, 7))
    return img, question, text, "Scene Text-centric VQA"


def licence_plate(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(3))
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 4)))
    text = rng.choice([f"{letters} {digits}", f"{digits} {letters}", f"{rng.randint(1, 9)}{letters}{digits[:3]}"])
    body = im.random_colour(rng, 0, 255)
    img = im.gradient(size, body, im.jitter(body, rng, 60), rng)
    draw = ImageDraw.Draw(img)
    plate_bg = rng.choice([(245, 245, 240), (250, 215, 40), (235, 240, 250)])
    w, h = size * 0.8, size * 0.26
    x0, y0 = (size - w) / 2, size * rng.uniform(0.38, 0.52)
    draw.rectangle([0, y0 - size * 0.08, size, y0 + h + size * 0.08], fill=im.jitter((60, 60, 60), rng, 20))  # bumper
    draw.rounded_rectangle([x0, y0, x0 + w, y0 + h], radius=size // 40, fill=plate_bg, outline=(20, 20, 20),
                           width=max(2, size // 70))
    region = rng.choice(["CALIFORNIA", "TEXAS", "OREGON", "NEVADA", "OHIO", "MAINE", "ALASKA", "IDAHO"])
    small = im.load_font(im.FONTS["sans_bold"][0], max(6, int(size * 0.05)))
    rb = small.getbbox(region)
    draw.text((x0 + (w - (rb[2] - rb[0])) / 2, y0 + size * 0.012), region, font=small, fill=(150, 30, 30))
    font = im.fit_font(im.pick_font_file(rng, "mono_bold", text), text, w * 0.9, h * 0.62, int(size * 0.16))
    im.paste_center(img, im.text_layer(text, font, (15, 15, 25)), size / 2, y0 + h * 0.6)
    img = img.rotate(rng.uniform(-6, 6), resample=Image.Resampling.BICUBIC, fillcolor=body)
    return img, "What is the license plate number?", text, "Scene Text-centric VQA"


def receipt(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """A till receipt: shop name, items with prices, total (key information extraction)."""
    shop = _shop_name(rng).upper()
    items = rng.sample(GROCERIES, rng.randint(2, 4))
    cents = [rng.randint(49, 1599) for _ in items]
    total = sum(cents)
    width_chars = 20
    lines = [shop[:width_chars].center(width_chars)]
    for name, c in zip(items, cents):
        price = f"{c / 100:.2f}"
        lines.append(name[: width_chars - len(price) - 1].ljust(width_chars - len(price)) + price)
    total_s = f"{total / 100:.2f}"
    lines.append("-" * width_chars)
    lines.append("TOTAL".ljust(width_chars - len(total_s) - 1) + "$" + total_s)
    text = "\n".join(lines)
    img = im.noise_texture(size, im.random_colour(rng, 60, 140), rng, strength=12, cells=3)  # the table
    font = im.fit_font(im.FONTS["mono"][0], text, size * 0.8, size * 0.8, int(size * 0.075), min_size=6)
    layer = im.text_layer(text, font, im.jitter((35, 35, 40), rng, 10), spacing=max(1, size // 110))
    pad = int(size * 0.04)
    paper = Image.new("RGBA", (layer.width + 2 * pad, layer.height + 2 * pad),
                      im.jitter((250, 249, 242), rng, 4) + (255,))
    paper.paste(layer, (pad, pad), layer)
    im.paste_center(img, paper, size / 2, size / 2, angle=rng.uniform(-4, 4))
    kind = rng.random()
    if kind < 0.5:
        return img, "What is the total amount on the receipt?", f"${total_s}", "Key Information Extraction"
    if kind < 0.75:
        return img, "What is the name of the store on the receipt?", shop, "Key Information Extraction"
    k = rng.randrange(len(items))
    return img, f"How much does {items[k]} cost on the receipt?", f"{cents[k] / 100:.2f}", "Key Information Extraction"


def document(rng: random.Random, size: int) -> tuple[Image.Image, str, str, str]:
    """A short note with a bold title and a dated line (document VQA)."""
    title = rng.choice(DOC_TITLES)
    months = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
              "October", "November", "December"]
    date = f"{rng.choice(months)} {rng.randint(1, 28)}, {rng.randint(2015, 2025)}"
    body = [_phrase(rng, 3) for _ in range(rng.randint(2, 3))]
    img = im.paper_background(size, rng)
    draw = ImageDraw.Draw(img)
    tfont = im.fit_font(im.pick_font_file(rng, "serif_bold", title), title, size * 0.86, size * 0.14, int(size * 0.1))
    y = size * 0.1
    draw.text((size * 0.07, y), title, font=tfont, fill=(15, 15, 20))
    y += tfont.size * 1.5
    bfont = im.load_font(im.FONTS["serif"][0], max(6, int(size * 0.058)))
    draw.text((size * 0.07, y), f"Date: {date}", font=bfont, fill=(40, 40, 45))
    y += bfont.size * 1.6
    for line in body:
        bf = im.fit_font(im.FONTS["serif"][0], "- " + line, size * 0.86, size * 0.1, bfont.size)
        draw.text((size * 0.07, y), "- " + line, font=bf, fill=(40, 40, 45))
        y += bfont.size * 1.4
    if rng.random() < 0.5:
        return img, "What is the title of the document?", title, "Doc-oriented VQA"
    return img, "What date is written on the document?", date, "Doc-oriented VQA"


SCENES: dict[str, Callable[[random.Random, int], tuple[Image.Image, str, str, str]]] = {
    "regular": regular_text, "irregular": irregular_text, "artistic": artistic_text, "handwriting": handwriting,
    "digits": digit_string, "non_semantic": non_semantic, "sign": street_sign, "licence_plate": licence_plate,
    "receipt": receipt, "document": document,
}


def generate_ocr(seed: int, index: int, image_size: int) -> Draft:
    """Sample ``index`` of the OCRBench-style generator: (image, question) -> transcription."""
    rng = sample_rng_for(seed, index)
    scene = rng.choice(sorted(SCENES))
    img, question, answer, qtype = SCENES[scene](rng, image_size)
    img = img.convert("RGB")
    if img.size != (image_size, image_size):  # defensive: every scene draws on a size x size canvas
        img = img.resize((image_size, image_size), Image.Resampling.LANCZOS)
    return Draft(prompt=question, reference=answer, image=img,
                 meta={"answer": answer, "answers": [answer], "question_type": qtype, "scene": scene})


def sample_rng_for(seed: int, index: int) -> random.Random:
    return im.sample_rng("ocr_synth", seed, index)
