"""Finding tags in text that arrives in pieces."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``: they must be
    held back until the next piece says whether the tag is there."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
