"""The fleet of a rehearsal: run the job on one "machine" after another, preempting it on schedule.

Order of one machine: a fresh heartbeat file (and, with ``fresh_local``, a fresh local folder) ->
start the command in its own session with the notice source's environment, ``$SPOTGUARD_HEARTBEAT``
and ``$SPOTGUARD_METRICS_FILE`` set -> watch it every ``poll_s``: its heartbeat (steps, the stop
flag) on our own clock, the moment its notice is due, the notice's deadline (past it the job is
killed, as the cloud kills the machine; a notice meant for a save or an evaluation waits for the
heartbeat's mark, looked at every ``FAST_POLL_S`` meanwhile) -> once it exited and nothing of it
is left, note the newest checkpoint in the storage -> the replacement starts ``replacement_s``
after the job is gone (the old machine idles on until its deadline: the report shows that window
on its own line). What the job's Guard measured is read from its JSON lines afterwards
(``report``); the job's output is never parsed.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import mmap
import os
import random
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard import checkpoint, heartbeat
from spotguard._env import LOCAL_DIR, METRICS_FILE, STORAGE
from spotguard.errors import ConfigError, StorageError
from spotguard.storage import open_storage

from ..supervisor.procs import Job
from .notices import Sender, make_sender
from .options import RehearsalOptions

logger = logging.getLogger(__name__)

#: How often the heartbeat is looked at while a notice waits for a save or an evaluation to begin
#: (a small model's save can take a few tens of milliseconds).
FAST_POLL_S = 0.005


@dataclass
class Planned:
    """One notice to send: ``after`` seconds after the machine's first step, or of its start (``restart``);
    with ``during`` ("save" or "evaluation") at the first moment after that the job is in one."""

    after: float
    restart: bool = False
    during: str | None = None


@dataclass
class Machine:
    """What happened on one machine, on the rehearsal's clock (Unix seconds)."""

    index: int
    start: float
    end: float = 0.0  # the job and all it started exited (or were killed)
    code: int | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time first seen, step)
    stopped_flag: float | None = None  # when the heartbeat's stop flag was first seen
    planned: Planned | None = None
    notice: float | None = None  # when the notice was sent
    landed: str | None = None  # what the job was doing then: step, save, evaluation (joined by +), startup
    approved: float | None = None  # when the job approved the notice (Azure): the machine may go then
    deadline: float | None = None
    killed: bool = False  # still running at the deadline: killed
    events: list[dict[str, Any]] = field(default_factory=list)  # the Guard's JSON lines
    latest_step: int | None = None  # the newest complete checkpoint once the machine ended
    latest_reason: str | None = None
    storage_read: bool = False  # the storage was read once the machine ended (latest_* is the truth)
    latest_time: float | None = None  # its manifest's commit time
    cpu_s: float = 0.0  # the job's CPU time (all its processes that were waited for)
    resumes_at: int | None = None  # the storage's newest step when it started (None: unknown, no storage)

    @property
    def first_step(self) -> float | None:
        return self.timeline[0][0] if self.timeline else None

    @property
    def first_new_step(self) -> float | None:
        """When the job first reported a step past its resume point: training on this machine began.
        A job may report its resume step first (an evaluation due there): that is no training yet, and
        a notice timed from it could stop the job before it trained a step."""
        fresh = (t for t, step in self.timeline if self.resumes_at is None or step > self.resumes_at)
        return next(fresh, None)

    @property
    def last_step(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    @property
    def preempted(self) -> bool:
        return self.notice is not None and (self.killed or self.code != 0)

    @property
    def crashed(self) -> bool:
        return self.notice is None and self.code not in (0, None)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("events", "timeline", "planned")}
        d["steps_first_last"] = [self.timeline[0][1], self.last_step] if self.timeline else None
        d["after_restart"] = bool(self.planned and self.planned.restart)
        return d


def plan_notices(o: RehearsalOptions) -> list[Planned]:
    """The notices, in order: exponential gaps of training (mean ``mtbf_s``), ``after_restart`` of them
    replaced by moments within ``restart_window_s`` of a later machine's start, ``during_save`` and ``during_eval`` of
    the others sent at the next save or evaluation after their gap; all from one private generator
    (the draws of a plan without the last two are those of older versions)."""
    rng = random.Random(o.seed)
    planned = [Planned(rng.expovariate(1.0 / o.mtbf_s)) for _ in range(o.preemptions)]
    picks = rng.sample(range(o.preemptions), o.after_restart)
    if 0 in picks:  # the first machine's start is no restart (and has nothing to resume): another one
        picks[picks.index(0)] = rng.choice([i for i in range(1, o.preemptions) if i not in picks])
    for i in picks:
        planned[i] = Planned(rng.uniform(0.0, o.restart_window_s), restart=True)
    if o.during_save or o.during_eval:
        free = [i for i, p in enumerate(planned) if not p.restart]
        for n, i in enumerate(rng.sample(free, o.during_save + o.during_eval)):
            planned[i].during = "save" if n < o.during_save else "evaluation"
    return planned


