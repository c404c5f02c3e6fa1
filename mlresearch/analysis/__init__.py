"""Similarity analysis: capture feature and attention maps, compare them, plot them."""

from .capture import Capture, capture
from .metrics import MinibatchCKA, cosine, js_divergence, linear_cka
from .similarity import head_similarity, layer_similarity, neuron_similarity

__all__ = ["Capture", "MinibatchCKA", "capture", "cosine", "head_similarity", "js_divergence", "layer_similarity",
           "linear_cka", "neuron_similarity"]
