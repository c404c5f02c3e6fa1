"""Operator properties, parametrised over every family in the test matrix (tests/models.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from models import FACTORIES, example_input, outputs, randomize

from mlresearch.families import family_of
from mlresearch.operators import Scheme, coalesce, decoalesce, interpolate, norm_ratios
from mlresearch.operators.mapping import make_plan

FAMILIES = sorted(FACTORIES)
KINDS = {
    "width": dict(depth=None),
    "depth": dict(width=False),
    "both": dict(),
    "both-stack": dict(depth="stack"),
}


def params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def max_param_diff(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    return max((pa[n] - pb[n]).abs().max().item() for n in pa)


def small_and_scheme(family, kind, seed=1):
    big = FACTORIES[family]()
    scheme = Scheme.halving(big, **KINDS[kind])
    return randomize(coalesce(big, scheme), seed), scheme


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family, kind):
    small, scheme = small_and_scheme(family, kind)
    back = coalesce(decoalesce(small, scheme), scheme)
    assert type(back) is type(small)
    assert max_param_diff(small, back) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_groups_of_three(family):
    """12 heads -> 4 (groups of 3) and 6 layers -> 2 (groups of 3)."""
    kw = dict(layers=6, heads=12, hidden=48)
    if "kv_heads" in inspect.signature(FACTORIES[family]).parameters:
        kw["kv_heads"] = 6
    big = FACTORIES[family](**kw)
    scheme = Scheme.uniform(big, width_factor=3, depth_factor=3)
    small = randomize(coalesce(big, scheme), 2)
    assert family_of(small).sizes(small).heads == 4 and family_of(small).sizes(small).layers == 2
    bigger = decoalesce(small, scheme)
    assert family_of(bigger).sizes(bigger) == family_of(big).sizes(big)
    assert max_param_diff(small, coalesce(bigger, scheme)) <= 1e-6
    x = example_input(big)
    width_only = Scheme(width=scheme.width, kv_heads=scheme.kv_heads)
    small_w = randomize(coalesce(big, width_only), 3)
    ref, got = outputs(small_w, x), outputs(decoalesce(small_w, width_only), x)
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5


def test_every_registered_family_is_in_the_test_matrix():
    from mlresearch.families import FAMILIES as REGISTERED

    assert set(REGISTERED) == set(FACTORIES)


VARIANTS = {"gpt2-untied": lambda: FACTORIES["gpt2"](tied=False), "llama-tied": lambda: FACTORIES["llama"](tied=True)}


@pytest.mark.parametrize("scheme_kind", ["halving", "permuted"])
@pytest.mark.parametrize("family", FAMILIES + sorted(VARIANTS))
def test_width_decoalescing_preserves_function(family, scheme_kind):
    big = VARIANTS.get(family, FACTORIES.get(family))()
    tied = family_of(big).head_tied(big)
    assert tied == getattr(getattr(big, "config", None), "tie_word_embeddings", False)
    if scheme_kind == "halving":
        scheme = Scheme.halving(big, depth=None)
    else:  # a non-strided grouping exercises the gather path
        scheme = Scheme(width=[[3, 0], [1, 2]], kv_heads=Scheme.halving(big).kv_heads)
    small = randomize(coalesce(big, scheme), 4)
    assert family_of(small).head_tied(small) == tied
    x = example_input(big)
    ref, got = outputs(small, x), outputs(decoalesce(small, scheme), x)
    assert ref.shape == got.shape
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_ffn_grouped_on_its_own(family):
    """An FFN grouping of its own (a random permutation, so the gather path): de-coalescing keeps the
    function, the round trip is exact, and FFN neurons merge as the groups say, not as the heads do."""
    big = FACTORIES[family]()
    sizes = family_of(big).sizes(big)
    perm = torch.randperm(sizes.ffn, generator=torch.Generator().manual_seed(0)).tolist()
    ffn = [perm[2 * i:2 * i + 2] for i in range(sizes.ffn // 2)]
    base = Scheme.halving(big, depth=None)
    scheme = Scheme(width=[[3, 0], [1, 2]], kv_heads=base.kv_heads, ffn=ffn)
    small = randomize(coalesce(big, scheme), 11)
    assert family_of(small).sizes(small).ffn == sizes.ffn // 2
    x = example_input(big)
    up = decoalesce(small, scheme)
    ref, got = outputs(small, x), outputs(up, x)
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5
    assert max_param_diff(small, coalesce(up, scheme)) <= 1e-6
    # By value, with plain indexing: an FFN-writing matrix's merged row i is the mean over FFN group i of
    # the rows, each with its hidden columns summed over the hidden groups.
    src = randomize(FACTORIES[family](), 12)
    fam, merged = family_of(src), dict(coalesce(src, scheme).named_parameters())
    plan = make_plan(fam.sizes(src), scheme, down=True)
    hidden = plan.width["hidden"]
    cols = [[m * hidden.chunk + t for m in group] for group in hidden.groups for t in range(hidden.chunk)]
    checked = 0
    for name, p in src.named_parameters():
        roles = fam.locate(name, fam.head_tied(src)).roles
        if set(roles) != {"ffn", "hidden_in"}:
            continue
        w, got = (p, merged[name]) if roles[0] == "ffn" else (p.T, merged[name].T)
        w = w.detach()
        summed = torch.stack([w[:, c].sum(1) for c in cols], 1)
        expected = torch.stack([summed[list(group)].mean(0) for group in ffn])
        assert torch.allclose(got, expected, atol=1e-5), name
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("pattern", ["adjacent", "stack"])
@pytest.mark.parametrize("family", FAMILIES)
def test_depth_decoalescing_copies_layers(family, pattern):
    small, scheme = small_and_scheme(family, "depth" if pattern == "adjacent" else "both-stack")
    scheme = Scheme(depth=scheme.depth)
    fam = family_of(small)
    big = decoalesce(small, scheme)
    n_small = fam.sizes(small).layers
    assert fam.sizes(big).layers == 2 * n_small
    ps, pb = params(small), params(big)
    prefix = fam.layers + "."
    for name, value in pb.items():
        if not name.startswith(prefix):
            assert torch.equal(value, ps[name])
            continue
        j, rel = name[len(prefix):].split(".", 1)
        i = int(j) // 2 if pattern == "adjacent" else int(j) % n_small
        assert torch.equal(value, ps[fam.layer_name(i, rel)]), name
        assert value.data_ptr() != ps[fam.layer_name(i, rel)].data_ptr()


def dense_F(groups, chunk):
    """The reference's width matrix (small x big): 1/g at each group member's chunk."""
    g, n = len(groups[0]), len(groups)
    F = torch.zeros(n * chunk, n * g * chunk)
    for i, group in enumerate(groups):
        for j in group:
            F[i * chunk:(i + 1) * chunk, j * chunk:(j + 1) * chunk] = torch.eye(chunk) / g
    return F


def test_coalesce_equals_dense_matrix_products():
    """Independent check on BERT: W_small = F_out W T_in, depth = mean of grouped layers."""
    big = randomize(FACTORIES["bert"](), 5)
    scheme = Scheme(width=[[0, 2], [1, 3]], depth=[[0, 3], [1, 2]])
    small = coalesce(big, scheme)
    F = dense_F(scheme.width, 8)  # hidden 32 / 4 heads; head_dim 8
    F_ffn = dense_F(scheme.width, 24)  # ffn 96 / 4
    T, T_ffn = (F.T > 0).float(), (F_ffn.T > 0).float()
    pb = params(big)
    for i, group in enumerate(scheme.depth):
        def mean(rel):
            return sum(pb[f"bert.encoder.layer.{j}.{rel}"] for j in group) / len(group)
        got = params(small)
        torch.testing.assert_close(got[f"bert.encoder.layer.{i}.attention.self.query.weight"],
                                   F @ mean("attention.self.query.weight") @ T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[f"bert.encoder.layer.{i}.intermediate.dense.weight"],
                                   F_ffn @ mean("intermediate.dense.weight") @ T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[f"bert.encoder.layer.{i}.output.dense.weight"],
                                   F @ mean("output.dense.weight") @ T_ffn, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(params(small)["bert.embeddings.word_embeddings.weight"],
                               pb["bert.embeddings.word_embeddings.weight"] @ F.T, atol=1e-6, rtol=1e-6)
    # The LayerNorm in front of the tied decoder is summed (split on the way up), not averaged.
    torch.testing.assert_close(params(small)["cls.predictions.transform.LayerNorm.weight"],
                               pb["cls.predictions.transform.LayerNorm.weight"] @ T, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_interpolation_endpoints_and_midpoints(family):
    a = randomize(FACTORIES[family](), 6)
    b = randomize(FACTORIES[family](), 7)
    assert max_param_diff(interpolate(a, b, alpha=0.0), a) == 0.0
    assert max_param_diff(interpolate(a, b, alpha=1.0), b) == 0.0
    mid, pa, pb = params(interpolate(a, b, alpha=0.25)), params(a), params(b)
    for n in pa:
        torch.testing.assert_close(mid[n], 0.75 * pa[n] + 0.25 * pb[n], atol=1e-6, rtol=1e-6)
    assert max_param_diff(a, randomize(FACTORIES[family](), 6)) == 0.0  # inputs untouched


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_adaptive_interpolation_normalises_then_halves(mode):
    a = randomize(FACTORIES["gpt2"](), 8)
    b = randomize(FACTORIES["gpt2"](), 9)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(3.0)  # a de-coalesced model at another scale
    merged = params(interpolate(a, b, adaptive=mode))
    pa, pb = params(a), params(b)
    for n in pa:
        x, y = pa[n], pb[n]
        if mode == "row" and y.dim() >= 2:
            scale = x.flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1)
            y = y * scale.view(-1, *([1] * (y.dim() - 1)))
        else:
            y = y * (x.norm() / y.norm())
        torch.testing.assert_close(merged[n], 0.5 * x + 0.5 * y, atol=1e-5, rtol=1e-5)
    if mode == "tensor":  # the ratios the V-cycle logs are the factors the merge applied
        ratios = norm_ratios(a, b)
        assert set(ratios) == set(pa) and all(0.1 < r < 0.7 for r in ratios.values())  # b was scaled x3
        for n in pa:
            torch.testing.assert_close(merged[n], 0.5 * pa[n] + 0.5 * ratios[n] * pb[n], atol=1e-5, rtol=1e-5)
    # The same model merged with itself is itself: normalisation is a no-op there.
    assert max_param_diff(interpolate(a, a, adaptive=mode), a) <= 1e-6
    # adaptive=True is the per-tensor variant
    assert max_param_diff(interpolate(a, b, adaptive=True), interpolate(a, b, adaptive="tensor")) == 0.0


def test_coalesced_llama_gqa_sizes():
    big = FACTORIES["llama"](heads=8, kv_heads=2, hidden=64)
    small = coalesce(big, Scheme.halving(big, depth=None))
    c = small.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.hidden_size, c.head_dim) == (4, 1, 32, 8)
    mha = FACTORIES["llama"](heads=4, kv_heads=4)
    assert coalesce(mha, Scheme.halving(mha)).config.num_key_value_heads == 2


def test_input_model_is_not_modified():
    big = randomize(FACTORIES["gpt2"](), 10)
    before = {n: p.clone() for n, p in params(big).items()}
    scheme = Scheme.halving(big)
    small = coalesce(big, scheme)
    decoalesce(small, scheme)
    assert all(torch.equal(before[n], p) for n, p in params(big).items())
