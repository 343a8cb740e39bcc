"""The items a recommender may emit, as tables that constrain beam search level by level.

An item is a tuple of codes (one per codebook). For level ``l``, every prefix of ``l`` codes
that starts some item gets a row of a boolean table: which codes may follow it. Prefixes are
keyed by their codes read as a number in base ``codebook_size``, so a batch of beams finds its
rows with one ``searchsorted``: no per-beam Python.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.core.errors import ModelLoadError

CATALOG_FILE = "catalog.safetensors"


class Catalog:
    def __init__(self, items: torch.Tensor, codebook_size: int) -> None:
        if items.dim() != 2 or items.shape[0] == 0:
            raise ModelLoadError("the catalog must be a non-empty [items, codebooks] tensor")
        if int(items.min()) < 0 or int(items.max()) >= codebook_size:
            raise ModelLoadError(f"catalog codes must lie in [0, {codebook_size})")
        self.items = items.to(torch.int64)
        self.codebook_size = codebook_size
        self.num_codebooks = int(items.shape[1])
        self.prefix_keys: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []
        for level in range(self.num_codebooks):
            keys = self.key_of(self.items[:, :level])
            unique, row = torch.unique(keys, sorted=True, return_inverse=True)
            table = torch.zeros(unique.numel(), codebook_size, dtype=torch.bool)
            table[row, self.items[:, level]] = True
            self.prefix_keys.append(unique)
            self.allowed.append(table)

    def key_of(self, prefixes: torch.Tensor) -> torch.Tensor:
        """[..., l] codes -> [...] keys (0 for the empty prefix)."""
        keys = torch.zeros(prefixes.shape[:-1], dtype=torch.int64)
        for level in range(prefixes.shape[-1]):
            keys = keys * self.codebook_size + prefixes[..., level]
        return keys

    def allowed_next(self, prefixes: torch.Tensor) -> torch.Tensor:
        """[..., l] prefixes -> [..., codebook_size] codes that extend them to some item."""
        level = prefixes.shape[-1]
        keys = self.key_of(prefixes)
        table_keys = self.prefix_keys[level]
        index = torch.searchsorted(table_keys, keys).clamp(max=table_keys.numel() - 1)
        found = table_keys[index] == keys
        return self.allowed[level][index] & found.unsqueeze(-1)

    def contains(self, items: torch.Tensor) -> torch.Tensor:
        """[N, C] tuples -> [N] whether each is in the catalog."""
        keys = self.key_of(items)
        full = self.key_of(self.items)
        return torch.isin(keys, full)


def load_catalog(folder: Path, codebook_size: int) -> Catalog:
    path = folder / CATALOG_FILE
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no {CATALOG_FILE} (the items beam search may emit)")
    tensors = load_file(str(path))
    if "items" not in tensors:
        raise ModelLoadError(f"{path} has no 'items' tensor")
    return Catalog(tensors["items"], codebook_size)
