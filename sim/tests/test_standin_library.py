"""The stand-in communicator library is built once per source version and fails to build with
the compiler's own message; the ACL runtime's per-thread device it carries, the HCCL entry
points that need one, its report of communicators left at exit, and its deadlines' clock.
(Its collectives are tested through the bindings in hw/tests.)"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest
from tandem_sim.standin_library import (
    StandinProbe,
    StandinUnavailable,
    build_standin_library,
    find_compiler,
)

T = TypeVar("T")


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_built_once_and_exports_both_apis(tmp_path: Path) -> None:
    first = build_standin_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_standin_library(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    lib = ctypes.CDLL(str(first))
    for symbol in (
        "HcclCommInitAll",
        "HcclCommInitRootInfo",
        "ncclCommInitAll",
        "ncclCommInitRank",
    ):
        assert hasattr(lib, symbol)
    assert lib.TandemStandinVersion() >= 1
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_failing_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = tmp_path / "cc-that-fails"
    failing.write_text("#!/bin/sh\necho 'no toolchain here' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(StandinUnavailable, match="no toolchain here"):
        build_standin_library(tmp_path / "build")
    assert not list((tmp_path / "build").glob("*.so"))


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine")
    return build_standin_library(tmp_path_factory.mktemp("standin"))


def _on_new_thread(fn: Callable[[], T]) -> T:
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join(30)
    return box[0]


def test_the_acl_device_is_per_thread(standin: Path) -> None:
    """aclrtSetDevice sets the calling thread's device (CANN aclrtSetDevice reference); codes
    from acl_base.h."""
    probe = StandinProbe(standin)
    assert _on_new_thread(probe.get_device)[0] == 107002  # ACL_ERROR_RT_CONTEXT_NULL
    assert _on_new_thread(lambda: (probe.set_device(5), probe.get_device())[1]) == (0, 5)
    assert _on_new_thread(lambda: probe.set_device(-1)) == 107001  # invalid device id
    assert _on_new_thread(probe.get_device)[0] == 107002


def test_hccl_entry_points_need_a_device_on_the_calling_thread(standin: Path) -> None:
    """op_base.cc reads the thread's device first (hrtGetDeviceRefresh): HCCL_E_RUNTIME."""
    lib = ctypes.CDLL(str(standin))
    lib.HcclCommDestroy.argtypes = [ctypes.c_void_p]
    probe = StandinProbe(standin)

    def init_all() -> tuple[int, list[int]]:
        devices = (ctypes.c_int32 * 2)(0, 1)
        comms = (ctypes.c_void_p * 2)()
        code = int(lib.HcclCommInitAll(ctypes.c_uint32(2), devices, comms))
        return code, [int(c or 0) for c in comms]

    assert _on_new_thread(init_all)[0] == 15

    def bound_init_all() -> tuple[int, list[int]]:
        probe.set_device(0)
        return init_all()

    def destroy(comm: int, device: int | None) -> int:
        if device is not None:
            probe.set_device(device)
        return int(lib.HcclCommDestroy(comm))

    code, comms = _on_new_thread(bound_init_all)
    assert code == 0 and probe.live_comms() == 2
    assert [_on_new_thread(partial(destroy, c, None)) for c in comms] == [15, 15]
    assert [_on_new_thread(partial(destroy, c, 1)) for c in comms] == [0, 0]
    assert probe.live_comms() == 0


def test_communicators_alive_at_exit_are_reported_on_request(standin: Path) -> None:
    script = (
        "import ctypes\n"
        f"lib = ctypes.CDLL({str(standin)!r})\n"
        "lib.aclrtSetDevice(0)\n"
        "lib.HcclCommInitAll(1, (ctypes.c_int32 * 1)(0), (ctypes.c_void_p * 1)())\n"
    )
    for env, expected in (({"TANDEM_STANDIN_REPORT_LEAKS": "1"}, True), ({}, False)):
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        reported = "1 communicator(s) never destroyed" in done.stderr
        assert reported is expected


