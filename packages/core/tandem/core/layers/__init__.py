"""Tensor-parallel-aware building blocks of the decoder models."""
