"""Prepared data: token files equal an in-memory tokenization, reads keep no mapping, a corpus's
order is a permutation in constant memory, preparation is parallel, atomic and reusable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import smoke
from forked_cli import run_cli

from mlresearch.data import datasets as ds
from mlresearch.data.datasets import batch_indices, feistel_permutation, load_data, text_split
from mlresearch.data.prepare import open_prepared, prepare_text, prepared_dir
from mlresearch.tasks import mask_tokens

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("isolated_data_cache")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_prepared_blocks_equal_an_in_memory_tokenization(name):
    cfg = smoke(name)
    settings = asdict(cfg.data)
    data = load_data(cfg.task, settings, cfg.seed)
    ts = text_split(cfg.task, settings, cfg.seed)  # the documents, their split and the same tokenizer
    end = ts.special["eos" if cfg.task == "causal_lm" else "sep"]
    body = cfg.data.seq_len - (0 if cfg.task == "causal_lm" else 2)
    for split, docs in (("train", ts.train), ("val", ts.val), ("test", ts.test)):
        ids = [t for enc in ts.tokenizer.encode_batch([ts.docs[i] for i in docs], add_special_tokens=False)
               for t in enc.ids + [end]]
        n = len(ids) // body
        expected = np.asarray(ids[:n * body]).reshape(n, body)
        blocks = data.split(split)[0]
        got = blocks[np.arange(len(blocks))]
        if cfg.task == "masked_lm":
            assert (got[:, 0] == ts.special["cls"]).all() and (got[:, -1] == ts.special["sep"]).all()
            got = got[:, 1:-1]
        assert got.shape == expected.shape and np.array_equal(got, expected)
        assert np.array_equal(blocks[3], blocks[np.array([3])][0])  # one block or many, the same rows


def test_reading_blocks_leaves_no_mapping_behind():
    cfg = smoke("gpt2")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    path = str(data.train.path)
    data.train[np.arange(0, len(data.train), 7)]
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert path not in maps  # memory does not grow with the blocks a run has visited


@pytest.mark.parametrize("n", [2, 3, 7, 64, 1000, 4099])
def test_the_computed_permutation_is_a_bijection(n):
    for seed, epoch in ((0, 0), (1, 0), (0, 5)):
        perm = feistel_permutation(np.arange(n), n, seed, epoch)
        assert sorted(perm.tolist()) == list(range(n))
    if n >= 64:  # and it shuffles: epochs and seeds differ
        assert not np.array_equal(feistel_permutation(np.arange(n), n, 0, 0), feistel_permutation(np.arange(n), n, 0, 1))


def test_large_corpora_draw_batches_without_a_stored_permutation(monkeypatch):
    monkeypatch.setattr(ds, "PERMUTATION_TABLE_MAX", 10)
    ds._epoch_perm.cache_clear()
    n, batch = 50, 8
    drawn = np.concatenate([batch_indices(n, batch, step, seed=3) for step in range(25)])  # 4 epochs
    for epoch in range(4):
        assert sorted(drawn[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))  # every example once an epoch
    assert np.array_equal(batch_indices(n, batch, 7, 3), batch_indices(n, batch, 7, 3))  # a function of (seed, step)
    assert ds._epoch_perm.cache_info().currsize == 0


def _local_corpus(tmp_path, docs=120):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    lines = [" ".join(rng.choice(words, rng.integers(20, 80))) for _ in range(docs)]
    (folder / "a.txt").write_text("\n".join(lines[:70]) + "\n")
    (folder / "b.txt").write_text("\n".join(lines[70:]) + "\n")
    return folder


def _cli(*args):
    """``python -m mlresearch.cli ARGS`` in a process of its own (forked warm: tests/forked_cli.py)."""
    return run_cli(*args, cwd=REPO, timeout=600)


def test_prepare_command_in_parallel_equals_one_process_and_trains(tmp_path):
    corpus = _local_corpus(tmp_path)
    config = str(REPO / "experiments" / "configs" / "gpt2_smoke.yaml")
    common = ["--set", f"data.path={corpus}", "--set", "data.vocab_size=300", "--set", "vcycle=null"]
    one = _cli("data", "prepare", config, "--num-proc", "1", "--out", tmp_path / "p1", *common)
    two = _cli("data", "prepare", config, "--num-proc", "2", "--out", tmp_path / "p2", *common)
    assert one.returncode == two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert "train from it with --set data.prepared_dir=" in one.stdout
    a, b = json.loads((tmp_path / "p1" / "index.json").read_text()), json.loads((tmp_path / "p2" / "index.json").read_text())
    assert a == b and sum(s["documents"] for s in a["splits"].values()) == 120 and a["dtype"] == "uint16"
    for split in a["splits"]:
        assert (tmp_path / "p1" / f"{split}.bin").read_bytes() == (tmp_path / "p2" / f"{split}.bin").read_bytes()
    again = _cli("data", "prepare", config, "--out", tmp_path / "p1", *common)
    assert again.returncode == 0 and "already prepared" in again.stdout
    run = _cli("run", "--method", "baseline", config, "--out", tmp_path / "run", *common, "--set", f"data.prepared_dir={tmp_path / 'p2'}",
               "--set", "train.steps=4")
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["split_documents"] == [a["splits"][k]["documents"] for k in ("train", "val", "test")]


def test_a_failed_preparation_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    from mlresearch.data import prepare

    corpus = _local_corpus(tmp_path)
    cfg = {"path": str(corpus), "vocab_size": 300, "seq_len": 32}
    real, calls = prepare._write_stream, {"n": 0}

    def failing(mapped, path, dtype, batch=4096):
        calls["n"] += 1
        if calls["n"] == 2:  # the validation split: the training tokens are already on disk
            raise OSError(28, "No space left on device")
        return real(mapped, path, dtype, batch)

    monkeypatch.setattr(prepare, "_write_stream", failing)
    out = prepared_dir("causal_lm", cfg, 0)
    with pytest.raises(OSError):
        prepare_text("causal_lm", cfg, 0)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))  # nothing left, nothing finished
    monkeypatch.setattr(prepare, "_write_stream", real)
    assert prepare_text("causal_lm", cfg, 0) == out
    blocks, vocab, _, index = open_prepared(out, "causal_lm", 32)
    assert set(blocks) == {"train", "val", "test"} and vocab <= 300


def test_the_tuning_split_is_prepared_apart():
    cfg = smoke("gpt2", "data.tune_fraction=0.1")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    plain = load_data(cfg.task, asdict(smoke("gpt2").data), cfg.seed)
    assert data.info["split_documents"][:3] != plain.info["split_documents"][:3]  # train lost documents ...
    assert data.info["split_documents"][1:3] == plain.info["split_documents"][1:3]  # ... validation and test did not
    assert len(data.tune) > 0 and plain.tune is None


@pytest.mark.parametrize("mask_prob", [0.15, 0.4])
def test_masked_lm_predicts_the_configured_fraction_of_tokens(mask_prob):
    """data.mask_prob reaches the masking: the share of non-special tokens with a label is within
    4 binomial standard deviations of it, and BERT's 80/10/10 split holds among them."""
    cfg = smoke("bert", f"data.mask_prob={mask_prob}")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    ids = data.train[: min(len(data.train), 200)]
    batch = mask_tokens(torch.from_numpy(ids), data, step=3, seed=0)
    special = np.isin(ids, list(data.special.values()))
    labelled = batch["labels"].numpy() != -100
    n = int((~special).sum())
    assert not labelled[special].any()
    assert abs(labelled.sum() / n - mask_prob) < 4 * np.sqrt(mask_prob * (1 - mask_prob) / n)
    masked = batch["input_ids"].numpy()[labelled] == data.special["mask"]
    assert abs(masked.mean() - 0.8) < 4 * np.sqrt(0.16 / labelled.sum())


