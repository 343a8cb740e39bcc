"""``ProcessOnce``: a value made once per process, on first use."""

from __future__ import annotations

import itertools

from tandem.core.kernels.process_once import ProcessOnce


def test_process_once_makes_its_value_once_and_says_so() -> None:
    counter = itertools.count()
    once = ProcessOnce(lambda: next(counter))
    assert not once.made
    assert once() == 0
    assert once() == 0
    assert once.made
