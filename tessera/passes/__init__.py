"""Transformations within one IR level (fusion decides kernels)."""
