"""Fractals: a formula-driven image-classification set (FractalDB, Kataoka et al., ACCV 2020; its use
to pre-train ViTs: Nakashima et al., AAAI 2022), generated here so that a ViT's capacity can pay on
a CPU: as many classes as asked, each one iterated function system, its images differing by the
system's jitter, pose and rendering. Re-implemented from the papers' description, not from code.

A **class** is an iterated function system (IFS) of 2 to 4 affine maps ``x -> A x + b`` with every
entry drawn uniformly from [-1, 1], kept only if every ``A`` is a contraction (its largest singular
value below 1, so the system has an attractor) and the attractor fills at least ``MIN_FILL`` of a
64 x 64 canvas (FractalDB's filling-rate test, which rejects systems that collapse to a line or a
point). Each map is chosen with probability proportional to ``|det A|`` (a floor keeps a thin map
drawn). Classes depend only on ``(seed, class)``.

An **image** of a class renders the attractor by the chaos game (``points`` points from many
chains run in parallel, their first steps dropped) after FractalDB's intra-class variation: one
map's linear part scaled by a factor in [0.8, 1.2] (capped below 1); then a random rotation,
mirror, scale and shift within the frame, a random brightness (and, with ``colour``, a random hue:
colour says nothing of the class), a slight blur by point splatting and Gaussian noise. Image
``i`` of a class depends only on ``(seed, class, i)``.

:func:`prepare` renders a set once, in parallel, to ``<cache>/fractals-<fingerprint>/`` (``images.npy``
uint8 [n, C, S, S] and ``labels.npy``, read memory-mapped; written to a temporary directory and
renamed, so a killed preparation leaves nothing that looks finished), ordered class-major and
balanced; a run's seed chooses the split (``data.split_indices``), not the images.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..faults import fault_point
from .text import DataError, cache_dir

FORMAT = 2  # (2: shifts kept inside the frame)
MIN_FILL = 0.08  # of a 64 x 64 canvas: the filling-rate test of a class's system
CHAINS = 64  # chaos-game chains per image, run in parallel
BURN = 12  # steps each chain runs before its points count (it has reached the attractor by then)


@dataclass(frozen=True)
class FractalSet:
    """What a prepared set is: ``classes`` systems, ``per_class`` images each, ``size`` x ``size``
    pixels, grey or ``colour``, from ``seed``, each image ``points`` chaos-game points."""

    classes: int = 100
    per_class: int = 100
    size: int = 32
    colour: bool = False
    seed: int = 0
    points: int = 3000

    def problem(self) -> str | None:
        """Why this set cannot be made (None when it can): one line naming the setting."""
        for name, low in (("classes", 2), ("per_class", 3), ("size", 8), ("points", 100)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                return f"fractals: {name} must be a whole number >= {low}, got {value!r}"
        if not isinstance(self.colour, bool):
            return f"fractals: colour must be true or false, got {self.colour!r}"
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            return f"fractals: seed must be a whole number >= 0, got {self.seed!r}"
        return None

    @property
    def channels(self) -> int:
        return 3 if self.colour else 1

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()).hexdigest()[:16]


def _contractive(a: np.ndarray) -> bool:
    return bool(np.linalg.norm(a, ord=2) < 1.0)


def _chaos_game(maps: np.ndarray, probs: np.ndarray, points: int, rng: np.random.Generator) -> np.ndarray:
    """``points`` points [points, 2] of the attractor of ``maps`` [k, 2, 3] (``A | b``)."""
    steps = BURN + -(-points // CHAINS)
    x = rng.uniform(-1, 1, (CHAINS, 2))
    choice = rng.choice(len(maps), size=(steps, CHAINS), p=probs)
    out = np.empty((steps - BURN, CHAINS, 2))
    for t in range(steps):
        m = maps[choice[t]]
        x = np.einsum("cij,cj->ci", m[:, :, :2], x) + m[:, :, 2]
        if t >= BURN:
            out[t - BURN] = x
    return out.reshape(-1, 2)[:points]


def _probabilities(maps: np.ndarray) -> np.ndarray:
    det = np.abs(np.linalg.det(maps[:, :, :2])) + 0.02
    return det / det.sum()


def _raster(xy: np.ndarray, side: int, margin: float = 0.0) -> np.ndarray:
    """Points scaled into a ``side`` x ``side`` frame (their bounding box, less ``margin``) and counted per pixel."""
    lo, hi = xy.min(0), xy.max(0)
    span = max(float((hi - lo).max()), 1e-9)
    px = ((xy - (lo + hi) / 2) / span * (1 - 2 * margin) + 0.5) * (side - 1)
    ij = np.clip(np.round(px).astype(int), 0, side - 1)
    return np.bincount(ij[:, 1] * side + ij[:, 0], minlength=side * side).reshape(side, side)


def class_system(seed: int, label: int) -> np.ndarray:
    """The IFS of class ``label``: maps [k, 2, 3], drawn until one passes the contraction and filling tests."""
    rng = np.random.default_rng([seed, label, 0])
    for _ in range(10_000):
        k = int(rng.integers(2, 5))
        maps = rng.uniform(-1, 1, (k, 2, 3))
        if not all(_contractive(m[:, :2]) for m in maps):
            continue
        xy = _chaos_game(maps, _probabilities(maps), 4000, rng)
        if not np.isfinite(xy).all():
            continue
        if (_raster(xy, 64) > 0).mean() >= MIN_FILL:
            return maps
    raise DataError(f"fractals: no system for class {label} of seed {seed} passed the filling test")  # (never seen)


def render(maps: np.ndarray, spec: FractalSet, label: int, index: int) -> np.ndarray:
    """Image ``index`` of class ``label`` (uint8 [C, S, S]) from the class's ``maps``."""
    rng = np.random.default_rng([spec.seed, label, index + 1])
    maps = maps.copy()
    j = int(rng.integers(len(maps)))
    a = maps[j, :, :2] * rng.uniform(0.8, 1.2)
    norm = np.linalg.norm(a, ord=2)
    maps[j, :, :2] = a if norm < 0.99 else a * (0.99 / norm)  # FractalDB's weight jitter, kept contractive
    xy = _chaos_game(maps, _probabilities(maps), spec.points, rng)
    angle = rng.uniform(0, 2 * np.pi)
    c, s = np.cos(angle), np.sin(angle)
    pose = np.array([[c, -s], [s, c]]) * np.array([1.0, rng.choice([-1.0, 1.0])])  # rotation, maybe mirrored
    xy = (xy - xy.mean(0)) @ pose.T
    side = spec.size
    margin = rng.uniform(0.05, 0.25)  # the scale within the frame
    counts = _raster(xy, side, margin).astype(np.float32)
    room = int(margin * (side - 1))  # a shift within the margin: nothing wraps round the frame
    counts = np.roll(counts, tuple(rng.integers(-room, room + 1, 2)), axis=(0, 1))
    # splat each pixel's count onto its neighbours (a slight blur), then a saturating intensity
    padded = np.pad(counts, 1)
    blurred = (4 * counts + padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]) / 8
    image = 1 - np.exp(-blurred * (side * side) / (spec.points * rng.uniform(0.15, 0.4)))
    image = image * rng.uniform(0.6, 1.0)
    if spec.colour:
        hue = rng.dirichlet(np.ones(3)) * 1.5
        image = np.clip(image[None] * hue[:, None, None], 0, 1)
    else:
        image = image[None]
    image = np.clip(image + rng.normal(0, 0.04, image.shape), 0, 1)
    return np.round(image * 255).astype(np.uint8)


