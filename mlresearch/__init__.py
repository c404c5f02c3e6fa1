"""mlresearch: multi-level (V-cycle) training and staged growth for transformers."""

__version__ = "0.1.0"
