"""Declarative ctypes bindings: a table of C functions, bound once per library file."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CFunction:
    name: str
    restype: Any
    argtypes: tuple[Any, ...]


class LibraryNotFound(RuntimeError):
    """The shared library could not be found or loaded; the message says where to point."""


class BoundLibrary:
    """A shared library with every function of its table typed; a missing symbol fails at load,
    not at the first call in the middle of serving."""

    def __init__(self, path: str, functions: Sequence[CFunction]) -> None:
        self.path = path
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as exc:
            raise LibraryNotFound(f"cannot load {path}: {exc}") from None
        self._functions: dict[str, Any] = {}
        for fn in functions:
            try:
                handle = getattr(self._lib, fn.name)
            except AttributeError:
                raise LibraryNotFound(f"{path} does not export {fn.name}") from None
            handle.restype = fn.restype
            handle.argtypes = list(fn.argtypes)
            self._functions[fn.name] = handle

    def __getitem__(self, name: str) -> Any:
        return self._functions[name]

    def has_symbol(self, name: str) -> bool:
        return hasattr(self._lib, name)


_bound: dict[tuple[str, str], BoundLibrary] = {}
_bound_lock = threading.Lock()


def bind_library(path: Path | str, table: str, functions: Sequence[CFunction]) -> BoundLibrary:
    """The bound library for ``path`` (one per path and table per process)."""
    key = (str(path), table)
    with _bound_lock:
        library = _bound.get(key)
        if library is None:
            library = BoundLibrary(str(path), functions)
            _bound[key] = library
        return library
