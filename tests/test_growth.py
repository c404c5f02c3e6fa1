"""Growth operators: loss preservation, gradients, mapped optimizer state, one-step dynamics."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from models import FACTORIES, example_input, loss_of, outputs, randomize

from mlresearch.operators import (
    NotLossPreservingWarning,
    Scheme,
    UnsupportedOptimizerError,
    coalesce,
    coalesce_state,
    decoalesce_state,
    grow_depth,
    grow_width,
    width_growth,
)
from mlresearch.families import family_of
from mlresearch.operators.axes import grad_factor
from mlresearch.operators.optim import _reads, clear_step_multipliers

FAMILIES = sorted(FACTORIES)
PRE_NORM = ["gpt2", "llama", "vit"]


def make(family, seed=0, dtype=torch.float32):
    return randomize(FACTORIES[family](), seed).to(dtype)


def adamw(model, **kw):
    """AdamW with the usual two groups: weight decay for matrices, none for norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3, **kw)


def train_steps(model, optimizer, inputs, steps=2):
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(model, inputs).backward()
        optimizer.step()
    optimizer.zero_grad()


def grads(model, inputs):
    model.zero_grad()
    loss_of(model, inputs).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- loss preserved
@pytest.mark.parametrize("init", ["block", "split"])
@pytest.mark.parametrize("family", FAMILIES)
def test_width_growth_preserves_loss(family, init):
    model = make(family)
    x = example_input(model)
    grown, _ = grow_width(model, init=init)
    assert abs(loss_of(grown, x).item() - loss_of(model, x).item()) <= 1e-5
    assert sum(p.numel() for p in grown.parameters()) > 3 * sum(p.numel() for p in model.parameters()) // 2


@pytest.mark.parametrize("where", ["alternate", "append"])
@pytest.mark.parametrize("family", PRE_NORM)
def test_identity_depth_growth_preserves_loss(family, where):
    model = make(family)
    x = example_input(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotLossPreservingWarning)
        grown, _ = grow_depth(model, where=where, init="identity")
        both, _ = grow_width(grow_depth(model, where=where)[0])
    base = loss_of(model, x).item()
    assert abs(loss_of(grown, x).item() - base) <= 1e-5
    assert abs(loss_of(both, x).item() - base) <= 1e-5


@pytest.mark.parametrize("family, init", [("bert", "identity"), ("gpt2", "copy"), ("vit", "copy")])
def test_non_preserving_depth_growth_is_reported(family, init):
    model = make(family)
    x = example_input(model)
    with pytest.warns(NotLossPreservingWarning):
        grown, _ = grow_depth(model, init=init)
    assert abs(loss_of(grown, x).item() - loss_of(model, x).item()) > 1e-3


