"""The scenarios' test models: each written once per process (a scenario runs hundreds of
schedules on it), into one folder removed when the process exits. Left behind, as they were,
every suite worker and every ``python -m tandem_sim`` run added folders to /tmp."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.demo.family_demo_model import Qwen3_5DemoSpec, write_qwen3_5_demo_model
from tandem.core.demo.rec_demo_model import tiny_rec_spec, write_rec_demo_model


@lru_cache(maxsize=1)
def _folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tandem-sim-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@lru_cache(maxsize=1)
def tiny_model() -> Path:
    """The tiny dense demo model."""
    return write_demo_model(_folder() / "tiny", tiny_spec())


@lru_cache(maxsize=1)
def tiny_hybrid() -> Path:
    """A Qwen3.5 hybrid of two layers (Gated DeltaNet, then gated full attention), heads that
    split over two ranks."""
    spec = Qwen3_5DemoSpec(
        hidden_size=32, intermediate_size=64, num_layers=2, full_attention_interval=2,
        num_heads=2, num_kv_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        vocab_size=512, max_position_embeddings=128, init_std=0.2,
    )  # fmt: skip
    return write_qwen3_5_demo_model(_folder() / "hybrid", spec)


@lru_cache(maxsize=1)
def rec_model() -> Path:
    """The tiny generative recommender."""
    return write_rec_demo_model(_folder() / "rec", tiny_rec_spec())
