"""Data at scale: preparation throughput, and training memory against corpus size.

Generates a local text dataset (one document per line in .txt files, as `datasets`' text loader
reads them): the shipped English corpora (~9 MB) in shuffled copies up to the size asked. Then,
each step in its own process:

1. ``mlresearch data prepare`` of the whole set (``--size-mb``, default ~1 GB) with 1 and with 2
   tokenizing processes (GPT-2's tokenizer, so no tokenizer training is timed): MB of text per
   second, and the peak resident memory of the preparing process tree (sampled every 0.1 s);
2. a short ``mlresearch run --method baseline`` of a tiny GPT-2 on the prepared data of the whole set (10x) and of
   a tenth of it (1x): the training process's peak resident memory (``ru_maxrss``).

Last line: ``prepare_mb_s=<x> rss_ratio=<y>`` (x: with 2 processes; y: training peak RSS at 10x /
at 1x). Goals: rss_ratio <= 1.1, and 2 processes >= 1.6x the throughput of 1. Run it on a quiet
machine (it times things), from the project root:

    python experiments/bench_data.py [--size-mb 1000] [--workdir /tmp/bench-data] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent


def generate(directory: Path, size_mb: float, seed: int = 0) -> float:
    """Real English (the shipped Bible chapters and BBC articles, one document per line) in shuffled
    copies, one file each, until ``size_mb`` MB; returns MB written. (Repetition does not matter
    here: the benchmark measures throughput and memory, not a model.)"""
    from mlresearch.data import corpora

    docs = [(" ".join(d.split()) + "\n").encode() for name in ("bible", "bbc") for d in corpora.TEXT_CORPORA[name]()]
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    written, part = 0, 0
    while written < size_mb * 1e6:
        data = b"".join(docs[i] for i in rng.permutation(len(docs)))
        data = data[:int(size_mb * 1e6 - written)].rsplit(b"\n", 1)[0] + b"\n" if written + len(data) > size_mb * 1e6 else data
        (directory / f"part-{part:04d}.txt").write_bytes(data)
        written, part = written + len(data), part + 1
    return written / 1e6


def config(path: Path, data_dir: Path, prepared: Path | None) -> Path:
    cfg = {"experiment": "bench_data", "seed": 0, "task": "causal_lm",
           "model": {"family": "gpt2", "layers": 2, "heads": 2, "hidden": 64},
           "data": {"path": str(data_dir), "tokenizer": "gpt2", "seq_len": 128, "val_fraction": 0.0001,
                    "test_fraction": 0.0001, **({"prepared_dir": str(prepared)} if prepared else {})},
           "train": {"steps": 100, "batch_size": 8, "lr": 0.001, "warmup": 10, "eval_every": 100000,
                     "eval_batches": 2, "log_every": 50, "checkpoint_every": 100000, "threads": 2}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def tree_peak_rss(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for ``proc``; (exit code, peak summed RSS of it and its descendants in MB)."""
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                peak = max(peak, total)
            except psutil.Error:
                pass
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    code = proc.wait()
    done.set()
    t.join()
    return code, peak / 1e6


def cli(*args: str, log: Path) -> subprocess.Popen:
    """The command in its own process, its stderr (progress bars) to ``log``: a pipe nobody reads
    until the end fills up and stalls the child (the 1 GB preparation did, at 64 KB of bars)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "mlresearch.cli", *args], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def prepare(cfg: Path, out: Path, num_proc: int) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    log = out.with_name(out.name + ".log")
    tick = time.perf_counter()
    proc = cli("data", "prepare", str(cfg), "--num-proc", str(num_proc), "--out", str(out), log=log)
    code, peak = tree_peak_rss(proc)
    if code:
        sys.exit(f"prepare failed: {log.read_text()[-2000:]}")
    return time.perf_counter() - tick, peak


def train_peak_rss(cfg: Path, out: Path) -> float:
    """Peak RSS (MB) of one ``mlresearch run --method baseline`` process, read by a fresh wrapper process whose only
    child it is (``ru_maxrss`` of its children)."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "mlresearch.cli", "run", "--method", "baseline", str(cfg),
                           "--out", str(out), "--overwrite"], cwd=REPO, env=env, capture_output=True, text=True)
    code, kb = done.stdout.split()[-2:]
    if int(code):
        sys.exit(f"train failed: {done.stderr[-2000:]}")
    return int(kb) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1000.0)
    ap.add_argument("--workdir", default="/tmp/mlresearch-bench-data")
    ap.add_argument("--keep", action="store_true", help="keep the generated and prepared data")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    full, tenth = work / "text-10x", work / "text-1x"
    mb = generate(full, args.size_mb)
    small_mb = generate(tenth, args.size_mb / 10)
    print(f"generated {mb:.0f} MB (10x) and {small_mb:.0f} MB (1x) of text in {work}")

    cfg = config(work / "prepare.yaml", full, None)
    rates = {}
    for n in (1, 2):
        seconds, peak = prepare(cfg, work / f"prepared-10x-p{n}", n)
        rates[n] = mb / seconds
        print(f"prepare with {n} process(es): {seconds:.1f} s, {rates[n]:.2f} MB/s, peak RSS {peak:.0f} MB")
    print(f"2 processes / 1: {rates[2] / rates[1]:.2f}x (goal >= 1.6)")
    prepare(config(work / "prepare-1x.yaml", tenth, None), work / "prepared-1x", 2)

    peaks = {}
    for name, data, prepared in (("1x", tenth, work / "prepared-1x"), ("10x", full, work / "prepared-10x-p2")):
        blocks = (prepared / "train.bin").stat().st_size // 2 // 128
        peaks[name] = train_peak_rss(config(work / f"train-{name}.yaml", data, prepared), work / f"run-{name}")
        print(f"training on {name} ({blocks:,} training blocks): peak RSS {peaks[name]:.0f} MB")
    ratio = peaks["10x"] / peaks["1x"]
    print(f"training peak RSS 10x / 1x: {ratio:.3f} (goal <= 1.1)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"prepare_mb_s={rates[2]:.2f} rss_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
