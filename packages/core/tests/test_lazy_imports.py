"""Package ``__init__`` files import on first use: importing one submodule loads that module
and what it imports, not the engine behind the package's public names; and every public name
still resolves from the package."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest

# Importing the block pool (what the KV accounting needs) must load none of these: the engine
# and its loop, the executors, the models, the C++ kernel build, the collectives.
HEAVY_MODULES = (
    "tandem.core.llm.engine",
    "tandem.core.llm.engine_loop",
    "tandem.core.executor.thread_executor",
    "tandem.core.models.registry",
    "tandem.core.kernels.cpu.native_build",
    "tandem.collectives.inprocess",
)
# Nor anything under these.
HEAVY_PACKAGES = (
    "tandem.core.llm",
    "tandem.core.rec",
    "tandem.core.executor",
    "tandem.core.worker",
    "tandem.core.models",
    "tandem.core.layers",
    "tandem.core.kernels",
    "tandem.collectives",
)

PACKAGES = ("tandem.device", "tandem.collectives", "tandem.core", "tandem_sim")


def _loaded_after(statement: str) -> list[str]:
    """The tandem modules a fresh interpreter holds after running ``statement``."""
    code = (
        f"import json, sys\n{statement}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tandem'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", HEAVY_MODULES)
def test_the_named_heavy_modules_exist(module: str) -> None:
    # So that the test below cannot pass because a module was renamed.
    assert importlib.util.find_spec(module) is not None


def test_importing_the_block_pool_loads_no_engine_model_or_kernel_build() -> None:
    loaded = _loaded_after("import tandem.core.kv.block_pool")
    assert "tandem.core.kv.block_pool" in loaded
    assert not [m for m in HEAVY_MODULES if m in loaded]
    heavy = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in HEAVY_PACKAGES)]
    assert not heavy
    # The packages on the way are loaded, their exports are not: a handful of modules.
    assert len(loaded) <= 10, loaded


def test_a_public_name_loads_its_module_on_first_use() -> None:
    loaded = _loaded_after("from tandem.core import SamplingParams")
    assert "tandem.core.llm.sampling_params" in loaded
    assert "tandem.core.llm.engine" not in loaded
    assert "tandem.core.llm.engine" in _loaded_after("from tandem.core import LLMEngine")


def _package(name: str) -> ModuleType:
    if name == "tandem_sim":
        pytest.importorskip("tandem_sim")
    return importlib.import_module(name)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves(name: str) -> None:
    package = _package(name)
    exports: dict[str, str] = package._EXPORTS
    assert sorted(package.__all__) == sorted(exports)
    for export in package.__all__:
        value = getattr(package, export)
        assert value is getattr(importlib.import_module(exports[export]), export)
        assert export in dir(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = package.no_such_name


@pytest.mark.parametrize("name", PACKAGES)
def test_star_import_gives_every_exported_name(name: str) -> None:
    package = _package(name)
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(package.__all__) <= set(namespace)
