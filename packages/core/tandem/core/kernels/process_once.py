"""A value made on first use and kept for the life of the process: a kernel library loaded
(or None where it cannot be had), whether Triton is usable. One thread makes it while the
others wait, so its outcome is logged once; every device family's loader shares it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ProcessOnce(Generic[T]):
    def __init__(self, load: Callable[[], T]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._loaded: list[T] = []

    @property
    def made(self) -> bool:
        """Whether the value exists yet (read without the lock: it is only ever added)."""
        return bool(self._loaded)

    def __call__(self) -> T:
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]
