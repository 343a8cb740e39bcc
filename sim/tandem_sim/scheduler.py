"""The deterministic scheduler: it implements the ``Sync`` facade, so engine, executor,
worker, communicator and registry code runs on it unchanged.

Every task is a real thread, but only one runs at a time. A task runs until it reaches a
yield point (any facade call: lock, condition, thread start/join, ``yield_point``); there
the strategy picks among the tasks that can run, and the task either goes on (picked again)
or hands control straight to the one picked and waits to be picked itself.
Time is virtual: when every task waits and some wait with a timeout, the clock jumps to the
earliest deadline. When every task waits with no deadline, that is a deadlock, reported with
what each task is blocked on. A task that blocks outside the facade (a raw lock, a sleep)
never comes back: the watchdog reports it by name and label.
"""

from __future__ import annotations

import _thread
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from tandem_sim.strategies import Strategy


class _Signal:
    """A binary semaphore on one raw lock: ``post`` lets one ``wait`` through, a second post
    before that wait changes nothing. The schedule hands control back and forth thousands of
    times per run; ``threading.Semaphore`` builds a condition and a fresh lock per wait, and
    this halves the cost of a hand-off (measured 34 -> 19 us a round trip)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def post(self) -> None:
        try:  # noqa: SIM105 - a hot path; suppress() costs a context manager per hand-off
            self._lock.release()
        except RuntimeError:
            pass  # already posted

    def wait(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)


@dataclass(frozen=True)
class _End:
    """Why no task can be picked: all done (neither field), a deadlock, or the step limit."""

    deadlock: str | None = None
    stuck: str | None = None


class SimulationAborted(BaseException):
    """Raised inside the tasks of an abandoned schedule, to unwind them."""


@dataclass
class _Task:
    name: str
    sem: _Signal = field(default_factory=_Signal)
    done: bool = False
    label: str = "start"
    # While blocked: what on (for reports), when it may run again, and until when.
    blocked_on: str | None = None
    wake: Callable[[], bool] | None = None
    deadline: float | None = None
    error: BaseException | None = None


@dataclass
class Outcome:
    decisions: list[str]
    labels: list[str]
    errors: dict[str, BaseException]
    deadlock: str | None = None
    stuck: str | None = None

    @property
    def ok(self) -> bool:
        return not self.errors and self.deadlock is None and self.stuck is None

    def describe(self) -> str:
        if self.stuck:
            return f"stuck: {self.stuck}"
        if self.deadlock:
            return f"deadlock: {self.deadlock}"
        return "; ".join(f"{task}: {type(e).__name__}: {e}" for task, e in self.errors.items())


class SimThread:
    """The facade's thread handle for a task."""

    def __init__(self, scheduler: DeterministicScheduler, task: _Task) -> None:
        self._scheduler = scheduler
        self._task = task
        self.name = task.name

    def is_alive(self) -> bool:
        return not self._task.done

    def join(self, timeout: float | None = None) -> None:
        s = self._scheduler
        deadline = None if timeout is None else s.monotonic() + timeout
        while not self._task.done:
            if deadline is not None and s.monotonic() >= deadline:
                return
            s._block(f"join {self.name}", lambda: self._task.done, deadline)


class SimLock:
    def __init__(self, scheduler: DeterministicScheduler, name: str) -> None:
        self._s = scheduler
        self.name = name
        self.owner: _Task | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        s = self._s
        s.yield_point(f"acquire {self.name}")
        deadline = None if timeout is None or timeout < 0 else s.monotonic() + timeout
        while self.owner is not None:
            if not blocking or (deadline is not None and s.monotonic() >= deadline):
                return False
            owner = self.owner.name
            s._block(f"{self.name} held by {owner}", lambda: self.owner is None, deadline)
        self.owner = s._me()
        return True

    def release(self) -> None:
        if self.owner is None:
            raise RuntimeError(f"release of unlocked {self.name}")
        self.owner = None
        self._s.yield_point(f"release {self.name}")

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        self.release()


class _Waiter:
    def __init__(self) -> None:
        self.notified = False


