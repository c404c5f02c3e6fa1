"""HF Qwen2 / Qwen2.5 and Qwen3: the LLaMA layout (RMSNorm, RoPE, SwiGLU, GQA). Qwen2 has q/k/v
biases (covered by the LLaMA table); Qwen3 has none, a head_dim of its own (q/o projections need
not be square) and RMSNorms on q and k over head_dim, shared by all heads: head_dim is kept by
every operator, so those norms are left as they are."""

from .llama import Llama


class Qwen2(Llama):
    name = "qwen2"
    classes = ("Qwen2ForCausalLM",)
    config_class = "Qwen2Config"


class Qwen3(Llama):
    name = "qwen3"
    classes = ("Qwen3ForCausalLM",)
    config_class = "Qwen3Config"
    block_params = {**Llama.block_params, r"self_attn\.[qk]_norm\.weight": (None,)}
