"""Tandem's reference engine: real inference in PyTorch over a paged KV cache."""
