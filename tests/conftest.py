import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(min(2, torch.get_num_threads()))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "experiments" / "configs"


@pytest.fixture(scope="module")
def isolated_data_cache(tmp_path_factory):
    """Tokenizers and token blocks of the module's runs go to a fresh cache, not the user's."""
    old = os.environ.get("MLRESEARCH_CACHE")
    os.environ["MLRESEARCH_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("MLRESEARCH_CACHE", None)
    else:
        os.environ["MLRESEARCH_CACHE"] = old


def smoke(name, *overrides):
    """A ``*_smoke.yaml`` preset with ``key=value`` overrides."""
    from mlresearch.training.config import load_config

    return load_config(CONFIGS / f"{name}_smoke.yaml", list(overrides))


def write_run(path, rows, kind, experiment="fixture", seed=0, data=None):
    """A finished run directory with the given metrics rows (for compare/table tests); its config's
    data section is ``data`` (default: the gpt2 smoke preset's)."""
    import json

    import yaml

    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [r for r in rows if "val_loss" in r and "event" not in r]
    last = evals[-1] if evals else {}
    final = last.get("val_loss") if isinstance(last.get("val_loss"), float) else 0.0  # (a damaged row's is not)
    phases = {}
    for r in evals:  # each phase's last evaluation: where it ended
        phases[r.get("phase", kind)] = {"phase": r.get("phase", kind), "level": r.get("level", 1), "steps": r.get("step", 0),
                                       "flops": r.get("flops", 0.0), "wall": r.get("wall", 0.0), "examples": 0}
    # A summary as runs wrote them before the record's descriptive fields (RunRecord fills those from
    # the config): kind, experiment, seed, final losses, totals, phases, data as loaded.
    (path / "summary.json").write_text(json.dumps({
        "kind": kind, "experiment": experiment, "seed": seed, "final_full_val": {"val_loss": final},
        "final_test": {"test_loss": final}, "flops_total": last.get("flops", 0.0),
        "wall_total": last.get("wall", 0.0), "examples_total": 0, "phases": list(phases.values()), "data": {}}))
    config = yaml.safe_load((CONFIGS / "gpt2_smoke.yaml").read_text())
    config.update(experiment=experiment, seed=seed)
    config["data"].update(data or {})
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path
