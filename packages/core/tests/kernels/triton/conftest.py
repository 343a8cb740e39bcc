"""The Triton kernels run here under Triton's interpreter on CPU tensors (``tox -e triton``):
the environment sets ``TRITON_INTERPRET=1`` before Triton is imported, because ``triton.jit``
reads it when each kernel is decorated. Without Triton installed the module is skipped."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
