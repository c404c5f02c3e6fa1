"""Native models in and out (safetensors), and clear errors that write nothing."""

from __future__ import annotations

import json

import pytest
import torch
from models import FACTORIES, example_input, outputs, randomize

from mlresearch.checkpoint import load_model, save_model
from mlresearch.cli import main
from mlresearch.errors import CheckpointError, SchemeError, UnsupportedModelError
from mlresearch.operators import Scheme, coalesce, decoalesce, interpolate


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_mapped_models_save_and_load(family, tmp_path):
    big = randomize(FACTORIES[family](), 11)
    scheme = Scheme.halving(big)
    for label, model in (("small", coalesce(big, scheme)), ("big", decoalesce(coalesce(big, scheme), scheme))):
        out = save_model(model, tmp_path / label)
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        loaded = load_model(out)
        assert type(loaded) is type(model)
        # in memory of its own, aligned like the run's tensors, not at the file's 8-byte offsets (an
        # ulp apart under MKL: a resumed V-cycle logged another partner loss than the uninterrupted run)
        assert all(t.data_ptr() % 64 == 0 for t in [*loaded.parameters(), *loaded.buffers()] if t.numel())
        x = example_input(big)
        assert torch.equal(outputs(model.eval(), x), outputs(loaded, x))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_a_loaded_training_state_is_in_aligned_memory_of_its_own(tmp_path):
    """The optimizer's moments are updated in place after a resume: they must not stay where
    safetensors maps them (a 3-float tensor before a 1,000-float one puts that one at a 4-byte offset)."""
    from mlresearch.checkpoint import load_state, save_state

    state = {"moments": [torch.arange(3.0), torch.arange(1000.0)], "step": 7}
    save_state(tmp_path, state)
    loaded = load_state(tmp_path)
    assert loaded["step"] == 7 and all(torch.equal(a, b) for a, b in zip(loaded["moments"], state["moments"]))
    assert all(t.data_ptr() % 64 == 0 for t in loaded["moments"])


def test_hf_models_round_trip_through_from_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    small = coalesce(randomize(FACTORIES["gpt2"](), 12), Scheme.halving(FACTORIES["gpt2"]()))
    small.save_pretrained(tmp_path / "hf")
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert again.lm_head.weight is again.transformer.wte.weight
    assert torch.equal(again.transformer.wte.weight, small.transformer.wte.weight)
    mine = load_model(tmp_path / "hf")  # its copy out of the mapped file keeps the tie
    assert mine.lm_head.weight is mine.transformer.wte.weight
    assert torch.equal(mine.lm_head.weight, small.lm_head.weight)


@pytest.mark.parametrize(
    "scheme, message",
    [
        (Scheme(width=[[0, 4], [1, 2]]), "out of range"),
        (Scheme(width=[[0, 1]]), "in no group"),
        (Scheme(width=[[0, 1], [2, 3], [4, 5]]), "out of range"),
        (Scheme(depth=[[0, 1], [2, 3], [4, 5]]), "out of range"),
        (Scheme(depth=[[0, 1], [2]]), "in no group"),
    ],
)
def test_schemes_that_do_not_fit_the_model(scheme, message):
    with pytest.raises(SchemeError, match=message):
        coalesce(FACTORIES["gpt2"](), scheme)


def test_scheme_construction_errors():
    with pytest.raises(SchemeError, match="more than one group"):
        Scheme(width=[[0, 1], [1, 2]])
    with pytest.raises(SchemeError, match="same size"):
        Scheme(width=[[0, 1, 2], [3]])
    with pytest.raises(SchemeError, match="width scheme, a depth scheme"):
        Scheme()
    with pytest.raises(SchemeError, match="3 layers"):
        Scheme.halving(FACTORIES["gpt2"](layers=3))
    with pytest.raises(SchemeError, match="depth pattern"):
        Scheme.halving(FACTORIES["gpt2"](), depth="diagonal")


def test_decoalesce_scheme_must_match_small_model():
    small = FACTORIES["gpt2"](layers=2, heads=2, hidden=16)
    with pytest.raises(SchemeError, match="3 groups but the model has 2 heads"):
        decoalesce(small, Scheme(width=[[0, 3], [1, 4], [2, 5]]))


def test_width_not_divisible():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, n_inner=30, vocab_size=50,
                                       bos_token_id=0, eos_token_id=0))
    assert coalesce(model, Scheme.halving(model)).config.n_inner == 15  # FFN grouped on its own (30 / 2)
    with pytest.raises(SchemeError, match="FFN size 30 is not divisible by the width factor 4"):
        coalesce(model, Scheme.uniform(model, width_factor=4, depth_factor=None))


def test_gqa_scheme_that_splits_kv_heads():
    model = FACTORIES["llama"](heads=8, kv_heads=4, hidden=64)
    with pytest.raises(SchemeError, match="key/value heads"):
        coalesce(model, Scheme(width=[[0, 1], [2, 4], [3, 5], [6, 7]]))
    consistent = coalesce(model, Scheme(width=[[0, 2], [1, 3], [4, 6], [5, 7]]))
    assert consistent.config.num_key_value_heads == 2


