"""One attempt: start the job in its own process group and watch it until it exits, hangs or overstays.

A hang is ``hang_timeout`` seconds without a new step in the heartbeat (``startup_timeout`` before
the first one; either works alone): the Python stacks of the job's processes are dumped to the log
(faulthandler, on ``SIGUSR2``), then every process of the job is killed. After a stop signal the child gets ``grace``
seconds to checkpoint and exit; a job writing its emergency checkpoint (heartbeat flag) makes no
steps and gets the same grace instead of the hang timeout.

An attempt ends when the launcher has exited and nothing it started is left (``procs.Job``): what
a launcher leaves behind gets the stop signal (after our own stop) or SIGTERM (after any other
exit), the rest of the grace to checkpoint and exit, then SIGKILL. So a restart never trains beside
a trainer of the previous attempt, and a killed job leaves nothing running.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from spotguard import heartbeat
from spotguard._env import LOCAL_DIR as LOCAL_DIR_ENV
from spotguard._env import STORAGE as STORAGE_ENV
from spotguard._env import TAKEOVER as TAKEOVER_ENV
from spotguard.errors import ConfigError

from .options import SupervisorOptions, signame
from .procs import Job
from .signals import Forwarder

logger = logging.getLogger("spotguard.ops.supervisor")


@dataclass
class Outcome:
    """How one attempt ended."""

    code: int  # Popen.returncode: -N when the child died of signal N
    flags: int = 0  # the heartbeat's flags at the end (STOPPED_FOR_NOTICE)
    hung: bool = False
    killed_after_grace: bool = False
    stepped: bool = True  # a hang after the first step (else a startup timeout)

    @property
    def exit_code(self) -> int:
        """The exit as a shell reports it: 128+N for death by signal N (Popen gives -N, and
        ``sys.exit(-N)`` would wrap to 256-N)."""
        return 128 - self.code if self.code < 0 else self.code


def run_once(opts: SupervisorOptions, beat: Path, stops: Forwarder) -> Outcome:
    """Start ``opts.command`` with the heartbeat and storage variables set; watch it to its end."""
    env = {**os.environ, **opts.env, heartbeat.HEARTBEAT_ENV: str(beat)}
    if opts.storage:
        env[STORAGE_ENV] = opts.storage
    if opts.local_dir:
        env[LOCAL_DIR_ENV] = opts.local_dir
    if opts.takeover:
        env[TAKEOVER_ENV] = "1"
    logger.info("starting: %s", " ".join(opts.command))
    # Own process group: a terminal's Ctrl-C reaches only us (we forward it once), and a hung
    # job is killed together with its data-loader workers.
    try:
        proc = subprocess.Popen(
            opts.command, env=env, start_new_session=True, stdout=2 if opts.stdout_to_stderr else None
        )
    except OSError as e:
        raise ConfigError(f"cannot start {opts.command[0]!r}: {e}") from e
    job = Job(proc, beat)
    stops.attach(job)  # forwards a stop signal that came while Popen ran
    try:
        return _watch(job, beat, opts, stops)
    finally:
        stops.detach()


def _watch(job: Job, beat: Path, opts: SupervisorOptions, stops: Forwarder) -> Outcome:
    proc = job.proc
    last_step, last_change, seen_step = 0, time.monotonic(), False
    while True:
        try:
            return _after_exit(job, proc.wait(timeout=opts.poll), beat, opts, stops)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if stops.stopping.is_set():
            if now - stops.at > opts.grace:
                logger.error(
                    "the job did not exit within %.0fs of %s: killing it", opts.grace, signame(stops.signal or 0)
                )
                _kill(job)
                return Outcome(proc.wait(), heartbeat.read(beat)[1], killed_after_grace=True)
            continue
        if opts.hang_timeout is None and opts.startup_timeout is None:
            continue
        step, flags = heartbeat.read(beat)
        if step != last_step:
            last_step, last_change, seen_step = step, now, True
            continue
        # A job writing its emergency checkpoint makes no steps: give it the grace period.
        limit = (
            opts.grace
            if flags & heartbeat.STOPPED_FOR_NOTICE
            else opts.hang_timeout
            if seen_step
            else opts.startup_timeout
        )
        if limit is not None and now - last_change > limit:
            where = f"after step {last_step}" if seen_step else "since the start"
            logger.error(
                "no step completed for %.1fs (%s): dumping the job's Python stacks, then killing it",
                now - last_change,
                where,
            )
            _dump_stacks(job, opts.stack_wait)
            _kill(job)
            return Outcome(proc.wait(), heartbeat.read(beat)[1], hung=True, stepped=seen_step)


def _after_exit(job: Job, code: int, beat: Path, opts: SupervisorOptions, stops: Forwarder) -> Outcome:
    """The launcher exited with ``code``: stop what it left running before the attempt counts as over.

    After our stop signal the leftovers are the job stopping (their heartbeat flag decides whether it
    stopped for the notice, whatever the launcher's code); after any other exit the outcome is the
    launcher's, read before the leftovers are told to stop (their stop is ours, not a notice).
    """
    flags = heartbeat.read(beat)[1]
    left = job.leftovers()
    if not left:
        return Outcome(code, flags)
    described = job.describe(left)  # before the signal: a process that dies of it has no command line
    stopping = stops.stopping.is_set()
    if stopping:
        sig = stops.forwarded or signal.SIGTERM
        until = stops.at + opts.grace
        # Stopped for the notice already: it got the signal; a second one would mean "stop now".
        sent = [] if flags & heartbeat.STOPPED_FOR_NOTICE else job.signal_top(sig)
    else:
        sig, until = signal.SIGTERM, time.monotonic() + opts.grace
        sent = job.signal_top(sig)
    logger.warning(
        "the job's launcher exited with code %d and left %d process(es) running: %s; %s, waiting up to %.0fs",
        Outcome(code).exit_code,
        len(left),
        described,
        f"sent {signame(sig)} to {', '.join(map(str, sent))}" if sent else "they are stopping already",
        max(until - time.monotonic(), 0.0),
    )
    killed = not job.wait_gone(until, opts.poll)
    if killed:
        logger.error("processes of the job still running after the grace period: killing them")
        _kill(job)
    return Outcome(code, heartbeat.read(beat)[1] if stopping else flags, killed_after_grace=killed and stopping)


def _dump_stacks(job: Job, wait: float) -> None:
    """faulthandler (registered by the Guard) writes every thread's stack to stderr, in every process of
    the job: under a launcher the ranks are the ones stuck. A process without the handler dies of it."""
    pids = set(job.processes()) | {job.proc.pid}
    for pid in pids:
        try:
            os.kill(pid, heartbeat.STACKS_SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    if len(pids) > 1:
        time.sleep(wait)  # the ranks' handlers run when they run; the launcher may die of it at once
        return
    try:
        job.proc.wait(timeout=wait)  # a child without the handler dies of the signal
    except subprocess.TimeoutExpired:
        pass


def _kill(job: Job) -> None:
    """SIGKILL every process of the job and reap the launcher; the next attempt starts on a clean slate."""
    job.kill_all()
    job.proc.wait()
    if not job.wait_gone(time.monotonic() + 5.0, 0.05):
        logger.error("still running after SIGKILL: %s", job.describe(job.leftovers()))
