"""Prepare once, stream forever: a text corpus of any size as token files training reads in place.

``prepare_text`` takes the documents (the shipped corpora, or a local dataset through HF
``datasets``: a ``save_to_disk`` directory or text/parquet/json files, memory-mapped Arrow either
way), splits them *by document* with the seeded permutation (train / validation / test / tuning,
fixed here once), trains the tokenizer on the training documents (or takes GPT-2's), tokenizes
every split with ``datasets.map(num_proc=N)`` and writes each split as one flat file of token ids
(``uint16`` when the vocabulary fits, else ``uint32``) plus ``index.json``. Nothing holds a
split's tokens in memory: ``map`` writes Arrow shards to disk and the writer streams them out.

``TokenBlocks`` reads a split as fixed-length blocks on demand (the memory map is opened for
each read and closed after it, so a training process's memory does not grow with the corpus or
with the blocks it has visited). Blocks are the split's token stream cut into non-overlapping
pieces, exactly what tokenizing the documents in memory and cutting them would give.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..checkpoint import file_sha256
from ..tasks import task_of
from .text import DataError, cache_dir, local_dataset, named_documents, special_ids, split_indices, text_fractions, \
    text_tokenizer

FORMAT = 1
SPLITS = ("train", "val", "test", "tune")


def data_fingerprint(cfg: dict, task: str, seed: int, docs_id: str) -> str:
    key = [FORMAT, task, docs_id, int(cfg.get("vocab_size", 8192)), cfg.get("tokenizer", "train"), seed,
           list(text_fractions(cfg))]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def document_dataset(cfg: dict):
    """(a ``datasets.Dataset`` with a ``text`` column, its source name, an identity for cache keys)."""
    import datasets

    if not cfg.get("path"):
        docs, source, _ = named_documents(cfg)
        identity = f"{source}:{len(docs)}:{sum(map(len, docs))}"
        return datasets.Dataset.from_dict({"text": list(docs)}), source, identity
    ds = local_dataset(cfg["path"], cfg.get("text_field", "text"))
    return ds, f"local:{cfg['path']}", f"local:{Path(cfg['path']).expanduser().resolve()}:{ds._fingerprint}"


def prepared_dir(task: str, cfg: dict, seed: int, identity: str | None = None) -> Path:
    """Where the prepared splits of this data section live: ``data.prepared_dir`` or the cache."""
    if cfg.get("prepared_dir"):
        return Path(cfg["prepared_dir"]).expanduser()
    if identity is None:
        identity = document_dataset(cfg)[2]
    return cache_dir() / f"prepared-{data_fingerprint(cfg, task, seed, identity)}"


def is_prepared(path: Path) -> bool:
    return (path / "index.json").is_file()


def prepare_text(task: str, cfg: dict, seed: int, num_proc: int = 1, out: Path | None = None,
                 progress: bool = False) -> Path:
    """Prepare the data section ``cfg`` (see the module docstring); returns the directory. An
    existing preparation of the same data is reused. Written to a temporary directory and renamed,
    so a killed preparation leaves nothing that looks finished."""
    import datasets

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism is num_proc's, one thread per process
    ds, source, identity = document_dataset(cfg)
    out = Path(out) if out else prepared_dir(task, cfg, seed, identity)
    if is_prepared(out):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"cannot prepare data into {out}: it is {'a file' if not out.is_dir() else 'a directory that holds other files'}"
                        " (give --out a new or empty directory)")
    if len(ds) < 3:
        raise DataError(f"need at least 3 documents to split, got {len(ds)} from {source}")
    fractions = text_fractions(cfg)
    parts = dict(zip(("train", "val", "test", "tune"), split_indices(len(ds), seed, *fractions)))
    key = data_fingerprint(cfg, task, seed, identity)
    gpt2 = cfg.get("tokenizer") == "gpt2"
    train_docs = ds.select(parts["train"])
    tok = text_tokenizer(task, int(cfg.get("vocab_size", 8192)), _texts(train_docs), key, gpt2)
    special = special_ids(task, tok)
    end = special[task_of(task).text.end]  # what ends each document in the stream
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    index = {"format": FORMAT, "task": task, "source": source, "seed": seed, "fractions": list(fractions),
             "vocab_size": vocab, "special": special, "dtype": np.dtype(dtype).name, "splits": {}}
    encode = _Encoder(str(tmp / "tokenizer.json"), end)
    bars_were_off = datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        for name in SPLITS:
            _prepare_split(ds, parts[name], name, encode, tmp, dtype, num_proc, index)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # (a kill leaves it: a later preparation starts afresh)
        raise
    finally:
        if not progress and not bars_were_off:
            datasets.enable_progress_bars()
    (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # an empty directory given as --out
        tmp.rename(out)
    except OSError:  # another process (a second rank, say) finished the same preparation first
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(out):
            raise
    return out


def _prepare_split(ds, rows, name: str, encode, tmp: Path, dtype, num_proc: int, index: dict) -> None:
    if name == "tune" and not len(rows):
        return
    mapped = ds.select(rows).map(encode, batched=True, batch_size=256, num_proc=num_proc if len(rows) > 1 else None,
                                 remove_columns=["text"], cache_file_name=str(tmp / f"map-{name}.arrow"),
                                 desc=f"tokenizing {name}")
    tokens, digest = _write_stream(mapped, tmp / f"{name}.bin", dtype)
    index["splits"][name] = {"documents": len(rows), "tokens": tokens, "sha256": digest}
    del mapped
    for f in tmp.glob(f"map-{name}*.arrow"):
        f.unlink()


def _texts(ds, batch: int = 1000):
    for i in range(0, len(ds), batch):
        yield from ds[i:i + batch]["text"]


class _Encoder:
    """``datasets.map`` function: documents -> token ids, each followed by the end-of-document
    token (a plain class so that worker processes can rebuild it)."""

    def __init__(self, path: str, end: int) -> None:
        self.path, self.end, self._tok = path, end, None

    def __call__(self, batch: dict) -> dict:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.path)
        return {"ids": [enc.ids + [self.end] for enc in self._tok.encode_batch(batch["text"], add_special_tokens=False)]}

    def __getstate__(self):
        return {"path": self.path, "end": self.end, "_tok": None}


def _write_stream(mapped, path: Path, dtype, batch: int = 4096) -> int:
    """Append every row's ids to ``path``; returns the number of tokens written and the file's sha256."""
    import pyarrow.compute as pc

    total, digest = 0, hashlib.sha256()
    table = mapped.with_format("arrow")
    with open(path, "wb") as f:
        for i in range(0, len(mapped), batch):
            flat = pc.list_flatten(table[i:i + batch]["ids"]).to_numpy(zero_copy_only=False)
            chunk = flat.astype(dtype, copy=False).tobytes()
            f.write(chunk)
            digest.update(chunk)
            total += len(flat)
    return total, digest.hexdigest()


def check_prepared(path: Path, index: dict) -> None:
    """A prepared directory is what its index says: a token dtype we write, each split's file
    exactly ``tokens`` long and (where the index records it) with its checksum, and a tokenizer
    whose vocabulary is the index's. Raises a DataError naming the file and what is wrong."""
    def damaged(what: str):
        return DataError(f"prepared data {path} is damaged: {what}; prepare it again (delete it, then "
                         "`mlresearch data prepare CONFIG`)")

    if index.get("dtype") not in ("uint16", "uint32"):
        raise damaged(f"index.json names token dtype {index.get('dtype')!r} (uint16 or uint32 expected)")
    width = np.dtype(index["dtype"]).itemsize
    for name, info in (index.get("splits") or {}).items():
        file = Path(path) / f"{name}.bin"
        if not file.is_file() or file.stat().st_size != int(info["tokens"]) * width:
            size = file.stat().st_size if file.is_file() else "no file"
            raise damaged(f"{file.name} should hold {info['tokens']} {index['dtype']} tokens "
                          f"({int(info['tokens']) * width} bytes), found {size}")
        if "sha256" in info and file_sha256(file) != info["sha256"]:
            raise damaged(f"{file.name} does not match the checksum in index.json")
    tokenizer = Path(path) / "tokenizer.json"
    if not tokenizer.is_file():
        raise damaged("tokenizer.json is missing")
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises its own exception type for a bad file
        raise damaged(f"tokenizer.json is unreadable ({exc})") from None
    if vocab != index.get("vocab_size"):
        raise damaged(f"tokenizer.json has {vocab} tokens, index.json says {index.get('vocab_size')}")


