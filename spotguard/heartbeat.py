"""The heartbeat between a training process and ``spotguard run``: a 16-byte shared file.

The supervisor creates the file and passes its path in ``$SPOTGUARD_HEARTBEAT``. The child's
``Guard`` maps it with ``mmap`` and, on every ``guard.step(n)``, stores ``n`` in the first slot: one
memory write, no system call, so the hot path stays well under a microsecond. The second slot is
set to ``STOPPED_FOR_NOTICE`` when the Guard stops for a notice, so the supervisor knows not to
restart even when the child's exit code says nothing; ``COMMITTED`` is added once that stop's
checkpoint is committed (written, or there already), so the supervisor exits 75 ("checkpoint
written") only when it is true; ``CONFIG_ERROR`` is added when the Guard raised an error that a
restart would meet again (a checkpoint that no resume can load, a changed data loader);
``LEASE_HELD`` when another job holds (or took over) the writer lease of its storage. The
supervisor reads the file (the page cache is shared) and measures time on its own clock: the child
never calls a clock for the heartbeat.

Two more slots say what the job is doing between steps, so ``spotguard rehearse`` can time a notice
into it and say where each one landed (``Activity``): ``SAVING`` holds 1 + the step of the save in
flight (a background save until its thread ends), ``EVALUATING`` 1 + the step an evaluation follows
inside ``guard.evaluation()``; 0 otherwise. Each is written at a save's or an evaluation's start and
end, never by ``guard.step()``. They are slots of their own, not flag bits: a background save's
thread clears its mark while the loop's thread may be setting a stop flag, and a read-modify-write of
one shared word from two threads could lose one of them. A file of the older 16-byte layout still
works: the two marks are then not kept.

``Beat`` is the child's side, with a name for each write (``step``, ``stopped``, ``committed``,
``permanent``, ``lease_held``); the Guard, the stop protocol and every trainer integration write
through it. A flag is only ever added, never cleared.

When the variable is set, the Guard also registers ``faulthandler`` on ``STACKS_SIGNAL`` so a hung
child prints every thread's Python stack to its stderr (the supervisor's log) when asked, even while
its main thread is blocked in C code.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import mmap
import os
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec

from spotguard import _env
from spotguard.errors import PERMANENT, LeaseHeldError

logger = logging.getLogger(__name__)

#: Exit code of a job that stopped for a notice (EX_TEMPFAIL): "stopped on purpose, resume elsewhere".
EXIT_PREEMPTED = 75
#: Exit code of ``spotguard run`` when its job failed on a configuration error (EX_CONFIG): a restart would
#: meet the same error (``errors.PERMANENT``), so it is not restarted. A job may exit with it too.
EXIT_CONFIG = 78
#: Exit code of ``spotguard run`` when another job holds the writer lease of the run's storage, or took
#: it over from this job (EX_CANTCREAT): a restart would meet the same writer, so it is not restarted.
EXIT_LEASE_HELD = 73
HEARTBEAT_ENV = _env.HEARTBEAT
STACKS_SIGNAL = signal.SIGUSR2
SIZE = 32  # four native int64 slots: [last completed step, flags, save in flight, evaluating]
MIN_SIZE = 16  # the first two slots: a file an older spotguard created
#: Slot indices of the two marks (``Activity``): 1 + the step, 0 when none.
SAVING = 2
EVALUATING = 3
STOPPED_FOR_NOTICE = 1
CONFIG_ERROR = 2  # the Guard raised an error a restart would meet again (``errors.PERMANENT``)
COMMITTED = 4  # with STOPPED_FOR_NOTICE: the stop's checkpoint is committed, the resume point is safe
LEASE_HELD = 8  # another job writes to the run's storage (``errors.LeaseHeldError``, ``LeaseLostError``)
_LAYOUT = struct.Struct("=qq")  # the first two slots


def create(path: str | Path) -> Path:
    """Supervisor side: a fresh zeroed heartbeat file (one per child start)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(SIZE))
    os.replace(tmp, path)
    return path


def read(path: str | Path) -> tuple[int, int]:
    """Supervisor side: ``(step, flags)``; ``(0, 0)`` when the file is missing or short."""
    try:
        raw = Path(path).read_bytes()[:MIN_SIZE]
    except OSError:
        return 0, 0
    return _LAYOUT.unpack(raw) if len(raw) == MIN_SIZE else (0, 0)


def attach(path: str | None = None) -> memoryview:
    """Child side: the writable int64 slots, shared with the supervisor when ``path`` is set (two of
    them in a file of the older layout, else four).

    Without a usable path the slots are private memory, so ``Guard.step()`` writes the same way
    either way (no branch on the hot path). Called once, from ``Guard.__init__``.
    """
    path = _env.text(HEARTBEAT_ENV) if path is None else path
    if path:
        try:
            with open(path, "r+b") as f:
                size = min(os.fstat(f.fileno()).st_size, SIZE) // 8 * 8
                if size < MIN_SIZE:
                    raise ValueError(f"{size} bytes, not {SIZE}")
                mapped = mmap.mmap(f.fileno(), size)  # the mapping outlives the file object
            _register_stack_dump()
            return memoryview(mapped).cast("q")
        except (OSError, ValueError) as e:
            logger.warning(
                "heartbeat file %s unusable (%s); the supervisor's hang watchdog will not see steps", path, e
            )
    return memoryview(bytearray(SIZE)).cast("q")


