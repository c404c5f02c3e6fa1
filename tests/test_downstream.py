"""Downstream checks, run-directory guards and the accuracy target of the comparison."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from conftest import smoke, write_run

from mlresearch.checkpoint import load_model
from mlresearch.data import corpora
from mlresearch.data.datasets import text_split
from mlresearch.data.text import DataError
from mlresearch.downstream import DownstreamConfig, bbc_topic_accuracy, evaluate_run, zero_shot_perplexity
from mlresearch.training.compare import compare_runs
from mlresearch.training.config import ConfigError
from mlresearch.training.run import default_out, run_method

pytestmark = pytest.mark.usefixtures("isolated_data_cache")


@pytest.fixture(scope="module")
def gpt2_run(isolated_data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "gpt2"
    run_method(smoke("gpt2"), "baseline", out)
    return out


def test_zero_shot_perplexity_equals_the_models_own_loss(gpt2_run):
    dc = DownstreamConfig(text="bbc", ppl_blocks=6)
    r = zero_shot_perplexity(gpt2_run, dc)
    # Independent: the same evenly spaced blocks through the HF model's own loss.
    cfg = smoke("gpt2")
    ts = text_split(cfg.task, asdict(cfg.data), cfg.seed)
    ids = []
    for enc in ts.tokenizer.encode_batch(list(corpora.bbc_news()[0]), add_special_tokens=False):
        ids += enc.ids + [ts.special["eos"]]
    seq = cfg.data.seq_len
    n = len(ids) // seq
    picks = np.unique(np.linspace(0, n - 1, 6).round().astype(int))
    model = load_model(gpt2_run / "final_model").eval()
    with torch.no_grad():
        losses = [model(input_ids=torch.tensor([ids[p * seq:(p + 1) * seq]]),
                        labels=torch.tensor([ids[p * seq:(p + 1) * seq]])).loss.item() for p in picks]
    assert r["tokens"] == len(picks) * (seq - 1)
    assert r["nll_per_token"] == pytest.approx(float(np.mean(losses)), rel=1e-5)
    assert r["perplexity"] == pytest.approx(np.exp(np.mean(losses)), rel=1e-5)


def test_zero_shot_text_must_be_unseen(gpt2_run):
    with pytest.raises(DataError, match="trained on 'bible'"):
        zero_shot_perplexity(gpt2_run, DownstreamConfig(text="bible"))


def test_bbc_fine_tuning_classifies_only_articles_held_out_of_pretraining(tmp_path):
    cfg = smoke("bert")
    run_method(cfg, "baseline", tmp_path / "bert")
    dc = DownstreamConfig(finetune_steps=4, finetune_batch=8, finetune_warmup=2, threads=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r1 = evaluate_run(tmp_path / "bert", dc)
        assert torch.get_num_threads() == 1  # the check ran on dc.threads, then put the caller's setting back
    finally:
        torch.set_num_threads(before)
    ts = text_split(cfg.task, asdict(cfg.data), cfg.seed)
    assert r1["held_out_articles"] == len(ts.val) + len(ts.test) and r1["train_articles"] == len(ts.train)
    assert set(ts.train).isdisjoint(set(ts.val) | set(ts.test))
    assert (r1["accuracy"] * r1["held_out_articles"]) == pytest.approx(round(r1["accuracy"] * r1["held_out_articles"]))
    saved = json.loads((tmp_path / "bert" / "downstream.json").read_text())
    assert saved["accuracy"] == r1["accuracy"] and saved["provenance"]["config"]["finetune_steps"] == 4
    assert bbc_topic_accuracy(tmp_path / "bert", dc)["accuracy"] == r1["accuracy"]  # seeded: reproducible
    sel = bbc_topic_accuracy(tmp_path / "bert", dc, select=True)  # recipe choice: training articles only
    assert sel["held_out_articles"] == len(ts.train) // 10
    assert sel["train_articles"] + sel["held_out_articles"] == len(ts.train)


def test_an_image_run_gets_its_test_top1_and_a_linear_probe_on_a_set_it_never_saw(tmp_path):
    # deit_smoke trains on MNIST: its transfer set is the next one named, glyphs.
    run_method(smoke("deit", "vcycle=null"), "baseline", tmp_path / "vit")
    dc = DownstreamConfig(transfer_images=600)
    result = evaluate_run(tmp_path / "vit", dc)
    summary = json.loads((tmp_path / "vit" / "summary.json").read_text())
    assert result["accuracy"] == summary["final_test"]["test_acc"] and result["transfer"] == "glyphs"
    assert (result["transfer_train_images"], result["transfer_test_images"]) == (480, 120)
    # Recomputed independently: timm's own classifier-free forward gives the features, probed on the
    # same seeded split (glyph i depends only on i, so the 600 images are the set's first 600).
    from mlresearch.data import glyphs
    from mlresearch.data.text import split_indices
    from mlresearch.downstream import probe_accuracy

    x, y = glyphs.glyphs(600)
    model = load_model(tmp_path / "vit" / "final_model").eval()
    model.reset_classifier(0)
    with torch.no_grad():
        features = model(torch.from_numpy(x)).double().numpy()
    train, _, test, _ = split_indices(600, dc.seed, 0.0, 0.2)
    assert set(train).isdisjoint(test) and len(set(train) | set(test)) == 600
    assert result["transfer_accuracy"] == probe_accuracy((features[train], y[train]), (features[test], y[test]))
    assert 0.0 < result["transfer_pixels_accuracy"] <= 1.0
    assert json.loads((tmp_path / "vit" / "downstream.json").read_text())["transfer_accuracy"] == result["transfer_accuracy"]
    # A run that trained on every set named has nothing to transfer to: one line, nothing written.
    (tmp_path / "vit" / "downstream.json").unlink()
    with pytest.raises(DataError, match=r"^no transfer set: the run trained on mnist, the only one of \['mnist'\]$"):
        evaluate_run(tmp_path / "vit", DownstreamConfig(transfer=("mnist",)))
    assert not (tmp_path / "vit" / "downstream.json").exists()


def test_probe_features_meet_the_model_at_its_input_side_and_channels():
    # A 32-pixel RGB ViT (as deit_fractals' colour variant) probed on 28-pixel grey images: the grey
    # image is the same picture in every channel, and the resize is the one a user would do first.
    from timm.models.vision_transformer import VisionTransformer

    from mlresearch.downstream import image_features

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, in_chans=3, num_classes=5, embed_dim=16, depth=1,
                              num_heads=2).eval()
    grey = torch.rand(6, 1, 28, 28)
    resized = torch.nn.functional.interpolate(grey, size=(32, 32), mode="bilinear", align_corners=False)
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(resized.expand(-1, 3, -1, -1)), pre_logits=True)
    assert np.allclose(image_features(model, grey, batch=4), expected.double().numpy(), atol=1e-6)


def test_downstream_noise_refits_with_the_recorded_recipe_and_resumes(tmp_path, monkeypatch, capsys):
    """experiments/downstream_noise.py: seed 0 is the run's own downstream.json, other seeds differ
    only in the fine-tuning seed, and a rerun refits nothing."""
    import importlib.util
    import sys

    import pandas as pd

    from mlresearch.results import REPO

    spec = importlib.util.spec_from_file_location("downstream_noise", REPO / "experiments" / "downstream_noise.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run, out = tmp_path / "bert", tmp_path / "noise.csv"
    run_method(smoke("bert"), "baseline", run)
    monkeypatch.setattr(sys, "argv", ["downstream_noise.py", str(run), "--seeds", "2", "--out", str(out)])
    with pytest.raises(SystemExit, match="no downstream.json"):
        script.main()
    assert not out.exists()  # refused before anything was written
    dc = DownstreamConfig(finetune_steps=4, finetune_batch=8, finetune_warmup=2)
    recorded = evaluate_run(run, dc)
    script.main()
    table = pd.read_csv(out)
    assert list(table.finetune_seed) == [0, 1]
    assert table.accuracy[0] == recorded["accuracy"]  # the recorded recipe (4 steps), not the default 150
    assert table.accuracy[1] == bbc_topic_accuracy(run, DownstreamConfig(**{**asdict(dc), "seed": 1}))["accuracy"]
    before = out.read_bytes()
    capsys.readouterr()
    script.main()
    assert out.read_bytes() == before and ": accuracy" not in capsys.readouterr().out  # nothing refit


def test_downstream_needs_a_finished_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        evaluate_run(tmp_path)


def test_tag_names_the_run_directory_and_bad_tags_are_refused():
    cfg = smoke("gpt2", "vcycle.tag=up270")
    assert default_out(cfg, "vcycle").name == "vcycle-L2-halving-a0.25-reset-up270-seed0"
    with pytest.raises(ConfigError, match="vcycle.tag"):
        smoke("gpt2", "vcycle.tag=a/b")


def test_resuming_with_another_config_is_refused(gpt2_run, tmp_path):
    with pytest.raises(ConfigError, match="train.lr"):
        run_method(smoke("gpt2", "train.lr=0.01"), "baseline", gpt2_run, resume=True)


def test_settings_added_after_a_run_count_as_their_defaults(tmp_path):
    import yaml

    from mlresearch.training.run import config_differences

    stored = smoke("gpt2").to_dict()
    del stored["train"]["keep_snapshots"], stored["vcycle"]["tag"]  # as written before these settings existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))
    assert config_differences(tmp_path, smoke("gpt2"), "vcycle") == []
    assert config_differences(tmp_path, smoke("gpt2", "train.keep_snapshots=true", "train.lr=0.01"), "vcycle") == \
        ["train.keep_snapshots", "train.lr"]


def test_compare_also_measures_the_accuracy_target(tmp_path):
    write_run(tmp_path / "b", kind="baseline", rows=[{"phase": "baseline", "step": s, "val_loss": v, "val_acc": a, "flops": f, "wall": f}
                           for s, v, a, f in ((1, 3.0, 0.5, 100.0), (2, 2.5, 0.7, 200.0), (3, 2.0, 0.8, 400.0))])
    write_run(tmp_path / "v", kind="vcycle", rows=[{"phase": "up1", "step": 1, "val_loss": 2.6, "val_acc": 0.81, "flops": 300.0, "wall": 3.0},
                           {"phase": "up1", "step": 2, "val_loss": 2.1, "val_acc": 0.79, "flops": 500.0, "wall": 5.0}])
    c = compare_runs(tmp_path / "b", tmp_path / "v")
    assert not c["reached"] and c["reached_acc"]
    assert c["acc_flops_saving_pct"] == pytest.approx(25.0)  # 0.81 >= 0.8 at 300 vs the baseline's 400


def test_the_classifier_is_the_familys_and_must_be_filled_by_the_saved_encoder(tmp_path):
    """The fine-tuning check loads the family's sequence classifier over the saved encoder: every
    encoder weight filled (only the head and pooler fresh), one the file lacks is refused by name;
    a family with no classifier says so."""
    from safetensors.torch import load_file, save_file

    from mlresearch.errors import CheckpointError, UnsupportedModelError
    from mlresearch.families import family_of
    from models import tiny_bert, tiny_gpt2

    bert = tiny_bert(layers=2)
    family = family_of(bert)
    family.save(bert, tmp_path / "bert")
    classifier = family.load_classifier(tmp_path / "bert", num_labels=5)
    assert torch.equal(classifier.bert.encoder.layer[1].output.dense.weight, bert.bert.encoder.layer[1].output.dense.weight)
    weights = load_file(tmp_path / "bert" / "model.safetensors")
    del weights["bert.encoder.layer.1.output.dense.weight"]
    save_file(weights, tmp_path / "bert" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"does not fill the classifier's encoder \(missing \['bert.encoder.layer.1"):
        family.load_classifier(tmp_path / "bert", num_labels=5)
    gpt2 = tiny_gpt2(layers=1)
    family_of(gpt2).save(gpt2, tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="family 'gpt2' has no sequence classifier"):
        family_of(gpt2).load_classifier(tmp_path / "gpt2", num_labels=5)


def test_every_task_names_a_downstream_check_that_exists():
    """A task's check is a fact of the task (tasks.Downstream), found in downstream.CHECKS by name."""
    from mlresearch.downstream import CHECKS
    from mlresearch.tasks import TASKS

    for task in TASKS.values():
        assert task.downstream.check in CHECKS, task.name
    assert {t.downstream.check for t in TASKS.values()} == set(CHECKS)  # and no check without a task
