"""Real model shapes: the published configurations (numbers from the model cards, written here as
literals; nothing is downloaded), at full size on the meta device and scaled down on the CPU.

Scaled down keeps each model's head and key/value head counts and the ratios of hidden size, FFN
size and head_dim (all divided by the same number), with 2 layers and a small vocabulary; so
Qwen2.5's FFN stays no multiple of its 14 heads and SmolLM2's 9 heads stay odd.
"""

from __future__ import annotations

import pytest
import torch
from models import example_input, outputs, randomize

from mlresearch.families import FAMILIES, family_of
from mlresearch.operators import Scheme, coalesce, decoalesce
from mlresearch.operators.growth import depth_growth, width_growth


def _hf(family, **values):
    import transformers

    cls = getattr(transformers, FAMILIES[family].config_class)
    return getattr(transformers, FAMILIES[family].classes[0]), cls(**values)


def gpt2(d, L, V):
    return _hf("gpt2", n_embd=768 // d, n_layer=L, n_head=12, n_inner=3072 // d, vocab_size=V, n_positions=1024,
               bos_token_id=0, eos_token_id=0)


def bert(d, L, V):
    return _hf("bert", hidden_size=768 // d, num_hidden_layers=L, num_attention_heads=12,
               intermediate_size=3072 // d, vocab_size=V, max_position_embeddings=512)


def smollm2(d, L, V):  # SmolLM2-135M
    return _hf("llama", hidden_size=576 // d, num_hidden_layers=L, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536 // d, vocab_size=V, tie_word_embeddings=True, max_position_embeddings=8192,
               bos_token_id=0, eos_token_id=0)


def qwen25(d, L, V):  # Qwen2.5-0.5B
    return _hf("qwen2", hidden_size=896 // d, num_hidden_layers=L, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864 // d, vocab_size=V, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)


def qwen3(d, L, V):  # Qwen3-0.6B
    return _hf("qwen3", hidden_size=1024 // d, num_hidden_layers=L, num_attention_heads=16, num_key_value_heads=8,
               head_dim=128 // d, intermediate_size=3072 // d, vocab_size=V, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0)


def llama32(d, L, V):  # Llama-3.2-1B
    return _hf("llama", hidden_size=2048 // d, num_hidden_layers=L, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64 // d, intermediate_size=8192 // d, vocab_size=V, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=0)


def pythia(d, L, V):  # Pythia-160M
    return _hf("gpt_neox", hidden_size=768 // d, num_hidden_layers=L, num_attention_heads=12,
               intermediate_size=3072 // d, vocab_size=V, rotary_pct=0.25, use_parallel_residual=True,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def opt(d, L, V):  # OPT-125m
    return _hf("opt", hidden_size=768 // d, num_hidden_layers=L, num_attention_heads=12, ffn_dim=3072 // d,
               word_embed_proj_dim=768 // d, vocab_size=V, max_position_embeddings=2048, bos_token_id=0,
               eos_token_id=0, pad_token_id=1)


def deit_b(d, L, V):
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer, dict(img_size=224 if d == 1 else 32, patch_size=16, embed_dim=768 // d, depth=L,
                                   num_heads=12, mlp_ratio=4.0, num_classes=1000 if d == 1 else 10)


# name: (builder, layers, vocabulary, published parameter count, width factor,
#        coalesced (layers, heads, kv heads, hidden, FFN, head_dim) with depth halved too)
REAL = {
    "GPT-2-124M": (gpt2, 12, 50257, 124_439_808, 2, (6, 6, 6, 384, 1536, 64)),
    "BERT-Base": (bert, 12, 30522, 109_514_298, 2, (6, 6, 6, 384, 1536, 64)),
    "DeiT-B": (deit_b, 12, None, 86_567_656, 2, (6, 6, 6, 384, 1536, 64)),
    "SmolLM2-135M": (smollm2, 30, 49152, 134_515_008, 3, (15, 3, 1, 192, 512, 64)),
    "Qwen2.5-0.5B": (qwen25, 24, 151936, 494_032_768, 2, (12, 7, 1, 448, 2432, 64)),
    "Qwen3-0.6B": (qwen3, 28, 151936, 596_049_920, 2, (14, 8, 4, 512, 1536, 128)),
    "Llama-3.2-1B": (llama32, 16, 128256, 1_235_814_400, 2, (8, 16, 4, 1024, 4096, 64)),
    "Pythia-160M": (pythia, 12, 50304, 162_322_944, 2, (6, 6, 6, 384, 1536, 64)),
    "OPT-125m": (opt, 12, 50272, 125_239_296, 2, (6, 6, 6, 384, 1536, 64)),
}


def build(name, divide=1, layers=None, vocab=None, device=None):
    maker, L, V = REAL[name][:3]
    cls, config = maker(divide, layers or L, vocab or V)
    family = next(f for f in FAMILIES.values() if f.name in ("vit",) and cls.__name__ == "VisionTransformer"
                  or cls.__name__ in getattr(f, "classes", ()))
    ctx = torch.device(device) if device else torch.device("cpu")
    with ctx, family.skip_init():
        model = cls(**config) if isinstance(config, dict) else cls(config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def count(model):
    return sum(p.numel() for p in model.parameters())


def shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def same_family_sized(model, sizes):
    """A model built directly from ``model``'s config with ``sizes``, to compare against."""
    family = family_of(model)
    recipe = family.resize(family.recipe(model), sizes)
    with torch.device("meta"), family.skip_init():
        built = family.build(recipe)
    if hasattr(built, "tie_weights"):
        built.tie_weights()
    return built


@pytest.mark.parametrize("name", sorted(REAL))
def test_full_size_on_the_meta_device(name):
    _, _, _, published, factor, small = REAL[name]
    model = build(name, device="meta")
    family = family_of(model)
    assert count(model) == published  # the literals above are the real configuration
    scheme = Scheme.uniform(model, width_factor=factor, depth_factor=2)
    coalesced = coalesce(model, scheme)
    got = family.sizes(coalesced)
    assert (got.layers, got.heads, got.kv_heads, got.hidden, got.ffn, got.head_dim) == small
    direct = same_family_sized(model, got)
    assert shapes(coalesced) == shapes(direct) and count(coalesced) == count(direct)
    grown = width_growth(model).build(model)
    s = family.sizes(model)
    assert family.sizes(grown) == s.replace(heads=2 * s.heads, kv_heads=2 * s.kv_heads, hidden=2 * s.hidden,
                                            ffn=2 * s.ffn)
    assert shapes(grown) == shapes(same_family_sized(model, family.sizes(grown)))
    deep = depth_growth(model).build(model)
    assert family.sizes(deep) == s.replace(layers=2 * s.layers)
    assert count(deep) == count(same_family_sized(model, family.sizes(deep)))


@pytest.mark.parametrize("name", sorted(REAL))
def test_scaled_down_real_shapes_keep_every_promise(name):
    factor = REAL[name][4]
    model = randomize(build(name, divide=16, layers=2, vocab=64), 0)
    family = family_of(model)
    x = example_input(model, batch=2) if family.task == "image_cls" else {"input_ids": torch.randint(0, 64, (2, 12))}
    if family.task == "image_cls":
        x = {"x": torch.randn(2, 3, 32, 32)}
    width = Scheme.uniform(model, width_factor=factor, depth_factor=None)
    small = randomize(coalesce(model, width), 1)
    up = decoalesce(small, width)
    ref, got = outputs(small, x), outputs(up, x)
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5  # width de-coalescing keeps the function
    back = coalesce(up, width)
    assert max((a - b).abs().max().item() for a, b in zip(small.parameters(), back.parameters())) <= 1e-6
    grown = width_growth(model).build(model)
    ref, got = outputs(model, x), outputs(grown, x)
    assert (ref - got).abs().max() / ref.abs().max() <= 1e-5  # width growth keeps the function
    if family.norm_position == "pre":
        deep = depth_growth(model).build(model)
        ref, got = outputs(model, x), outputs(deep, x)
        assert (ref - got).abs().max() / ref.abs().max() <= 1e-5  # identity depth growth too
