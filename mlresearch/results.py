"""Run directories under results/: every number comes with its config, seed and git commit."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from .checkpoint import atomic_write_text

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files outside ``results/`` differ from it:
    the commit names the code and configs that made a number; a study rewriting its committed tables
    (``results/tables/``) in the worktree it runs from has not changed either."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(config: dict[str, Any], seed: int) -> dict[str, Any]:
    return {
        "config": config,
        "seed": seed,
        "git_commit": git_commit(),
        "command": " ".join(os.sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
    }


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(Path(path), json.dumps(data, indent=2, default=str) + "\n")
