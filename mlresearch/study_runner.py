"""Run a study spec (experiments/studies/*.yaml): every method on the same seeds, one run at a
time, resumable (a finished run is skipped, a killed one resumes), choices made on the tuning split.

1. **Fair baseline.** The baseline's peak LR (at the preset's warm-up), then its warm-up (at the best
   LR), on the spec's tuning seed; every candidate is judged on the *tuning split* (documents held
   out of training and of the validation split that defines the target). The candidates and the
   choice go to ``<root>/tables/baseline_tuning.csv``; the chosen LR and warm-up are every seed's
   baseline's, and every method's for its full-size model (see :meth:`Study.full_model_lr`). A spec
   without ``tuning`` uses the preset's.
2. **Every run on its seeds**: the main rows on ``seeds`` first, then the rest, one variant at a time,
   on ``variant_seeds``; the ``best`` V-cycle (lowest mean tuning loss over ``variant_seeds`` among
   ``best.among``) then runs on every seed. Runs land in ``<root>/<experiment>/``.
3. **The baseline frontier** (``frontier`` in the spec): the baseline trained for each of
   ``budgets`` (fractions of its steps) and the small shape alone for each of ``small_budgets``
   (fractions of the baseline's FLOPs), each run with its LR schedule fully decayed at its own end,
   on every seed. At a budget ``check_lr`` names (a list: the lowest budget), the baseline also runs at
   each of its LRs on the tuning seed first, and the LR with the lowest tuning loss (the tuned one
   among them; it wins ties) trains that budget on every seed: an LR tuned for the full budget may
   handicap a shorter or longer one, and a frontier point trained with it would flatter every method
   read against it. A point the study
   already has (the 1.0x baseline, the small control at equal FLOPs) is copied, not retrained. Runs
   land in ``<root>/<experiment>-frontier/``; the points (one row per run) go to
   ``<root>/tables/frontier.csv``, which the saving at matched loss reads (:mod:`mlresearch.frontier`).
4. **The answer**: each run against the baseline of its seed (mean and spread over seeds), and the
   study's CPU-hour total: each run's CPU seconds (the child process's ``getrusage``) are added to
   ``<run>/cpu.json``.

5. **The regime check** (``regime: true``): on every seed, the baseline against the small-model
   control (the small shape alone for the same FLOPs); ``<root>/tables/regime.csv`` and the margin
   against the baseline's seed spread. A saving means something only where the full model is
   clearly better.

Each run is its own process: ``python -m mlresearch.cli run ...``, or under a launcher
(``--launch "torchrun --standalone --nproc_per_node 8"`` or ``$MLRESEARCH_LAUNCH``) on a GPU node.

``mlresearch study SPEC [--stage tune|frontier|regime|all] [--dry-run] [--launch CMD]``
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from .checkpoint import atomic_write_text, read_structured
from .errors import MLResearchError
from .results import REPO, provenance
from .training.config import SPEEDS, ConfigError, load_config, preset_path
from .training.record import RunRecord, finished
from .training.run import config_differences, default_out


class StudyError(MLResearchError, ValueError):
    """A study spec that cannot run, or a run of it that failed."""


STUDY_KEYS = {"config", "root", "tuning", "seeds", "variant_seeds", "runs", "best", "frontier", "regime", "speed"}
FRONTIER_KEYS = {"budgets", "small_budgets", "check_lr"}


# A run of a spec: its method, overrides, whether it is a main row (on every seed), whether it gets the
# baseline's FLOPs (the small control), and what the answer table adds to its name ("the paper's recipe").
RUN_KEYS = {"method", "set", "main", "equal_flops", "label"}


def load_study(path: str | Path) -> dict:
    """A study spec (experiments/studies/*.yaml): which runs, on which seeds, how the baseline is
    tuned and among which variants the best is chosen. Checked whole before any run starts."""
    from .training.methods import METHODS

    spec = read_structured(path, "study spec", StudyError, fmt="yaml") or {}
    path = Path(path)

    def bad(what: str):
        return StudyError(f"study spec {path}: {what}")

    if not isinstance(spec, dict) or set(spec) - STUDY_KEYS or not {"config", "runs", "seeds"} <= set(spec):
        raise bad(f"needs config, runs and seeds, and only the keys {sorted(STUDY_KEYS)}")

    def seeds(key: str) -> None:
        value = spec[key]
        if not isinstance(value, list) or not value or not all(isinstance(x, int) and not isinstance(x, bool)
                                                               and x >= 0 for x in value):
            raise bad(f"{key} must be a non-empty list of seeds (whole numbers >= 0), e.g. [0, 1, 2], got {value!r}")

    def strings(value, where: str) -> None:
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise bad(f"{where} must be a list of key=value overrides, e.g. [vcycle.alpha=0.5], got {value!r}")

    if not isinstance(spec["config"], str):
        raise bad(f"config must be a preset name or a .yaml path, got {spec['config']!r}")
    if spec.get("speed", "eager") not in SPEEDS:  # every run's train.speed (not part of what a run computes)
        raise bad(f"speed must be one of {', '.join(SPEEDS)}, got {spec['speed']!r}")
    seeds("seeds")
    spec.setdefault("variant_seeds", spec["seeds"])
    seeds("variant_seeds")
    spec.setdefault("tuning", {"seed": spec["seeds"][0], "lr": [], "warmup": []})
    tuning = spec["tuning"]
    if isinstance(tuning, dict) and not set(tuning) - {"seed", "lr", "warmup"}:
        tuning = spec["tuning"] = {"seed": spec["seeds"][0], "lr": [], "warmup": [], **tuning}
    if not isinstance(tuning, dict) or set(tuning) != {"seed", "lr", "warmup"} or not isinstance(tuning["seed"], int) \
            or not isinstance(tuning["lr"], list) or not isinstance(tuning["warmup"], list):
        raise bad(f"tuning must be a mapping of seed (a number) and lr, warmup (lists), got {tuning!r}")
    runs = spec["runs"]
    if not isinstance(runs, dict):
        raise bad(f"runs must be a mapping of run names to {{method: ..., set: [...]}}, got {type(runs).__name__}")
    for name, item in runs.items():
        if name == "baseline" or not isinstance(item, dict) or item.get("method") not in METHODS:
            raise bad(f"run {name!r} needs a method among {sorted(METHODS)} (and may not be called baseline)")
        if set(item) - RUN_KEYS:
            raise bad(f"run {name!r} has unknown keys {sorted(set(item) - RUN_KEYS)} (known: {sorted(RUN_KEYS)})")
        if not isinstance(item.get("label", ""), str):
            raise bad(f"run {name!r}: label must be text (how the answer table names the row), got {item['label']!r}")
        strings(item.get("set", []), f"run {name!r}: set")
    if "best" in spec and not isinstance(spec["best"], dict):
        raise bad(f"best must be a mapping with among: [run names], got {spec['best']!r}")
    among = (spec.get("best") or {}).get("among", [])
    if "best" in spec and (not among or set(among) - set(runs)):
        raise bad(f"best.among names runs the spec does not have: {sorted(set(among) - set(runs)) or 'none given'}")
    if not set(spec["variant_seeds"]) <= set(spec["seeds"]):
        raise bad("variant_seeds must be a subset of seeds")
    if "regime" in spec and (not isinstance(spec["regime"], bool) or spec["regime"] and control(spec) is None):
        raise bad("regime: true needs the small-model control among the runs, e.g. "
                  "small: {method: small, equal_flops: true, main: true}")
    if "frontier" in spec:
        frontier = spec["frontier"]
        if not isinstance(frontier, dict) or set(frontier) - FRONTIER_KEYS or "budgets" not in frontier:
            raise bad(f"frontier must be a mapping with budgets and optionally small_budgets, check_lr, got {frontier!r}")
        frontier.setdefault("small_budgets", [])

        def numbers(value, key: str, least: int = 0) -> None:
            if not isinstance(value, list) or len(value) < least or len(set(value)) != len(value) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
                raise bad(f"frontier.{key} must be a list of distinct positive numbers"
                          + (f" (at least {least}: a frontier is read between its points)" if least else "")
                          + f", got {value!r}")

        numbers(frontier["budgets"], "budgets", 2)
        numbers(frontier["small_budgets"], "small_budgets")
        if frontier["small_budgets"] and len(frontier["small_budgets"]) < 2:
            raise bad("frontier.small_budgets needs at least 2 budgets (or none)")
        checks = frontier.get("check_lr", [])  # a list: LRs to check at the lowest budget
        checks = {min(frontier["budgets"]): checks} if isinstance(checks, list) else checks
        if not isinstance(checks, dict) or set(checks) - set(frontier["budgets"]):
            raise bad("frontier.check_lr must be a list of LRs (checked at the lowest budget) or a mapping "
                      f"budget -> LRs, each budget one of frontier.budgets {frontier['budgets']}, got {checks!r}")
        for budget, lrs in checks.items():
            numbers(lrs, f"check_lr at {budget:g}x")
        frontier["check_lr"] = {b: lrs for b, lrs in checks.items() if lrs}
    return spec


def controls(spec: dict) -> list[str]:
    """The spec's small-model controls: its runs of a small shape alone for the baseline's FLOPs (the
    V-cycle's coarsest shape; another method's smallest, e.g. staged training's half-width one), in
    the spec's order; each gets a frontier (``frontier.small_budgets``)."""
    return [name for name, item in spec["runs"].items() if item.get("method") == "small" and item.get("equal_flops")]


def control(spec: dict) -> str | None:
    """The regime check's control: the spec's first small shape alone for the baseline's FLOPs."""
    return next(iter(controls(spec)), None)


def equal_flops_steps(cfg, budget: float = 1.0) -> tuple[int, int]:
    """Steps (and warm-up, in the same proportion) for which ``cfg``'s small-model control costs
    ``budget`` times the baseline's planned FLOPs: the strongest small model at that compute."""
    from .training.methods import planned_ledger

    base = budget * planned_ledger(cfg, "baseline")["flops"]
    small = planned_ledger(cfg, "small")
    per_step = small["flops"] / small["phases"][0]["steps"]
    steps = math.ceil(base / per_step)
    return steps, round(steps * cfg.train.warmup / cfg.train.steps)


def tuning_loss(run: str | Path) -> float:
    """A finished run's final loss on its tuning split: documents held out of training *and* of the
    validation split that defines the target, so choices among runs (the baseline's LR and warm-up,
    the best variant of a method) never look at the target. Read from the summary (``final_tune``);
    a run finished before summaries carried it is scored once from its final model and cached in
    ``<run>/tune.json``."""
    from .checkpoint import load_model
    from .data.datasets import load_data
    from .training.engine import evaluate
    from .training.models import data_settings

    run = Path(run)
    record = RunRecord.read(run)
    if record.tune_loss is not None:
        return float(record.tune_loss)
    cached = run / "tune.json"
    if cached.exists():
        return float(json.loads(cached.read_text())["tune_loss"])
    if not (run / "final_model").is_dir():
        raise FileNotFoundError(f"{run} has no final_tune in its summary and no final_model/ to score")
    cfg = load_config(run / "config.yaml")
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    result = evaluate(load_model(run / "final_model"), data, cfg, "tune", batches=10**9)
    atomic_write_text(cached, json.dumps(result, indent=2) + "\n")
    return float(result["tune_loss"])


def _tuning_key(row) -> tuple:
    return str(row.experiment), int(row.seed), float(row.lr), int(row.warmup)


def _tuning_content(frame: pd.DataFrame) -> list:
    return sorted((_tuning_key(r), float(r.tune_loss), bool(r.chosen)) for r in frame.itertuples())


def merge_tuning_rows(previous: pd.DataFrame, table: pd.DataFrame, experiment: str, commit: str) -> pd.DataFrame | None:
    """``previous`` (the committed tuning table) with this study's candidates ``table`` merged in by
    (experiment, seed, lr, warm-up): a candidate replaces the row of the same configuration, every
    other row -- other experiments', and candidates of this experiment a narrower grid did not run
    -- is kept; ``chosen`` marks this study's choice alone. None when nothing would change (the
    same rows, losses and choice: the file and its commit stay)."""
    ran = {_tuning_key(r) for r in table.itertuples()}
    kept = previous[[_tuning_key(r) not in ran for r in previous.itertuples()]].copy()
    if len(kept):
        kept.loc[kept.experiment == experiment, "chosen"] = False
    merged = pd.concat([kept, table.assign(git_commit=commit)], ignore_index=True)
    if len(previous) and _tuning_content(merged) == _tuning_content(previous):
        return None
    return merged


def word_order_gain(run: Path, previous: pd.DataFrame, experiment: str, seed: int) -> float:
    """A run's final model's word-order gain (:mod:`mlresearch.analysis.word_order`), cached in
    ``<run>/word_order.json``; a committed run keeps no weights, so without the model or the cache
    the value the regime table already holds for it is kept (NaN when it has none)."""
    from .analysis.word_order import run_word_order

    cached = run / "word_order.json"
    if cached.exists():
        return float(json.loads(cached.read_text())["gain"])
    if (run / "final_model").is_dir():
        gain = float(run_word_order(run).gain)
        atomic_write_text(cached, json.dumps({"gain": gain}, indent=2) + "\n")
        return gain
    column = "small_word_order_gain" if RunRecord.read(run).method == "small" else "baseline_word_order_gain"
    if column in previous:
        row = previous[(previous.experiment == experiment) & (previous.seed == seed)]
        if len(row):
            return float(row[column].iloc[0])
    return math.nan


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


class Study:
    """One study spec, run: ``tune()``, then ``all_runs()``, then ``report()``."""

    def __init__(self, path: str | Path, dry_run: bool = False, launch: str | None = None,
                 root: str | Path | None = None, finished_only: bool = False):
        """``root``: where the spec's runs are (default: the spec's ``root``, relative to the current
        directory, as ``mlresearch study`` writes them); ``finished_only``: train nothing, and write
        the stages' tables from the runs that have finished (a study stopped part-way)."""
        from .training.run import runs_root

        launch = os.environ.get("MLRESEARCH_LAUNCH", "") if launch is None else launch
        try:  # "torchrun --standalone --nproc_per_node 8": each run is started as `<launch> -m mlresearch.cli run ...`
            self.launcher = shlex.split(launch) or [sys.executable]
        except ValueError as e:
            raise StudyError(f"--launch / MLRESEARCH_LAUNCH {launch!r} is not a command line: {e}") from None

        self.spec = load_study(path)
        try:
            self.config = preset_path(self.spec["config"], near=path)
        except ConfigError as e:
            raise StudyError(f"study spec {path}: {e}") from None
        if not self.config.is_file():
            raise StudyError(f"study spec {path}: config {self.config} does not exist")
        self.root = Path(root).resolve() if root is not None else runs_root(self.spec.get("root")).resolve()
        self.experiment = load_config(self.config).experiment
        self.home = self.root / self.experiment
        self.dry_run, self.finished_only = dry_run, finished_only
        self.baseline = (load_config(self.config).train.lr, load_config(self.config).train.warmup)
        self.runs: dict = {}
        from .training.methods import build_plan

        seed = self.spec["seeds"][0]
        outs = {self.main_baseline(seed): "baseline"}
        for name, item in self.spec["runs"].items():  # every run's config and plan, before anything trains
            try:
                cfg = load_config(self.config, [f"seed={seed}", *item.get("set", [])])
                build_plan(cfg, item["method"])
            except MLResearchError as e:
                raise StudyError(f"study spec {path}: run {name!r}: {e}") from None
            out = self.out(name, item, cfg)
            if out in outs:  # the second would be skipped as finished, or resume the first
                raise StudyError(f"study spec {path}: runs {outs[out]!r} and {name!r} would share the directory "
                                 f"{out.relative_to(self.root)} (they differ only in settings its name does not "
                                 "show): give one a vcycle.tag / staged.tag / stack.tag")
            outs[out] = name

    def main_baseline(self, seed: int) -> Path:
        """The study's baseline run of ``seed`` (the preset's, at the tuned LR: the main rows' baseline)."""
        return default_out(load_config(self.config, [f"seed={seed}"]), "baseline", self.root)

    def out(self, name: str, item: dict, cfg) -> Path:
        """Where run ``name`` of the spec (``item``) lands for ``cfg`` (its seed's config)."""
        if item.get("equal_flops"):
            return self.home / f"{name}-equalflops-seed{cfg.seed}"
        return default_out(cfg, item["method"], self.root)

    def sets(self, sets: list[str]) -> list[str]:
        """A run's settings as its command line gives them (the spec's execution choice first)."""
        speed = [f"train.speed={self.spec['speed']}"] if self.spec.get("speed", "eager") != "eager" else []
        return [*speed, *sets]

    def command(self, out: Path, method: str, sets: list[str]) -> list[str]:
        """The command line that trains one run (skipped when finished, resumed when killed)."""
        return [*self.launcher, "-m", "mlresearch.cli", "run", str(self.config), "--method", method,
                *_sets(self.sets(sets)), "--out", str(out), "--resume", "--skip-done"]

    def launch(self, out: Path, method: str, sets: list[str]) -> Path:
        """One run in its own process (skipped when finished, resumed when killed); the CPU seconds
        it takes are added to ``out/cpu.json``."""
        if self.dry_run or self.finished_only:
            state = "finished" if finished(out) else "started" if out.exists() else "to run"
            via = "" if self.launcher == [sys.executable] else f" (via {shlex.join(self.launcher)})"
            print(f"[{state:8}] {out}  <- {method} {' '.join(sets)}{via}")
            return out
        if finished(out):  # said here: a process started only to say it costs seconds a run, minutes a study
            changed = config_differences(out, load_config(self.config, self.sets(sets)), method)
            note = f" (WARNING: its config differs in {', '.join(changed)})" if changed else ""
            print(f"{method}: {out} is complete (summary.json); skipped{note}")
            return out
        cpu, wall = cpu_seconds(), time.perf_counter()
        try:
            done = subprocess.run(self.command(out, method, sets),
                                  env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
        except OSError as e:  # a launcher that is not installed
            raise StudyError(f"cannot start {self.launcher[0]!r} (--launch / MLRESEARCH_LAUNCH): {e.strerror}") from None
        finally:  # a failed or interrupted run's CPU was spent too (subprocess.run reaps its process first)
            if out.exists():
                record = out / "cpu.json"
                before = json.loads(record.read_text()) if record.exists() else {"cpu_seconds": 0.0, "wall_seconds": 0.0}
                atomic_write_text(record, json.dumps({"cpu_seconds": before["cpu_seconds"] + cpu_seconds() - cpu,
                                                      "wall_seconds": before["wall_seconds"] + time.perf_counter() - wall},
                                                     indent=2) + "\n")
        if done.returncode:
            raise StudyError(f"mlresearch run {self.config.name} --method {method} {' '.join(_sets(sets))} --out {out} "
                             f"failed (exit {done.returncode}); run the study again to resume it")
        return out

    # ----------------------------------------------------------------------------------- tuning
    def candidate(self, lr: float, warmup: int) -> Path:
        """A tuning run (its directory): the experiment's own baseline when it is that configuration."""
        seed = self.spec["tuning"]["seed"]
        sets = [f"seed={seed}", f"train.lr={lr}", f"train.warmup={warmup}"]
        main = self.main_baseline(seed)
        if finished(main) and not config_differences(main, load_config(self.config, sets), "baseline"):
            return main
        out = self.root / f"{self.experiment}-tuning" / f"baseline-lr{lr:g}-wu{warmup}-seed{seed}"
        return self.launch(out, "baseline", sets)

    def tune(self) -> tuple[float, int]:
        """The baseline's LR at the preset's warm-up, then its warm-up at the best LR, judged on the
        tuning split; sets and returns the choice (the preset's when the spec tunes nothing)."""
        t = self.spec["tuning"]
        preset_lr, preset_warmup = self.baseline
        if not t.get("lr") and not t.get("warmup"):
            return self.baseline
        rows, unknown = [], []

        def score(lr, warmup):
            run = self.candidate(lr, warmup)
            if (self.dry_run or self.finished_only) and not finished(run):  # not run yet: as if the preset won
                unknown.append(run)
                return -math.inf if (lr, warmup) == (preset_lr, preset_warmup) else math.inf
            rows.append({"experiment": self.experiment, "seed": t["seed"], "lr": lr, "warmup": warmup,
                         "tune_loss": tuning_loss(run), "run": str(run.relative_to(self.root))})
            return rows[-1]["tune_loss"]

        lr = min(t.get("lr") or [preset_lr], key=lambda x: score(x, preset_warmup))
        for w in t.get("warmup", []):
            if w != preset_warmup:
                score(lr, w)
        if unknown:
            return self.baseline
        warmup = min((r for r in rows if r["lr"] == lr), key=lambda r: r["tune_loss"])["warmup"]
        table = pd.DataFrame(rows).assign(chosen=lambda d: (d.lr == lr) & (d.warmup == warmup))
        out = self.root / "tables" / "baseline_tuning.csv"
        previous = pd.read_csv(out) if out.exists() else pd.DataFrame(columns=["experiment"])
        merged = merge_tuning_rows(previous, table, self.experiment, provenance({}, 0)["git_commit"])
        written = merged is not None and not self.dry_run
        if written:
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, merged.to_csv(index=False))
        state = "unchanged" if merged is None else "written" if written else "would write"
        print(f"{self.experiment}: baseline tuned over {len(rows)} runs on the tuning split: lr {lr:g}, warm-up "
              f"{warmup} (tuning loss {min(r['tune_loss'] for r in rows):.4f}); {out} ({state})")
        self.baseline = (lr, warmup)
        return self.baseline

    # ------------------------------------------------------------------------------------- runs
    def run(self, name: str, seed: int) -> Path:
        if name == "baseline":
            lr, warmup = self.baseline
            sets, method, equal = [f"seed={seed}", f"train.lr={lr}", f"train.warmup={warmup}"], "baseline", False
        else:
            item = self.spec["runs"][name]
            sets, method, equal = [f"seed={seed}", *item.get("set", [])], item["method"], item.get("equal_flops")
            if equal:  # as many steps as the baseline's FLOPs buy this method's model
                steps, warmup = equal_flops_steps(load_config(self.config, sets))
                sets += [f"train.steps={steps}", f"train.warmup={warmup}"]
            else:
                sets += self.full_model_lr(load_config(self.config, sets))
        cfg = load_config(self.config, sets)
        out = default_out(cfg, method, self.root) if name == "baseline" else self.out(name, self.spec["runs"][name], cfg)
        if name == "baseline" and seed == self.spec["tuning"]["seed"] and not out.exists() and not self.dry_run:
            self._adopt(self.candidate(*self.baseline), out)  # the chosen tuning run is this seed's baseline
        changed = config_differences(out, cfg, method) if finished(out) else []
        if changed:
            raise StudyError(f"{out} is finished with another configuration (differs in {', '.join(changed)}); move "
                             "it away (an untuned baseline, say) and run the study again")
        self.runs[name, seed] = self.launch(out, method, sets)
        return self.runs[name, seed]

    def full_model_lr(self, cfg) -> list[str]:
        """Overrides that give a method's full-size model the baseline's tuned LR and warm-up: the
        ``train`` section (staged and G_stack train the full model on it) and whatever each method's
        settings say (``MethodSettings.full_model_lr``: the V-cycle's level-1 LR; smaller levels keep theirs). Otherwise a method would be compared, at the preset's LR, with a
        baseline tuned on its own. (The small-model control keeps its own schedule: it is not the full model.)"""
        lr, warmup = self.baseline
        sets = [f"train.lr={lr}", f"train.warmup={min(warmup, cfg.train.steps)}"]
        return sets + [s for settings in cfg.methods.values() for s in settings.full_model_lr(lr)]

    def _adopt(self, candidate: Path, out: Path) -> None:
        """Copy a finished run (not its checkpoints) to ``out``: written beside it, then renamed. The
        record's ``copied_from`` is relative to the results root, as ``frontier.csv``'s ``run`` is, so
        it reads the same on every machine and checkout (an absolute path named the worktree it ran in)."""
        import shutil

        if candidate == out or not finished(candidate):
            return
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(candidate, tmp, ignore=shutil.ignore_patterns("checkpoints", ".lock", "cpu.json"))
        record = json.loads((tmp / "provenance.json").read_text())
        source = candidate.resolve()
        record["copied_from"] = str(source.relative_to(self.root) if source.is_relative_to(self.root) else source)
        atomic_write_text(tmp / "provenance.json", json.dumps(record, indent=2) + "\n")
        tmp.rename(out)

    # --------------------------------------------------------------------------------- frontier
    def _baseline_point(self, budget: float, lr: float, seed: int) -> tuple[Path, list[str]]:
        """The directory and overrides of the baseline's frontier run at ``budget`` with peak ``lr``."""
        tuned, warmup = self.baseline
        steps = max(1, round(budget * load_config(self.config, [f"seed={seed}"]).train.steps))
        name = f"baseline-x{budget:g}-seed{seed}" if lr == tuned else f"baseline-x{budget:g}-lr{lr:g}-seed{seed}"
        return (self.root / f"{self.experiment}-frontier" / name,
                [f"seed={seed}", f"train.steps={steps}", f"train.lr={lr}", f"train.warmup={min(warmup, steps)}"])

    def budget_lr(self, budget: float) -> float | None:
        """The peak LR the baseline trains ``budget`` with on every seed: the tuned one, or at a budget
        ``check_lr`` names, the candidate (the tuned LR first, so it wins ties) with the lowest
        tuning loss on the tuning seed; None until every candidate there has finished."""
        tuned = self.baseline[0]
        candidates = [tuned, *(x for x in self.spec["frontier"]["check_lr"].get(budget, []) if x != tuned)]
        if len(candidates) == 1:
            return tuned
        runs = {lr: self._baseline_point(budget, lr, self.spec["tuning"]["seed"])[0] for lr in candidates}
        if not all(finished(run) for run in runs.values()):
            return None
        return min(candidates, key=lambda lr: tuning_loss(runs[lr]))

    def frontier_points(self) -> list[tuple[Path, str, list[str], float, str]]:
        """(directory, method, overrides, budget, role) of every frontier run, in the order they run:
        the baseline's budgets on every seed (at a checked budget, each candidate LR on the tuning
        seed first, role "lr check" for those not chosen; on the other seeds the chosen LR, role
        "pending" until the choice is made), then each small-model control's (``controls``: the
        regime check's first; role "frontier"), so a study stopped part-way has the baseline's
        frontier on every seed first."""
        f, tuned = self.spec["frontier"], self.baseline[0]
        home = self.root / f"{self.experiment}-frontier"
        tuning_seed = self.spec["tuning"]["seed"]
        chosen = {budget: self.budget_lr(budget) for budget in f["budgets"]}
        points = []
        for seed in sorted(self.spec["seeds"], key=lambda s: s != tuning_seed):  # the checks first
            for budget in f["budgets"]:
                lrs = [tuned, *(x for x in f["check_lr"].get(budget, []) if x != tuned)] if seed == tuning_seed \
                    else [tuned if chosen[budget] is None else chosen[budget]]
                for lr in lrs:
                    role = ("pending" if seed != tuning_seed else "frontier" if lr == tuned else "lr check") \
                        if chosen[budget] is None else "frontier" if lr == chosen[budget] else "lr check"
                    out, sets = self._baseline_point(budget, lr, seed)
                    points.append((out, "baseline", sets, budget, role))
        for name in controls(self.spec):  # the regime check's control first
            for seed in self.spec["seeds"]:
                sets = [f"seed={seed}", *self.spec["runs"][name].get("set", [])]
                cfg = load_config(self.config, sets)
                for budget in f["small_budgets"]:
                    steps, small_warmup = equal_flops_steps(cfg, budget)
                    points.append((home / f"{name}-x{budget:g}-seed{seed}", "small",
                                   [*sets, f"train.steps={steps}", f"train.warmup={small_warmup}"], budget, "frontier"))
        return points

    def _same_run(self, method: str, cfg) -> Path | None:
        """A finished run of the study's own (the baseline, a spec run) with exactly ``cfg``."""
        homes = [default_out(cfg, method, self.root)]
        homes += [self.out(n, item, cfg) for n, item in self.spec["runs"].items() if item["method"] == method]
        for out in homes:
            if finished(out) and not config_differences(out, cfg, method):
                return out
        return None

    def frontier(self) -> list[tuple[Path, float, str]]:
        """Train (or copy) every frontier point; returns (directory, budget, role) of each. Where a
        point waits for an LR check's choice, the baseline's other points (the checks among them)
        run first, then every point in order, the waiting ones with the LR chosen."""
        if not (self.dry_run or self.finished_only) and any(p[4] == "pending" for p in self.frontier_points()):
            self._frontier_pass(baseline_only=True)
        done = self._frontier_pass()
        if self.dry_run:
            return done
        return [(out, budget, role) for out, _, _, budget, role in self.frontier_points()  # the roles as the
                if role != "pending"]                                                      # checks now decide

    def _frontier_pass(self, baseline_only: bool = False) -> list[tuple[Path, float, str]]:
        done = []
        for out, method, sets, budget, role in self.frontier_points():
            if role == "pending" or (baseline_only and method != "baseline"):
                if role == "pending" and (self.dry_run or self.finished_only):
                    print(f"[{'pending':8}] {out}  <- baseline at {budget:g}x with the LR its check chooses")
                continue
            cfg = load_config(self.config, sets)
            same = None if out.exists() else self._same_run(method, cfg)
            if same is not None and not self.dry_run:
                self._adopt(same, out)
            elif same is not None:
                print(f"[{'copy':8}] {out}  <- {same}")
                continue
            changed = config_differences(out, cfg, method) if finished(out) else []
            if changed:
                raise StudyError(f"{out} is finished with another configuration (differs in {', '.join(changed)}); "
                                 "move it away and run the study again")
            done.append((self.launch(out, method, sets), budget, role))
        return done

    def write_frontier(self, runs: list[tuple[Path, float, str]]) -> Path | None:
        """``<root>/tables/frontier.csv``: one row per finished frontier run (this experiment's rows
        replaced, every other experiment's kept)."""
        from .frontier import frontier_row

        regime = {out for out, method, sets, *_ in self.frontier_points()
                  if method == "small" and out.name.startswith(f"{control(self.spec)}-x")}
        rows = [{**frontier_row(run, self.root, budget), "role": role, "regime_control": run in regime}
                for run, budget, role in runs if finished(run)]
        out = self.root / "tables" / "frontier.csv"
        if not rows or self.dry_run:
            return None
        kept = pd.read_csv(out) if out.exists() else None
        kept = [] if kept is None else [kept[kept.experiment != self.experiment]]
        table = pd.concat([*[k for k in kept if len(k)], pd.DataFrame(rows)], ignore_index=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, table.to_csv(index=False))
        print(f"{self.experiment}: {len(rows)} frontier points -> {out}")
        return out

    # ----------------------------------------------------------------------------------- regime
    def regime(self) -> pd.DataFrame:
        """The regime check: on every seed, the baseline and the small shape alone for the same FLOPs
        (both trained first if need be); ``<root>/tables/regime.csv`` gets this experiment's rows
        (the small shape's loss at the baseline's FLOPs, the margin; for sequence tasks each final
        model's word-order gain), ``<root>/figures/regime_<experiment>.png`` both curves; printed:
        the margin against the baseline's seed spread (:func:`mlresearch.analysis.regime.verdict`)."""
        from .analysis.regime import figure, merge_rows, regime_row, verdict
        from .tasks import task_of

        small, seeds = control(self.spec), self.spec["seeds"]
        pairs = [(seed, self.run("baseline", seed), self.run(small, seed)) for seed in seeds]
        pairs = [p for p in pairs if finished(p[1]) and finished(p[2])] if self.finished_only else pairs
        if self.dry_run or not pairs:
            return pd.DataFrame()
        out = self.root / "tables" / "regime.csv"
        previous = pd.read_csv(out) if out.exists() else pd.DataFrame()
        cfg = load_config(self.config)
        rows = []
        for seed, base, alone in pairs:
            gain = (lambda run, s=seed: word_order_gain(run, previous, self.experiment, s)) \
                if task_of(cfg.task).sequences else None
            steps = load_config(alone / "config.yaml").train.steps
            rows.append(regime_row(self.experiment, seed, base, alone, steps, word_order=gain))
        table = merge_rows(previous, pd.DataFrame(rows).assign(git_commit=provenance({}, 0)["git_commit"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, table.to_csv(index=False))
        figure(self.root, self.experiment, [(seed, base, alone) for seed, base, alone in pairs])
        v = verdict(table[table.experiment == self.experiment])
        print(f"{self.experiment}: baseline {v['baseline']:.4f} (seed spread {v['spread']:.4f}), small alone at the same "
              f"FLOPs {v['small']:.4f}; margin {v['margin']:+.4f} (min {v['margin_min']:+.4f}, {v['seeds']} seeds): "
              + ("in the regime" if v["in_regime"] else "NOT clearly in the regime") + f"; {out}")
        return table

    def best(self) -> str:
        """The candidate V-cycle with the lowest mean tuning loss over ``variant_seeds``."""
        seeds = self.spec["variant_seeds"]
        scores = {n: sum(tuning_loss(self.runs[n, s]) for s in seeds) / len(seeds) for n in self.spec["best"]["among"]}
        choice = min(scores, key=scores.get)
        print(f"best (mean tuning loss, seeds {', '.join(map(str, seeds))}): " +
              ", ".join(f"{n} {v:.4f}" for n, v in sorted(scores.items(), key=lambda kv: kv[1])) + f" -> {choice}")
        return choice

    def all_runs(self) -> None:
        """The main rows on every seed first (they answer the question), then each variant on all of
        ``variant_seeds`` before the next, in the spec's order, so a study stopped part-way has whole
        rows (mean and spread) rather than one seed of everything."""
        seeds, variant_seeds = self.spec["seeds"], self.spec["variant_seeds"]
        main = ["baseline", *(n for n, item in self.spec["runs"].items() if item.get("main"))]
        for seed in seeds:
            for name in main:
                self.run(name, seed)
        for name in self.spec["runs"]:
            if name not in main:
                for seed in variant_seeds:
                    self.run(name, seed)
        if "best" in self.spec and not self.dry_run:
            among = self.spec["best"]["among"]
            if self.finished_only and not all(finished(self.runs[n, s]) for n in among for s in variant_seeds):
                return  # (the choice needs every candidate's tuning loss)
            choice = self.best()  # --finished too: the best's other seeds are the study's runs, counted and tabled
            for seed in seeds:
                self.run(choice, seed)

    def headline_runs(self) -> dict[str, str]:
        """The run directories (names under ``<root>/<experiment>/``) of the rows that answer the
        question, each with its label: the spec's main runs (their ``label``, if any) and, once its
        candidates have finished, the best V-cycle ("best by tuning loss"), on every seed. The
        README's answer table shows these; the full table shows every run."""
        names = {n: item.get("label", "") for n, item in self.spec["runs"].items() if item.get("main")}
        among = (self.spec.get("best") or {}).get("among", [])
        scores = {}
        for name in among:
            item = self.spec["runs"][name]
            outs = [self.out(name, item, load_config(self.config, [f"seed={s}", *item.get("set", [])]))
                    for s in self.spec["variant_seeds"]]
            if all(finished(o) for o in outs):
                scores[name] = sum(tuning_loss(o) for o in outs) / len(outs)
        if among and len(scores) == len(among):
            best = min(scores, key=scores.get)
            names[best] = ", ".join(x for x in (names.get(best), "best by tuning loss") if x)
        dirs = {}
        for name, label in names.items():
            item = self.spec["runs"][name]
            for seed in self.spec["seeds"]:
                dirs[self.out(name, item, load_config(self.config, [f"seed={seed}", *item.get("set", [])])).name] = label
        return dirs

    # ----------------------------------------------------------------------------------- report
    def report(self) -> pd.DataFrame:
        """Every finished run of the spec against the baseline of its seed (mean and spread over
        seeds), then the study's CPU-hour total."""
        from .study import collect, markdown, variants

        mine = {p.name for p in self.runs.values()}
        runs = collect(self.root)
        runs = runs[(runs.experiment == self.experiment) & runs.run.isin(mine)] if len(runs) else runs
        table = variants(runs)
        if len(table):
            print(markdown(table))
        dirs = [d for d in (*self.home.glob("*/"), *(self.root / f"{self.experiment}-tuning").glob("*/"),
                            *(self.root / f"{self.experiment}-frontier").glob("*/"))
                if finished(d) and (d.parent != self.home or d.name in mine)
                and "copied_from" not in json.loads((d / "provenance.json").read_text())]  # counted where it ran
        recorded = [json.loads((d / "cpu.json").read_text())["cpu_seconds"] for d in dirs if (d / "cpu.json").exists()]
        missing = [d for d in dirs if not (d / "cpu.json").exists()]
        # Runs trained before CPU time was recorded: training wall time x threads (a lower bound: it
        # leaves out evaluation and checkpoints).
        estimate = sum(RunRecord.read(d).wall *
                       (load_config(d / "config.yaml").train.threads or 1) for d in missing)
        print(f"{self.experiment}: {len(dirs)} finished runs, {sum(recorded) / 3600:.2f} CPU-hours recorded "
              f"({len(recorded)} runs)" + (f" + ~{estimate / 3600:.2f} estimated for {len(missing)} runs trained before "
                                            "CPU time was recorded (training wall time x threads)" if missing else ""))
        return table