def test_unsupported_model():
    from transformers import GPT2Config, GPT2Model

    with pytest.raises(UnsupportedModelError, match="unsupported model class Linear"):
        coalesce(torch.nn.Linear(4, 4), Scheme(depth=[[0]]))
    with pytest.raises(UnsupportedModelError, match="GPT2Model"):
        Scheme.halving(GPT2Model(GPT2Config(n_layer=2, n_embd=16, n_head=2)))


def test_interpolate_errors():
    a, b = FACTORIES["gpt2"](), FACTORIES["gpt2"](hidden=64)
    with pytest.raises(ValueError, match="incompatible shapes"):
        interpolate(a, b, alpha=0.5)
    with pytest.raises(ValueError, match="needs alpha"):
        interpolate(a, a)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        interpolate(a, a, alpha=1.5)
    with pytest.raises(TypeError, match="cannot interpolate"):
        interpolate(a, FACTORIES["bert"](), alpha=0.5)


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    good = save_model(FACTORIES["gpt2"](), tmp_path / "good")
    (good / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(good)
    (good / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_model(good)
    other = save_model(FACTORIES["gpt2"](), tmp_path / "other")
    (other / "config.json").write_text("{truncated")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(other)
    (other / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        load_model(other)


def test_scheme_json_reference_format(tmp_path):
    path = tmp_path / "L6-H6.json"
    pairs = [[i, i + 6] for i in range(6)]
    path.write_text(json.dumps({"width_scheme": pairs, "depth_scheme": pairs, "reserved_heads": [], "reserved_layers": []}))
    scheme = Scheme.from_json(path)
    assert scheme == Scheme.halving(heads=12, layers=12, depth="stack")
    scheme.to_json(tmp_path / "again.json")
    assert Scheme.from_json(tmp_path / "again.json") == scheme
    (tmp_path / "width.json").write_text(json.dumps({"width_scheme": pairs}))
    assert Scheme.from_json(tmp_path / "width.json").depth is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SchemeError, match="not valid JSON"):
        Scheme.from_json(tmp_path / "bad.json")
    (tmp_path / "typo.json").write_text(json.dumps({"width_schem": pairs}))
    with pytest.raises(SchemeError, match="unknown scheme keys"):
        Scheme.from_json(tmp_path / "typo.json")


def test_cli_map_round_trip(tmp_path, capsys):
    big = randomize(FACTORIES["bert"](), 13)
    save_model(big, tmp_path / "m1")
    scheme = tmp_path / "scheme.json"
    Scheme.halving(big).to_json(scheme)
    assert main(["map", "coalesce", "--src", str(tmp_path / "m1"), "--out", str(tmp_path / "m2"), "--scheme", str(scheme)]) == 0
    assert main(["map", "decoalesce", "--src", str(tmp_path / "m2"), "--out", str(tmp_path / "up"), "--halving"]) == 0
    assert main(["map", "interpolate", "--src", str(tmp_path / "m1"), "--with", str(tmp_path / "up"),
                 "--out", str(tmp_path / "ip"), "--alpha", "0.25"]) == 0
    assert main(["map", "interpolate", "--src", str(tmp_path / "m1"), "--with", str(tmp_path / "up"),
                 "--out", str(tmp_path / "ada"), "--adaptive"]) == 0
    up, m2 = load_model(tmp_path / "up"), load_model(tmp_path / "m2")
    expected = interpolate(big, decoalesce(m2, Scheme.halving(big)), alpha=0.25)
    got = load_model(tmp_path / "ip")
    for (n, p), (_, q) in zip(got.named_parameters(), expected.named_parameters()):
        assert torch.equal(p, q), n
    assert sum(p.numel() for p in up.parameters()) == sum(p.numel() for p in big.parameters())
    assert "coalesce:" in capsys.readouterr().out


def test_cli_failure_writes_nothing(tmp_path, capsys):
    save_model(FACTORIES["gpt2"](), tmp_path / "m1")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"width_scheme": [[0, 9], [1, 2]]}))
    code = main(["map", "coalesce", "--src", str(tmp_path / "m1"), "--out", str(tmp_path / "out"), "--scheme", str(bad)])
    assert code == 2 and "out of range" in capsys.readouterr().err
    code = main(["map", "coalesce", "--src", str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--halving"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "m1"]
    code = main(["map", "coalesce", "--src", str(tmp_path / "m1"), "--out", str(tmp_path / "m1"), "--halving"])
    assert code == 2 and "already exists" in capsys.readouterr().err


def test_cli_new_builds_each_family(tmp_path, capsys):
    assert main(["new", "llama", "--out", str(tmp_path / "l"), "--layers", "2", "--heads", "4", "--kv-heads", "2",
                 "--hidden", "32", "--ffn", "64", "--set", "vocab_size=50", "--set", "bos_token_id=0",
                 "--set", "eos_token_id=0"]) == 0
    model = load_model(tmp_path / "l")
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.vocab_size) == (2, 4, 2, 32, 50)
    assert main(["new", "vit", "--out", str(tmp_path / "v"), "--layers", "2", "--heads", "2", "--hidden", "16",
                 "--set", "img_size=8", "--set", "patch_size=2", "--set", "in_chans=1"]) == 0
    assert load_model(tmp_path / "v").patch_embed.proj.in_channels == 1
