"""Similarity analysis: CKA against an independent numpy implementation, its invariances, and
captured attention maps against the model's own computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import FACTORIES, example_input, outputs, randomize

from mlresearch.analysis import MinibatchCKA, capture, head_similarity, layer_similarity, linear_cka, neuron_similarity
from mlresearch.analysis.metrics import gram, hsic_unbiased, pairwise
from mlresearch.analysis.schemes import scheme_from_similarity
from mlresearch.analysis.similarity import METRICS
from mlresearch.families import family_of


# ----------------------------------------------------------------------------- CKA
def numpy_cka(x, y, unbiased):
    """Kornblith et al.'s linear CKA written out independently in numpy."""
    x, y = np.asarray(x, np.float64).reshape(len(x), -1), np.asarray(y, np.float64).reshape(len(y), -1)
    n = len(x)
    k, l = x @ x.T, y @ y.T

    def hsic(a, b):
        if not unbiased:
            h = np.eye(n) - np.ones((n, n)) / n
            return np.trace(a @ h @ b @ h) / (n - 1) ** 2
        a, b = a.copy(), b.copy()
        np.fill_diagonal(a, 0)
        np.fill_diagonal(b, 0)
        return (np.trace(a @ b) + a.sum() * b.sum() / ((n - 1) * (n - 2)) - 2 / (n - 2) * a.sum(0) @ b.sum(1)) / (n * (n - 3))

    return hsic(k, l) / np.sqrt(hsic(k, k) * hsic(l, l))


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("width", [7, 90])  # feature-space form (narrow) and kernel form (wide)
def test_cka_equals_numpy_reference(unbiased, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 12, generator=g)
    y = x @ torch.randn(12, width, generator=g) + 0.5 * torch.randn(40, width, generator=g)
    assert linear_cka(x, y, unbiased) == pytest.approx(numpy_cka(x.numpy(), y.numpy(), unbiased), abs=1e-10)


@pytest.mark.parametrize("unbiased", [False, True])
def test_cka_self_similarity_and_invariances(unbiased):
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(30, 16, generator=g) for _ in range(3)]
    m = pairwise(feats, lambda a, b: linear_cka(a, b, unbiased))
    assert torch.equal(torch.diagonal(m), torch.ones(3, dtype=torch.float64))
    x = feats[0].double()
    y = (feats[0] @ torch.randn(16, 16, generator=g) + torch.randn(30, 16, generator=g)).double()
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    base = linear_cka(x, y, unbiased)
    assert linear_cka(x @ q, y, unbiased) == pytest.approx(base, abs=1e-10)
    assert linear_cka(3.7 * x, y, unbiased) == pytest.approx(base, abs=1e-10)


def test_unbiased_cka_of_independent_features_is_near_zero_biased_is_not():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(60, 2000, generator=g), torch.randn(60, 2000, generator=g)
    assert abs(linear_cka(x, y, unbiased=True)) < 0.05
    assert linear_cka(x, y, unbiased=False) > 0.5


def test_minibatch_cka_approaches_full_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4000, 20, generator=g)
    y = torch.tanh(x @ torch.randn(20, 30, generator=g)) + 0.3 * torch.randn(4000, 30, generator=g)
    acc = MinibatchCKA(2)
    for i in range(0, 4000, 200):
        acc.update([x[i:i + 200], y[i:i + 200]])
    mini = acc.compute()
    assert mini[0, 0] == 1.0 and mini[1, 1] == 1.0
    assert abs(float(mini[0, 1]) - linear_cka(x, y, unbiased=True)) < 0.02


def test_negative_unbiased_hsic_gives_no_nan():
    g = torch.Generator().manual_seed(4)
    found = False
    for _ in range(50):
        x, y = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)
        if hsic_unbiased(gram(x), gram(y)) < 0:
            found = True
            value = linear_cka(x, y, unbiased=True)
            assert np.isfinite(value) and -1.0 <= value <= 0.0
    assert found
    assert linear_cka(torch.ones(8, 3), torch.randn(8, 3, generator=g), unbiased=True) == 0.0  # zero variance


# ----------------------------------------------------------------------------- capture
@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_capture_leaves_outputs_unchanged_and_maps_are_distributions(family):
    model = randomize(FACTORIES[family](), 0)
    x = example_input(model)
    cap = capture(model, x)
    torch.testing.assert_close(cap.output, outputs(model, x), atol=1e-5, rtol=1e-5)
    L = len(cap.hidden)
    assert L == len(cap.attentions) == len(cap.heads) == 4
    for a in cap.attentions:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)
        if family_of(model).task == "causal_lm":  # causal: no weight on future keys
            assert torch.triu(a, diagonal=1).abs().max() == 0
    # The captured maps reproduce the model's own per-head outputs: head_out = A @ V.
    with torch.no_grad():
        value = _values(model, family, cap, x)
    for layer in range(L):
        torch.testing.assert_close(cap.attentions[layer] @ value[layer], cap.heads[layer].transpose(1, 2),
                                   atol=1e-4, rtol=1e-4)


