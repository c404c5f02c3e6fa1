"""Model checkpoints as directories: HF ``save_pretrained`` (config.json + model.safetensors) for
transformers models, and the same two files for timm models (the config holds the constructor
arguments). Writes go to a temporary sibling directory that is renamed only on success.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch import nn

from .errors import CheckpointError
from .faults import fault_point
from .families import FAMILIES, Family, family_of
from .overwrite import check_writable_path

WEIGHTS = "model.safetensors"


def _owner_alive(leftover: Path) -> bool:
    """Whether the process that named ``leftover`` (``...-<pid>`` or ``...-<pid>-<random>``) still runs."""
    try:
        pid = int(leftover.name.rsplit(".", 1)[-1].split("-")[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return pid != os.getpid()  # our own leftovers are from a write this process already gave up


def recover(path: str | os.PathLike) -> None:
    """Finish what a killed :func:`atomic_dir` / :func:`atomic_write_text` left at ``path``.

    A replace is two renames (``path`` -> ``.name.old-<pid>``, temporary -> ``path``). Killed
    between them, ``path`` is missing and the old version holds the last complete content: it is
    put back. Temporaries and old versions of dead processes are removed; a live writer's are
    left alone.
    """
    path = Path(path)
    if not path.parent.is_dir():
        return
    olds = sorted(p for p in path.parent.glob(f".{glob.escape(path.name)}.old-*") if not _owner_alive(p))
    if olds and not path.exists():
        os.replace(olds.pop(), path)
    for left in olds + [p for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*") if not _owner_alive(p)]:
        if left.is_dir():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)


def recover_tree(root: str | os.PathLike) -> None:
    """:func:`recover` every interrupted write below ``root`` (a run directory, under its lock)."""
    root = Path(root)
    names = {(p.parent, p.name[1:].rsplit(".", 1)[0]) for p in root.rglob(".*.*-*")
             if p.name.rsplit(".", 1)[-1].startswith(("tmp-", "old-"))}
    for parent, name in sorted(names):
        recover(parent / name)


@contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds.

    A kill at any instant leaves either the previous ``path`` or the new one (see :func:`recover`).
    """
    path = Path(path)
    check_writable_path(path)
    recover(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite=True / --overwrite to replace it)")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            fault_point(f"between-renames:{path.name}")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ----------------------------------------------------------------------------- training state
# Optimizer, scheduler, RNG and ledger state as JSON plus one safetensors file of its tensors:
# neither format can run code when read (pickle, and so torch.load of arbitrary files, can).
STATE_JSON, STATE_TENSORS, LEGACY_STATE = "state.json", "state.safetensors", "state.pt"


