"""Groups among processes made through a backend plugin."""

from __future__ import annotations

import pytest

from tandem.core.errors import ConfigError
from tandem.core.parallel import groups
from tandem.core.parallel.collective_choice import CollectiveChoice
from tandem.device import Device
from tandem.device.cpu import CpuRuntime


class _OlderBackend:
    """A plugin written before process_group returned the communicators with the group."""

    name = "older"

    def process_group(
        self, device: Device, runtime: object, rank: int, size: int, timeout_s: float
    ) -> object:
        return object()


def test_a_backend_returning_a_bare_group_is_refused_naming_what_to_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(groups, "get_collective_backend", lambda name: _OlderBackend())
    choice = CollectiveChoice(local="inprocess", process="older", dist_backend="gloo")
    with pytest.raises(ConfigError, match=r"'older' returned object .*CrossProcessGroup"):
        groups.make_process_group(
            choice, Device("cpu", 0), CpuRuntime(), rank=0, size=2, timeout_s=5.0
        )
