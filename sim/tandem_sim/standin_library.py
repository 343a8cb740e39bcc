"""Build the CPU stand-in for libhccl.so / libnccl.so (``standin/collectives.c``) with the
system C compiler, once per source version, so the hardware bindings run in CI."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "standin" / "collectives.c"


class StandinUnavailable(RuntimeError):
    """No C compiler here, or the build failed; the message says which."""


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build_standin_library(build_dir: Path) -> Path:
    """The stand-in shared library under ``build_dir`` (built if this source version has not
    been built there yet). Safe when several processes build at once: each compiles to a
    private file and renames it into place."""
    compiler = find_compiler()
    if compiler is None:
        raise StandinUnavailable(
            "no C compiler (cc, gcc or clang; or set CC) to build the stand-in"
        )
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = build_dir / f"libtandem_standin-{digest}.so"
    if target.is_file():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=".standin-", suffix=".so", dir=build_dir)
    os.close(fd)
    command = [compiler, "-shared", "-fPIC", "-O2", "-pthread", "-o", scratch, str(SOURCE), "-lrt"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        Path(scratch).unlink(missing_ok=True)
        raise StandinUnavailable(
            f"building the stand-in failed: {' '.join(command)}\n{result.stderr}"
        )
    os.replace(scratch, target)
    return target


class StandinProbe:
    """The stand-in's test-only exports (what each communicator recorded, counters) and its
    copy of the ACL runtime's per-thread device."""

    def __init__(self, path: Path | str) -> None:
        self._lib = ctypes.CDLL(str(path))
        self._lib.TandemStandinLastStream.restype = ctypes.c_size_t
        for name in ("TandemStandinLastStream", "TandemStandinCommDevice", "TandemStandinCommRank"):
            getattr(self._lib, name).argtypes = [ctypes.c_void_p]
        self._lib.TandemStandinLiveComms.argtypes = []
        self._lib.TandemStandinInFlight.argtypes = [ctypes.c_int]
        self._lib.aclrtSetDevice.argtypes = [ctypes.c_int32]
        self._lib.aclrtGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int32)]

    def last_stream(self, comm: int) -> int:
        return int(self._lib.TandemStandinLastStream(comm))

    def comm_device(self, comm: int) -> int:
        return int(self._lib.TandemStandinCommDevice(comm))

    def comm_rank(self, comm: int) -> int:
        return int(self._lib.TandemStandinCommRank(comm))

    def live_comms(self) -> int:
        """Communicators created and neither destroyed nor aborted, in this process."""
        return int(self._lib.TandemStandinLiveComms())

    def in_flight(self, device: int) -> int:
        """HCCL collective calls inside the library on ``device`` right now."""
        return int(self._lib.TandemStandinInFlight(device))

    def set_device(self, device: int) -> int:
        """``aclrtSetDevice``: the ACL result code."""
        return int(self._lib.aclrtSetDevice(device))

    def get_device(self) -> tuple[int, int]:
        """``aclrtGetDevice``: (ACL result code, the calling thread's device)."""
        value = ctypes.c_int32(-1)
        code = int(self._lib.aclrtGetDevice(ctypes.byref(value)))
        return code, value.value
