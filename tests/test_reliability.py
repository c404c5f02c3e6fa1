"""Reliability: nothing in a model directory runs code, ``--overwrite`` deletes only what a run wrote.

Each test plants what a hostile or careless user would (a model directory shipping its own Python,
``--out`` at a folder of their own files, a run inside a checkout git cannot read) and checks both
the refusal (one line naming the path and the reason) and that nothing on disk changed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from models import FACTORIES

from mlresearch.checkpoint import load_model, save_model
from mlresearch.cli import main
from mlresearch.errors import CheckpointError
from mlresearch.training.engine import read_metrics
from mlresearch.overwrite import MODEL, RUN, OverwriteRefused, check_is_run, check_overwrite

REPO = Path(__file__).resolve().parent.parent
SMOKE = str(REPO / "experiments" / "configs" / "gpt2_smoke.yaml")
BERT_SMOKE = str(REPO / "experiments" / "configs" / "bert_smoke.yaml")

pytestmark = pytest.mark.usefixtures("isolated_data_cache")


def one_error(capsys) -> str:
    err = capsys.readouterr().err  # in-process: a crash would raise here rather than print a traceback
    lines = [line for line in err.splitlines() if line.startswith("mlresearch:")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- nothing from disk runs code
def plant_remote_code(directory: Path, marker: Path, architecture: str = "AutoModelForCausalLM") -> Path:
    """A model directory whose config names its own class (``auto_map``) in a ``modeling_*.py``
    that touches ``marker`` when it is imported: what transformers would run after a "y"."""
    source = directory.parent / f".genuine-{directory.name}"
    save_model(FACTORIES["gpt2"](), source)
    shutil.copytree(source, directory, dirs_exist_ok=True)
    shutil.rmtree(source)
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=[architecture], model_type="evil_gpt2",
                  auto_map={"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class EvilConfig(GPT2Config):\n    model_type = 'evil_gpt2'\n"
        "class EvilModel(GPT2LMHeadModel):\n    config_class = EvilConfig\n")
    return directory


@pytest.fixture(scope="module")
def finished_bert(tmp_path_factory):
    """A finished masked-LM run (downstream and resume read its models)."""
    out = tmp_path_factory.mktemp("bert") / "run"
    assert main(["run", BERT_SMOKE, "--method", "baseline", "--set", "train.steps=4", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("architecture", ["AutoModelForCausalLM", "GPT2LMHeadModel"])
def test_a_model_directory_never_runs_its_own_code(tmp_path, monkeypatch, capsys, architecture):
    marker = tmp_path / "touched"
    evil = plant_remote_code(tmp_path / "evil", marker, architecture)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 1000))  # `yes |`: every prompt would be answered y
    with pytest.raises(CheckpointError, match="auto_map"):
        load_model(evil)
    commands = [["check", str(evil)],
                ["map", "coalesce", "--src", str(evil), "--out", str(tmp_path / "small"), "--halving"],
                ["map", "interpolate", "--src", str(evil), "--with", str(evil), "--out", str(tmp_path / "mix"),
                 "--alpha", "0.5"],
                ["similarity", "--model", str(evil), "--data", SMOKE, "--out", str(tmp_path / "sim")]]
    for argv in commands:
        assert main(argv) == 2, argv
        line = one_error(capsys)
        assert str(evil) in line and "auto_map" in line, (argv, line)
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil"]  # no command wrote anything


def test_only_the_family_tables_classes_are_built(tmp_path):
    model = save_model(FACTORIES["gpt2"](), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    for archs in (["GPT2ForSequenceClassification"], ["AutoModel"], [], ["GPT2LMHeadModel", "BertForMaskedLM"]):
        (model / "config.json").write_text(json.dumps({**config, "architectures": archs}))
        with pytest.raises(CheckpointError, match="not one of the supported classes"):
            load_model(model)


def test_downstream_and_resume_refuse_planted_code(finished_bert, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "touched"
    run = tmp_path / "run"
    shutil.copytree(finished_bert, run, ignore=shutil.ignore_patterns(".lock"))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 1000))
    shutil.rmtree(run / "final_model")
    plant_remote_code(run / "final_model", marker, "AutoModelForMaskedLM")
    assert main(["downstream", str(run)]) == 2
    assert "auto_map" in one_error(capsys)
    # Resume reads each finished phase's checkpointed model.
    (run / "summary.json").unlink()
    phase_model = next((run / "checkpoints").glob("*/model"))
    shutil.rmtree(phase_model)
    plant_remote_code(phase_model, marker, "AutoModelForMaskedLM")
    assert main(["run", BERT_SMOKE, "--method", "baseline", "--set", "train.steps=4", "--out", str(run),
                 "--resume"]) == 2
    assert "auto_map" in one_error(capsys)
    assert not marker.exists() and not (run / "downstream.json").exists()


def test_downstream_refuses_a_config_that_disagrees_with_its_weights(finished_bert, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_bert, run, ignore=shutil.ignore_patterns(".lock", "checkpoints"))
    config = json.loads((run / "final_model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    (run / "final_model" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert main(["downstream", str(run)]) == 2
    assert "disagree" in one_error(capsys) and not (run / "downstream.json").exists()


def test_a_replace_killed_between_its_renames_is_found_by_readers(tmp_path):
    model = save_model(FACTORIES["gpt2"](), tmp_path / "m")
    dead = 2**22 + 12345  # above the default pid_max: no live process has it
    old = tmp_path / f".m.old-{dead}"
    os.replace(model, old)  # the state a kill between the two renames of atomic_dir leaves
    assert load_model(model).config.n_layer == 4 and model.is_dir() and not old.exists()


# ----------------------------------------------------------------------------- --overwrite deletes only runs
def untimed(run_dir):
    return [{k: v for k, v in r.items() if k not in ("wall", "seconds")} for r in read_metrics(run_dir)]


def users_folder(path: Path) -> dict:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "data").mkdir()
    (path / "data" / "a.csv").write_text("1,2\n")
    return snapshot(path)


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def fake_run(path: Path, **extra_files: str) -> Path:
    path.mkdir(parents=True)
    (path / "provenance.json").write_text(json.dumps({"config": {}, "seed": 0, "git_commit": "x"}))
    (path / "metrics.jsonl").write_text("{}\n")
    for name, text in extra_files.items():
        (path / name).write_text(text)
    return path


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    mine = tmp_path / "work"
    before = users_folder(mine)
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(mine), "--overwrite"]) == 2
    line = one_error(capsys)
    assert "--overwrite refuses" in line and str(mine) in line and "not a run directory" in line
    assert snapshot(mine) == before
    # A run directory with a file of the user's in it: not classified, so not deleted.
    run = fake_run(tmp_path / "run", **{"notes.txt": "mine"})
    with pytest.raises(OverwriteRefused, match="notes.txt, which a run directory never writes"):
        check_overwrite(run, RUN)
    # provenance.json that is not ours
    (run / "notes.txt").unlink()
    (run / "provenance.json").write_text('{"author": "me"}')
    with pytest.raises(OverwriteRefused, match="provenance.json lacks"):
        check_overwrite(run, RUN)


def test_overwrite_refuses_a_tree_with_a_git_checkout_below(tmp_path):
    run = fake_run(tmp_path / "run")
    nested = run / "checkpoints" / "clone"
    nested.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(nested)], check=True)
    with pytest.raises(OverwriteRefused, match="a git checkout"):
        check_overwrite(run, RUN)
    assert (nested / ".git").is_dir()


def test_overwrite_fails_closed_when_git_cannot_answer(tmp_path, monkeypatch, capsys):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".git").write_text("gitdir: /nonexistent/worktree\n")  # git refuses to read this repository
    run = fake_run(checkout / "runs" / "gpt2_smoke" / "baseline-seed0")
    before = snapshot(run)
    with pytest.raises(OverwriteRefused, match="git could not say"):
        check_overwrite(run, RUN)
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))  # git not installed at all
    with pytest.raises(OverwriteRefused, match="git could not be asked"):
        check_overwrite(run, RUN)
    monkeypatch.undo()
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(run), "--overwrite"]) == 2
    assert "git could not say" in one_error(capsys)
    assert snapshot(run) == before


def test_overwrite_spares_tracked_files_of_a_marked_run(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    run = fake_run(tmp_path / "results" / "x" / "baseline-seed0")
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    with pytest.raises(OverwriteRefused, match="2 file\\(s\\) git tracks"):
        check_overwrite(run, RUN)
    subprocess.run(["git", "-C", str(tmp_path), "rm", "-q", "--cached", "-r", "results"], check=True)
    check_overwrite(run, RUN)  # a run of ours, nothing tracked: may go


def test_overwrite_of_a_real_run_starts_it_over(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--method", "baseline", SMOKE, "--set", "train.steps=2", "--set", "vcycle=null", "--out", str(out)]
    assert main(argv) == 0
    rows = untimed(out)
    (out / "metrics.jsonl").write_text("")
    assert main([*argv, "--overwrite"]) == 0
    assert untimed(out) == rows and len(rows) > 2


def test_resume_continues_only_a_run(tmp_path, capsys):
    mine = tmp_path / "work"
    before = users_folder(mine)
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(mine), "--resume"]) == 2
    line = one_error(capsys)
    assert "--resume refuses" in line and "not a run directory" in line
    assert snapshot(mine) == before
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(tmp_path / "new"), "--resume", "--overwrite"]) == 2
    assert "give one of them" in one_error(capsys)
    started = tmp_path / "started"  # killed before its provenance was written: still a run
    (started / "checkpoints").mkdir(parents=True)
    (started / ".lock").write_text("")
    check_is_run(started)


@pytest.mark.parametrize("command", ["map", "new", "similarity"])
def test_model_and_report_outputs_are_replaced_only_when_ours(tmp_path, capsys, command):
    src = tmp_path / "src"  # fits gpt2_smoke's data (the similarity probe)
    assert main(["new", "gpt2", "--out", str(src), "--layers", "2", "--heads", "2", "--hidden", "16",
                 "--set", "vocab_size=512", "--set", "n_positions=32"]) == 0
    mine = tmp_path / "work"
    before = users_folder(mine)
    argv = {"map": ["map", "coalesce", "--src", str(src), "--halving"],
            "new": ["new", "gpt2", "--layers", "1", "--heads", "2", "--hidden", "8", "--set", "vocab_size=50"],
            "similarity": ["similarity", "--model", str(src), "--data", SMOKE, "--examples", "2"]}[command]
    assert main([*argv, "--out", str(mine), "--overwrite"]) == 2
    assert "--overwrite refuses" in one_error(capsys)
    assert snapshot(mine) == before
    out = tmp_path / "ours"
    assert main([*argv, "--out", str(out)]) == 0
    assert main([*argv, "--out", str(out)]) == 2
    assert "already exists" in one_error(capsys)
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0


def test_model_kind_classifies_saved_models(tmp_path):
    check_overwrite(save_model(FACTORIES["gpt2"](), tmp_path / "m"), MODEL)
    check_overwrite(save_model(FACTORIES["vit"](), tmp_path / "v"), MODEL)
    check_overwrite(tmp_path / "absent", MODEL)  # nothing there: nothing to delete


# ----------------------------------------------------------------------------- no comparison of unlike runs
def with_finals(*runs):
    """What collect reads of a finished run's summary beside its metrics."""
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        summary.update(final_full_val={"val_loss": 2.0}, final_test={"test_loss": 2.0})
        (run / "summary.json").write_text(json.dumps(summary))
    return runs


