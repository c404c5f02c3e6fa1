"""Offline data: real text and images that ship inside pip packages (nothing downloads)."""
