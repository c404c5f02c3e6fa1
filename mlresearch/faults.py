"""Fault injection for tests: kill this process at a named point, as a crash or ``kill -9`` would.

``MLRESEARCH_FAULT=PATTERN[#N]`` sends SIGKILL to the process the N-th time (default: the first)
it passes a point whose name matches the glob ``PATTERN``. Points are named where they are
passed: ``step:<phase>:<step>`` after a training step, ``between-renames:<dir>`` inside an atomic
directory replace, ``after:<transition>:<level>`` after a V-cycle operator, ``after-phase:<phase>``.
Without the variable each point costs one dictionary look-up.
"""

from __future__ import annotations

import fnmatch
import os
import signal

_passed: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("MLRESEARCH_FAULT")
    if not spec:
        return
    pattern, _, nth = spec.partition("#")
    if fnmatch.fnmatchcase(name, pattern):
        _passed[pattern] = _passed.get(pattern, 0) + 1
        if _passed[pattern] == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
