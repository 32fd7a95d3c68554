"""The heartbeat's marks of a save in flight and of an evaluation, which `spotguard rehearse` times
notices into: set at the start, cleared at the end, whichever thread ends it; never by ``step()``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard import heartbeat


class Peek:
    """A tracked object whose ``state_dict()`` (called while a save snapshots) reads the marks."""

    def __init__(self, slots: memoryview) -> None:
        self.slots = slots
        self.seen: list[tuple[int, int]] = []

    def state_dict(self) -> dict:
        self.seen.append((self.slots[heartbeat.SAVING], self.slots[heartbeat.EVALUATING]))
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def guard_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw) -> tuple[spotguard.Guard, memoryview, Peek]:
    beat = heartbeat.create(tmp_path / "beat")
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(beat))
    slots = heartbeat.attach(str(beat))  # another mapping of the same file: what the fleet reads
    g = spotguard.Guard(str(tmp_path / "ckpt"), providers=[], every_steps=3, lease_ttl=None, **kw)
    peek = Peek(slots)
    g.track(model=torch.nn.Linear(2, 2), peek=peek)
    return g, slots, peek


def test_a_synchronous_save_is_marked_while_it_writes(tmp_path, monkeypatch):
    g, slots, peek = guard_for(tmp_path, monkeypatch, async_save=False)
    with g:
        for s in range(1, 4):
            g.step(s)
        assert peek.seen == [(4, 0)]  # 1 + step 3, inside the save
        assert slots[heartbeat.SAVING] == 0  # and cleared once it is committed
    assert slots[heartbeat.SAVING] == 0


def test_a_background_save_is_marked_until_its_thread_ends(tmp_path, monkeypatch):
    g, slots, peek = guard_for(tmp_path, monkeypatch, async_save=True)
    gate = threading.Event()
    stage = g.saves.engine.stage

    def held_stage(*args, **kwargs):
        work = stage(*args, **kwargs)

        def write(cancel: threading.Event) -> None:
            gate.wait(30)
            work(cancel)

        return write

    g.saves.engine.stage = held_stage  # type: ignore[method-assign]
    with g:
        for s in range(1, 4):
            g.step(s)
        # The first step() walks the state to reserve the staging (no save, no mark), then the save of step 3.
        assert peek.seen == [(0, 0), (4, 0)]
        assert slots[heartbeat.SAVING] == 4  # the loop goes on; the save is still in flight
        g.step(4)  # a step writes the step slot only
        assert slots[0] == 4 and slots[heartbeat.SAVING] == 4
        gate.set()
        g.wait()
        assert slots[heartbeat.SAVING] == 0


def test_an_evaluation_is_marked_inside_its_block(tmp_path, monkeypatch):
    g, slots, peek = guard_for(tmp_path, monkeypatch, async_save=False)
    with g:
        g.step(1)
        with g.evaluation() as ev:
            assert slots[heartbeat.EVALUATING] == 2 and not ev.should_stop()
            g.save(1, "manual")  # a save inside an evaluation: both marks at once
        assert peek.seen == [(2, 2)]
        assert slots[heartbeat.EVALUATING] == 0


def test_a_heartbeat_file_of_the_older_layout_keeps_its_two_slots(tmp_path, monkeypatch):
    beat = tmp_path / "beat"
    beat.write_bytes(bytes(heartbeat.MIN_SIZE))  # what an older `spotguard run` creates
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(beat))
    g = spotguard.Guard(str(tmp_path / "ckpt"), providers=[], every_steps=2, lease_ttl=None, async_save=False)
    g.track(model=torch.nn.Linear(2, 2))
    with g:
        g.step(1)
        with g.evaluation():
            pass
        g.step(2)
    assert heartbeat.read(beat) == (2, 0) and beat.stat().st_size == heartbeat.MIN_SIZE
