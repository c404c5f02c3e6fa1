"""``python -m mlresearch.cli ARGS`` as a separate process, started without paying its imports.

The fault tests kill runs with SIGKILL at named points and resume them, so every run must be its own
process; but starting one costs about 5 seconds of imports (torch, transformers, accelerate) against
well under a second of training for a smoke run. Here each run is a child forked from a
``multiprocessing`` fork server that imported those modules once and has run nothing: a fresh
process (its own memory, file descriptors, environment, working directory, ``SIGKILL`` ends it as
it would ``python -m``) that starts where ``python -m mlresearch.cli`` would be after its imports.
The child's output goes to files (read back as ``stdout``/``stderr``, line-buffered, so a kill loses
at most an unfinished line, as with ``PYTHONUNBUFFERED``), and its exit code is ``main()``'s, or
``-9`` after a SIGKILL, as ``subprocess.run`` reports it.

Modules that read the environment once at import (tqdm's ``TQDM_*``) see the fork server's; a
test of those starts a real interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

PRELOAD = ["torch", "transformers", "accelerate", "safetensors.torch", "mlresearch.cli", "mlresearch.training.run",
           "mlresearch.training.engine", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.bert.modeling_bert"]
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    import atexit
    import traceback

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        from mlresearch.cli import main

        code = main(argv)
    except SystemExit as stop:  # (argparse's errors and --help)
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:  # noqa: BLE001 -- as the interpreter would: the traceback, then exit code 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_cli(*args, env: dict | None = None, cwd=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """What ``subprocess.run([sys.executable, "-m", "mlresearch.cli", *args], env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout)`` returns."""
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = _server().Process(target=_child, args=(argv, dict(os.environ if env is None else env),
                                                         str(cwd or os.getcwd()), out, err))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["mlresearch", *argv], timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(["mlresearch", *argv], process.exitcode, o.read(), e.read())
