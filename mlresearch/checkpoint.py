"""Model checkpoints as directories: HF ``save_pretrained`` (config.json + model.safetensors) for
transformers models, and the same two files for timm models (the config holds the constructor
arguments). Writes go to a temporary sibling directory that is renamed only on success.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch import nn

from .errors import CheckpointError
from .families import FAMILIES, family_of

WEIGHTS = "model.safetensors"


@contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (pass overwrite=True / --overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_structured(path: str | os.PathLike, what: str, error: type[Exception], fmt: str = "json"):
    """Parse a JSON or YAML file, raising ``error`` that names the file when it is missing or malformed."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text()) if fmt == "json" else yaml.safe_load(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"{what} {path} is not valid {fmt.upper()}: {exc}") from exc


def save_model(model: nn.Module, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Save ``model`` (any supported family) to a directory with ``model.safetensors``."""
    family = family_of(model)
    with atomic_dir(path, overwrite) as tmp:
        family.save(model, tmp)
        if not (tmp / WEIGHTS).is_file():
            raise CheckpointError(f"saving {type(model).__name__} produced no {WEIGHTS}")
    return Path(path)


def load_model(path: str | os.PathLike) -> nn.Module:
    """Load a directory written by :func:`save_model` (or by HF ``save_pretrained``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {WEIGHTS} is missing")
    config = read_structured(path / "config.json", f"checkpoint {path}:", CheckpointError)
    try:
        if config.get("mlresearch_family"):
            return _load_timm(path, config)
        return _load_hf(path, config)
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors/HF raise many types for truncated or corrupt files
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc


def _check_safetensors(weights: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            list(f.keys())
    except Exception as exc:
        raise CheckpointError(f"{weights} is not a readable safetensors file: {exc}") from exc


def _load_hf(path: Path, config: dict) -> nn.Module:
    import transformers

    _check_safetensors(path / WEIGHTS)
    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise CheckpointError(f"checkpoint {path}: config.json names no known transformers architecture ({archs})")
    return cls.from_pretrained(str(path))


def _load_timm(path: Path, config: dict) -> nn.Module:
    import torch
    from safetensors.torch import load_file

    family = FAMILIES.get(config["mlresearch_family"])
    if family is None or config.get("timm_class") != "VisionTransformer":
        raise CheckpointError(f"checkpoint {path}: unknown family {config.get('mlresearch_family')!r}")
    from timm.models.vision_transformer import VisionTransformer

    _check_safetensors(path / WEIGHTS)
    state = load_file(str(path / WEIGHTS))
    with torch.device("meta"):
        model = VisionTransformer(**config["kwargs"])
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path}: weights do not match config (missing {missing}, unexpected {unexpected})")
    return model.eval()
