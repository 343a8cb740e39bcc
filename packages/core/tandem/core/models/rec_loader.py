"""Build a recommender from its folder (config.json, *.safetensors, catalog.safetensors),
reading each rank's shard tensor by tensor, like the LLM loader."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.collectives import ProcessGroup
from tandem.core.errors import ModelLoadError
from tandem.core.models.loader import fill_from_checkpoint, materialize, weight_files
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.models.rec_model import GenerativeRecommender

logger = logging.getLogger(__name__)


def load_rec_model(
    folder: Path,
    config: RecModelConfig,
    group: ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> GenerativeRecommender:
    files = [f for f in weight_files(folder) if f.name != "catalog.safetensors"]
    if not files:
        raise ModelLoadError(f"{folder} has no weight files besides the catalog")
    model = materialize(lambda: GenerativeRecommender(config, group), folder, dtype, device)
    fill_from_checkpoint(model, files, f"loading {folder.name} (rank {group.rank})")
    logger.info(
        "loaded recommender %s (%d codebooks of %d, %d+%d layers) in %s",
        folder,
        config.num_codebooks,
        config.codebook_size,
        config.num_encoder_layers,
        config.num_decoder_layers,
        dtype,
    )
    return model