ROWS = [{"phase": "baseline", "step": 1, "val_loss": 3.0, "flops": 1.0, "wall": 1.0},
        {"phase": "baseline", "step": 2, "val_loss": 2.0, "flops": 2.0, "wall": 2.0}]


@pytest.mark.parametrize("change, named", [
    (lambda c, s: c["data"].update(vocab_size=256), "data.vocab_size (512 vs 256)"),
    (lambda c, s: c["data"].update(corpus=["bbc"]), "data.corpus"),
    (lambda c, s: c["model"].update(family="llama"), "model.family"),
    (lambda c, s: c["model"]["options"].update(resid_pdrop=0.1), "model.options.resid_pdrop"),
    (lambda c, s: c.update(task="masked_lm"), "task"),
    (lambda c, s: c["data"].update(val_fraction=0.2), "data.val_fraction"),
    (lambda c, s: s.update(data={"source": "bible", "documents": 10}), "data as trained"),
])
def test_compare_refuses_runs_that_measure_different_things(tmp_path, capsys, change, named):
    import yaml

    from mlresearch.study import collect
    from mlresearch.training.compare import CompareError, compare_runs
    from conftest import write_run

    base = write_run(tmp_path / "x" / "baseline-seed0", ROWS, kind="baseline")
    method = write_run(tmp_path / "x" / "vcycle-seed0", [dict(r, phase="up1") for r in ROWS], kind="vcycle")
    with_finals(base, method)
    compare_runs(base, method)  # alike: compared
    config, summary = yaml.safe_load((method / "config.yaml").read_text()), json.loads((method / "summary.json").read_text())
    if named == "data.val_fraction":
        config["data"].pop("val_fraction", None)  # written before the key existed: it had its default ...
        (method / "config.yaml").write_text(yaml.safe_dump(config))
        compare_runs(base, method)
    change(config, summary)
    (method / "config.yaml").write_text(yaml.safe_dump(config))
    (method / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(CompareError, match="measure different things: they differ in " + named.replace("(", r"\(")
                       .replace(")", r"\)")):
        compare_runs(base, method)
    assert main(["compare", str(base), str(method)]) == 2
    assert named.split(" ")[0] in one_error(capsys)
    with pytest.raises(CompareError, match="measure different things"):
        collect(tmp_path)  # the tables read pairs through the same check


def test_non_finite_losses_are_an_error_in_compare_and_a_marked_cell_in_tables(tmp_path, capsys):
    from conftest import write_run

    from mlresearch.study import collect, markdown, variants
    from mlresearch.training.compare import NonFiniteLoss, compare_runs

    base = write_run(tmp_path / "x" / "baseline-seed0", ROWS, kind="baseline")
    method = write_run(tmp_path / "x" / "vcycle-seed0", [dict(ROWS[0], phase="up1"),
                                                         dict(ROWS[1], phase="up1", val_loss=float("nan"))],
                       kind="vcycle")
    with pytest.raises(NonFiniteLoss, match="validation loss nan at up1 step 2"):
        compare_runs(base, method)
    assert main(["compare", str(base), str(method)]) == 2 and "nan" in one_error(capsys)
    with_finals(base, method)
    with pytest.warns(UserWarning, match="validation loss nan"):
        runs = collect(tmp_path)
    assert len(runs) == 1 and not runs.reached.iloc[0]
    assert "NaN/inf loss: 1 seed left out" in markdown(variants(runs))


def test_committed_runs_record_the_corpora_they_trained_on():
    import yaml

    checked = 0
    for summary in sorted((REPO / "results").glob("*/*/summary.json")):
        data = json.loads(summary.read_text()).get("data") or {}
        config = summary.parent / "config.yaml"
        source = data.get("source", "")
        if not config.exists() or "documents" not in data or source.startswith("local:"):
            continue  # image sets, paper-scale local data
        corpus = yaml.safe_load(config.read_text())["data"]["corpus"]
        assert "+".join(corpus) == source.split("+first")[0], summary.parent
        checked += 1
    assert checked > 100


def test_the_recorded_commit_is_dirty_for_changed_code_not_for_rewritten_results(tmp_path, monkeypatch):
    """A study rewrites ``results/tables/`` in the checkout it runs from; its records must still name
    a clean commit, while an edited source file marks it ``+dirty``."""
    import mlresearch.results as results

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    (tmp_path / "results" / "tables").mkdir(parents=True)
    (tmp_path / "results" / "tables" / "frontier.csv").write_text("run,loss\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    monkeypatch.setattr(results, "REPO", tmp_path)
    sha = git("rev-parse", "HEAD")
    (tmp_path / "results" / "tables" / "frontier.csv").write_text("run,loss\nbaseline,1.0\n")
    (tmp_path / "results" / "new_run").mkdir()
    assert results.git_commit() == sha
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.git_commit() == sha + "+dirty"


def test_a_run_records_the_data_it_loaded(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--method", "baseline", SMOKE, "--set", "train.steps=2", "--set", "vcycle=null", "--out", str(out)]) == 0
    recorded = json.loads((out / "provenance.json").read_text())["data"]
    assert recorded == json.loads((out / "summary.json").read_text())["data"] and recorded["source"] == "bible+first60"


# ----------------------------------------------------------------------------- validation before any write
def test_a_number_in_exponent_form_is_a_number_in_configs_and_overrides():
    """PyYAML (YAML 1.1) reads "1e-4" as a string, so `--set train.lr=1e-4` (and a study's LR check
    at 1e-6) was refused as "must be a number"; it is the float YAML 1.2 reads. A string stays a string."""
    from mlresearch.checkpoint import parse_yaml
    from mlresearch.training.config import load_config

    assert parse_yaml("a: 1e-4\nb: -2E+3\nc: 1.5e-2\nd: '1e-4'\ne: 1e\nf: 10\n") == \
        {"a": 1e-4, "b": -2000.0, "c": 0.015, "d": "1e-4", "e": "1e", "f": 10}
    assert load_config(SMOKE, ["train.lr=1e-4"]).train.lr == 1e-4


def test_a_key_given_twice_is_refused_in_every_file_we_read(tmp_path, capsys):
    from mlresearch.checkpoint import parse_json, parse_yaml
    from mlresearch.operators import Scheme
    from mlresearch.operators.scheme import SchemeError
    from mlresearch.study_runner import StudyError, load_study
    from mlresearch.training.config import ConfigError, load_config

    assert parse_yaml("a: 1\nb: {c: 2}\n") == {"a": 1, "b": {"c": 2}} and parse_json('{"a": [1]}') == {"a": [1]}
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.yaml"  # a YAML tag that would call a function when loaded unsafely
    hostile.write_text(f"seed: !!python/object/apply:os.system ['touch {marker}']\n")  # yaml.unsafe_load runs it
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(hostile)
    assert not marker.exists()
    config = tmp_path / "twice.yaml"
    config.write_text(Path(SMOKE).read_text() + "seed: 3\n")  # the preset already says seed: 0
    with pytest.raises(ConfigError, match="'seed' appears twice"):
        load_config(config)
    nested = tmp_path / "nested.yaml"
    nested.write_text(Path(SMOKE).read_text().replace("steps: 12,", "steps: 12, steps: 5,"))
    with pytest.raises(ConfigError, match="'steps' appears twice"):
        load_config(nested)
    with pytest.raises(ConfigError, match="'a' appears twice"):
        load_config(SMOKE, ["model.options={a: 1, a: 2}"])
    spec = tmp_path / "study.yaml"
    spec.write_text(f"config: {SMOKE}\nseeds: [0]\nruns: {{}}\nseeds: [1]\n")
    with pytest.raises(StudyError, match="'seeds' appears twice"):
        load_study(spec)
    scheme = tmp_path / "scheme.json"
    scheme.write_text('{"width_scheme": [[0, 1]], "width_scheme": [[0, 2]]}')
    with pytest.raises(SchemeError, match="'width_scheme' appears twice"):
        Scheme.from_json(scheme)
    out = tmp_path / "run"
    assert main(["run", "--method", "baseline", str(config), "--out", str(out)]) == 2
    assert "twice.yaml" in one_error(capsys) and not out.exists()


@pytest.mark.parametrize("setting, message", [
    ("model.options={n_layer: 3}", r"model.options for gpt2: \['n_layer'\] set the model's size"),
    ("model.options={n_embd: 64}", r"\['n_embd'\] set the model's size"),
    ("model.options={resid_pdropp: 0.1}", r"GPT2Config has no \['resid_pdropp'\]"),
    ("model.options={activation_function: nope}", "cannot be built"),
    ("train.compile=no_such_backend", "torch.compile has no backend 'no_such_backend'"),
])
def test_model_options_and_backends_are_checked_before_the_run_directory_exists(tmp_path, capsys, setting, message):
    import re

    out = tmp_path / "run"
    assert main(["run", "--method", "baseline", SMOKE, "--set", setting, "--set", "vcycle=null", "--out", str(out)]) == 2
    assert re.search(message, one_error(capsys)) and not out.exists()


def test_vit_options_are_checked_against_timms_constructor(tmp_path, capsys):
    from mlresearch.training.config import ConfigError, load_config

    deit = str(REPO / "experiments" / "configs" / "deit_smoke.yaml")
    with pytest.raises(ConfigError, match=r"takes no \['patch_sise'\]"):
        load_config(deit, ["model.options={patch_sise: 4}"])
    with pytest.raises(ConfigError, match=r"\['depth'\] set the model's size"):
        load_config(deit, ["model.options={depth: 3}"])


@pytest.mark.parametrize("flags, message", [
    (["--layers", "-1", "--heads", "2", "--hidden", "8"], "model.layers must be"),
    (["--layers", "1", "--heads", "4", "--kv-heads", "3", "--hidden", "16"], "not divisible by model.kv_heads 3"),
    (["--layers", "1", "--heads", "3", "--hidden", "16"], "not divisible by model.heads 3"),
    (["--layers", "1", "--heads", "2", "--hidden", "8", "--set", "n_layer=4"], "set the model's size"),
])
def test_new_follows_the_same_rules_as_run(tmp_path, capsys, flags, message):
    out = tmp_path / "m"
    assert main(["new", "llama" if "--kv-heads" in flags else "gpt2", "--out", str(out), *flags]) == 2
    assert message in one_error(capsys) and not out.exists()


@pytest.fixture
def local_corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    (folder / "a.txt").write_text("\n".join(" ".join(words[(i + j) % 8] for j in range(40)) for i in range(60)) + "\n")
    return ["--set", f"data.path={folder}", "--set", "data.vocab_size=300", "--set", "vcycle=null"]


def test_prepared_data_is_checked_and_never_created_by_a_run(tmp_path, capsys, local_corpus):
    prepared, out = tmp_path / "prepared", tmp_path / "run"
    run = ["run", "--method", "baseline", SMOKE, *local_corpus, "--set", "train.steps=2", "--set", f"data.prepared_dir={prepared}",
           "--out", str(out)]
    assert main(run) == 2  # a data.prepared_dir that holds nothing is not silently created
    assert "holds no prepared data" in one_error(capsys) and not prepared.exists() and not out.exists()
    file = tmp_path / "a-file"
    file.write_text("mine")
    assert main(["data", "prepare", SMOKE, *local_corpus, "--out", str(file)]) == 2
    assert "a file" in one_error(capsys) and file.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "corpus"]  # no temporary left
    assert main(["data", "prepare", SMOKE, *local_corpus, "--out", str(prepared)]) == 0
    index = json.loads((prepared / "index.json").read_text())
    assert all(len(s["sha256"]) == 64 for s in index["splits"].values())
    capsys.readouterr()
    train = prepared / "train.bin"
    good = train.read_bytes()
    for damage, message in ((good[:-2], "should hold"), (bytes([good[0] ^ 1]) + good[1:], "checksum"),
                            (good, None)):
        train.write_bytes(damage)
        if message is None:  # restored: it trains
            assert main(run) == 0
            break
        assert main(run) == 2
        line = one_error(capsys)
        assert "is damaged" in line and "train.bin" in line and message in line and not out.exists()
    vocab = index["vocab_size"]
    index["vocab_size"] = vocab + 1
    (prepared / "index.json").write_text(json.dumps(index))
    assert main([*run[:-2], "--out", str(tmp_path / "run2")]) == 2
    assert f"tokenizer.json has {vocab} tokens, index.json says {vocab + 1}" in one_error(capsys)


def test_table_refuses_a_results_folder_that_does_not_exist(tmp_path, capsys):
    assert main(["table", "--results", str(tmp_path / "reslts")]) == 2
    assert "reslts" in one_error(capsys) and not (tmp_path / "reslts").exists()


def test_an_over_long_name_leaves_no_parents(tmp_path, capsys):
    out = tmp_path / "a" / "b" / ("x" * 250)
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(out)]) == 2
    assert "longer than" in one_error(capsys) and not (tmp_path / "a").exists()
    assert main(["new", "gpt2", "--layers", "1", "--heads", "2", "--hidden", "8", "--out", str(out)]) == 2
    assert "longer than" in one_error(capsys) and not (tmp_path / "a").exists()