#: The heartbeat's slot of each mark a notice can wait for.
MARKS = {"save": heartbeat.SAVING, "evaluation": heartbeat.EVALUATING}


def _wait_mark(slots: memoryview, slot: int, until: float) -> None:
    """Look at one of the heartbeat's marks every ``FAST_POLL_S`` until it is set or ``until``."""
    while not slots[slot] and time.time() < until:
        time.sleep(FAST_POLL_S)


def landed(slots: memoryview, stepped: bool) -> str:
    """What the heartbeat says the job is doing: "save", "evaluation" (both: "save+evaluation"), else
    "step" once it made a step on this machine, "startup" before (starting, resuming)."""
    marks = [name for name, slot in MARKS.items() if slots[slot]]
    return "+".join(marks) if marks else "step" if stepped else "startup"


def _fill(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


class Fleet:
    """Runs ``options.command`` through its preemptions; ``run()`` returns the machines, oldest first."""

    def __init__(self, options: RehearsalOptions, work_dir: Path, env: dict[str, str] | None = None) -> None:
        self.o = options
        self.work_dir = work_dir
        self.base_env = dict(os.environ if env is None else env)
        self.machines: list[Machine] = []
        self.crashes = 0
        self.error: str | None = None

    def run(self) -> list[Machine]:
        o = self.o
        self._check_storage()
        assert o.lead_s is not None
        sender = make_sender(o.source, o.lead_s, self.work_dir)
        planned = plan_notices(o)
        until = None if o.timeout_s is None else time.time() + o.timeout_s
        try:
            while True:
                m = self._machine(sender, planned[0] if planned else None, until)
                self.machines.append(m)
                if m.notice is not None:
                    planned.pop(0)
                if m.preempted:  # the replacement starts once the job is gone (its machine idles to the deadline)
                    sender.clear()
                    time.sleep(o.replacement_s)
                    continue
                if m.code == 0:
                    if m.notice is not None:
                        logger.warning("machine %d finished before its notice took effect", m.index)
                        sender.clear()
                    done = sum(x.preempted for x in self.machines)
                    if done < o.preemptions:
                        self.error = (
                            f"only {done} of {o.preemptions} preemption(s) happened before the job finished: "
                            "lower --mtbf or lengthen the job"
                        )
                    return self.machines
                self.crashes += 1
                if until is not None and time.time() >= until:
                    self.error = f"the rehearsal ran past its time limit ({o.timeout_s:g}s): the job was killed"
                    return self.machines
                if self.crashes > o.max_crashes:
                    self.error = f"the job failed {self.crashes} time(s) without a notice (last exit code {m.code})"
                    return self.machines
                logger.error("machine %d: the job exited with code %s without a notice; restarting it", m.index, m.code)
        finally:
            sender.close()

    # -- one machine -------------------------------------------------------------------------
    def _machine(self, sender: Sender, planned: Planned | None, until: float | None) -> Machine:
        o, index = self.o, len(self.machines) + 1
        beat = heartbeat.create(self.work_dir / f"heartbeat-{index}")
        events = self.work_dir / f"events-{index}.rank{{rank}}.jsonl"  # under torchrun: one file per rank
        local = self.work_dir / f"local-{index}" if o.fresh_local else self.work_dir / "local"
        local.mkdir(exist_ok=True)
        values = {"storage": o.storage or "", "local": str(local), "machine": str(index)}
        env = {
            **self.base_env,
            **sender.env,
            heartbeat.HEARTBEAT_ENV: str(beat),
            METRICS_FILE: str(events),
        }
        if o.storage:
            env[STORAGE] = o.storage
        if o.fresh_local:
            env[LOCAL_DIR] = env["TMPDIR"] = str(local)
        command = [_fill(a, values) for a in o.command]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        prev = self.machines[-1] if self.machines else None
        resumes_at = 0 if prev is None else (prev.latest_step or 0) if prev.storage_read else None
        m = Machine(index, time.time(), planned=planned, resumes_at=resumes_at)
        logger.info("machine %d: starting %s", index, " ".join(command))
        try:
            proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=2 if o.stdout_to_stderr else None)
        except OSError as e:
            raise ConfigError(f"cannot start {command[0]!r}: {e}") from e
        job = Job(proc, beat)
        try:
            self._watch(m, job, beat, sender, until)
        finally:
            if proc.poll() is None or job.leftovers():
                job.kill_all()
                proc.wait()
        m.end = time.time()
        m.code = proc.returncode
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        m.cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        m.events = _read_events(events)
        self._note_latest(m)
        if o.fresh_local:
            shutil.rmtree(local, ignore_errors=True)
        return m

    def _watch(self, m: Machine, job: Job, beat: Path, sender: Sender, until: float | None) -> None:
        o, proc = self.o, job.proc
        assert o.lead_s is not None
        last, approvals, waiting = 0, sender.approvals(), False
        with open(beat, "rb") as f:  # mapped: a look at the job's step costs no system call
            slots = memoryview(mmap.mmap(f.fileno(), heartbeat.SIZE, access=mmap.ACCESS_READ)).cast("q")
        while True:
            done = proc.poll() is not None
            now = time.time()
            step, flags = slots[0], slots[1]
            if step != last:
                m.timeline.append((now, step))
                last = step
            if flags & heartbeat.STOPPED_FOR_NOTICE and m.stopped_flag is None:
                m.stopped_flag = now
            if done:
                if not job.leftovers():  # what the job started (loader workers, ranks) is gone too
                    return
                if m.deadline is None:
                    job.wait_gone(now + 5.0, o.poll_s)
                    return
            if m.notice is None and m.planned is not None and not done:
                since = m.start if m.planned.restart else m.first_new_step
                if since is not None and now >= since + m.planned.after:
                    where = landed(slots, m.first_new_step is not None)
                    waiting = m.planned.during is not None and m.planned.during not in where.split("+")
                    if not waiting:
                        m.notice, m.deadline, m.landed = now, now + o.lead_s, where
                        logger.info(
                            "machine %d: notice at step %d (%s), deadline in %.1fs", m.index, step, m.landed, o.lead_s
                        )
                        sender.send(job)
            elif m.notice is not None and m.approved is None and sender.approvals() > approvals:
                m.approved = now
            if m.deadline is not None and now >= m.deadline:
                logger.error("machine %d: the job is still running at its notice's deadline: killed", m.index)
                m.killed = True
                return
            if until is not None and now >= until:
                return
            if waiting:  # only the mark, often, until it is set or the next full look is due
                assert m.planned is not None and m.planned.during is not None
                _wait_mark(slots, MARKS[m.planned.during], time.time() + o.poll_s)
            else:
                time.sleep(o.poll_s)

    # -- the storage ---------------------------------------------------------------------------
    def _check_storage(self, option: str = "--storage") -> None:
        """A rehearsal starts from nothing: a storage that holds checkpoints would be resumed. ``option``: the
        command-line option that names the storage, for the message."""
        if not self.o.storage:
            return
        storage = open_storage(self.o.storage)
        try:
            found = storage.list()
        except StorageError as e:
            raise ConfigError(f"cannot list the storage {self.o.storage}: {e}") from e
        finally:
            storage.close()
        if found:
            raise ConfigError(
                f"{self.o.storage} is not empty ({len(found)} object(s), e.g. {found[0]}); a rehearsal starts "
                f"from scratch: give an empty {option} (nothing was deleted)"
            )

    def _note_latest(self, m: Machine) -> None:
        if not self.o.storage:
            return
        storage = open_storage(self.o.storage)
        try:
            info = checkpoint.latest(storage)
        except StorageError as e:
            logger.warning("cannot read the storage after machine %d: %s", m.index, e)
            return
        finally:
            storage.close()
        m.storage_read = True
        if info is not None and info.manifest is not None:
            m.latest_step, m.latest_reason = info.step, info.manifest.reason
            m.latest_time = _unix(info.manifest.time)


def _unix(iso: str) -> float | None:
    try:
        t = dt.datetime.fromisoformat(iso)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def _read_events(path: Path) -> list[dict[str, Any]]:
    """The Guard's JSON lines (rank 0's under torchrun); none when the job has no Guard."""
    for p in (path, path.with_name(path.name.replace("{rank}", "0"))):
        try:
            lines = p.read_text().splitlines()
        except OSError:
            continue
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
        return out
    return []