def test_glyphs_are_reproducible_balanced_and_a_larger_set_extends_a_smaller_one():
    from mlresearch.data.glyphs import CLASSES, glyphs

    x, y = glyphs(2 * len(CLASSES) + 5)
    assert x.shape == (len(y), 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert np.ptp(np.bincount(y, minlength=len(CLASSES))) <= 1  # balanced to within one image a class
    small_x, small_y = glyphs.__wrapped__(len(CLASSES))  # rendered again, not the cache's copy
    assert np.array_equal(small_x, x[: len(CLASSES)]) and np.array_equal(small_y, y[: len(CLASSES)])
    assert not np.array_equal(glyphs.__wrapped__(len(CLASSES), seed=1)[0], small_x)


def test_a_glyphs_label_is_the_character_in_the_middle():
    """Independently of the renderer's bookkeeping: class means of the middle of the images classify
    fresh images (another seed) far above chance; with the labels rolled by one class they would not."""
    from mlresearch.data.glyphs import CLASSES, glyphs

    k = len(CLASSES)
    x, y = glyphs.__wrapped__(40 * k, seed=5)
    fresh_x, fresh_y = glyphs.__wrapped__(10 * k, seed=6)
    middle = (slice(None), 0, slice(7, 21), slice(9, 19))  # the neighbours sit left and right of it
    means = np.stack([x[middle][y == c].mean(0) for c in range(k)]).reshape(k, -1)
    d = ((fresh_x[middle].reshape(len(fresh_x), 1, -1) - means[None]) ** 2).sum(-1)
    accuracy = (d.argmin(1) == fresh_y).mean()
    assert accuracy > 5 / k, accuracy  # chance is 1/k
    assert (d.argmin(1) == (fresh_y + 1) % k).mean() < 2 / k


@pytest.mark.parametrize("setting, message", [
    (["data.corpus=mnist", "data.examples=500"], "data.examples sizes a generated corpus (glyphs, fractals); mnist has a fixed"),
    (["data.corpus=glyphs", "data.examples=0"], "data.examples must be a positive integer"),
    (["data.corpus=[glyphs, mnist]"], "known: mnist, glyphs"),
    (["data.corpus=glyphs", "data.examples=100"], "model.options.num_classes 10 is smaller than the data's 34 classes"),
])
def test_bad_image_data_settings_are_one_line_before_anything_is_written(tmp_path, setting, message, capsys):
    from mlresearch.cli import main

    args = [a for s in setting for a in ("--set", s)]
    assert main(["run", "--method", "baseline", str(REPO / "experiments" / "configs" / "deit_smoke.yaml"), "--out", str(tmp_path / "run"),
                 *args]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlresearch:")]
    assert message in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", ["gpt2_paper", "deit_b_paper"])
def test_a_paper_preset_without_its_data_on_disk_is_one_line_naming_data_path(tmp_path, preset, capsys):
    from mlresearch.cli import main

    assert main(["run", str(REPO / "experiments" / "configs" / f"{preset}.yaml"), "--method", "baseline",
                 "--set", f"data.path={tmp_path / 'absent'}", "--out", str(tmp_path / "run")]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlresearch:")]
    assert str(tmp_path / "absent") in line and "(data.path) does not exist" in line and "--set data.path=" in line, line
    assert not (tmp_path / "run").exists()


def test_each_process_masks_its_rows_as_the_global_batch_would():
    """Process r of w takes rows r::w of a step's batch; its masks are those rows of the one-process
    draw, exactly -- not the same positions on every process (which would correlate their masks)."""
    cfg = smoke("bert", "data.mask_prob=0.4")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    ids = torch.from_numpy(data.train[:8])
    whole = mask_tokens(ids, data, step=5, seed=1)
    parts = [mask_tokens(ids[r::2], data, step=5, seed=1, part=(r, 2)) for r in range(2)]
    for r, part in enumerate(parts):
        for key in ("input_ids", "labels"):
            assert torch.equal(part[key], whole[key][r::2])
    first, second = ((p["labels"] != -100) for p in parts)
    assert not torch.equal(first, second)


def test_training_passes_the_process_index_to_the_masking(monkeypatch):
    """``accumulate`` on process 1 of 2 trains on rows 1::2 masked as in the global batch: its loss
    equals the loss computed from the one-process masks of those rows."""
    from types import SimpleNamespace

    from mlresearch.training import engine
    from mlresearch.training.models import build_model

    cfg = smoke("bert")
    data = load_data(cfg.task, asdict(cfg.data), cfg.seed)
    model = build_model(cfg, data.vocab_size, data.special)
    accelerator = SimpleNamespace(process_index=1, num_processes=2, device=torch.device("cpu"),
                                  backward=lambda loss: loss.backward())
    rows = np.arange(1, 8, 2)
    loss = engine.accumulate(model, data, rows, micro=len(rows), data_step=3, cfg=cfg, accelerator=accelerator)
    whole = ds.make_batch(data, "train", np.arange(8), 3, cfg.seed)
    expected, _ = engine.compute_loss(model, {k: v[1::2].contiguous() for k, v in whole.items()}, data.task)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    own, _ = engine.compute_loss(model, ds.make_batch(data, "train", rows, 3, cfg.seed), data.task)
    assert abs(own.item() - loss.item()) > 1e-4  # masked as process 0 would: another loss


def test_a_masked_lm_tokenizer_trained_twice_gives_every_token_the_same_id(tmp_path, monkeypatch):
    """The WordPiece trainer orders its alphabet and equal-count merges differently from one training
    to the next; the trained tokenizer must not, or a run in a fresh cache trains other embedding rows
    for the same tokens (measured: 34 of 1,024 ids moved between two trainings on the Bible)."""
    import json as json_module

    from mlresearch.data import corpora
    from mlresearch.data.text import text_tokenizer
    from mlresearch.tasks import task_of

    docs = corpora.TEXT_CORPORA["bible"]()[:400]
    special = list(task_of("masked_lm").text.special)
    vocabs = []
    for i in range(3):
        monkeypatch.setenv("MLRESEARCH_CACHE", str(tmp_path / f"cache{i}"))
        tok = text_tokenizer("masked_lm", 400, docs, "k", gpt2_vocab=False)
        vocabs.append(json_module.loads(tok.to_str())["model"]["vocab"])
    assert vocabs[0] == vocabs[1] == vocabs[2]
    assert [vocabs[0][t] for t in special] == [0, 1, 2, 3, 4]  # the special ids the task uses
    # tokenizing is unchanged: the same pieces as the trainer's own tokenizer, only their ids renumbered
    from tokenizers.implementations import BertWordPieceTokenizer

    from mlresearch.data.text import canonical_ids

    raw = BertWordPieceTokenizer(lowercase=True)
    raw.train_from_iterator(docs, vocab_size=400, special_tokens=special, show_progress=False)
    text = " ".join(docs[400:420])
    assert canonical_ids(raw, special).encode(text).tokens == raw.encode(text).tokens


# ----------------------------------------------------------------------------- the fractal image set
def _radial_profiles(images: np.ndarray) -> np.ndarray:
    """Rotation- and mirror-invariant shape features (an independent classifier's input): the
    intensity-weighted histogram of distances from the centre of mass, in units of the spread."""
    img = np.clip(images.mean(1) / 255 - 0.15, 0, None)
    side = img.shape[-1]
    yy, xx = np.mgrid[:side, :side]
    mass = img.sum((1, 2)) + 1e-6
    cy, cx = (img * yy).sum((1, 2)) / mass, (img * xx).sum((1, 2)) / mass
    r = np.sqrt((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2)
    spread = np.sqrt((img * r ** 2).sum((1, 2)) / mass)
    bins = np.linspace(0, 3, 13)
    hist = np.stack([np.histogram(r[i] / spread[i], bins, weights=img[i])[0] for i in range(len(img))]) / mass[:, None]
    return np.concatenate([hist, ((img > 0.1).mean((1, 2)) / (spread / side) ** 2 / 10)[:, None]], 1)


def test_the_fractal_set_is_reproducible_balanced_and_read_from_disk(tmp_path):
    """Two preparations write the same bytes; each class has its images; a stored image is the
    renderer's for (seed, class, index); another seed gives other systems; the splits a run reads
    are views of the memory-mapped file, shuffled by the run's seed only."""
    from mlresearch.data import fractals

    spec = fractals.FractalSet(classes=6, per_class=20, size=24, colour=True)
    a, b = fractals.prepare(spec, out=tmp_path / "a"), fractals.prepare(spec, num_proc=2, out=tmp_path / "b")
    assert (a / "images.npy").read_bytes() == (b / "images.npy").read_bytes()
    images, labels, index = fractals.open_prepared(a)
    assert isinstance(images, np.memmap) and images.shape == (120, 3, 24, 24) and index["images"] == 120
    assert np.bincount(labels).tolist() == [20] * 6
    assert np.array_equal(images[45], fractals.render(fractals.class_system(0, 2), spec, 2, 5))
    other = fractals.FractalSet(classes=6, per_class=20, size=24, colour=True, seed=1)
    assert not np.array_equal(fractals.class_system(1, 2), fractals.class_system(0, 2))
    assert other.fingerprint() != spec.fingerprint()
    section = {"corpus": "fractals", "classes": 6, "examples": 120, "colour": True, "img_size": 24}
    data = load_data("image_cls", section, 0)
    assert isinstance(data.train, fractals.StoredImages) and data.info["classes"] == 6
    assert sum(data.info["images"]) == 120
    batch = data.train[np.array([3, 0, 7])]
    assert batch.dtype == np.float32 and np.array_equal(batch[1], np.asarray(images[data.train.rows[0]], np.float32) / 255)
    again = load_data("image_cls", section, 1)
    assert not np.array_equal(again.train.rows, data.train.rows)


def test_fractal_classes_are_told_apart_by_their_shape_but_not_by_a_linear_probe_on_pixels():
    """10 classes, 80 images each: a 1-nearest-neighbour classifier on rotation-invariant radial
    profiles is far above chance (0.1), a linear probe on the pixels (trained to fit its training
    images) near it: the classes differ in shape, seen in any pose, which is what a ViT has to learn."""
    from mlresearch.data import fractals

    images, labels, _ = fractals.open_prepared(fractals.prepare(fractals.FractalSet(classes=10, per_class=80, size=32)))
    test = np.random.default_rng(0).permutation(len(labels))
    test, train = test[:160], test[160:]
    f = _radial_profiles(np.asarray(images, np.float32))
    f = (f - f[train].mean(0)) / (f[train].std(0) + 1e-6)
    nearest = labels[train][((f[test][:, None] - f[train][None]) ** 2).sum(-1).argmin(1)]
    assert (nearest == labels[test]).mean() > 0.6
    x = torch.tensor(np.asarray(images, np.float32).reshape(len(labels), -1) / 255)
    y = torch.tensor(labels)
    torch.manual_seed(0)
    probe = torch.nn.Linear(x.shape[1], 10)
    opt = torch.optim.Adam(probe.parameters(), 1e-2)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(probe(x[train]), y[train]).backward()
        opt.step()
    with torch.no_grad():
        assert (probe(x[train]).argmax(1) == y[train]).float().mean() > 0.9  # it fits what it saw
        assert (probe(x[test]).argmax(1) == y[test]).float().mean() < 0.35


def test_fractal_settings_are_refused_in_one_line_before_anything_is_written(tmp_path):
    from mlresearch.data import fractals
    from mlresearch.data.text import DataError
    from mlresearch.training.config import ConfigError

    with pytest.raises(DataError, match=r"^fractals: classes must be a whole number >= 2, got 1$"):
        fractals.prepare(fractals.FractalSet(classes=1), out=tmp_path / "x")
    with pytest.raises(DataError, match=r"^fractals: size must be a whole number >= 8, got 4$"):
        fractals.prepare(fractals.FractalSet(size=4), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(DataError, match="data.examples 20 gives fewer than 3 images to each of data.classes 10"):
        load_data("image_cls", {"corpus": "fractals", "classes": 10, "examples": 20}, 0)
    with pytest.raises(ConfigError, match="data.colour must be true or false, got 3"):
        smoke("deit", "data.colour=3")


def test_a_killed_fractal_preparation_leaves_nothing_that_looks_finished(tmp_path):
    """Killed after its first block of images: no prepared directory (only its temporary sibling,
    which the next preparation replaces); the next preparation writes what an uninterrupted one does."""
    from mlresearch.data import fractals

    spec = fractals.FractalSet(classes=4, per_class=40, size=16)
    out = tmp_path / "set"
    code = ("from mlresearch.data import fractals; "
            f"fractals.prepare(fractals.FractalSet(classes=4, per_class=40, size=16), out={str(out)!r})")
    killed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MLRESEARCH_FAULT": "fractals:*"},
                            cwd=REPO, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists() and [p.name.startswith(".set.tmp-") for p in tmp_path.iterdir()] == [True]
    fractals.prepare(spec, out=out)
    assert (out / "images.npy").read_bytes() == (fractals.prepare(spec, out=tmp_path / "clean") / "images.npy").read_bytes()


def test_data_prepare_renders_a_fractal_set_once_and_refuses_a_set_read_where_it_is(capsys):
    """`mlresearch data prepare` on an image config renders the generated set into the cache (a
    second call finds it; a run then reads that directory); a fixed set (MNIST) is refused in one line."""
    from mlresearch.cli import main
    from mlresearch.data import fractals

    config = str(REPO / "experiments" / "configs" / "deit_smoke.yaml")
    sets = ["--set", "data.corpus=fractals", "--set", "data.classes=4", "--set", "data.examples=40"]
    assert main(["data", "prepare", config, *sets, "--num-proc", "2"]) == 0
    path = fractals.prepared_path(fractals.FractalSet(classes=4, per_class=10, size=28))
    assert fractals.is_prepared(path) and str(path) in capsys.readouterr().out
    made = (path / "images.npy").stat().st_mtime_ns
    assert main(["data", "prepare", config, *sets]) == 0 and (path / "images.npy").stat().st_mtime_ns == made
    assert main(["data", "prepare", config]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mlresearch:")]
    assert "data.corpus 'mnist' is read where it is" in line
