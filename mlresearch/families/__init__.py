"""The family registry: each architecture is one small declarative spec (see ``base.py``).

Adding a family: write ``families/<name>.py`` with a :class:`Family` subclass, add it to
``FAMILIES`` and to the test matrix in ``tests/models.py``.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Family, HFFamily, Recipe, Sizes
from .bert import BERT
from .gpt2 import GPT2
from .gpt_neox import GPTNeoX
from .llama import Llama
from .mistral import Mistral
from .opt import OPT
from .qwen import Qwen2, Qwen3
from .vit import ViT

FAMILIES: dict[str, Family] = {f.name: f for f in (GPT2(), BERT(), Llama(), ViT(), Qwen2(), Qwen3(), Mistral(),
                                                     GPTNeoX(), OPT())}


def family_of(model: nn.Module) -> Family:
    """The family spec that describes ``model``'s parameters."""
    for family in FAMILIES.values():
        if family.matches(model):
            return family
    supported = ", ".join(
        c for f in FAMILIES.values() for c in (getattr(f, "classes", None) or ("timm VisionTransformer",))
    )
    raise UnsupportedModelError(f"unsupported model class {type(model).__name__}; supported: {supported}")


__all__ = ["FAMILIES", "Family", "HFFamily", "Recipe", "Sizes", "family_of"]
