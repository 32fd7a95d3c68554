"""The supervisor's loop: start, watch, decide (finished, preempted, stopped, or restart), repeat.

Every start and exit is an event (``Supervisor.events``, ``Supervisor.exits``): an exit has its
cause (``CAUSES``), exit code, signal, last step and the seconds of work lost, the wall time from the
newer of the newest checkpoint's commit and the child's start to its exit.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from spotguard import _env, checkpoint, heartbeat
from spotguard._env import STORAGE as STORAGE_ENV
from spotguard.checkpoint.folders import tier
from spotguard.errors import SpotguardError, StorageError
from spotguard.events import Events, Record
from spotguard.heartbeat import EXIT_CONFIG, EXIT_LEASE_HELD, EXIT_PREEMPTED
from spotguard.ops.supervisor import buildlocks
from spotguard.storage import Storage, open_storage

from .child import Outcome, run_once
from .options import SupervisorOptions, signame
from .signals import Forwarder

logger = logging.getLogger("spotguard.ops.supervisor")

#: Why a child exited. Restarted: ``exit_code`` (non-zero), ``signal`` (killed by one), ``hang`` (no step
#: for hang_timeout), ``startup_timeout`` (no first step in time). Not restarted: ``finished``,
#: ``preempted`` (exit 75 or its Guard stopped for a notice), ``stopped`` (it exited after our stop
#: signal), ``grace_exceeded`` (killed: it did not exit within the grace after our stop signal),
#: ``config_error`` (exit 78 or its Guard raised an error a restart would meet again), ``lease_held`` (exit
#: 73 or its Guard found another job writing to the run's storage).
CAUSES = (
    "exit_code",
    "signal",
    "hang",
    "startup_timeout",
    "finished",
    "preempted",
    "stopped",
    "grace_exceeded",
    "config_error",
    "lease_held",
)
RESTARTED = CAUSES[:4]


class RestartBudgetExhausted(SpotguardError):
    """The child kept failing: ``max_restarts`` restarts were used up."""


class Supervisor:
    """Runs ``options.command`` until it finishes, is preempted, or uses up its restart budget."""

    def __init__(self, options: SupervisorOptions) -> None:
        self.options = options
        self.restarts = 0
        self.stops = Forwarder(options.grace, options.forward_as)
        self.events = Events()
        self.starts = 0
        self.exits: list[Record] = []  # one per child exit, oldest first
        self.restart_causes: Counter[str] = Counter()
        self.exit_code: int | None = None
        self.error: str | None = None
        self.beat: Path | None = None  # the running child's heartbeat file
        self._started_at = 0.0  # wall time of the running child's start

    @property
    def running(self) -> subprocess.Popen[bytes] | None:
        """The child process while one runs."""
        return self.stops.job.proc if self.stops.job else None

    # -- checkpoints -------------------------------------------------------------------------
    def _storage_url(self) -> str | None:
        return self.options.storage or _env.text(STORAGE_ENV)

    def report_latest(self) -> checkpoint.CheckpointInfo | None:
        """Log the newest complete checkpoint (step, age, size); None when there is none.

        Raises ``CheckpointFormatError`` when a newer spotguard wrote the newest one: the job's resume
        would refuse it too, and neither it nor an older checkpoint is prefetched.
        """
        url = self._storage_url()
        if not url:
            logger.info("no --storage and no $%s: the command must name its own storage", STORAGE_ENV)
            return None
        storage = open_storage(url)
        try:
            info = checkpoint.latest(storage)
            if info is None or info.manifest is None:
                logger.info("no complete checkpoint in %s: the job starts from step 0", url)
                return None
            m = info.manifest
            logger.info(
                "newest checkpoint: step %d (%s), %s old, %.1f MB, in %s",
                info.step,
                m.reason,
                checkpoint.human_duration(m.age_seconds()),
                m.size / 1e6,
                url.rstrip("/") + "/" + info.name,
            )
            if self.options.prefetch and self.options.local_dir:
                self._prefetch(storage, info)
        except StorageError as e:
            logger.warning("cannot read checkpoints in %s: %s; starting anyway", storage.describe(), e)
            return None
        finally:
            storage.close()
        return info

    def _prefetch(self, storage: Storage, info: checkpoint.CheckpointInfo) -> None:
        """Copy a checkpoint into the local tier, verified, so the job's resume reads local disk."""
        local = open_storage(self.options.local_dir or "")
        if not tier.claim(local, storage):  # another run's tier: the job will not read it either
            return
        if any(i.complete and i.name == info.name for i in checkpoint.scan(local)):  # a revision is another
            logger.info("%s is already in the local tier %s", info.name, local.describe())
            return
        t0 = time.monotonic()
        try:
            checkpoint.copy(storage, local, info, verify=True, link=True)
        except (SpotguardError, OSError) as e:
            logger.warning("prefetch of %s failed (%s); the job reads it from %s", info.name, e, storage.describe())
            return
        logger.info("prefetched %s into %s in %.1fs", info.name, local.describe(), time.monotonic() - t0)

    def _newest_checkpoint(self) -> tuple[int, float] | None:
        """(step, unix commit time) of the newest complete checkpoint; None without one or storage."""
        url = self._storage_url()
        if not url:
            return None
        try:
            storage = open_storage(url)
            try:
                info = checkpoint.latest(storage)
            finally:
                storage.close()
            if info is None or info.manifest is None:
                return None
            return info.step, dt.datetime.fromisoformat(info.manifest.time).timestamp()
        except (SpotguardError, OSError, ValueError) as e:
            logger.debug("cannot read the newest checkpoint for the lost-work figure: %s", e)
            return None

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until done; returns the exit code (see ``spotguard.ops.supervisor``)."""
        try:
            self.exit_code = self._supervise()
        except SpotguardError as e:
            self.exit_code, self.error = 2, str(e)
            raise
        finally:
            self.events.emit("end", exit_code=self.exit_code, restarts=self.restarts, error=self.error)
        return self.exit_code

    def summary(self) -> Record:
        """The run as one JSON-ready document: exit code, outcome, restarts by cause, every exit."""
        last = self.exits[-1] if self.exits else None
        outcome = (
            "gave_up"
            if self.error
            else last["cause"]
            if last and not last["restart"]
            else "stopped"
            if self.stops.stopping.is_set()
            else None
        )
        return {
            "exit_code": self.exit_code,
            "outcome": outcome,
            "restarts": self.restarts,
            "restart_causes": dict(self.restart_causes),
            "starts": self.starts,
            "exits": self.exits,
            "error": self.error,
        }

    def _supervise(self) -> int:
        workdir = Path(tempfile.mkdtemp(prefix="spotguard-run-"))
        self.stops.install()
        try:
            while True:
                info = self.report_latest()
                if self.stops.stopping.is_set():
                    return self.stops.stop_code()
                self.starts += 1
                # One file per attempt: its path in the environment marks this attempt's processes (procs)
                self.beat = heartbeat.create(workdir / f"heartbeat-{self.starts}")
                self._started_at = time.time()
                self.events.emit("start", attempt=self.starts, checkpoint_step=info.step if info else None)
                decided = self._decide(run_once(self.options, self.beat, self.stops))
                if decided is not None:
                    return decided
                delay = self.options.backoff_s(self.restarts)
                logger.warning("restart %d of %d in %.3gs", self.restarts, self.options.max_restarts, delay)
                if self.stops.stopping.wait(delay):
                    logger.warning("stop signal during the backoff: not restarting")
                    return self.stops.stop_code()
                buildlocks.clear_stale()  # a lock the killed attempt held would hang the next one
        finally:
            self.beat = None
            self.stops.restore()
            shutil.rmtree(workdir, ignore_errors=True)

    def _exited(self, out: Outcome, cause: str, restart: bool) -> None:
        """Record one child exit (``exits``, ``restart_causes``, an ``exit`` event)."""
        now = time.time()
        step = heartbeat.read(self.beat)[0] if self.beat else 0
        newest = self._newest_checkpoint() if cause != "finished" else None
        lost = None
        if cause != "finished":
            since = self._started_at if newest is None else max(newest[1], self._started_at)
            lost = max(now - since, 0.0)
        record: Record = {
            "attempt": self.starts,
            "cause": cause,
            "exit_code": out.exit_code,
            "signal": signame(-out.code) if out.code < 0 else None,
            "step": step,
            "seconds": now - self._started_at,
            "checkpoint_step": newest[0] if newest else None,
            "lost_s": lost,
            "restart": restart,
        }
        self.exits.append(record)
        if restart:
            self.restart_causes[cause] += 1
        self.events.emit("exit", **record)

    def _stopped_uncommitted(self, out: Outcome) -> int:
        """The job stopped for a notice but never reported its checkpoint committed (killed mid-save, the
        save failed): not restarted (the machine is going), and never 75. Its own code, or 1 where that
        would claim a checkpoint (75) or a finish (0); the log says what was lost."""
        code = out.exit_code
        exit_code = 1 if code in (0, EXIT_PREEMPTED) else code
        step = heartbeat.read(self.beat)[0] if self.beat else 0
        newest = self._newest_checkpoint()
        logger.error(
            "the job stopped for a notice at step %d but reported no committed checkpoint (exit code %d): "
            "the resume point stays %s, %d step(s) lost; not restarting, exiting %d",
            step,
            code,
            f"step {newest[0]}" if newest else "the start (no checkpoint)",
            max(step - (newest[0] if newest else 0), 0),
            exit_code,
        )
        self._exited(out, "stopped" if self.stops.stopping.is_set() else "preempted", restart=False)
        return exit_code

    def _decide(self, out: Outcome) -> int | None:
        """The exit code to stop with, or None to restart (counts against the budget)."""
        if out.killed_after_grace:
            self._exited(out, "grace_exceeded", restart=False)
            return self.stops.stop_code(signal.SIGTERM)
        code = out.exit_code
        stopped = bool(out.flags & heartbeat.STOPPED_FOR_NOTICE)
        # 75 says "checkpoint written": from a Guard's word (the heartbeat), or from a job without one.
        if (stopped and out.flags & heartbeat.COMMITTED) or (code == EXIT_PREEMPTED and not stopped):
            logger.warning(
                "the job stopped for a notice (exit code %d): not restarting, exiting %d", code, EXIT_PREEMPTED
            )
            self._exited(out, "preempted", restart=False)
            return EXIT_PREEMPTED
        if code == EXIT_LEASE_HELD or out.flags & heartbeat.LEASE_HELD:
            logger.error(
                "another job writes to this run's storage (exit code %d; see the job's message above, naming it): "
                "not restarting, exiting %d",
                code,
                EXIT_LEASE_HELD,
            )
            self._exited(out, "lease_held", restart=False)
            return EXIT_LEASE_HELD
        if stopped:
            return self._stopped_uncommitted(out)
        if code == EXIT_CONFIG or code != 0 and out.flags & heartbeat.CONFIG_ERROR:  # exit 0: it caught the error
            logger.error(
                "the job failed on an error a restart would meet again (exit code %d; see its message above): "
                "not restarting, exiting %d",
                code,
                EXIT_CONFIG,
            )
            self._exited(out, "config_error", restart=False)
            return EXIT_CONFIG
        if self.stops.stopping.is_set():
            logger.warning("the job exited with code %d after a stop signal: not restarting", code)
            self._exited(out, "stopped", restart=False)
            return code
        if code == 0 and not out.hung:
            logger.info("the job finished")
            self._exited(out, "finished", restart=False)
            return 0
        what = (
            "hung"
            if out.hung
            else (
                f"was killed by {signame(-out.code)} (exit code {code})"
                if out.code < 0
                else f"crashed with exit code {code}"
            )
        )
        cause = (
            ("hang" if out.stepped else "startup_timeout") if out.hung else "signal" if out.code < 0 else "exit_code"
        )
        if self.restarts >= self.options.max_restarts:
            self._exited(out, cause, restart=False)
            raise RestartBudgetExhausted(
                f"the job {what} and the restart budget is used up ({self.options.max_restarts} "
                f"restart(s)); giving up. Fix the cause (see the log above), then run again: "
                "it resumes from the newest checkpoint"
            )
        self.restarts += 1
        logger.error("the job %s", what)
        self._exited(out, cause, restart=True)
        return None
