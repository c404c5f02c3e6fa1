"""HF GPT-NeoX / Pythia: LayerNorm with biases, an untied ``embed_out`` head, parallel residual
(``x + attn(ln1(x)) + mlp(ln2(x))``, still pre-norm: zero writers make a block the identity) and
partial rotary embeddings (on the first dims of each head; head_dim is kept, so untouched).

``query_key_value`` is fused per head: its rows are head 0's q, k, v, then head 1's, so its
output axis is the heads space in units of three head-sized chunks (role ``"heads:3"``).
"""

from .base import HFFamily


class GPTNeoX(HFFamily):
    name = "gpt_neox"
    classes = ("GPTNeoXForCausalLM",)
    config_class = "GPTNeoXConfig"
    layers = "gpt_neox.layers"
    residual_writers = r"(attention\.dense|mlp\.dense_4h_to_h)\.(weight|bias)"
    attention_output = "attention.dense"
    top_params = {
        r"gpt_neox\.embed_in\.weight": (None, "hidden"),
        r"gpt_neox\.final_layer_norm\.(weight|bias)": ("final_norm",),
        r"embed_out\.weight|lm_head\.weight": (None, "hidden_in"),
    }
    block_params = {
        r"(input|post_attention)_layernorm\.(weight|bias)": ("hidden",),
        r"attention\.query_key_value\.weight": ("heads:3", "hidden_in"),
        r"attention\.query_key_value\.bias": ("heads:3",),
        r"attention\.dense\.weight": ("hidden", "heads_in"),
        r"(attention\.dense|mlp\.dense_4h_to_h)\.bias": ("hidden",),
        r"mlp\.dense_h_to_4h\.weight": ("ffn", "hidden_in"),
        r"mlp\.dense_h_to_4h\.bias": ("ffn",),
        r"mlp\.dense_4h_to_h\.weight": ("hidden", "ffn_in"),
    }
