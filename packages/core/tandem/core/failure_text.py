"""What a failure says to a client: one line naming the cause, without the source locations,
file paths and module paths of the libraries it came through. The full text, traceback
included, goes to the server's log where it was caught."""

from __future__ import annotations

import re

# gloo / c10 style "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] " prefixes.
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|c|h|hpp|cu|py):\d+\]\s*")
# Absolute or relative paths with at least two components; the last one is kept.
_PATH = re.compile(r"(?<![\w.])(?:\.{0,2}/)?(?:[\w.\-+@]+/)+([\w.\-+@]+)")
# Python module paths such as "transformers.tokenization_utils_base.Tokenizer.method": the
# last component is kept.
_MODULE_PATH = re.compile(r"\b(?:[A-Za-z_]\w*\.){2,}([A-Za-z_]\w*)")

MAX_LENGTH = 500


def client_text(text: str) -> str:
    """The first non-empty line of ``text``, without locations and paths, at most
    ``MAX_LENGTH`` characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    first = _SOURCE_LOCATION.sub("", first)
    first = _PATH.sub(r"\1", first)
    first = _MODULE_PATH.sub(r"\1", first)
    return first[:MAX_LENGTH]


def describe(error: BaseException) -> str:
    """``Type: message`` of ``error``, fit for a client."""
    text = client_text(str(error))
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def rank_failure(rank: int, device: object, error: BaseException | str) -> str:
    """``rank R (device) failed: cause``, the one sentence every request of a failed step gets."""
    cause = describe(error) if isinstance(error, BaseException) else client_text(error)
    return f"rank {rank} ({device}) failed: {cause}"
