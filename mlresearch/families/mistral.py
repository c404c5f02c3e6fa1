"""HF Mistral: the LLaMA layout (sliding-window attention changes no parameter)."""

from .llama import Llama


class Mistral(Llama):
    name = "mistral"
    classes = ("MistralForCausalLM",)
    config_class = "MistralConfig"
