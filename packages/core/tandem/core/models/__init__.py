"""Decoder-only model families, registered by their Hugging Face architecture name."""
