"""When the rehearsal's notice clock starts on a machine that resumes: at its first step of training.

A job may report its resume step before training (examples/train.py evaluates first when it resumes at
a multiple of ``--eval-every``): a notice timed from that report could stop the job before it trained a
single step on the machine (seen once as a flaky five-preemption rehearsal whose fifth stop was at the
fourth's step). The job here is a real process writing the real heartbeat.
"""

from __future__ import annotations

import sys

from spotguard.ops.rehearsal import RehearsalOptions
from spotguard.ops.rehearsal.fleet import Fleet, Machine, Planned
from spotguard.ops.rehearsal.notices import make_sender

JOB = """
import signal, sys, time
from spotguard import heartbeat
slots = heartbeat.attach()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
slots[0] = 45  # the resume step, reported first: an evaluation due there
time.sleep(1.0)
for step in range(46, 1000):
    slots[0] = step
    time.sleep(0.02)
"""


def test_a_notice_is_timed_from_the_first_step_past_the_machines_resume_point(tmp_path):
    o = RehearsalOptions(command=[sys.executable, "-c", JOB], preemptions=1, source="signal", lead_s=10.0, poll_s=0.01)
    fleet = Fleet(o, tmp_path)
    before = Machine(1, 0.0, end=0.0, code=75, storage_read=True, latest_step=45)  # it committed step 45
    fleet.machines = [before]
    sender = make_sender("signal", 10.0, tmp_path)
    try:
        m = fleet._machine(sender, Planned(0.2), None)
    finally:
        sender.close()
    first_trained = next(t for t, step in m.timeline if step == 46)
    assert m.resumes_at == 45 and m.code == 75
    assert m.notice is not None and m.notice >= first_trained + 0.2, m.to_dict()
    assert m.landed == "step"


def test_without_a_read_storage_the_clock_starts_at_the_first_report():
    m = Machine(2, 0.0, timeline=[(1.0, 45), (2.0, 46)])
    assert m.resumes_at is None and m.first_new_step == 1.0
    m.resumes_at = 45
    assert m.first_new_step == 2.0