class TokenBlocks:
    """One prepared split as ``(n, seq_len)`` blocks read on demand: ``blocks[idx]`` -> int64 array.

    Causal LM: blocks of ``seq_len`` tokens of the stream. Masked LM: ``seq_len - 2`` tokens between
    [CLS] and [SEP]. The tail shorter than a block is dropped."""

    def __init__(self, path: Path, dtype: str, tokens: int, seq_len: int, task: str, special: dict) -> None:
        layout = task_of(task).text
        self.path, self.dtype, self.special, self.wrap = Path(path), np.dtype(dtype), special, layout.wrap
        self.body = layout.body(seq_len)
        n = tokens // self.body
        if n == 0:
            raise DataError(f"a split has {tokens} tokens, fewer than one block of {self.body}")
        self.shape = (n, seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        rows = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64)
        single = rows.ndim == 0
        rows = np.atleast_1d(rows)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"block index out of range for {len(self)} blocks")
        mm = np.memmap(self.path, dtype=self.dtype, mode="r")  # mapped for this read only
        out = mm[rows[:, None] * self.body + np.arange(self.body)].astype(np.int64)
        del mm
        if self.wrap:
            n, (before, after) = len(rows), self.wrap
            out = np.concatenate([np.full((n, 1), self.special[before], np.int64), out,
                                  np.full((n, 1), self.special[after], np.int64)], axis=1)
        return out[0] if single else out

    def __array__(self, dtype=None, copy=None):
        out = self[np.arange(len(self))]
        return out.astype(dtype) if dtype is not None else out


def open_prepared(path: Path, task: str, seq_len: int):
    """(blocks per split, vocabulary size, special ids, index) of a prepared directory."""
    try:
        index = json.loads((Path(path) / "index.json").read_text())
    except ValueError as exc:
        raise DataError(f"prepared data {path}: index.json is not valid JSON ({exc}); prepare it again") from None
    if index.get("format") != FORMAT or index.get("task") != task:
        raise DataError(f"{path} was prepared for {index.get('task')!r} (format {index.get('format')}), not {task!r} "
                        f"(format {FORMAT}); prepare it again with `mlresearch data prepare`")
    check_prepared(Path(path), index)
    blocks = {name: TokenBlocks(Path(path) / f"{name}.bin", index["dtype"], info["tokens"], seq_len, task,
                                index["special"])
              for name, info in index["splits"].items()}
    return blocks, index["vocab_size"], index["special"], index
