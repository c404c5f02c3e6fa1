"""What ``--overwrite`` may delete: a directory this project wrote, and nothing else.

A directory is replaced (or emptied) only when

1. it is recognisably ours: the marker files its kind writes are there (a run's ``provenance.json``
   with the keys :func:`mlresearch.results.provenance` writes; a model's ``config.json`` and
   ``model.safetensors``; a similarity report's ``provenance.json`` and ``similarity.csv``), and
   every entry in it is one its kind writes (or a leftover temporary of one): anything we cannot
   classify is refused, not deleted;
2. no ``.git`` (a checkout, a worktree's ``.git`` file) lies anywhere below it;
3. git says none of its files is tracked -- and when the directory is inside a git work tree and
   git cannot answer (not installed, a "dubious ownership" refusal, a broken repository), nothing
   is deleted: the check fails closed.

``--resume`` uses the first test alone (:func:`check_is_run`): it continues a run, never adopts a
directory that is not one.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import MLResearchError


class OverwriteRefused(MLResearchError, FileExistsError):
    """A directory ``--overwrite`` (or ``--resume``) will not touch, with the reason."""


@dataclass(frozen=True)
class DirKind:
    """A kind of directory this project writes: its name, the files that mark it, every entry it may hold."""

    what: str
    markers: tuple[str, ...]
    entries: frozenset[str]

    def owns(self, name: str) -> bool:
        """An entry this kind writes, or the temporary / old copy of one that a killed write left."""
        if name in self.entries:
            return True
        if name.startswith(".") and (".tmp-" in name or ".old-" in name):
            return name[1:].rsplit(".", 1)[0] in self.entries
        return False


RUN = DirKind("run directory", ("provenance.json",),
              frozenset({"config.yaml", "provenance.json", "metrics.jsonl", "summary.json", "checkpoints",
                         "final_model", ".lock", "cpu.json", "downstream.json", "tune.json", "word_order.json"}))
MODEL = DirKind("model directory", ("config.json", "model.safetensors"),
                frozenset({"config.json", "model.safetensors", "generation_config.json", "model.safetensors.sha256"}))
REPORT = DirKind("similarity report", ("provenance.json", "similarity.csv"),
                 frozenset({"provenance.json", "similarity.csv", "layers.png", "heads.png", "summary.csv",
                            "trend.png"}))
PROVENANCE_KEYS = {"config", "seed", "git_commit"}  # what results.provenance always writes


NAME_MAX = 255 - 40  # a file name's limit, less what a temporary sibling adds (".<name>.tmp-<pid>-<random>")


def check_writable_path(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse a path with a component too long to create (with its temporaries) before any parent
    is made: ``mkdir -p`` would otherwise leave the parents behind when the last name fails."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise OverwriteRefused(f"{flag} {str(path)[:80]}...: the name {part[:40]}... is {len(os.fsencode(part))} "
                                   f"bytes, longer than the {NAME_MAX} this project's writes allow; nothing was written")


def _started_run(path: Path) -> bool:
    """A run killed before its provenance was written: only the lock and an empty checkpoints folder."""
    names = {p.name for p in path.iterdir()}
    ckpt = path / "checkpoints"
    return names <= {".lock", "checkpoints"} and (not ckpt.exists() or (ckpt.is_dir() and not any(ckpt.iterdir())))


def _marked(path: Path, kind: DirKind) -> str | None:
    """Why ``path`` is not recognisably a ``kind`` (None when it is)."""
    missing = [m for m in kind.markers if not (path / m).is_file()]
    if missing:
        return f"it has no {', '.join(missing)}"
    if kind is RUN:
        try:
            record = json.loads((path / "provenance.json").read_text())
        except (OSError, ValueError):
            return "its provenance.json is not readable JSON"
        if not isinstance(record, dict) or not PROVENANCE_KEYS <= set(record):
            return f"its provenance.json lacks {sorted(PROVENANCE_KEYS - set(record or {}))}"
    return None


def check_is(path: str | os.PathLike, kind: DirKind, flag: str) -> None:
    """Refuse ``path`` unless it is a ``kind`` holding nothing but what that kind writes."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise OverwriteRefused(f"{flag} refuses {path}: it is {'a link' if path.is_symlink() else 'not a directory'}")
    if kind is RUN and _started_run(path):
        return
    why = _marked(path, kind)
    if why is None:
        foreign = sorted(p.name for p in path.iterdir() if not kind.owns(p.name))
        why = f"it holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which a {kind.what} never " \
              "writes" if foreign else None
    if why:
        raise OverwriteRefused(f"{flag} refuses {path}: it is not a {kind.what} this project wrote ({why}); "
                               "nothing was deleted: write elsewhere (--out) or remove it yourself")


def check_is_run(path: str | os.PathLike) -> None:
    check_is(path, RUN, "--resume")


def _git_root(path: Path) -> Path | None:
    """The nearest directory at or above ``path`` holding a ``.git`` (directory or worktree file)."""
    for parent in (path, *path.parents):
        if (parent / ".git").exists():
            return parent
    return None


def tracked_files(path: Path) -> list[str]:
    """Files under ``path`` that git tracks; [] outside any work tree. Raises
    :class:`OverwriteRefused` when ``path`` is inside one and git cannot answer (fail closed)."""
    if _git_root(path.resolve()) is None:
        return []
    try:
        done = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=path, capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise OverwriteRefused(f"--overwrite refuses {path}: it is inside a git work tree and git could not be asked "
                               f"which of its files are committed ({exc}); nothing was deleted") from None
    if done.returncode:
        said = " ".join(done.stderr.split())[:300] or f"exit {done.returncode}"
        raise OverwriteRefused(f"--overwrite refuses {path}: it is inside a git work tree and git could not say which "
                               f"of its files are committed (git: {said}); nothing was deleted")
    return [f for f in done.stdout.split("\0") if f]


def check_overwrite(path: str | os.PathLike, kind: DirKind) -> None:
    """Refuse, with the reason, to delete ``path`` unless every rule of this module's docstring holds.
    A path that does not exist passes (nothing would be deleted)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    check_is(path, kind, "--overwrite")
    for root, dirs, files in os.walk(path):  # links are not followed (and are unlinked, not descended, on delete)
        if ".git" in dirs or ".git" in files:
            raise OverwriteRefused(f"--overwrite refuses {path}: {Path(root) / '.git'} is below it (a git checkout); "
                                   "nothing was deleted")
    tracked = tracked_files(path)
    if tracked:
        raise OverwriteRefused(f"--overwrite refuses {path}: it holds {len(tracked)} file(s) git tracks (e.g. "
                               f"{tracked[0]}); nothing was deleted: write elsewhere with --out or --root")