def _values(model, family, cap, inputs):
    """Per-layer value vectors (B, H, T, hd), recomputed from each block's input with its weights."""
    def heads(v, n):
        return v.unflatten(-1, (n, -1)).transpose(1, 2)

    vals = []
    if family == "vit":
        x = model.norm_pre(model._pos_embed(model.patch_embed(inputs["x"])))
        for i, block in enumerate(model.blocks):
            x = cap.hidden[i - 1] if i else x
            b, n, _ = x.shape
            vals.append(block.attn.qkv(block.norm1(x)).reshape(b, n, 3, block.attn.num_heads, -1).permute(2, 0, 3, 1, 4)[2])
        return vals
    ids = inputs["input_ids"]
    if family == "gpt2":
        x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(ids.shape[1]))
        for i, block in enumerate(model.transformer.h):
            x = cap.hidden[i - 1] if i else x
            vals.append(heads(block.attn.c_attn(block.ln_1(x)).split(x.shape[-1], dim=-1)[2], block.attn.num_heads))
    elif family == "bert":
        x = model.bert.embeddings(input_ids=ids)
        for i, layer in enumerate(model.bert.encoder.layer):
            x = cap.hidden[i - 1] if i else x
            vals.append(heads(layer.attention.self.value(x), model.config.num_attention_heads))
    elif family == "llama":
        x = model.model.embed_tokens(ids)
        c = model.config
        for i, layer in enumerate(model.model.layers):
            x = cap.hidden[i - 1] if i else x
            v = heads(layer.self_attn.v_proj(layer.input_layernorm(x)), c.num_key_value_heads)
            vals.append(v.repeat_interleave(c.num_attention_heads // c.num_key_value_heads, dim=1))
    else:  # the value projections' own outputs, taken by this test's hooks during one forward pass
        c, outs = model.config, []
        layers = model.gpt_neox.layers if family == "gpt_neox" else (
            model.model.decoder.layers if family == "opt" else model.model.layers)
        mods = [layer.attention.query_key_value if family == "gpt_neox" else layer.self_attn.v_proj for layer in layers]
        hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o)) for m in mods]
        model(**inputs)
        for h in hooks:
            h.remove()
        kv = getattr(c, "num_key_value_heads", c.num_attention_heads)
        for o in outs:
            if family == "gpt_neox":  # per head: q, k, v of head_dim each
                o = o.unflatten(-1, (c.num_attention_heads, 3, -1))[..., 2, :].flatten(-2)
            vals.append(heads(o, kv).repeat_interleave(c.num_attention_heads // kv, dim=1))
    return vals


def test_padding_mask_zeroes_padded_keys():
    model = randomize(FACTORIES["bert"](), 1)
    ids = torch.randint(5, 90, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    cap = capture(model, {"input_ids": ids, "attention_mask": mask})
    for a in cap.attentions:
        assert a[1, :, :, 6:].abs().max() < 1e-6
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)
    assert cap.mask.sum() == 16
    sim = layer_similarity(cap, "cka")
    assert sim.shape == (4, 4) and torch.allclose(torch.diagonal(sim), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("name", list(METRICS))
def test_every_similarity_metric_gives_symmetric_matrices_with_a_fixed_diagonal(name):
    """Each registered metric (a new one is one entry in METRICS): a layer compared with itself is
    at the metric's fixed point (similarity 1, or distance 0 for attention rows), matrices are
    symmetric; a metric of attention rows refuses features with one clear line."""
    model = randomize(FACTORIES["gpt2"](), 2)
    cap = capture(model, example_input(model, batch=4))
    m = METRICS[name]
    kinds = ["attention"] if m.on_attention_rows else ["features", "attention"]
    for kind in kinds:
        sim = layer_similarity(cap, name, kind=kind)
        assert sim.shape == (4, 4) and torch.allclose(sim, sim.T)
        fixed = 0.0 if m.on_attention_rows else 1.0
        assert torch.allclose(torch.diagonal(sim), torch.full((4,), fixed, dtype=sim.dtype), atol=1e-6)
    if m.on_attention_rows:
        with pytest.raises(ValueError, match=f"metric '{name}' compares attention maps row by row"):
            layer_similarity(cap, name, kind="features")
    with pytest.raises(ValueError, match="metric must be one of cka, cka-unbiased, cosine, attention, got 'cca'"):
        layer_similarity(cap, "cca")


def test_similarity_matrices_and_neuron_summary():
    model = randomize(FACTORIES["gpt2"](), 2)
    cap = capture(model, example_input(model, batch=4))
    js = layer_similarity(cap, "attention", kind="attention")
    assert torch.all(torch.diagonal(js) == 0) and js.max() <= np.log(2) + 1e-9
    heads = head_similarity(cap, 0, "cosine")
    assert heads.shape == (4, 4)
    out = head_similarity(cap, 1, "cka", kind="outputs")
    assert torch.allclose(torch.diagonal(out), torch.ones(4, dtype=torch.float64))
    # Neurons duplicated on purpose are found as each other's nearest neighbour.
    with torch.no_grad():
        fc = model.transformer.h[0].mlp.c_fc
        fc.weight[:, 1] = fc.weight[:, 0]
        fc.bias[1] = fc.bias[0]
    summary = neuron_similarity(model)
    assert len(summary) == 4 and summary[0]["max"] == pytest.approx(1.0)
    assert summary[1]["max"] < 0.99


# ----------------------------------------------------------------------------- similarity-guided schemes
def test_from_similarity_recovers_identical_head_pairs_and_alike_layers():
    from mlresearch.operators import coalesce

    model = randomize(FACTORIES["gpt2"](layers=4, heads=4, hidden=32), 5)
    d, hd = 32, 8
    with torch.no_grad():
        for i, block in enumerate(model.transformer.h):
            w, b = block.attn.c_attn.weight, block.attn.c_attn.bias
            for part in range(3):  # q, k, v: head 3 := head 0, head 2 := head 1
                for src, dst in ((0, 3), (1, 2)):
                    cols = slice(part * d + dst * hd, part * d + (dst + 1) * hd)
                    w[:, cols] = w[:, part * d + src * hd: part * d + (src + 1) * hd]
                    b[cols] = b[part * d + src * hd: part * d + (src + 1) * hd]
            if i >= 2:  # identity blocks: layers 1, 2, 3 output the same residual stream
                for p in (block.attn.c_proj.weight, block.attn.c_proj.bias, block.mlp.c_proj.weight, block.mlp.c_proj.bias):
                    p.zero_()
    batches = [example_input(model, seed=s, batch=4) for s in range(2)]
    scheme = scheme_from_similarity(model, batches)
    assert scheme.width == ((0, 3), (1, 2))
    assert scheme.depth == ((0,), (1, 2, 3))
    small = coalesce(model, scheme)
    assert small.config.n_layer == 2 and small.config.n_head == 2


def test_group_greedily_with_groups_of_three():
    from mlresearch.analysis.schemes import contiguous_groups, group_greedily

    sim = torch.eye(6, dtype=torch.float64)
    for a, b in ((0, 2), (2, 4), (0, 4), (1, 3), (3, 5), (1, 5)):
        sim[a, b] = sim[b, a] = 0.9
    assert group_greedily(sim, 3) == [[0, 2, 4], [1, 3, 5]]
    assert contiguous_groups([0.9, 0.1, 0.8, 0.2, 0.95], 3) == [[0, 1], [2, 3], [4, 5]]


def test_similarity_over_training_cli(tmp_path, monkeypatch):
    import pandas as pd

    from mlresearch.analysis.over_training import summary_over_training
    from mlresearch.cli import main

    monkeypatch.setenv("MLRESEARCH_CACHE", str(tmp_path / "cache"))
    config = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "experiments/configs/deit_smoke.yaml")
    assert main(["run", "--method", "baseline", config, "--out", str(tmp_path / "run"), "--set", "train.keep_snapshots=true",
                 "--set", "vcycle=null"]) == 0
    assert main(["similarity", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "sim")]) == 0
    frame = pd.read_csv(tmp_path / "sim" / "similarity.csv")
    assert list(frame.snapshot.unique()) == ["baseline-0000004", "baseline-0000008", "baseline-0000012", "final_model"]
    assert set(frame.kind) == {"layers", "attention", "heads"}
    diag = frame[(frame.kind == "layers") & (frame.i == frame.j)]
    assert (diag.value - 1).abs().max() < 1e-9
    assert len(summary_over_training(frame)) == 4
    for name in ("layers.png", "heads.png", "trend.png", "summary.csv", "provenance.json"):
        assert (tmp_path / "sim" / name).stat().st_size > 0
    assert main(["similarity", "--model", str(tmp_path / "run" / "final_model"), "--metric", "attention",
                 "--data", "deit_smoke", "--out", str(tmp_path / "sim2")]) == 0
    js = pd.read_csv(tmp_path / "sim2" / "similarity.csv")
    assert set(js.metric) == {"js"} and js.value.min() >= 0


def test_js_divergence_is_pinned_to_known_values_in_nats():
    from mlresearch.analysis.metrics import js_divergence

    eye = torch.eye(4).reshape(1, 1, 4, 4)  # (batch, heads, query, key): one-hot attention rows
    shifted = torch.roll(eye, 1, dims=-1)  # every row's mass on another key: disjoint supports
    assert js_divergence(eye, shifted) == pytest.approx(np.log(2), abs=1e-6)
    assert js_divergence(eye, eye) == pytest.approx(0.0, abs=1e-9)
    # p = (1, 0) vs q = (1/2, 1/2): m = (3/4, 1/4); JS = (KL(p||m) + KL(q||m)) / 2, by hand.
    p = torch.tensor([[[[1.0, 0.0]]]])
    q = torch.tensor([[[[0.5, 0.5]]]])
    by_hand = 0.5 * (np.log(4 / 3) + 0.5 * np.log(2 / 3) + 0.5 * np.log(2))
    assert js_divergence(p, q) == pytest.approx(by_hand, abs=1e-6)
    # Masked query rows (padding) are left out of the mean, not averaged in as zeros: rows 0 and 2
    # agree (JS 0), rows 1 and 3 have disjoint supports (JS ln 2).
    mixed = torch.where(torch.tensor([True, False, True, False]).reshape(1, 1, 4, 1), eye, shifted)
    rows = lambda *keep: torch.tensor([i in keep for i in range(4)]).reshape(1, 1, 4)  # noqa: E731
    assert js_divergence(eye, mixed, rows(1, 3)) == pytest.approx(np.log(2), abs=1e-6)
    assert js_divergence(eye, mixed, rows(0, 2)) == pytest.approx(0.0, abs=1e-9)
    assert js_divergence(eye, mixed, rows(0, 1, 3)) == pytest.approx(2 * np.log(2) / 3, abs=1e-6)


@pytest.mark.parametrize("family", sorted(FACTORIES))
def test_similarity_guided_scheme_fits_every_family(family):
    """Measured on the model, the scheme coalesces it, and its width part de-coalesces exactly."""
    from mlresearch.operators import Scheme, coalesce, decoalesce

    model = randomize(FACTORIES[family](), 3)
    scheme = scheme_from_similarity(model, [example_input(model, seed=s) for s in range(2)])
    sizes = family_of(model).sizes(model)
    small = coalesce(model, scheme)
    assert family_of(small).sizes(small).heads == sizes.heads // 2
    width = Scheme(width=scheme.width, kv_heads=scheme.kv_heads)
    narrow = randomize(coalesce(model, width), 4)
    x = example_input(model)
    ref, got = outputs(narrow, x), outputs(decoalesce(narrow, width), x)
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5


# ----------------------------------------------------------------------------- word order
def test_shuffled_blocks_keep_every_token_label_pair_and_the_special_positions():
    from mlresearch.analysis.word_order import shuffle_blocks

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (4, 12), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    batch = {"input_ids": ids, "labels": ids * 10, "other": "kept"}
    fixed = (ids == 2) | (ids == 3)
    out = shuffle_blocks(batch, fixed, g)
    assert out["other"] == "kept" and torch.equal(out["labels"], out["input_ids"] * 10)  # pairs moved together
    assert torch.equal(out["input_ids"][fixed], ids[fixed])
    assert torch.equal(out["input_ids"].sort(1).values, ids.sort(1).values)
    assert not torch.equal(out["input_ids"], ids)


@pytest.mark.usefixtures("isolated_data_cache")
def test_word_order_gain_is_zero_exactly_when_the_model_cannot_see_position():
    """A BERT whose position embeddings are zero is permutation-equivariant: shuffling inputs and
    labels together leaves its loss unchanged (float noise). With its random position embeddings
    back, the same model's loss moves."""
    from conftest import smoke

    from mlresearch.analysis.word_order import word_order
    from mlresearch.data.datasets import load_data
    from mlresearch.tasks import task_of
    from mlresearch.training.models import build_model, data_settings

    cfg = smoke("bert")
    data = load_data(cfg.task, data_settings(cfg), cfg.seed)
    torch.manual_seed(0)
    model = build_model(cfg, data.vocab_size, data.special)
    seen = word_order(model, data, task_of(cfg.task), batches=2, batch_size=8)
    with torch.no_grad():
        model.bert.embeddings.position_embeddings.weight.zero_()
    blind = word_order(model, data, task_of(cfg.task), batches=2, batch_size=8)
    assert blind.blocks == seen.blocks == min(16, len(data.val))
    assert abs(blind.gain) < 1e-5 < abs(seen.gain)
