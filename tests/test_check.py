"""``mlresearch check`` and the families added for the models people train today: every family
runs through the V-cycle with no code of its own outside ``families/``."""

from __future__ import annotations

import json

import pytest
from conftest import smoke

from mlresearch.cli import main
from mlresearch.training.engine import read_metrics
from mlresearch.training.run import run_method

pytestmark = pytest.mark.usefixtures("isolated_data_cache")

NEW = {  # family: (extra `mlresearch new` arguments, config overrides for the V-cycle smoke run)
    "qwen2": (["--kv-heads", "2", "--ffn", "90"], ["model.ffn=90"]),  # FFN no multiple of the 4 heads
    "qwen3": (["--kv-heads", "2", "--set", "head_dim=12"], ["model.options={head_dim: 12}"]),
    "mistral": (["--kv-heads", "2"], []),
    "gpt_neox": ([], ["model.kv_heads=null", "model.options={rotary_pct: 0.25}"]),
    "opt": ([], ["model.kv_heads=null"]),
}


def _new(tmp_path, family, extra=(), name="m"):
    out = tmp_path / name
    assert main(["new", family, "--out", str(out), "--layers", "4", "--heads", "4", "--hidden", "32", *extra,
                 "--set", "vocab_size=64", "--set", "bos_token_id=0", "--set", "eos_token_id=0"]) == 0
    return out


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama", *NEW])
def test_check_marks_every_promise(tmp_path, family, capsys):
    model = _new(tmp_path, family, NEW.get(family, ([], []))[0])
    capsys.readouterr()
    assert main(["check", str(model)]) == 0
    out = capsys.readouterr().out
    for operator in ("coalesce", "width de-coalesce", "round trip", "depth de-coalesce", "grow width x2",
                     "grow depth x2"):
        assert operator in out
    assert out.count("-> HELD") == (3 if family == "bert" else 4)  # BERT is post-norm: identity depth growth
    assert "NOT HELD" not in out and out.strip().endswith("every promised property holds")


def test_check_fails_when_a_promise_breaks(tmp_path, capsys, monkeypatch):
    from mlresearch import check

    model = _new(tmp_path, "llama", ["--kv-heads", "2"])
    real = check.width_growth

    class Broken:  # a growth that forgets the block-diagonal init: the function changes
        def __init__(self, model):
            self.transfer = real(model, init="block")

        def build(self, model):
            grown = self.transfer.build(model)
            for p in grown.parameters():
                p.data.add_(0.01)
            return grown

    monkeypatch.setattr(check, "width_growth", Broken)
    assert main(["check", str(model)]) == 1
    assert capsys.readouterr().out.strip().endswith("NOT HELD: grow width x2")


@pytest.mark.parametrize("layers", [2, 6])
def test_check_refuses_a_config_that_disagrees_with_the_weights(tmp_path, capsys, layers):
    model = _new(tmp_path, "gpt2")
    config = json.loads((model / "config.json").read_text())
    config["n_layer"] = layers  # fewer layers than the weights hold, or more
    (model / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["check", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json and model.safetensors disagree" in err[0]
    assert ("not in the config" if layers == 2 else "missing") in err[0]


@pytest.mark.parametrize("family", sorted(NEW))
def test_new_families_run_the_vcycle(tmp_path, family):
    cfg = smoke("llama", f"model.family={family}", *NEW[family][1])
    summary = run_method(cfg, "vcycle", tmp_path / "vc")
    rows = read_metrics(tmp_path / "vc")
    assert [r["phase"] for r in rows if r.get("event") == "phase_end"] == ["down1", "small", "up1"]
    assert summary["final_full_val"]["val_loss"] < rows[0]["train_loss"]  # it learned