def test_identity_depth_growth_places_new_blocks():
    model = make("gpt2")
    for where, new in (("alternate", {1, 3, 5, 7}), ("append", {4, 5, 6, 7})):
        grown, _ = grow_depth(model, where=where)
        zero = {i for i, block in enumerate(grown.transformer.h)
                if not block.attn.c_proj.weight.any() and not block.mlp.c_proj.bias.any()}
        assert zero == new


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("init", ["block", "split"])
@pytest.mark.parametrize("family", FAMILIES + ["llama-tied"])
def test_gradients_after_width_growth_follow_the_derivation(family, init):
    if family == "llama-tied":
        model = randomize(FACTORIES["llama"](tied=True), 0).double()
    else:
        model = make(family, dtype=torch.float64)
    x = example_input(model)
    x = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    transfer = width_growth(model, init=init)
    grown = transfer.build(model)
    small, big = grads(model, x), grads(grown, x)
    for name, g in big.items():
        predicted = transfer.tensor(name, small, "moment")
        torch.testing.assert_close(g, predicted, atol=1e-6, rtol=0, msg=name)
    if family == "gpt2":  # spelled out for the two kinds the derivation singles out
        w_small, w_big = small["transformer.h.0.mlp.c_fc.weight"], big["transformer.h.0.mlp.c_fc.weight"]
        d, f = w_small.shape
        # Zero off-diagonal blocks (block init) get the same half gradient as the diagonal ones.
        torch.testing.assert_close(w_big[:d, f:], w_small / 2, atol=1e-9, rtol=0)
        torch.testing.assert_close(w_big[d:, :f], w_small / 2, atol=1e-9, rtol=0)
        # The halved final norm in front of the tied head receives the full gradient.
        g_ln, G_ln = small["transformer.ln_f.weight"], big["transformer.ln_f.weight"]
        torch.testing.assert_close(G_ln, torch.cat([g_ln, g_ln]), atol=1e-9, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mapped_adam_moments_equal_the_grown_models_measured_ones(family):
    """One AdamW step from zero state leaves m = (1-b1) g, v = (1-b2) g^2. Mapped up, they must
    equal the same expressions of the gradient measured on the grown model."""
    model = make(family, dtype=torch.float64)
    x = example_input(model)
    x = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    g_big = grads(width_growth(model).build(model), x)  # at the point the state was built
    opt = adamw(model)
    grads(model, x)
    opt.step()
    grown, grown_opt = grow_width(model, opt)
    b1, b2 = opt.param_groups[0]["betas"]
    for name, p in grown.named_parameters():
        state = grown_opt.state[p]
        torch.testing.assert_close(state["exp_avg"], (1 - b1) * g_big[name], atol=1e-9, rtol=1e-9, msg=name)
        torch.testing.assert_close(state["exp_avg_sq"], (1 - b2) * g_big[name] ** 2, atol=1e-12, rtol=1e-9, msg=name)
        assert state["step"].item() == 1


# ----------------------------------------------------------------------------- optimizer plumbing
def test_mapped_optimizer_groups_shapes_and_state_dict(tmp_path):
    model = make("gpt2")
    x = example_input(model)
    opt = adamw(model, betas=(0.9, 0.95))
    opt.param_groups[0]["lr"] = 3e-4
    train_steps(model, opt, x)
    for grown, new_opt in (grow_width(model, opt), grow_depth(model, opt)):
        assert type(new_opt) is torch.optim.AdamW
        assert len(new_opt.param_groups) == 2
        for old_g, new_g in zip(opt.param_groups, new_opt.param_groups):
            assert {k: v for k, v in old_g.items() if k != "params"} == {k: v for k, v in new_g.items() if k != "params"}
        assert {p.dim() >= 2 for p in new_opt.param_groups[0]["params"]} == {True}
        assert {p.dim() < 2 for p in new_opt.param_groups[1]["params"]} == {True}
        assert sum(len(g["params"]) for g in new_opt.param_groups) == len(list(grown.parameters()))
        for p in grown.parameters():
            st = new_opt.state[p]
            assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
        buffer = io.BytesIO()
        torch.save(new_opt.state_dict(), buffer)
        buffer.seek(0)
        fresh = torch.optim.AdamW([{"params": g["params"]} for g in new_opt.param_groups])
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        for p in grown.parameters():
            assert torch.equal(fresh.state[p]["exp_avg_sq"], new_opt.state[p]["exp_avg_sq"])
        train_steps(grown, new_opt, x, steps=1)  # and it trains


def test_identity_blocks_start_with_zero_moments_copy_blocks_with_copies():
    model = make("llama")
    opt = adamw(model)
    train_steps(model, opt, example_input(model))
    grown, new_opt = grow_depth(model, opt, where="alternate")
    for i, block in enumerate(grown.model.layers):
        for key in ("exp_avg", "exp_avg_sq"):  # both moments: a copied second moment would damp the new block
            m = new_opt.state[block.mlp.up_proj.weight][key]
            source = opt.state[model.model.layers[i // 2].mlp.up_proj.weight][key]
            assert source.abs().sum() > 0
            assert torch.equal(m, torch.zeros_like(m) if i % 2 else source), (i, key)
    with pytest.warns(NotLossPreservingWarning):
        grown, new_opt = grow_depth(model, opt, where="append", init="copy")
    assert torch.equal(new_opt.state[grown.model.layers[5].mlp.up_proj.weight]["exp_avg"],
                       opt.state[model.model.layers[1].mlp.up_proj.weight]["exp_avg"])


def test_decoalesced_moments_map_back_exactly():
    big = make("bert")
    scheme = Scheme.halving(big)
    small = randomize(coalesce(big, scheme), 3)
    opt = adamw(small)
    train_steps(small, opt, example_input(small))
    up, up_opt = decoalesce_state(small, opt, scheme)
    down, down_opt = coalesce_state(up, up_opt, scheme)
    for (n, p), q in zip(small.named_parameters(), down.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(down_opt.state[q][key], opt.state[p][key], atol=1e-7, rtol=1e-6, msg=n)


def test_growth_bad_input():
    model = make("gpt2")
    other = make("gpt2", seed=1)
    with pytest.raises(ValueError, match="not the model's"):
        grow_width(model, adamw(other))
    with pytest.raises(UnsupportedOptimizerError, match="torch.optim.AdamW"):
        grow_width(model, torch.optim.RMSprop(model.parameters()))
    for bad in (1, 0, 1.5):
        with pytest.raises(ValueError, match="factor"):
            grow_width(model, factor=bad)
    with pytest.raises(ValueError, match="where"):
        grow_depth(model, where="middle")


# ----------------------------------------------------------------------------- one step after growth
def _per_tensor_optimizer(model, optimizer, settings):
    """A copy of ``optimizer`` (same state) with one group per parameter, settings overridden."""
    groups = []
    base = optimizer.param_groups[0]
    for name, p in model.named_parameters():
        g = {k: v for k, v in base.items() if k != "params"}
        g.update(settings.get(name, {}))
        groups.append(dict(g, params=[p]))
    new = type(optimizer)(groups)
    for p in model.parameters():
        if p in optimizer.state:
            new.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()}
    return new


def _setup(family, make_opt):
    model = make(family, dtype=torch.float64)
    x = example_input(model)
    x = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
    opt = make_opt(model)
    train_steps(model, opt, x, steps=3)
    return model, opt, x


OPTS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6),
}


@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("family", ["gpt2", "llama", "vit"])
def test_one_step_after_growth_matches_the_derivation(family, opt_name):
    """The grown model's plain step equals the original model's step with per-tensor settings
    (SGD: lr*c*r; AdamW: lr*r, eps/c, wd/r), measured on the outputs."""
    model, opt, x = _setup(family, OPTS[opt_name])
    transfer = width_growth(model)
    grown, grown_opt = grow_width(model, opt)
    width = transfer.plan.width
    settings = {}
    for name, _ in model.named_parameters():
        c, r = grad_factor(transfer.moves[name].roles, width), _reads(transfer.moves[name].roles, width)
        base = opt.param_groups[0]
        if opt_name.startswith("sgd"):
            settings[name] = {"lr": base["lr"] * c * r}
        else:
            settings[name] = {"lr": base["lr"] * r, "eps": base["eps"] / c, "weight_decay": base["weight_decay"] / r}
    derived = _per_tensor_optimizer(model, opt, settings)
    train_steps(model, derived, x, steps=1)
    train_steps(grown, grown_opt, x, steps=1)
    ref, got = outputs(model, x), outputs(grown, x)
    assert (ref - got).abs().max() <= 1e-9 * ref.abs().max()


@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_match_first_step_multipliers(family, opt_name):
    model, opt, x = _setup(family, OPTS[opt_name])
    grown, grown_opt = grow_width(model, opt, match_first_step=True)
    plain, plain_opt = grow_width(model, opt)
    train_steps(model, opt, x, steps=1)
    train_steps(grown, grown_opt, x, steps=1)
    train_steps(plain, plain_opt, x, steps=1)
    ref, got, unmatched = outputs(model, x), outputs(grown, x), outputs(plain, x)
    assert (ref - got).abs().max() <= 1e-9 * ref.abs().max()
    assert (ref - unmatched).abs().max() > 1e-6 * ref.abs().max()  # without them it does differ
    clear_step_multipliers(grown_opt)
    settings = {(g["lr"], g.get("eps"), g["weight_decay"]) for g in grown_opt.param_groups}
    assert settings == {(g["lr"], g.get("eps"), g["weight_decay"]) for g in plain_opt.param_groups}


@pytest.mark.parametrize("family", FAMILIES)
def test_preserving_up_path_keeps_the_small_models_function(family):
    """Width de-coalesced as usual, new depth positions as identity blocks: exact for pre-norm blocks;
    post-norm BERT re-normalises a zero update, so there the result differs (and copies differ too)."""
    from mlresearch.operators import Scheme, coalesce, decoalesce_preserving

    big = FACTORIES[family]()
    scheme = Scheme.halving(big)
    small = randomize(coalesce(big, scheme), 3)
    up, _ = decoalesce_preserving(small, None, scheme)
    assert family_of(up).sizes(up) == family_of(big).sizes(big)
    x = example_input(big)
    ref, got = outputs(small, x), outputs(up, x)
    change = ((ref - got).abs().max() / ref.abs().max()).item()
    if family_of(big).norm_position == "pre":
        assert change <= 1e-5
    else:
        assert change > 1e-3
        # What post-norm does keep: the width part exactly, and an identity block exactly while the
        # LayerNorm before it has unit gain and zero bias (LN of an already normalised vector).
        width = Scheme.halving(big, depth=None)
        small_w = randomize(coalesce(big, width), 3)
        ref_w = outputs(small_w, x)
        assert ((ref_w - outputs(decoalesce_preserving(small_w, None, width)[0], x)).abs().max()
                / ref_w.abs().max()).item() <= 1e-5
        with torch.no_grad():
            for name, p in small.named_parameters():
                if "LayerNorm" in name and "output" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
        ref = outputs(small, x)
        got = outputs(decoalesce_preserving(small, None, scheme)[0], x)
        assert ((ref - got).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_stacking_with_the_optimizer_copies_each_layers_adam_state(family):
    """StackBERT with ``optimizer: carry``: the stacked model is G_stack's, and every parameter's
    Adam moments and step are its source parameter's (block i + L takes block i's)."""
    from mlresearch.operators import stack_layers, stack_layers_state

    model = randomize(FACTORIES[family](layers=2), 4)
    optimizer = adamw(model)
    train_steps(model, optimizer, example_input(model))
    stacked, carried = stack_layers_state(model, optimizer, 2)
    plain = dict(stack_layers(model, 2).named_parameters())
    prefix = family_of(model).layers + "."
    p = dict(model.named_parameters())
    for name, value in stacked.named_parameters():
        assert torch.equal(value, plain[name]), name
        source = p[f"{prefix}{int(name[len(prefix):].split('.', 1)[0]) % 2}.{name[len(prefix):].split('.', 1)[1]}"] \
            if name.startswith(prefix) else p[name]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(carried.state[value][key], optimizer.state[source][key]), (name, key)
    assert [g["weight_decay"] for g in carried.param_groups] == [g["weight_decay"] for g in optimizer.param_groups]


@pytest.mark.parametrize("family", FAMILIES)
def test_stacking_copies_the_whole_layer_stack(family):
    """G_stack on every family: block i of the stacked model is block i mod L of the original,
    every parameter outside the blocks is unchanged, and the config says the new depth."""
    from mlresearch.operators import stack_layers

    model = randomize(FACTORIES[family](layers=2), 4)
    stacked = stack_layers(model, 3)
    assert family_of(stacked).sizes(stacked).layers == 6
    prefix = family_of(model).layers + "."
    p, q = dict(model.named_parameters()), dict(stacked.named_parameters())
    assert len(q) == len(p) + 2 * sum(name.startswith(prefix) for name in p)  # blocks x3, the rest once
    for name, value in q.items():
        if name.startswith(prefix):
            i, rest = name[len(prefix):].split(".", 1)
            assert torch.equal(value, p[f"{prefix}{int(i) % 2}.{rest}"]), name
        else:
            assert torch.equal(value, p[name]), name


# ----------------------------------------------------------------------------- bert2BERT's AKI
def _writes_widened_units(roles) -> bool:
    from mlresearch.operators.axes import role_info, role_segments

    return any(role_info(s)[1] == "out" for r in roles if r is not None for s in role_segments(r))


@pytest.mark.parametrize("family", FAMILIES)
def test_aki_takes_the_new_units_from_the_layer_above(family):
    """bert2BERT's advanced knowledge initialisation, checked through coalescing (the exact inverse
    of FPI, tested above): coalescing the AKI model averages each unit with its new copy, so every
    block tensor that writes widened units comes back as the mean of its own layer's tensor and the
    layer above's; the top block, tensors that only read widened units and everything outside the
    blocks come back unchanged. FPI is ``init='split'``, whose function is kept (test above); AKI's
    is not."""
    model = randomize(FACTORIES[family](layers=3), 5)
    fam = family_of(model)
    grown, _ = grow_width(model, init="aki")
    x = example_input(model)
    assert abs(loss_of(grown, x).item() - loss_of(model, x).item()) > 1e-3  # not function-preserving
    sizes = fam.sizes(grown)
    back = dict(coalesce(grown, Scheme.uniform(heads=sizes.heads, width_factor=2, depth_factor=None)).named_parameters())
    p, tied, upper = dict(model.named_parameters()), fam.head_tied(model), 0
    for name, value in p.items():
        where = fam.locate(name, tied)
        expected = value
        if where.layer is not None and where.layer < 2 and _writes_widened_units(where.roles):
            expected = (value + p[fam.layer_name(where.layer + 1, where.rel)]) / 2
            upper += 1
        torch.testing.assert_close(back[name], expected, atol=1e-6, rtol=1e-5, msg=name)
    assert upper >= 4  # attention and MLP matrices of both lower blocks


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_aki_carries_the_layer_aboves_adam_state_onto_the_new_units(family):
    """With the optimizer carried, AKI's new units take the moments the layer above's units have
    under FPI, the original units their own (FPI's), and every step count is kept."""
    from mlresearch.operators.axes import new_units_mask

    model = randomize(FACTORIES[family](layers=2), 6)
    optimizer = adamw(model)
    train_steps(model, optimizer, example_input(model))
    aki, aki_opt = grow_width(model, optimizer, init="aki")
    fpi, fpi_opt = grow_width(model, optimizer, init="split")
    transfer = width_growth(model, init="aki")
    fam, f = family_of(model), dict(fpi.named_parameters())
    moved = 0
    for name, param in aki.named_parameters():
        where = fam.locate(name, fam.head_tied(aki))
        own = fpi_opt.state[f[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            expected = own[key]
            if transfer.moves[name].upper:
                mask = new_units_mask(where.roles, transfer.plan.width, param.shape)
                expected = torch.where(mask, fpi_opt.state[f[fam.layer_name(where.layer + 1, where.rel)]][key], own[key])
                moved += key == "exp_avg"
            assert torch.equal(aki_opt.state[param][key], expected), (name, key)
        assert aki_opt.state[param]["step"] == own["step"]
    assert moved >= 4


def test_aki_keeps_each_original_unit_where_fpi_puts_it():
    """The positions behind the coalescing check above: in an FFN up-projection, the rows of every
    group's first member (the original unit) are FPI's rows of the layer itself, the other members'
    rows FPI's rows of the layer above."""
    model = randomize(FACTORIES["llama"](layers=2), 7)
    aki = dict(grow_width(model, init="aki")[0].named_parameters())
    fpi = dict(grow_width(model, init="split")[0].named_parameters())
    ffn = width_growth(model, init="aki").plan.width["ffn"]
    own, above = fpi["model.layers.0.mlp.up_proj.weight"], fpi["model.layers.1.mlp.up_proj.weight"]
    got = aki["model.layers.0.mlp.up_proj.weight"]
    for group in ffn.groups:
        for k, unit in enumerate(group):
            rows = slice(unit * ffn.chunk, (unit + 1) * ffn.chunk)
            assert torch.equal(got[rows], (own if k == 0 else above)[rows]), (group, k)
    assert torch.equal(aki["model.layers.1.mlp.up_proj.weight"], above)  # the top block: FPI


# ----------------------------------------------------------------------------- LiGO
@pytest.mark.parametrize("family", FAMILIES)
def test_ligo_starts_at_fpi_and_stacking_and_its_fit_lowers_the_loss_it_was_fitted_on(family):
    """The learned operator before fitting is exactly bert2BERT's FPI widening followed by stacking
    (both tested on their own above); ten Adam steps on one batch's loss lower that loss; the
    materialised model computes what the operator computes; and the grown model does not keep the
    small model's function."""
    from mlresearch.operators import stack_layers
    from mlresearch.operators.ligo import LinearGrowth, fit

    model = randomize(FACTORIES[family](layers=2), 8)
    x = example_input(model)
    operator = LinearGrowth(model, width=2, depth=2)
    reference = dict(stack_layers(grow_width(model, init="split")[0], 2).named_parameters())
    start = operator.parameters_of_large()
    assert set(start) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(start[name], value, atol=1e-6, rtol=1e-6, msg=name)
    losses = fit(operator, loss_of, [x] * 10, lr=1e-2)
    grown = operator.materialise()
    after = loss_of(grown, x).item()
    assert after < losses[0] - 0.1, (losses[0], after)
    assert abs(loss_of(operator, x).item() - after) <= 1e-5
    assert abs(after - loss_of(model, x).item()) > 1e-3
    assert family_of(grown).sizes(grown) == family_of(model).sizes(model).replace(
        layers=4, heads=2 * family_of(model).sizes(model).heads, kv_heads=2 * family_of(model).sizes(model).kv_heads,
        hidden=2 * family_of(model).sizes(model).hidden, ffn=2 * family_of(model).sizes(model).ffn)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), randomize(FACTORIES[family](layers=2), 8).parameters()))


# ----------------------------------------------------------------------------- MSG
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width, depth", [(2, 1), (1, 2), (2, 2)])
def test_msg_keeps_the_function_at_mask_zero_whatever_the_new_weights(family, width, depth):
    """Masked growth in width, depth or both, on every family (post-norm BERT and OPT's pre-norm
    alike): with the masks at 0 the grown model's outputs equal the old model's within 1e-5 for two
    different initialisations of the new weights; without the masks it computes something else; with
    the masks at 1 it computes what the plain grown model does (so removing them after the ramp
    changes nothing); the old model is not modified."""
    from mlresearch.operators.msg import MaskRamp, masked_growth

    model = randomize(FACTORIES[family](layers=2), 3)
    before = {n: p.clone() for n, p in model.named_parameters()}
    x = example_input(model)
    reference = outputs(model, x)
    ramp = MaskRamp(width, 2, 10)
    grown_models = [masked_growth(model, width=width, depth=depth, seed=seed)[0].eval() for seed in (1, 2)]
    assert any(not torch.equal(p, q) for p, q in zip(*(g.parameters() for g in grown_models)))
    for grown in grown_models:
        sizes = family_of(grown).sizes(grown)
        assert (sizes.layers, sizes.hidden) == (2 * depth, family_of(model).sizes(model).hidden * width)
        plain = outputs(grown, x)
        with ramp.attach(grown).at(0.0):
            torch.testing.assert_close(outputs(grown, x), reference, atol=1e-5, rtol=0)
        assert (plain - reference).abs().max() > 1e-3
        with ramp.attach(grown).at(1.0):
            torch.testing.assert_close(outputs(grown, x), plain, atol=1e-5, rtol=0)
        torch.testing.assert_close(outputs(grown, x), plain, atol=0, rtol=0)  # the hooks are gone
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_msg_keeps_the_old_adam_state_and_starts_the_new_entries_at_zero(family):
    """The carried AdamW has the old groups and settings; each old parameter's moments sit at its old
    entries (read back at the positions the weights were written to) with zeros on the new entries
    and its step kept; the new blocks start without state."""
    from mlresearch.operators.msg import embed, masked_growth, widening

    model = randomize(FACTORIES[family](layers=2), 4)
    optimizer = adamw(model)
    train_steps(model, optimizer, example_input(model))
    grown, carried = masked_growth(model, optimizer, width=2, depth=2, seed=1)
    fam = family_of(grown)
    plan = widening(fam.sizes(model), 2)
    assert [{k: v for k, v in g.items() if k != "params"} for g in carried.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert sum(len(g["params"]) for g in carried.param_groups) == len(list(grown.parameters()))
    old = dict(model.named_parameters())
    for name, param in grown.named_parameters():
        where = fam.locate(name, fam.head_tied(grown))
        if where.layer is not None and where.layer >= 2:
            assert param not in carried.state, name
            continue
        own = optimizer.state[old[name]]
        values, written = embed(own["exp_avg"], where.roles, plan, param)
        assert torch.equal(carried.state[param]["exp_avg"], values), name
        assert not carried.state[param]["exp_avg_sq"][~written].any(), name
        assert torch.equal(carried.state[param]["exp_avg_sq"][written], own["exp_avg_sq"].reshape(-1)), name
        assert torch.equal(param.detach()[written], old[name].detach().reshape(-1)), name
        assert carried.state[param]["step"] == own["step"]
