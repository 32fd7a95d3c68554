"""The heartbeat's save and evaluation marks of a trainer integration (what ``spotguard rehearse`` times)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from spotguard import heartbeat


class Marks:
    """The heartbeat's ``SAVING`` and ``EVALUATING`` marks of an integration, as the ``Guard`` sets them
    (``heartbeat.Activity``): ``spotguard rehearse --during-save/--during-eval`` times notices into them.

    A trainer's save or evaluation often begins in one hook and ends in another, so a mark is held
    here by its slot: ``begin`` while one is held keeps the earlier start (the save began before this
    hook), ``end`` clears it (nothing when none is held). ``during`` is both around one block."""

    def __init__(self, slots: memoryview) -> None:
        #: Also what ``guard.evaluation()`` (the Guard's ``Evaluation``) marks through.
        self.activity = heartbeat.Activity(slots)
        self._held: dict[int, int] = {}

    def begin(self, slot: int, step: int) -> None:
        if slot not in self._held:
            self._held[slot] = self.activity.begin(slot, step)

    def end(self, slot: int) -> None:
        mark = self._held.pop(slot, None)
        if mark is not None:
            self.activity.end(slot, mark)

    def held(self, slot: int) -> bool:
        return slot in self._held

    @contextmanager
    def during(self, slot: int, step: int, *, last: bool = False) -> Iterator[None]:
        """Marked for the block. A mark held already stays after it, unless the block is the save's or
        the evaluation's ``last`` part (a trainer's commit of the folder it wrote)."""
        ends = last or slot not in self._held
        self.begin(slot, step)
        try:
            yield
        finally:
            if ends:
                self.end(slot)
