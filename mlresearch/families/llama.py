"""HF LLaMA: RMSNorm, RoPE (per head, so head_dim is kept), SwiGLU MLP, GQA, untied head."""

from .base import HFFamily


class Llama(HFFamily):
    name = "llama"
    classes = ("LlamaForCausalLM",)
    config_class = "LlamaConfig"
    layers = "model.layers"
    residual_writers = r"(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)"
    attention_output = "self_attn.o_proj"  # its input is the per-head attention output
    mlp_matrices = 3  # SwiGLU
    top_params = {
        r"model\.embed_tokens\.weight": (None, "hidden"),
        r"model\.norm\.weight": ("final_norm",),
        r"lm_head\.weight": (None, "hidden_in"),
    }
    block_params = {
        r"self_attn\.q_proj\.weight": ("heads", "hidden_in"),
        r"self_attn\.q_proj\.bias": ("heads",),
        r"self_attn\.[kv]_proj\.weight": ("kv_heads", "hidden_in"),
        r"self_attn\.[kv]_proj\.bias": ("kv_heads",),
        r"self_attn\.o_proj\.weight": ("hidden", "heads_in"),
        r"(self_attn\.o|mlp\.down)_proj\.bias": ("hidden",),
        r"mlp\.(gate|up)_proj\.weight": ("ffn", "hidden_in"),
        r"mlp\.(gate|up)_proj\.bias": ("ffn",),
        r"mlp\.down_proj\.weight": ("hidden", "ffn_in"),
        r"(input|post_attention)_layernorm\.weight": ("hidden",),
    }
