"""The emergency save's path: nothing but its commit on the deadline's clock, its own measured rate, the
warning when a cloud's notice is too short for the state, and a staging budget that bounds host memory."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

import spotguard
from spotguard import Notice, checkpoint, notices
from spotguard.guard.stats import GuardStats
from spotguard.planner import notice_lead
from spotguard.storage import open_storage
from tests.helpers import subprocess_env

WORKER = "tests/workers/budget_job.py"


def committed(root) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def test_an_emergency_save_leaves_pruning_to_the_next_save(tmp_path):
    """Deleting an old multi-GB checkpoint took 2 s of a 30 s notice: the emergency save only commits."""
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=2, keep=1, busy="wait")
    g.track(model=torch.nn.Linear(4, 4))
    with g:
        g.step(1)
        g.step(2)  # periodic, committed (busy="wait" below)
        g.wait()
        g.watcher.report(Notice("test", "terminate"))
        assert g.step(3) is True
    assert committed(tmp_path) == [(2, "periodic"), (3, "emergency")]  # keep=1, yet step 2 is still there

    g2 = spotguard.Guard(str(tmp_path), providers=[], every_steps=2, keep=1, busy="wait")
    g2.track(model=torch.nn.Linear(4, 4))
    assert g2.resume() == 3
    with g2:
        g2.step(4)  # the next save prunes as usual
        g2.wait()
    assert committed(tmp_path) == [(4, "periodic")]


def test_synchronous_saves_have_their_own_rate_and_the_emergency_estimate_uses_it():
    st = GuardStats()
    st.record_write(1.0, 1_000_000_000)  # background: 1 GB/s
    assert st.durable_seconds() == pytest.approx(1.0)  # nothing synchronous measured yet: the background rate
    st.record_sync(4.0, 1_000_000_000)  # what the loop waited for: 250 MB/s
    assert st.write_Bps == pytest.approx(1e9)  # not averaged together
    assert st.durable_seconds() == pytest.approx(4.0)
    assert st.durable_seconds(two_tiers=True) == pytest.approx(4.0)  # straight to the durable tier, measured


def test_before_any_synchronous_save_the_estimate_uses_the_background_writes_own_work():
    st = GuardStats()
    st.record_write(4.0, 1_000_000_000, work_s=1.0)  # 3 of its 4 s waiting for the loop's CPU
    assert st.write_Bps == pytest.approx(250e6)  # the wall-time rate stays what it was
    assert st.durable_seconds() == pytest.approx(1.0)
    assert st.durable_seconds(two_tiers=True) is None  # an upload's rate is the network's: not guessed from the disk
    st.record_sync(2.0, 1_000_000_000)
    assert st.durable_seconds() == pytest.approx(2.0)  # measured synchronous saves win


def test_a_background_write_beside_a_busy_loop_records_its_own_work_apart(tmp_path):
    """A periodic write that shares the CPU and the GIL with a loop running Python: its wall time
    counts the waiting, its work does not (the first emergency estimate's rate, ``Commit.work_s``)."""
    commits = []
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=2, keep=2, busy="wait", save_on_exit=False)
    g.track(model=torch.nn.Linear(1024, 1024))
    real = g.saves.committed
    g.saves.engine._on_commit = lambda c: (commits.append(c), real(c))
    with g:
        g.step(1)
        g.step(2)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline or g.saves.pending is not None and not g.saves.pending.done():
            sum(range(2000))  # pure Python: holds the GIL most of the time
        g.wait()
    (c,) = commits
    assert c.work_s is not None and 0 < c.work_s < c.seconds
    st = g.stats()
    assert st.work_Bps == pytest.approx(c.manifest.size / c.work_s)
    assert st.durable_seconds() == pytest.approx(c.work_s, rel=1e-6)


def test_a_guard_records_a_manual_save_as_synchronous_and_a_periodic_one_as_background(tmp_path):
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=1, keep=5, busy="wait", save_on_exit=False)
    g.track(model=torch.nn.Linear(64, 64))
    with g:
        g.step(1)
        g.wait()
        st = g.stats()
        assert st.write_Bps is not None and st.sync_Bps is None
        g.save(10, "manual")
        assert st.sync_Bps is not None and st.sync_s is not None


def test_the_shortest_notice_of_the_clouds_polled(tmp_path):
    assert notice_lead(notices.build(["aws", "signal"])) == ("aws", 120.0)
    assert notice_lead(notices.build(["aws", "gcp"])) == ("gcp", 30.0)
    assert notice_lead(notices.build(["signal"])) is None
    g = spotguard.Guard(str(tmp_path), providers=["azure"])  # built, never started: nothing is polled
    assert g.saves.notice_lead == ("azure", 30.0)