# Preloaded into a process, moves its CLOCK_REALTIME by SHIFT_S seconds, as if the wall clock
# stepped right after every reading (the kernel's own clock, which a timed wait on
# CLOCK_REALTIME compares against, is untouched).
_WALL_CLOCK_SHIFT = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>
int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && id == CLOCK_REALTIME) ts->tv_sec += SHIFT_S;
    return rc;
}
"""

# Ranks 0..N-1 (N from argv) on threads bound to their devices call HcclBarrier on a clique of
# two, rank i after i/2 s; prints the wall clock, the seconds the barrier took, each rank's code.
_BARRIER = (
    "import ctypes, sys, threading, time\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "lib.HcclBarrier.argtypes = [ctypes.c_void_p, ctypes.c_void_p]\n"
    "lib.aclrtSetDevice(0)\n"
    "comms = (ctypes.c_void_p * 2)()\n"
    "assert lib.HcclCommInitAll(2, (ctypes.c_int32 * 2)(0, 1), comms) == 0\n"
    "ranks = int(sys.argv[2])\n"
    "codes = [None] * ranks\n"
    "def rank(i):\n"
    "    lib.aclrtSetDevice(i)\n"
    "    time.sleep(0.5 * i)\n"
    "    codes[i] = lib.HcclBarrier(comms[i], ctypes.c_void_p(1))\n"
    "threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]\n"
    "started = time.monotonic()\n"
    "for t in threads: t.start()\n"
    "for t in threads: t.join()\n"
    "print(time.time(), time.monotonic() - started, *codes)\n"
)


def _wall_clock_shift(tmp_path: Path, seconds: int) -> Path:
    source = tmp_path / "wall_clock_shift.c"
    source.write_text(_WALL_CLOCK_SHIFT)
    shim = tmp_path / f"wall_clock_shift{seconds:+d}.so"
    # The stand-in's own compiler (the `standin` fixture skips where there is none).
    command = [str(find_compiler()), "-shared", "-fPIC", f"-DSHIFT_S={seconds}"]
    subprocess.run(
        [*command, "-o", str(shim), str(source), "-ldl"],
        check=True,
        capture_output=True,
    )
    return shim


@pytest.mark.parametrize(
    ("shift_s", "ranks", "timeout_s", "codes", "waited_s"),
    [
        (0, 2, 30, ["0", "0"], (0.4, 20)),
        # The wall clock stepped an hour ahead after each reading: with deadlines on
        # CLOCK_REALTIME the first rank's 30 s deadline was already past; it timed out at once,
        # and so did the second (HCCL_E_TIMEOUT, 9, for both).
        (-3600, 2, 30, ["0", "0"], (0.4, 20)),
        # Stepped an hour back: the missing rank's 1 s timeout became an hour and a second.
        (3600, 1, 1, ["9"], (0.9, 20)),
    ],
    ids=["steady", "stepped-ahead", "stepped-back"],
)
def test_a_wall_clock_step_neither_expires_nor_stretches_a_wait(
    standin: Path,
    tmp_path: Path,
    shift_s: int,
    ranks: int,
    timeout_s: int,
    codes: list[str],
    waited_s: tuple[float, float],
) -> None:
    """The stand-in's barrier keeps its timeout whatever the wall clock does meanwhile."""
    preload = str(_wall_clock_shift(tmp_path, shift_s)) if shift_s else ""
    env = {"LD_PRELOAD": preload, "TANDEM_STANDIN_TIMEOUT_S": str(timeout_s)}
    now = time.time()
    done = subprocess.run(
        [sys.executable, "-c", _BARRIER, str(standin), str(ranks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    wall, waited, *got = done.stdout.split()
    # The shim was in effect (or not): the child's wall clock shifted from this one's.
    assert abs(float(wall) - now - shift_s) < 600
    assert got == codes, done.stderr
    assert waited_s[0] < float(waited) < waited_s[1]
