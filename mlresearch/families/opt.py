"""HF OPT: learned positions (offset by 2), LayerNorm with biases, q/k/v/out with biases, a head
tied to the token embedding. Pre-norm (``do_layer_norm_before``) as in every size but 350m,
whose post-norm blocks and ``project_in``/``project_out`` are refused (no axis rule for them)."""

from ..errors import UnsupportedModelError
from .base import HFFamily


class OPT(HFFamily):
    name = "opt"
    classes = ("OPTForCausalLM",)
    config_class = "OPTConfig"
    layers = "model.decoder.layers"
    residual_writers = r"(self_attn\.out_proj|fc2)\.(weight|bias)"
    attention_output = "self_attn.out_proj"
    config_keys = {**HFFamily.config_keys, "ffn": "ffn_dim"}
    top_params = {
        r"model\.decoder\.embed_(tokens|positions)\.weight": (None, "hidden"),
        r"model\.decoder\.final_layer_norm\.(weight|bias)": ("final_norm",),
        r"lm_head\.weight": (None, "hidden_in"),  # only seen when untied
    }
    block_params = {
        r"self_attn\.[qkv]_proj\.weight": ("heads", "hidden_in"),
        r"self_attn\.[qkv]_proj\.bias": ("heads",),
        r"self_attn\.out_proj\.weight": ("hidden", "heads_in"),
        r"(self_attn\.out_proj|fc2)\.bias": ("hidden",),
        r"(self_attn_layer_norm|final_layer_norm)\.(weight|bias)": ("hidden",),
        r"fc1\.weight": ("ffn", "hidden_in"),
        r"fc1\.bias": ("ffn",),
        r"fc2\.weight": ("hidden", "ffn_in"),
    }

    def matches(self, model) -> bool:
        if not super().matches(model):
            return False
        c = model.config
        if not c.do_layer_norm_before or c.word_embed_proj_dim != c.hidden_size:
            raise UnsupportedModelError("OPT with post-norm blocks or project_in/project_out (OPT-350m) is not "
                                        "supported: the opt family describes the pre-norm layout")
        return True

    def resize(self, recipe, sizes):
        resized = super().resize(recipe, sizes)
        resized.config.word_embed_proj_dim = sizes.hidden  # kept equal to the hidden size
        return resized

    def new(self, sizes, **options):
        return super().new(sizes, **{"word_embed_proj_dim": sizes.hidden, **options})