class SimCondition:
    def __init__(self, scheduler: DeterministicScheduler, name: str) -> None:
        self._s = scheduler
        self.name = name
        self._lock = SimLock(scheduler, f"{name}.lock")
        self._waiters: list[_Waiter] = []

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        s = self._s
        if self._lock.owner is not s._me():
            raise RuntimeError(f"wait on {self.name} without holding it")
        waiter = _Waiter()
        self._waiters.append(waiter)
        self._lock.release()
        deadline = None if timeout is None else s.monotonic() + timeout
        s._block(f"wait {self.name}", lambda: waiter.notified, deadline)
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        self._lock.acquire()
        return waiter.notified

    def notify(self, n: int = 1) -> None:
        for waiter in self._waiters[:n]:
            waiter.notified = True
        del self._waiters[:n]

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class DeterministicScheduler:
    def __init__(self, strategy: Strategy, watchdog_s: float = 10.0, max_steps: int = 100_000):
        self.strategy = strategy
        self.watchdog_s = watchdog_s
        self.max_steps = max_steps
        self._tasks: list[_Task] = []
        self._by_thread: dict[int, _Task] = {}
        self._driver = _Signal()
        self._now = 0.0
        self._names: dict[str, int] = {}
        self._decisions: list[str] = []
        self._labels: list[str] = []
        self._aborted = False
        self._running: _Task | None = None
        self._end: _End | None = None

    # -- the Sync facade ----------------------------------------------------------------

    def lock(self) -> SimLock:
        return SimLock(self, self._name("lock"))

    def condition(self) -> SimCondition:
        return SimCondition(self, self._name("cond"))

    def monotonic(self) -> float:
        return self._now

    def yield_point(self, label: str) -> None:
        task = self._by_thread.get(threading.get_ident())
        if task is None:
            return  # not a simulated thread (set-up code before run())
        if self._aborted:
            raise SimulationAborted(label)
        if self._running is not task:
            raise RuntimeError(
                f"{task.name} reached {label!r} while {getattr(self._running, 'name', None)} "
                "was scheduled: two tasks ran at once"
            )
        task.label = label
        if self._hand_on(task) is task:
            return  # picked again: no hand-off at all (most decisions are this one)
        task.sem.wait()
        if self._aborted:
            raise SimulationAborted(label)

    def start_thread(self, target: Callable[[], None], name: str) -> SimThread:
        task = _Task(self._unique(name))
        self._tasks.append(task)
        self.strategy.on_task_created(task.name)

        def body() -> None:
            self._by_thread[threading.get_ident()] = task
            task.sem.wait()
            try:
                target()
            except SimulationAborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported in the outcome
                task.error = exc
            finally:
                task.done = True
                if not self._aborted:
                    self._hand_on(task)

        threading.Thread(target=body, name=f"sim-{task.name}", daemon=True).start()
        handle = SimThread(self, task)
        self.yield_point(f"start {task.name}")
        return handle

    # -- internals ------------------------------------------------------------------------

    def _name(self, kind: str) -> str:
        self._names[kind] = self._names.get(kind, 0) + 1
        return f"{kind}{self._names[kind]}"

    def _unique(self, name: str) -> str:
        taken = {t.name for t in self._tasks}
        if name not in taken:
            return name
        n = 2
        while f"{name}#{n}" in taken:
            n += 1
        return f"{name}#{n}"

    def _me(self) -> _Task:
        task = self._by_thread.get(threading.get_ident())
        if task is None:
            raise RuntimeError("a simulated primitive was used outside a simulated thread")
        return task

    def block(self, on: str, wake: Callable[[], bool], deadline: float | None = None) -> None:
        """Park the calling task until ``wake()`` holds (or virtual time passes ``deadline``);
        ``on`` is what a deadlock report says it waits for. For fakes built on the scheduler."""
        self._block(on, wake, deadline)

    def current_task(self) -> str | None:
        task = self._by_thread.get(threading.get_ident())
        return None if task is None else task.name

    def _block(self, on: str, wake: Callable[[], bool], deadline: float | None) -> None:
        task = self._me()
        task.blocked_on, task.wake, task.deadline = on, wake, deadline
        self.yield_point(f"blocked: {on}")
        task.blocked_on, task.wake, task.deadline = None, None, None

    # -- driving ------------------------------------------------------------------------

    def run(self, main: Callable[[], None], name: str = "main") -> Outcome:
        """Run ``main`` (and every thread it starts) to the end under the strategy.

        The task that reaches a yield point makes the next decision itself and passes control
        straight to the task chosen (or keeps it): the driver only starts the first task,
        watches for a task that stops reaching yield points, and turns the end of the run
        into the outcome. Decisions are the same as a central loop's, made at the same
        points over the same state, since one task runs at a time."""
        self.start_thread(main, name)
        first = self._pick()
        if isinstance(first, _Task):
            first.sem.post()
            # Progress is the decisions made: a task that reaches none in a watchdog period
            # is blocked outside the simulator.
            seen = len(self._decisions)
            while not self._driver.wait(timeout=self.watchdog_s):
                if len(self._decisions) == seen:
                    running = self._running
                    assert running is not None
                    return self._outcome(
                        stuck=f"{running.name} blocked outside the simulator's control after "
                        f"{running.label!r} (a raw lock, sleep or queue?), at:\n"
                        + self._where(running)
                    )
                seen = len(self._decisions)
            end = self._end
        else:
            end = first
        assert end is not None
        return self._outcome(deadlock=end.deadlock, stuck=end.stuck)

    def _hand_on(self, caller: _Task) -> _Task | None:
        """Make the next decision from the calling task and hand control to the task chosen
        (the caller keeps it without a post, which its next wait would take for a hand-off);
        at the end of the run (or a deadlock, or the step limit) wake the driver instead."""
        picked = self._pick()
        if isinstance(picked, _Task):
            if picked is not caller:
                picked.sem.post()
            return picked
        self._end = picked
        self._driver.post()
        return None

    def _pick(self) -> _Task | _End:
        """The next decision: the strategy's choice among the runnable tasks, recorded, or why
        there is none. Advancing virtual time to the earliest deadline is its only other
        effect, and it is the same whoever calls it."""
        while True:
            now = self._now
            live = False
            runnable: list[_Task] = []
            for t in self._tasks:
                if t.done:
                    continue
                live = True
                wake = t.wake
                if wake is None or wake() or (t.deadline is not None and now >= t.deadline):
                    runnable.append(t)
            if not live:
                return _End()
            if runnable:
                break
            deadlines = [t.deadline for t in self._tasks if not t.done and t.deadline is not None]
            if not deadlines:
                graph = "; ".join(
                    f"{t.name} waits on {t.blocked_on}" for t in self._tasks if not t.done
                )
                return _End(deadlock=graph)
            self._now = max(now, min(deadlines))
        step = len(self._decisions)
        if step >= self.max_steps:
            return _End(stuck=f"no end after {self.max_steps} steps")
        chosen_name = self.strategy.choose([t.name for t in runnable], step)
        chosen = next(t for t in runnable if t.name == chosen_name)
        self._decisions.append(chosen.name)
        self._labels.append(chosen.label)
        self._running = chosen
        return chosen

    def _where(self, task: _Task) -> str:
        for ident, owner in self._by_thread.items():
            if owner is task:
                frame = sys._current_frames().get(ident)
                if frame is not None:
                    return "".join(traceback.format_stack(frame)[-8:])
        return "(no frame)"

    def _outcome(self, deadlock: str | None = None, stuck: str | None = None) -> Outcome:
        errors = {t.name: t.error for t in self._tasks if t.error is not None}
        outcome = Outcome(list(self._decisions), list(self._labels), errors, deadlock, stuck)
        if deadlock or stuck:
            # Unwind the tasks left waiting, so abandoned schedules do not pile up threads.
            self._aborted = True
            for task in self._tasks:
                if not task.done:
                    task.sem.post()
        return outcome
