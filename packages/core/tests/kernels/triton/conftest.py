"""The Triton kernels run here under Triton's interpreter on CPU tensors: ``tox`` sets
``TRITON_INTERPRET=1`` for the whole run, because Triton reads it when each kernel is
decorated, its own library's included (``tl.sum`` and the like, at ``import triton``). Run
another way, the variable is set here, which is in time unless something imported Triton
first (transformers' Qwen3-Next and Qwen3.5 modelling code does): then these tests skip and
say so. Without Triton installed they are skipped too."""

from __future__ import annotations

import os
import sys

import pytest

IMPORTED_UNINTERPRETED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpreted() -> None:
    if IMPORTED_UNINTERPRETED:
        pytest.skip(
            "Triton was imported before TRITON_INTERPRET=1 was set: run through tox, or "
            "export TRITON_INTERPRET=1"
        )