def test_two_spec_runs_that_would_share_a_directory_are_refused(tmp_path):
    import yaml

    from mlresearch.study_runner import Study, StudyError

    spec = {"config": SMOKE, "root": str(tmp_path / "runs"), "seeds": [0],
            "runs": {"paper": {"method": "vcycle"}, "paper-1thread": {"method": "vcycle", "set": ["train.threads=1"]}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(StudyError, match="runs 'paper' and 'paper-1thread' would share the directory"):
        Study(tmp_path / "s.yaml")
    spec["runs"]["paper-1thread"]["set"].append("vcycle.tag=t1")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    Study(tmp_path / "s.yaml", dry_run=True)
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- every message names input and cause
def test_zero_factors_and_counts_are_named(tmp_path, capsys):
    from mlresearch.operators import Scheme
    from mlresearch.operators.scheme import SchemeError

    src = save_model(FACTORIES["gpt2"](), tmp_path / "m")
    for argv in (["check", str(src), "--factor", "0"],
                 ["similarity", "--model", str(src), "--data", SMOKE, "--examples", "0", "--out", str(tmp_path / "s")]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "expected a whole number >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SchemeError, match="width_factor must be a whole number >= 1"):
        Scheme.uniform(heads=4, layers=4, width_factor=0)
    assert main(["new", "vit", "--out", str(tmp_path / "v"), "--layers", "1", "--heads", "2", "--hidden", "8",
                 "--set", "patch_size=0"]) == 2
    line = one_error(capsys)
    assert "cannot build it with --set {'patch_size': 0}" in line and "ZeroDivisionError" in line


def test_an_empty_metrics_file_is_named(tmp_path, capsys):
    from conftest import write_run

    base = write_run(tmp_path / "b", ROWS, kind="baseline")
    method = write_run(tmp_path / "v", [], kind="vcycle")
    assert main(["compare", str(base), str(method)]) == 2
    assert f"{method}/metrics.jsonl has no validation rows" in one_error(capsys)
    assert main(["compare", str(write_run(tmp_path / "b0", [], kind="baseline")), str(method)]) == 2
    assert "b0/metrics.jsonl has no validation rows" in one_error(capsys)


def test_weights_damaged_on_disk_are_reported_as_damaged(tmp_path, capsys):
    model = save_model(FACTORIES["gpt2"](), tmp_path / "m")
    assert (model / "model.safetensors.sha256").read_text().strip() == __import__("hashlib").sha256(
        (model / "model.safetensors").read_bytes()).hexdigest()
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-3] ^= 0xFF  # one flipped byte inside a tensor: still a readable safetensors file
    (model / "model.safetensors").write_bytes(bytes(weights))
    for argv in (["check", str(model)], ["map", "coalesce", "--src", str(model), "--out", str(tmp_path / "o"),
                                         "--halving"]):
        assert main(argv) == 2
        line = one_error(capsys)
        assert "is damaged" in line and "checksum" in line and "NOT HELD" not in line
    assert not (tmp_path / "o").exists()


def test_a_full_disk_names_the_file_says_nothing_was_lost_and_how_to_resume(tmp_path, monkeypatch, capsys):
    import safetensors
    import transformers.modeling_utils

    out = tmp_path / "run"
    argv = ["run", "--method", "baseline", SMOKE, "--set", "train.steps=2", "--set", "vcycle=null", "--out", str(out)]

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    assert main(argv) == 2
    line = one_error(capsys)
    assert "no space left on the device while writing" in line and "model.safetensors" in line
    assert "nothing already written was lost" in line and "--resume" in line
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert (out / "summary.json").exists() and not list(out.rglob(".*.tmp-*"))


@pytest.mark.parametrize("text, message", [
    ("seeds: 0\nruns: {}", "seeds must be a non-empty list of seeds"),
    ("seeds: [0]\nvariant_seeds: [-1]\nruns: {}", "variant_seeds must be a non-empty list"),
    ("seeds: [0]\nruns: []", "runs must be a mapping of run names"),
    ("seeds: [0]\nruns: {a: {method: vcycle, set: train.steps=3}}", "run 'a': set must be a list of key=value"),
    ("seeds: [0]\nruns: {}\ntuning: [0.1]", "tuning must be a mapping"),
    ("seeds: [0]\nruns: {}\nbest: [a]", "best must be a mapping"),
])
def test_a_malformed_study_spec_names_the_key(tmp_path, text, message):
    from mlresearch.study_runner import StudyError, load_study

    (tmp_path / "s.yaml").write_text(f"config: gpt2_smoke\n{text}\n")
    with pytest.raises(StudyError, match=message):
        load_study(tmp_path / "s.yaml")


def test_bad_seeds_and_a_model_that_cannot_read_the_probe_are_named(tmp_path, capsys):
    assert main(["run", "--method", "baseline", SMOKE, "--set", "seed=-1", "--out", str(tmp_path / "r")]) == 2
    assert "seed must be a non-negative integer" in one_error(capsys)
    small_vocab = save_model(FACTORIES["gpt2"](), tmp_path / "m")  # 97 tokens; the smoke tokenizer has 512
    assert main(["similarity", "--model", str(small_vocab), "--data", SMOKE, "--out", str(tmp_path / "s")]) == 2
    assert "has a vocabulary of 97 tokens" in one_error(capsys) and not (tmp_path / "s").exists()
    vit = tmp_path / "v"  # 8x8 images; deit_smoke's probe is 28x28
    assert main(["new", "vit", "--out", str(vit), "--layers", "1", "--heads", "2", "--hidden", "8",
                 "--set", "img_size=8", "--set", "patch_size=2", "--set", "in_chans=1"]) == 0
    deit = str(REPO / "experiments" / "configs" / "deit_smoke.yaml")
    assert main(["similarity", "--model", str(vit), "--data", deit, "--out", str(tmp_path / "s")]) == 2
    line = one_error(capsys)
    assert "cannot read --data" in line and "doesn't match model (8)" in line and "internal error" not in line
    with pytest.raises(SystemExit):
        main(["data", "prepare", SMOKE, "--num-proc", "0"])
    assert "argument --num-proc: expected a whole number >= 1" in capsys.readouterr().err


def test_damaged_run_records_are_named(tmp_path, capsys):
    from conftest import write_run

    base = write_run(tmp_path / "e" / "baseline-seed0", ROWS + [{"phase": "baseline", "val_loss": "x", "flops": 3.0}],
                     kind="baseline")
    method = write_run(tmp_path / "e" / "vcycle-seed0", [dict(r, phase="up1") for r in ROWS], kind="vcycle")
    assert main(["compare", str(base), str(method)]) == 2
    assert "baseline-seed0/metrics.jsonl: validation loss 'x'" in one_error(capsys)
    (method / "summary.json").write_text("{")
    assert main(["table", "--results", str(tmp_path)]) == 2
    assert "run summary" in (line := one_error(capsys)) and "vcycle-seed0/summary.json is not valid JSON" in line
    (base / "config.yaml").write_text("x: [")
    assert main(["run", "--method", "baseline", SMOKE, "--out", str(base), "--resume"]) == 2
    assert "baseline-seed0/config.yaml is not valid YAML" in one_error(capsys)


def test_downstream_flags_are_checked(tmp_path, capsys):
    from mlresearch.downstream import DownstreamConfig

    for flag, value in (("--finetune-steps", "0"), ("--finetune-lr", "-1"), ("--finetune-lr", "nan")):
        with pytest.raises(SystemExit):
            main(["downstream", str(tmp_path), flag, value])
        assert f"argument {flag}: expected" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--finetune-steps 10 must exceed the fine-tuning warm-up of 15"):
        DownstreamConfig(finetune_steps=10)
