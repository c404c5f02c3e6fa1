"""Glyphs: a generated image-classification set as large as asked, for DeiT/ViT runs on a CPU.

No pip wheel ships an image set larger than MNIST-5k (README, Data), and 4,000 training images
are memorised long before a ViT's compute budget is spent: the regime check then measures
over-fitting, not what a growth method saves. This set is rendered from the fonts matplotlib
ships (DejaVu Sans/Mono/Serif, STIX, Computer Modern: 21 faces, their licences beside them in
``matplotlib/mpl-data/fonts/ttf``) and nothing else, so it is the same on every machine with the
same matplotlib and Pillow.

Each 28x28 grey image is a crop of a line of text: the character to classify in the middle, a
random neighbour on each side (partly cut off by the frame, at a random grey), the whole crop
rotated, sheared, scaled and shifted at random, dimmed, and with Gaussian noise. Classes: the 34
characters ``0-9`` and ``A-Z`` without ``I`` and ``O`` (which no font separates from ``1`` and ``0``).

The images depend only on ``(n, seed)``; a run's seed chooses the split, not the images, as it
does for MNIST.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

CLASSES = "0123456789ABCDEFGHJKLMNPQRSTUVWXYZ"
FACES = ("DejaVuSans", "DejaVuSans-Bold", "DejaVuSans-Oblique", "DejaVuSans-BoldOblique",
         "DejaVuSansMono", "DejaVuSansMono-Bold", "DejaVuSansMono-Oblique", "DejaVuSansMono-BoldOblique",
         "DejaVuSerif", "DejaVuSerif-Bold", "DejaVuSerif-Italic", "DejaVuSerif-BoldItalic",
         "STIXGeneral", "STIXGeneralBol", "STIXGeneralItalic", "STIXGeneralBolIta",
         "cmr10", "cmb10", "cmss10", "cmti10", "cmtt10")
SIDE = 28          # output side (MNIST's)
CANVAS = 64        # rendered at this side, then resampled down
FONT_PX = 40       # glyph size on the canvas
DEFAULT_IMAGES = 50_000


@lru_cache(maxsize=None)
def _fonts():
    import matplotlib
    from PIL import ImageFont

    root = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return tuple(ImageFont.truetype(str(root / f"{face}.ttf"), FONT_PX) for face in FACES)


def render(label: int, rng: np.random.Generator) -> np.ndarray:
    """One image (float32 [28, 28] in [0, 1]) of ``CLASSES[label]``; every random choice from ``rng``."""
    from PIL import Image, ImageDraw

    fonts = _fonts()
    font = fonts[rng.integers(len(fonts))]
    canvas = Image.new("L", (CANVAS, CANVAS), 0)
    draw = ImageDraw.Draw(canvas)
    mid = CANVAS / 2
    char = CLASSES[label]
    draw.text((mid, mid), char, fill=255, font=font, anchor="mm")
    half = draw.textlength(char, font=font) / 2
    for side in (-1, 1):  # neighbours on the text line, partly outside the frame
        other = CLASSES[rng.integers(len(CLASSES))]
        x = mid + side * (half + rng.uniform(1, 6) + draw.textlength(other, font=font) / 2)
        draw.text((x, mid), other, fill=int(rng.uniform(120, 255)), font=font, anchor="mm")
    angle = np.deg2rad(rng.uniform(-12, 12))
    c, s = np.cos(angle), np.sin(angle)
    # PIL's affine transform maps each output pixel to the input pixel it samples: input = A out + offset
    a = np.array([[c, -s], [s, c]]) @ np.array([[1.0, rng.uniform(-0.25, 0.25)], [0.0, 1.0]]) * rng.uniform(0.9, 1.3)
    offset = np.array([mid, mid]) - a @ (np.array([mid, mid]) + rng.uniform(-3, 3, 2))
    coefficients = (a[0, 0], a[0, 1], offset[0], a[1, 0], a[1, 1], offset[1])
    canvas = canvas.transform((CANVAS, CANVAS), Image.Transform.AFFINE, coefficients,
                              resample=Image.Resampling.BILINEAR)
    image = np.asarray(canvas.resize((SIDE, SIDE), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    image = image * rng.uniform(0.5, 1.0)
    return np.clip(image + rng.normal(0.0, 0.08, image.shape), 0.0, 1.0).astype(np.float32)


@lru_cache(maxsize=4)
def glyphs(n: int = DEFAULT_IMAGES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [n, 1, 28, 28] in [0, 1], labels int64 [n]), balanced to within one image a
    class; ~0.3 s per thousand images on one core. Image i depends only on (seed, i), so a larger
    set starts with a smaller one's images."""
    if n < len(CLASSES):
        raise ValueError(f"glyphs needs at least {len(CLASSES)} images (one per class), got {n}")
    labels = np.arange(n, dtype=np.int64) % len(CLASSES)
    images = np.stack([render(int(y), np.random.default_rng([seed, i])) for i, y in enumerate(labels)])
    return images[:, None], labels