def test_one_warning_when_the_measured_state_cannot_commit_within_the_notice(tmp_path, caplog):
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=1, keep=2, busy="wait", save_on_exit=False)
    g.track(model=torch.nn.Linear(64, 64))
    g.saves.notice_lead = ("gcp", 1e-6)  # any measured save is slower than this notice
    with caplog.at_level(logging.WARNING, logger="spotguard"), g:
        for s in range(1, 4):
            g.step(s)
            g.wait()
    warned = [r for r in caplog.records if "notice: it would miss the deadline" in r.getMessage()]
    assert len(warned) == 1
    assert "GCP's 0s notice" in warned[0].getMessage() and "MB/s" in warned[0].getMessage()


def test_no_warning_when_it_fits(tmp_path, caplog):
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=1, keep=2, busy="wait", save_on_exit=False)
    g.track(model=torch.nn.Linear(8, 8))
    g.saves.notice_lead = ("aws", 120.0)
    with caplog.at_level(logging.WARNING, logger="spotguard"), g:
        g.step(1)
        g.wait()
    assert not [r for r in caplog.records if "miss the deadline" in r.getMessage()]


def test_the_first_snapshots_allocation_is_recorded_apart_from_the_stall(tmp_path):
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=1, keep=2, busy="wait", save_on_exit=False)
    g.track(model=torch.nn.Linear(512, 512))
    with g:
        g.step(1)
        g.wait()
        first = g.stats().alloc_s
        g.step(2)
        g.wait()
        assert first is not None and first > 0.0
        assert g.stats().alloc_s == 0.0  # warm: the buffers are reused


def test_staging_budget_is_validated():
    with pytest.raises(spotguard.ConfigError, match="staging_budget"):
        spotguard.Guard("unused", providers=[], staging_budget=-1)


def run_budget_job(root, budget: str) -> dict:
    out = subprocess.run(
        [sys.executable, WORKER, str(root), budget], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
def test_a_state_over_the_staging_budget_is_saved_within_it_and_resumes_exactly(tmp_path):
    """Without a budget the snapshot holds a copy of the whole state; with one smaller than the state the
    save streams it, and the process's peak memory grows by no more than the budget and the writer's buffers."""
    free = run_budget_job(tmp_path / "free", "none")
    assert free["grew"] >= free["state"]  # the measure sees a full copy when there is one
    budget = 32 << 20
    tight = run_budget_job(tmp_path / "tight", str(budget))
    assert tight["budget"] == budget and tight["checkpoints"] == 1
    assert tight["grew"] <= budget + (40 << 20)  # + DirectFile's two 16 MiB buffers and small change
    a = torch.load(tmp_path / "free/step-00000001/state.pt", weights_only=True)["objects"]["model"]
    b = torch.load(tmp_path / "tight/step-00000001/state.pt", weights_only=True)["objects"]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("evaluate_first", [False, True])
def test_the_staging_is_reserved_in_slabs_off_the_loop_before_the_first_save(tmp_path, evaluate_first):
    """The first periodic save finds its buffers allocated: nothing is allocated on the loop's thread.
    ``evaluate_first``: ``guard.step(0)`` after an evaluation before any training step (nanoGPT's at iteration
    0) reserved the staging of a state without AdamW's moments, two thirds of it then allocated by the save."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=2, keep=2, busy="wait", save_on_exit=False)
    g.track(model=model, optimizer=opt)
    staging = g.saves.engine._staging
    assert g.resume() == 0
    with g:
        if evaluate_first:
            with g.evaluation():
                pass
            assert not g.step(0) and staging._reserving is None  # nothing trained yet: nothing to reserve
        model(torch.randn(2, 256)).sum().backward()
        opt.step()  # AdamW makes its moments here, lazily
        g.step(1)  # not due: the reservation starts
        assert staging._reserving is not None
        staging._reserving.join()
        reserved = staging._reserved
        assert len(reserved) == 16 + 16 * 2 + 16  # params, AdamW's moments and steps
        storages = {b.tensor.untyped_storage().data_ptr() for b in reserved}
        assert len(storages) == len(reserved)  # each buffer its own storage: torch.save writes only its bytes
        g.step(2)  # due: the snapshot uses the reserved buffers
        g.wait()
        assert staging.allocations == 0 and g.stats().alloc_s < 0.05
    saved = torch.load(tmp_path / "step-00000002/state.pt", weights_only=True)["objects"]
    assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())
    assert saved["optimizer"]["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