def headlines(results: str | Path) -> dict[str, dict[str, str]]:
    """experiment -> its headline run directories and labels (:meth:`Study.headline_runs`), for every committed
    study spec (``experiments/studies/*.yaml``) whose root is ``results`` (a relative root read from
    the repository)."""
    out = {}
    for path in sorted((REPO / "experiments" / "studies").glob("*.yaml")):
        root = Path(load_study(path).get("root") or "runs")
        if (root if root.is_absolute() else REPO / root).resolve() == Path(results).resolve():
            study = Study(path, root=results)  # (read from any directory: a notebook's is notebooks/)
            out[study.experiment] = study.headline_runs()
    return out


def run_study(path: str | Path, stage: str = "all", dry_run: bool = False, launch: str | None = None,
              finished_only: bool = False) -> pd.DataFrame:
    """``mlresearch study SPEC``: tune the baseline, then the frontier (``stage="frontier"``) or
    every run and the frontier (``stage="all"``), then report. ``launch`` starts each run (default
    ``$MLRESEARCH_LAUNCH``, else this Python); ``finished_only``: train nothing, write the tables of
    the runs already finished."""
    study = Study(path, dry_run, launch, finished_only=finished_only)
    if stage in ("frontier", "regime") and not study.spec.get(stage):
        raise StudyError(f"study spec {path} has no {stage} section: nothing to run for --stage {stage}")
    study.tune()
    if stage == "all":
        study.all_runs()
    if stage in ("all", "frontier") and "frontier" in study.spec:
        study.write_frontier(study.frontier())
    if stage in ("all", "regime") and study.spec.get("regime"):
        study.regime()
    return study.report()
