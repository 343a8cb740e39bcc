"""The CPU vendor the kernels' per-vendor tuning is chosen by."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from tandem.device.cpu import cpu_vendor

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not CPUINFO.is_file(),
    reason="an x86 CPU's /proc/cpuinfo names its vendor",
)
def test_an_x86_cpu_names_its_vendor() -> None:
    vendor = cpu_vendor()
    assert vendor and " " not in vendor
    assert f"vendor_id\t: {vendor}\n" in CPUINFO.read_text(encoding="ascii", errors="replace")
