"""HF GPT-2: Conv1D weights are stored (in, out); c_attn fuses q, k, v; the head is tied."""

from .base import HFFamily

QKV = ("heads", "heads", "heads")


class GPT2(HFFamily):
    name = "gpt2"
    classes = ("GPT2LMHeadModel",)
    config_class = "GPT2Config"
    layers = "transformer.h"
    residual_writers = r"(attn|mlp)\.c_proj\.(weight|bias)"
    attention_output = "attn.c_proj"  # its input is the per-head attention output
    config_keys = {"layers": "n_layer", "heads": "n_head", "hidden": "n_embd", "ffn": "n_inner"}
    positions_key = "n_positions"
    top_params = {
        r"transformer\.(wte|wpe)\.weight": (None, "hidden"),
        r"transformer\.ln_f\.(weight|bias)": ("final_norm",),
        r"lm_head\.weight": (None, "hidden_in"),  # only seen when untied
    }
    block_params = {
        r"ln_[12]\.(weight|bias)": ("hidden",),
        r"attn\.c_attn\.weight": ("hidden_in", QKV),
        r"attn\.c_attn\.bias": (QKV,),
        r"attn\.c_proj\.weight": ("heads_in", "hidden"),
        r"(attn|mlp)\.c_proj\.bias": ("hidden",),
        r"mlp\.c_fc\.weight": ("hidden_in", "ffn"),
        r"mlp\.c_fc\.bias": ("ffn",),
        r"mlp\.c_proj\.weight": ("ffn_in", "hidden"),
    }
