"""The test matrix: one tiny random model per family (fp32, dropout off). Add a family here."""

from __future__ import annotations

import torch


def tiny_gpt2(layers=4, heads=4, hidden=32, tied=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=97, n_positions=32,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=tied)
    return GPT2LMHeadModel(cfg).eval()


def tiny_bert(layers=4, heads=4, hidden=32):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden,
                     intermediate_size=3 * hidden, vocab_size=97, max_position_embeddings=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg).eval()


def tiny_llama(layers=4, heads=4, kv_heads=2, hidden=32, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      hidden_size=hidden, intermediate_size=3 * hidden, vocab_size=97,
                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _hf(config_class, model_class, **values):
    import transformers

    cfg = getattr(transformers, config_class)(vocab_size=97, bos_token_id=0, eos_token_id=0, pad_token_id=0, **values)
    return getattr(transformers, model_class)(cfg).eval()


def tiny_qwen2(layers=4, heads=4, kv_heads=2, hidden=32, tied=False):
    """Qwen2.5's layout: q/k/v biases, GQA; an FFN (3 x hidden - 6) that is no multiple of the heads."""
    return _hf("Qwen2Config", "Qwen2ForCausalLM", num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, hidden_size=hidden, intermediate_size=3 * hidden - 6,
               max_position_embeddings=32, tie_word_embeddings=tied)


def tiny_qwen3(layers=4, heads=4, kv_heads=2, hidden=32, tied=True):
    """Qwen3: q/k RMSNorms over head_dim, a head_dim of its own (heads x head_dim != hidden)."""
    return _hf("Qwen3Config", "Qwen3ForCausalLM", num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, hidden_size=hidden, head_dim=hidden // heads + 4,
               intermediate_size=3 * hidden, max_position_embeddings=32, tie_word_embeddings=tied)


def tiny_mistral(layers=4, heads=4, kv_heads=2, hidden=32):
    return _hf("MistralConfig", "MistralForCausalLM", num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, hidden_size=hidden, intermediate_size=3 * hidden,
               max_position_embeddings=32, sliding_window=8)


def tiny_gpt_neox(layers=4, heads=4, hidden=32, parallel=True):
    """Pythia's layout: fused per-head qkv, parallel residual, partial rotary (a quarter of head_dim)."""
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", num_hidden_layers=layers, num_attention_heads=heads,
               hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=32, rotary_pct=0.25,
               use_parallel_residual=parallel, hidden_dropout=0.0, attention_dropout=0.0)


def tiny_opt(layers=4, heads=4, hidden=32):
    return _hf("OPTConfig", "OPTForCausalLM", num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden,
               ffn_dim=3 * hidden, word_embed_proj_dim=hidden, max_position_embeddings=32, dropout=0.0,
               attention_dropout=0.0)


def tiny_vit(layers=4, heads=4, hidden=32):
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=10, embed_dim=hidden,
                             depth=layers, num_heads=heads, mlp_ratio=3.0).eval()


FACTORIES = {"gpt2": tiny_gpt2, "bert": tiny_bert, "llama": tiny_llama, "vit": tiny_vit, "qwen2": tiny_qwen2,
             "qwen3": tiny_qwen3, "mistral": tiny_mistral, "gpt_neox": tiny_gpt_neox, "opt": tiny_opt}


def randomize(model, seed=0):
    """Random values everywhere (norm gains and biases too), so no symmetry hides a wrong map."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def example_input(model, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    if hasattr(model, "patch_embed"):
        return {"x": torch.randn(batch, 3, 16, 16, generator=g)}
    return {"input_ids": torch.randint(0, 97, (batch, 12), generator=g)}


def outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def loss_of(model, inputs, seed=0):
    """A differentiable loss: LM cross-entropy on the inputs, or classification on fixed labels."""
    if "x" in inputs:
        labels = torch.randint(0, 10, (inputs["x"].shape[0],), generator=torch.Generator().manual_seed(seed))
        return torch.nn.functional.cross_entropy(model(**inputs), labels)
    return model(**inputs, labels=inputs["input_ids"]).loss
