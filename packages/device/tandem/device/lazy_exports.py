"""Package ``__init__`` files that import on first use (PEP 562).

A package re-exports its public names from the modules that define them, but importing one
of its submodules (``tandem.core.kv.block_pool``) must not load the rest of the package (the
engine, the models, the C++ kernel build). Each ``__init__`` keeps a name -> module table and
installs the two functions made here::

    if TYPE_CHECKING:  # what mypy sees
        from tandem.core.llm.engine import LLMEngine
    _EXPORTS = {"LLMEngine": "tandem.core.llm.engine"}
    __all__ = ["LLMEngine"]
    if not TYPE_CHECKING:  # what runs
        __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

``__getattr__`` is hidden from mypy, so a misspelt name is still an error there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: an exported name is
    imported from its module on first access and then kept in the package's namespace."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