def _render_chunk(args) -> tuple[int, np.ndarray]:
    spec, systems, start, stop = args
    out = np.empty((stop - start, spec.channels, spec.size, spec.size), np.uint8)
    for i, n in enumerate(range(start, stop)):
        label, index = divmod(n, spec.per_class)
        out[i] = render(systems[label], spec, label, index)
    return start, out


def prepared_path(spec: FractalSet) -> Path:
    return cache_dir() / f"fractals-{spec.fingerprint()}"


def is_prepared(path: Path) -> bool:
    return (path / "index.json").is_file()


def prepare(spec: FractalSet, num_proc: int = 1, out: Path | None = None, progress: bool = False) -> Path:
    """Render ``spec`` to ``out`` (default: the cache) unless it is there already; returns the directory."""
    problem = spec.problem()
    if problem:
        raise DataError(problem)
    out = Path(out) if out else prepared_path(spec)
    if is_prepared(out):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"cannot prepare fractals into {out}: it is {'a file' if not out.is_dir() else 'a directory that holds other files'}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        n = spec.classes * spec.per_class
        systems = [class_system(spec.seed, k) for k in range(spec.classes)]
        images = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8,
                                           shape=(n, spec.channels, spec.size, spec.size))
        chunk = max(1, min(2000, -(-n // (4 * max(1, num_proc)))))
        jobs = [(spec, systems, start, min(n, start + chunk)) for start in range(0, n, chunk)]
        from tqdm.auto import tqdm

        quiet = {} if progress else {"disable": True}  # (passed at all, disable would override TQDM_DISABLE=1)
        with tqdm(total=n, desc="render fractals", unit="img", leave=False, **quiet) as bar:
            done = ProcessPoolExecutor(num_proc).map(_render_chunk, jobs) if num_proc > 1 else map(_render_chunk, jobs)
            for start, block in done:
                images[start:start + len(block)] = block
                bar.update(len(block))
                fault_point(f"fractals:{start + len(block)}")
        images.flush()
        del images
        np.save(tmp / "labels.npy", np.repeat(np.arange(spec.classes, dtype=np.int64), spec.per_class))
        (tmp / "index.json").write_text(json.dumps({"format": FORMAT, **asdict(spec), "images": n}, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (a kill leaves it: a later preparation starts afresh)
        raise
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        tmp.rename(out)
    except OSError:  # another process finished the same preparation first
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(out):
            raise
    return out


class StoredImages:
    """A split of a prepared set, read from its memory-mapped file: ``images[idx]`` -> float32
    [n, C, S, S] in [0, 1] (the set is never held in memory whole)."""

    def __init__(self, images: np.ndarray, rows: np.ndarray) -> None:
        self.images, self.rows = images, np.asarray(rows)
        self.shape = (len(self.rows), *images.shape[1:])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> np.ndarray:
        rows = self.rows[np.atleast_1d(idx)]
        order = np.argsort(rows)  # the file read in order, then put back
        out = np.empty((len(rows), *self.images.shape[1:]), np.float32)
        out[order] = self.images[rows[order]]
        return out / 255.0


def open_prepared(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(images uint8 memmap [n, C, S, S], labels int64 [n], the index) of a prepared directory."""
    index = json.loads((path / "index.json").read_text())
    return np.load(path / "images.npy", mmap_mode="r"), np.load(path / "labels.npy"), index