def save_state(directory: str | os.PathLike, state: dict) -> None:
    """Write a nested structure of dicts, lists, tuples, numbers, strings, tensors and numpy
    arrays to ``directory/state.json`` + ``state.safetensors`` (inside an atomic directory)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, "torch.Tensor"] = {}

    def encode(x, key: str):
        if isinstance(x, torch.Tensor):
            tensors[key] = x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(x, np.ndarray):
            return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, tuple):
            return {"__tuple__": [encode(v, f"{key}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(x)]
        if isinstance(x, dict):  # keys may be ints (optimizer state by parameter index)
            return {"__dict__": [[k, encode(v, f"{key}.{i}")] for i, (k, v) in enumerate(x.items())]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise CheckpointError(f"cannot store a {type(x).__name__} in a checkpoint's state ({key})")

    doc = encode(state, "s")
    directory = Path(directory)
    with disk_full_names(directory / STATE_TENSORS):
        save_file(tensors, str(directory / STATE_TENSORS))
    (directory / STATE_JSON).write_text(json.dumps(doc))


def _decode(x, tensors):
    import numpy as np

    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if isinstance(x, dict):
        if "__tensor__" in x:
            return tensors[x["__tensor__"]]
        if "__ndarray__" in x:
            return np.asarray(x["__ndarray__"], dtype=x["dtype"])
        if "__tuple__" in x:
            return tuple(_decode(v, tensors) for v in x["__tuple__"])
        return {k: _decode(v, tensors) for k, v in x["__dict__"]}
    return x


def _unreadable(directory: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"training state in {directory} is unreadable ({type(exc).__name__}: {exc}); "
                           "delete that checkpoint directory to resume from an earlier one, or start over")


_REQUIRED = object()


def state_value(directory: str | os.PathLike, key: str, default=_REQUIRED):
    """One plain top-level value of a saved state (a step, a row count) without loading its tensors;
    ``default`` for a key that states written before it existed lack."""
    directory = Path(directory)
    if not (directory / STATE_JSON).is_file():
        state = load_state(directory)
        return state[key] if default is _REQUIRED else state.get(key, default)
    try:
        doc = dict(json.loads((directory / STATE_JSON).read_text())["__dict__"])
        return doc[key] if default is _REQUIRED else doc.get(key, default)
    except (ValueError, KeyError, TypeError) as exc:
        raise _unreadable(directory, exc) from exc


def state_exists(directory: str | os.PathLike) -> bool:
    directory = Path(directory)
    return (directory / STATE_JSON).is_file() or (directory / LEGACY_STATE).is_file()


def load_state(directory: str | os.PathLike) -> dict:
    """Read :func:`save_state`'s files; a run written before them (``state.pt``) is read with
    ``torch.load(weights_only=True)``, which admits tensors and plain containers only."""
    directory = Path(directory)
    if not (directory / STATE_JSON).is_file():
        return _load_legacy_state(directory / LEGACY_STATE)
    import torch
    from safetensors.torch import load_file

    try:
        doc = json.loads((directory / STATE_JSON).read_text())
        # Copied out of the file's mapping, where safetensors leaves each tensor at its offset (4-byte
        # aligned): an optimizer's moments are then updated in memory aligned like the uninterrupted
        # run's, as the model's weights are (_in_own_memory), and the file is not held open.
        tensors = {k: v.clone(memory_format=torch.contiguous_format)
                   for k, v in load_file(str(directory / STATE_TENSORS)).items()}
        return _decode(doc, tensors)
    except Exception as exc:  # truncated, corrupt or missing files
        raise _unreadable(directory, exc) from exc


def _load_legacy_state(path: Path) -> dict:
    import warnings

    import numpy as np
    import torch

    if not path.is_file():
        raise CheckpointError(f"no training state in {path.parent}")
    warnings.warn(f"{path} is in the old pickle-based format; reading it with weights_only=True (tensors and "
                  "plain containers only). The next checkpoint is written as state.json + state.safetensors.",
                  stacklevel=2)
    numpy_globals = [np.dtype, np.ndarray, np.core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(numpy_globals):
            return torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} could not be read safely ({type(exc).__name__}: {exc}); "
                              "it is refused rather than unpickled") from exc


class DuplicateKey(ValueError):
    """A mapping that names one key twice: YAML and JSON parsers silently keep the last."""


def _unique(pairs) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"the key {key!r} appears twice")
        out[key] = value
    return out


def parse_yaml(text: str):
    """``yaml.safe_load`` (plain data, no tags that build objects), refusing a key given twice in a mapping."""
    import yaml

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(k, deep=True), loader.construct_object(v, deep=True)) for k, v in node.value]
        try:
            return _unique(pairs)
        except DuplicateKey as exc:
            raise yaml.constructor.ConstructorError(None, None, str(exc), node.start_mark) from None

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    # YAML 1.1 (PyYAML) reads a float only with a dot: "1e-4" would be the string '1e-4', and
    # `--set train.lr=1e-4` a refused LR. Read it as YAML 1.2 does, a float.
    Strict.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    loader = Strict(text)  # a SafeLoader: python/object tags are refused, as by yaml.safe_load
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_json(text: str):
    """``json.loads`` refusing a key given twice in an object."""
    return json.loads(text, object_pairs_hook=_unique)


def read_structured(path: str | os.PathLike, what: str, error: type[Exception], fmt: str = "json"):
    """Parse a JSON or YAML file, raising ``error`` that names the file when it is missing or
    malformed, or names a key twice (which a plain parser would silently resolve to the last)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return parse_json(path.read_text()) if fmt == "json" else parse_yaml(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError, DuplicateKey) as exc:
        raise error(f"{what} {path} is not valid {fmt.upper()}: {' '.join(str(exc).split())}") from exc


