"""``tandem`` commands for the end-to-end tests, run in processes forked from a server that
imported torch, transformers and the CLI once.

Why: CI runs on two cores and is bound by CPU, and a short ``tandem generate`` on a test model
is mostly its interpreter's start. Measured on a 2-core AMD EPYC (AVX2) guest: importing the
CLI costs 2.6-2.8 s of CPU (torch 2.1 s of it), loading a tokenizer 0.8 s more (transformers
reads its whole models tree on import), against well under a second of work; the topology
suites start ~80 such processes. A child of the fork server starts with those modules
imported and runs ``tandem.server.cli.main.main(argv)``, what the ``tandem`` command runs:
its own process with the environment given, its own stdout and stderr, its exit status.
The end-to-end fixtures' ``tandem serve`` processes start the same way (``start_logged``):
integration/ without the hostile-clients run and the topology suites (170 tests, ``-n 3``,
on the same guest) took 110.9 and 120.3 s (216 and 228 s of CPU) with their servers started
so, 160.8 s (319 s of CPU) with real processes.

What it does not run is the interpreter's start itself, so the environment given must be
read at run time, not at import: ``TANDEM_*`` switches are (no Tandem module reads the
environment on import), ``OMP_NUM_THREADS`` or ``LD_PRELOAD`` are not; where the environment
changes a name read on import, ``run`` starts the real executable instead (and ``start``
refuses). The child ends as multiprocessing's do, with ``os._exit`` after Python's exit
handlers: what a C library does at exit does not run, so tests that read that (the HCCL
stand-in's leak report, hw/tests) start the real executable, as do the tests of the command
line as such (exit codes, signals, messages: packages/server/tests/test_cli.py) and the
end-to-end tests of how a server exits (``start_server(real_process=True)``).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

# Imported once by the fork server, so that its children start with them.
CLI = "tandem.server.cli.main"
PRELOAD = ["torch", "transformers.tokenization_utils_tokenizers", CLI, "tandem.server.app"]
# Read when a library loads (or by the interpreter itself): a child of the fork server would
# keep the server's value.
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "PYTHON", "TORCH_", "TRITON_")


@functools.cache
def _server() -> tuple[ForkServerContext, dict[str, str]]:
    """The fork server's context, and the names read on import in the environment it starts
    with (this process's, now: the first child starts it)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context, _read_at_import(os.environ)


def _read_at_import(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(READ_AT_IMPORT)}


def _redirect(path: str, fd: int) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(target, fd)
    os.close(target)


def _main(module: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """The child: the command's environment and output files (one for both where ``out`` is
    ``err``), then ``module``'s ``main``."""
    os.environ.clear()
    os.environ.update(env)
    _redirect(out, 1)
    if err == out:
        os.dup2(1, 2)
    else:
        _redirect(err, 2)
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv)
    finally:
        # What the interpreter runs at exit; a multiprocessing child ends with os._exit.
        atexit._run_exitfuncs()
    sys.exit(code)


class ForkedProcess:
    """A child of the fork server, as much of ``subprocess.Popen`` as the tests use: ``pid``,
    ``poll``, ``wait`` (``subprocess.TimeoutExpired`` past its timeout), ``send_signal``,
    ``kill``. Exit statuses read as Popen's do: the code ``main`` returned or exited with,
    minus the signal's number where a signal ended it; but an exception out of ``main``
    (KeyboardInterrupt included) reads 1, and a fork server that died reads 255 while its
    children may still run."""

    def __init__(self, process: BaseProcess, argv: list[str]) -> None:
        self._process = process
        self._argv = argv
        assert process.pid is not None  # started
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            assert timeout is not None  # join without one returns at the exit
            raise subprocess.TimeoutExpired(self._argv, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._process.kill()


@dataclass
class CliProcess:
    """One ``tandem`` command running in a child of the fork server, its stdout and stderr
    in files of its own folder."""

    process: ForkedProcess
    folder: Path

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def finish(self, timeout_s: float) -> tuple[str, str] | None:
        """(stdout, stderr) once it has exited; None if it is still running after
        ``timeout_s`` (it is then left running: ``kill`` it)."""
        try:
            self.process.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return None
        return self.output()

    def kill(self) -> tuple[str, str]:
        self.process.kill()
        self.process.wait(10)
        return self.output()

    def output(self) -> tuple[str, str]:
        outputs = (
            (self.folder / "stdout").read_text(errors="replace"),
            (self.folder / "stderr").read_text(errors="replace"),
        )
        shutil.rmtree(self.folder, ignore_errors=True)
        return outputs


def start_logged(
    argv: list[str], env: Mapping[str, str], log: Path, module: str = CLI
) -> ForkedProcess:
    """``python -m module *argv`` with ``env`` as its whole environment, in a child of the
    fork server, stdout and stderr into ``log`` (the caller checks ``preloadable`` first)."""
    return _start(argv, env, module, str(log), str(log))


def preloadable(env: Mapping[str, str]) -> bool:
    """Whether a child of the fork server can run with ``env``: its names read on import are
    the fork server's own."""
    return _read_at_import(env) == _server()[1]


def _start(
    argv: list[str], env: Mapping[str, str], module: str, out: str, err: str
) -> ForkedProcess:
    """A started child of the fork server running ``module``'s ``main`` with ``env`` as its
    whole environment and its stdout and stderr in ``out`` and ``err``."""
    env = dict(env)
    if not preloadable(env):
        raise ValueError("the environment changes names read on import: run the executable")
    process = _server()[0].Process(target=_main, args=(module, argv, env, out, err))
    process.start()
    return ForkedProcess(process, [module, *argv])


def start(argv: list[str], env: Mapping[str, str] | None = None, module: str = CLI) -> CliProcess:
    """``python -m module *argv`` (default: the ``tandem`` command) with ``env`` (default:
    this process's environment) as its whole environment, in a child of the fork server;
    output goes to files read by ``CliProcess.output``."""
    env = os.environ if env is None else env
    folder = Path(tempfile.mkdtemp(prefix="tandem-cli-"))
    try:
        process = _start(argv, env, module, str(folder / "stdout"), str(folder / "stderr"))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return CliProcess(process, folder)


def run(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300,
    module: str = CLI,
) -> subprocess.CompletedProcess[str]:
    """``python -m module *argv`` to its end, as ``subprocess.run`` with captured text
    output: a child of the fork server where ``env`` allows, else the real executable."""
    env = dict(os.environ if env is None else env)
    if not preloadable(env):
        command = [sys.executable, "-m", module, *argv]
        return subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    child = start(argv, env, module)
    finished = child.finish(timeout_s)
    if finished is None:
        child.kill()
        raise subprocess.TimeoutExpired([module, *argv], timeout_s)
    out, err = finished
    code = child.returncode
    assert code is not None  # it has exited
    return subprocess.CompletedProcess([module, *argv], code, out, err)