def _register_stack_dump() -> None:
    try:
        faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    except (RuntimeError, ValueError, AttributeError) as e:  # e.g. no usable stderr
        logger.warning("cannot register the stack dump on %s: %s", STACKS_SIGNAL.name, e)


class Activity:
    """The ``SAVING`` and ``EVALUATING`` marks of a heartbeat: set at a save's or an evaluation's start,
    cleared at its end (from any thread; a clear leaves a mark another save set since alone).

    ``begin``/``end`` pass the mark along (the Guard's background save ends it on its own thread).
    A trainer's save or evaluation often begins in one hook and ends in another, so the integrations
    ``hold`` a mark by its slot instead: ``hold`` while one is held keeps the earlier start (the save
    began before this hook), ``release`` clears it (nothing when none is held), ``during`` is both
    around one block."""

    def __init__(self, slots: memoryview | None = None) -> None:
        self._slots = slots if slots is not None and len(slots) > EVALUATING else None
        self._held: dict[int, int] = {}

    def begin(self, slot: int, step: int) -> int:
        """Mark ``slot`` for ``step``; returns the mark, for ``end``."""
        mark = step + 1
        if self._slots is not None:
            self._slots[slot] = mark
        return mark

    def end(self, slot: int, mark: int) -> None:
        slots = self._slots
        if slots is not None and slots[slot] == mark:
            slots[slot] = 0

    def hold(self, slot: int, step: int) -> None:
        if slot not in self._held:
            self._held[slot] = self.begin(slot, step)

    def release(self, slot: int) -> None:
        mark = self._held.pop(slot, None)
        if mark is not None:
            self.end(slot, mark)

    def held(self, slot: int) -> bool:
        return slot in self._held

    @contextmanager
    def during(self, slot: int, step: int, *, last: bool = False) -> Iterator[None]:
        """Marked for the block. A mark held already stays after it, unless the block is the save's or
        the evaluation's ``last`` part (a trainer's commit of the folder it wrote)."""
        ends = last or slot not in self._held
        self.hold(slot, step)
        try:
            yield
        finally:
            if ends:
                self.release(slot)


P = ParamSpec("P")


def marking(init: Callable[P, None]) -> Callable[P, None]:
    """Decorate a constructor (``Guard``'s, the trainer integrations'): an error it raises that a restart would
    meet again (a bad option, a malformed storage URL: ``errors.PERMANENT``) marks the heartbeat as
    ``Beat.marks`` does, so that ``spotguard run`` exits 78 at once instead of restarting into it."""

    @functools.wraps(init)
    def construct(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            init(*args, **kwargs)
        except PERMANENT as e:
            Beat().permanent(e)  # no Beat of the object's yet: its own mapping of the same file
            raise

    return construct


class Beat:
    """The child's named writes to its heartbeat: the step on the hot path, then the flags ``spotguard
    run`` reads when the child exits (each only added, never cleared), and the ``activity`` marks.

    ``slots``: those of ``attach()`` (the default: shared with ``spotguard run`` when
    ``$SPOTGUARD_HEARTBEAT`` is set, else private memory)."""

    def __init__(self, slots: memoryview | None = None) -> None:
        self.slots = attach() if slots is None else slots
        #: The ``SAVING`` and ``EVALUATING`` marks, of a save in flight and of an evaluation.
        self.activity = Activity(self.slots)

    @property
    def flags(self) -> int:
        return int(self.slots[1])

    def step(self, n: int) -> None:
        """The last completed step: one memory write, no system call (the supervisor's hang watchdog)."""
        self.slots[0] = n

    def stopped(self) -> None:
        """Stopped for a notice (also where only another rank saw it): ``spotguard run`` does not restart."""
        self.slots[1] |= STOPPED_FOR_NOTICE

    def committed(self) -> None:
        """The stop's checkpoint is committed: ``spotguard run`` exits 75 only then."""
        self.slots[1] |= COMMITTED

    def lease_held(self) -> None:
        """Another job holds (or took over) the run's writer lease: ``spotguard run`` exits 73, no restart."""
        self.slots[1] |= LEASE_HELD

    def permanent(self, error: BaseException) -> None:
        """``error`` would come back after a restart: ``spotguard run`` exits 78, no restart."""
        self.slots[1] |= CONFIG_ERROR
        logger.debug("marked the heartbeat: %s is not retried", type(error).__name__)

    @contextmanager
    def marks(self) -> Iterator[None]:
        """Mark an error raised in the block that ``spotguard run`` must not restart into: one a restart
        would meet again (``errors.PERMANENT``: exit 78) or another job's writer lease (exit 73)."""
        try:
            yield
        except PERMANENT as e:
            self.permanent(e)
            raise
        except LeaseHeldError:
            self.lease_held()
            raise