CHECKSUM = WEIGHTS + ".sha256"  # written beside the weights, verified on load: damage is named as damage


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def disk_full_names(path: Path) -> Iterator[None]:
    """Re-raise a full disk as ``OSError(ENOSPC)`` naming ``path``: safetensors reports it as its own
    error type, which would otherwise read as an internal failure."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        if "No space left on device" in str(exc):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from exc
        raise


def save_model(model: nn.Module, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Save ``model`` (any supported family) to a directory with ``model.safetensors`` and its checksum."""
    family = family_of(model)
    with atomic_dir(path, overwrite) as tmp:
        with disk_full_names(Path(path) / WEIGHTS):
            family.save(model, tmp)
        if not (tmp / WEIGHTS).is_file():
            raise CheckpointError(f"saving {type(model).__name__} produced no {WEIGHTS}")
        (tmp / CHECKSUM).write_text(file_sha256(tmp / WEIGHTS) + "\n")
    return Path(path)


def load_model(path: str | os.PathLike) -> nn.Module:
    """Load a directory written by :func:`save_model` (or by HF ``save_pretrained``).

    Nothing in the directory can run code: only the model classes the family table names are
    built, never a class the directory supplies itself (``auto_map`` + ``modeling_*.py``), and
    transformers is told ``trust_remote_code=False`` so it never asks whether to run it."""
    path = Path(path)
    if not path.exists() and path.parent.is_dir():
        recover(path)  # a replace killed between its two renames: the previous version is put back
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {WEIGHTS} is missing")
    config = read_structured(path / "config.json", f"checkpoint {path}:", CheckpointError)
    if (path / CHECKSUM).is_file() and (path / CHECKSUM).read_text().strip() != file_sha256(path / WEIGHTS):
        raise CheckpointError(f"checkpoint {path} is damaged: {WEIGHTS} does not match the checksum written with it "
                              f"({CHECKSUM}); it changed on disk after it was saved: restore it, or delete the "
                              "checkpoint to resume from an earlier one")
    family = _family_of_directory(path, config)  # before anything of the directory is read further
    _check_safetensors(path / WEIGHTS)
    try:
        return _in_own_memory(family.load(path, config))
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors/HF raise many types for truncated or corrupt files
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc


def _in_own_memory(model: nn.Module) -> nn.Module:
    """Copy every tensor a loader left mapped onto the weights file into memory of the model's own.

    transformers maps ``model.safetensors`` and hands out tensors at the file's offsets, aligned to
    8 bytes only, where the header's length puts them. MKL documents data alignment as one cause of
    results that differ in the last bits, so a model loaded from disk could score an ulp away from its
    in-memory twin (a resumed V-cycle once logged such a partner loss on CI; not reproduced on this
    project's CPU); the copy is allocator-aligned like every tensor the run makes itself, and the file
    is no longer held open.
    Tied tensors stay tied: a shared parameter is one object, copied once."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # (each shared tensor once)
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return model


def _family_of_directory(path: Path, config) -> Family:
    """The family whose ``save`` wrote this ``config.json``; refused: a config that ships model code
    (``auto_map``) or names a class no family table has."""
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {path}: config.json is not a JSON object")
    if "auto_map" in config:
        raise CheckpointError(f"checkpoint {path}: config.json has an auto_map (model code shipped in the directory); "
                              "code from a model directory is never run: save the model with a supported class")
    if config.get("mlresearch_family"):
        family = FAMILIES.get(config["mlresearch_family"])
        if family is None or not family.saved_by(config):
            raise CheckpointError(f"checkpoint {path}: unknown family {config.get('mlresearch_family')!r}")
        return family
    family = next((f for f in FAMILIES.values() if f.saved_by(config)), None)
    if family is None:
        known = sorted(c for f in FAMILIES.values() for c in getattr(f, "classes", ()))
        raise CheckpointError(f"checkpoint {path}: config.json's architectures {config.get('architectures') or []} is "
                              f"not one of the supported classes {known}")
    return family


def _check_safetensors(weights: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            list(f.keys())
    except Exception as exc:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {exc}") from exc
