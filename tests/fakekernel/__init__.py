"""Fake kernels: what a mode wrote, interpreted in memory (no root, no kernel)."""
