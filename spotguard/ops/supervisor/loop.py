"""``spotguard run``: start a training command, restart it after a crash or a hang, never after a preemption.

Order of one run: report the newest complete checkpoint -> start the child in its own process
group with ``$SPOTGUARD_STORAGE`` and ``$SPOTGUARD_HEARTBEAT`` set -> watch its exit, its
heartbeat and our stop signals -> decide:

=====================================================  ============================================
child outcome                                          supervisor
=====================================================  ============================================
exit 0                                                 exit 0 (finished)
exit 75 (``EXIT_PREEMPTED``) or its Guard stopped      exit 75, no restart: the machine can go
for a notice (heartbeat flag), whatever the code
any other exit, killed by a signal, or hung            restart after a backoff while the budget lasts,
                                                       then ``RestartBudgetExhausted`` (CLI: exit 2)
we got SIGTERM/SIGINT/SIGUSR1 (forwarded to the        the child's code once it exits (128+N if signal
child, which writes its emergency checkpoint)          N killed it); after ``grace`` seconds its group
                                                       is killed, exit 128+signal
=====================================================  ============================================

Stop signals are forwarded once: a repeat of the same signal within ``DUPLICATE_WINDOW`` is the
same broadcast; a later one is forwarded again (the child's Guard then stops at once). Where the
platform signals the child directly as well (Slurm preemption), ``forward_as=SIGUSR1`` keeps the
two deliveries distinct, so the child does not read them as "stop now".

A hang is ``hang_timeout`` seconds without a new step in the heartbeat (``startup_timeout`` before
the first one; either works alone): the child's Python stacks are dumped to the log (faulthandler, on ``SIGUSR2``),
its process group is killed and it is restarted from the last checkpoint.

Every start and exit is an event (``supervisor.events``, ``supervisor.exits``): an exit has its
cause (``CAUSES``), exit code, signal, last step and the seconds of work lost, the wall time from the
newer of the newest checkpoint's commit and the child's start to its exit. ``spotguard.metrics.run``
exports them; ``summary()`` is the document ``spotguard run --json`` prints.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from spotguard import checkpoint, heartbeat
from spotguard._env import LOCAL_DIR as LOCAL_DIR_ENV
from spotguard._env import STORAGE as STORAGE_ENV
from spotguard.errors import ConfigError, SpotguardError, StorageError
from spotguard.events import Events, Record
from spotguard.heartbeat import EXIT_PREEMPTED
from spotguard.storage import Storage, open_storage

logger = logging.getLogger(__name__)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: A repeat of the first stop signal this soon is the same broadcast (Slurm and systemd's
#: control-group mode signal every process, a wrapper shell may forward too), not a user insisting.
DUPLICATE_WINDOW = 2.0
#: Why a child exited. Restarted: ``exit_code`` (non-zero), ``signal`` (killed by one), ``hang`` (no step
#: for hang_timeout), ``startup_timeout`` (no first step in time). Not restarted: ``finished``,
#: ``preempted`` (exit 75 or its Guard stopped for a notice), ``stopped`` (it exited after our stop
#: signal), ``grace_exceeded`` (killed: it did not exit within the grace after our stop signal).
CAUSES = ("exit_code", "signal", "hang", "startup_timeout", "finished", "preempted", "stopped", "grace_exceeded")


class RestartBudgetExhausted(SpotguardError):
    """The child kept failing: ``max_restarts`` restarts were used up."""


@dataclass
class SupervisorOptions:
    """How to run, watch and restart one training command. Validated on creation."""

    command: Sequence[str]
    storage: str | None = None
    local_dir: str | None = None  # the job's fast local tier, passed as $SPOTGUARD_LOCAL_DIR
    prefetch: bool = False  # copy the newest checkpoint into local_dir before starting
    max_restarts: int = 10
    hang_timeout: float | None = None
    startup_timeout: float | None = None  # before the first step; default: hang_timeout
    backoff: float = 1.0
    backoff_max: float = 60.0
    backoff_factor: float = 2.0
    grace: float = 120.0
    stack_wait: float = 1.0
    poll: float = 0.1
    forward_as: int | None = None  # forward stop signals as this one (e.g. SIGUSR1); None: as received
    stdout_to_stderr: bool = False  # the job writes its stdout to our stderr (`spotguard run --json`)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.command = list(self.command)
        if not self.command:
            raise ConfigError("no command to run: put it after `--`, e.g. spotguard run -- python train.py")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        for name in ("hang_timeout", "startup_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive or None, got {value!r}")
        if self.startup_timeout is None:
            self.startup_timeout = self.hang_timeout
        if self.backoff < 0 or self.backoff_max < self.backoff or self.backoff_factor < 1:
            raise ConfigError("backoff must satisfy 0 <= backoff <= backoff_max and backoff_factor >= 1")
        if not self.grace > 0 or not self.poll > 0 or self.stack_wait < 0:
            raise ConfigError("grace and poll must be positive, stack_wait non-negative")
        if self.forward_as is not None:
            self.forward_as = int(_to_signal(self.forward_as))
        if self.prefetch and not self.local_dir:
            raise ConfigError("--prefetch needs --local-dir: the local tier to copy the checkpoint into")


def _to_signal(sig: str | int) -> signal.Signals:
    try:
        if isinstance(sig, str) and not sig.isdigit():
            name = sig.upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(int(sig))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"not a signal: {sig!r}") from e


@dataclass
class _Outcome:
    code: int  # Popen.returncode: -N when the child died of signal N
    flags: int = 0
    hung: bool = False
    killed_after_grace: bool = False
    stepped: bool = True  # a hang after the first step (else a startup timeout)


class Supervisor:
    """Runs ``options.command`` until it finishes, is preempted, or uses up its restart budget."""

    def __init__(self, options: SupervisorOptions) -> None:
        self.options = options
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop_signal: int | None = None
        self._stop_at = 0.0
        self._unforwarded: int | None = None  # a stop signal that came while no child was known
        self._stopping = threading.Event()
        self.events = Events()
        self.starts = 0
        self.exits: list[Record] = []  # one per child exit, oldest first
        self.restart_causes: Counter[str] = Counter()
        self.exit_code: int | None = None
        self.error: str | None = None
        self.beat: Path | None = None  # the running child's heartbeat file
        self._started_at = 0.0  # wall time of the running child's start

    # -- checkpoints -------------------------------------------------------------------------
    def report_latest(self) -> checkpoint.CheckpointInfo | None:
        """Log the newest complete checkpoint (step, age, size); None when there is none."""
        url = self.options.storage or os.environ.get(STORAGE_ENV)
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
            logger.info("newest checkpoint: step %d (%s), %s old, %.1f MB, in %s", info.step, m.reason,
                        checkpoint.human_duration(m.age_seconds()), m.size / 1e6,
                        url.rstrip("/") + "/" + info.name)
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
        if any(i.complete and i.step == info.step for i in checkpoint.scan(local)):
            logger.info("%s is already in the local tier %s", info.name, local.describe())
            return
        t0 = time.monotonic()
        try:
            checkpoint.verify(storage, info)
            checkpoint.copy(storage, local, info)
        except (SpotguardError, OSError) as e:
            logger.warning("prefetch of %s failed (%s); the job reads it from %s", info.name, e, storage.describe())
            return
        logger.info("prefetched %s into %s in %.1fs", info.name, local.describe(), time.monotonic() - t0)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until done; returns the exit code (see the module docstring)."""
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
        outcome = "gave_up" if self.error else last["cause"] if last and not last["restart"] else \
            "stopped" if self._stopping.is_set() else None
        return {"exit_code": self.exit_code, "outcome": outcome, "restarts": self.restarts,
                "restart_causes": dict(self.restart_causes), "starts": self.starts, "exits": self.exits,
                "error": self.error}

    def _supervise(self) -> int:
        workdir = Path(tempfile.mkdtemp(prefix="spotguard-run-"))
        previous = self._install_handlers()
        try:
            while True:
                info = self.report_latest()
                if self._stopping.is_set():
                    return 128 + (self._stop_signal or 0)
                self.starts += 1
                self.beat = heartbeat.create(workdir / "heartbeat")
                self._started_at = time.time()
                self.events.emit("start", attempt=self.starts, checkpoint_step=info.step if info else None)
                outcome = self._run_once(self.beat)
                decided = self._decide(outcome)
                if decided is not None:
                    return decided
                delay = min(self.options.backoff_max,
                            self.options.backoff * self.options.backoff_factor ** (self.restarts - 1))
                logger.warning("restart %d of %d in %.3gs", self.restarts, self.options.max_restarts, delay)
                if self._stopping.wait(delay):
                    logger.warning("stop signal during the backoff: not restarting")
                    return 128 + (self._stop_signal or 0)
        finally:
            self.beat = None
            self._restore_handlers(previous)
            shutil.rmtree(workdir, ignore_errors=True)

    def _exited(self, out: _Outcome, cause: str, restart: bool) -> None:
        """Record one child exit (``exits``, ``restart_causes``, an ``exit`` event)."""
        now = time.time()
        step = heartbeat.read(self.beat)[0] if self.beat else 0
        newest = self._newest_checkpoint() if cause != "finished" else None
        lost = None
        if cause != "finished":
            since = self._started_at if newest is None else max(newest[1], self._started_at)
            lost = max(now - since, 0.0)
        code = _exit_code(out.code)
        record: Record = {"attempt": self.starts, "cause": cause, "exit_code": code,
                          "signal": _signame(-out.code) if out.code < 0 else None, "step": step,
                          "seconds": now - self._started_at, "checkpoint_step": newest[0] if newest else None,
                          "lost_s": lost, "restart": restart}
        self.exits.append(record)
        if restart:
            self.restart_causes[cause] += 1
        self.events.emit("exit", **record)

    def _newest_checkpoint(self) -> tuple[int, float] | None:
        """(step, unix commit time) of the newest complete checkpoint; None without one or storage."""
        url = self.options.storage or os.environ.get(STORAGE_ENV)
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

    def _decide(self, out: _Outcome) -> int | None:
        """The exit code to stop with, or None to restart (counts against the budget)."""
        if out.killed_after_grace:
            self._exited(out, "grace_exceeded", restart=False)
            return 128 + (self._stop_signal or signal.SIGTERM)
        code = _exit_code(out.code)
        if code == EXIT_PREEMPTED or out.flags & heartbeat.STOPPED_FOR_NOTICE:
            logger.warning("the job stopped for a notice (exit code %d): not restarting, exiting %d",
                           code, EXIT_PREEMPTED)
            self._exited(out, "preempted", restart=False)
            return EXIT_PREEMPTED
        if self._stopping.is_set():
            logger.warning("the job exited with code %d after a stop signal: not restarting", code)
            self._exited(out, "stopped", restart=False)
            return code
        if code == 0 and not out.hung:
            logger.info("the job finished")
            self._exited(out, "finished", restart=False)
            return 0
        what = "hung" if out.hung else (f"was killed by {_signame(-out.code)} (exit code {code})" if out.code < 0
                                        else f"crashed with exit code {code}")
        cause = ("hang" if out.stepped else "startup_timeout") if out.hung else "signal" if out.code < 0 \
            else "exit_code"
        if self.restarts >= self.options.max_restarts:
            self._exited(out, cause, restart=False)
            raise RestartBudgetExhausted(
                f"the job {what} and the restart budget is used up ({self.options.max_restarts} "
                f"restart(s)); giving up. Fix the cause (see the log above), then run again: "
                "it resumes from the newest checkpoint")
        self.restarts += 1
        logger.error("the job %s", what)
        self._exited(out, cause, restart=True)
        return None

    def _run_once(self, beat: Path) -> _Outcome:
        opts = self.options
        env = {**os.environ, **opts.env, heartbeat.HEARTBEAT_ENV: str(beat)}
        if opts.storage:
            env[STORAGE_ENV] = opts.storage
        if opts.local_dir:
            env[LOCAL_DIR_ENV] = opts.local_dir
        logger.info("starting: %s", " ".join(opts.command))
        # Own process group: a terminal's Ctrl-C reaches only us (we forward it once), and a hung
        # job is killed together with its data-loader workers.
        try:
            proc = self._proc = subprocess.Popen(opts.command, env=env, start_new_session=True,
                                                 stdout=2 if opts.stdout_to_stderr else None)
        except OSError as e:
            raise ConfigError(f"cannot start {opts.command[0]!r}: {e}") from e
        # The child runs before Popen returns: a stop signal in that window found no child to
        # forward to. Forward it now, once (handlers run in this thread, so none is lost or doubled).
        sig, self._unforwarded = self._unforwarded, None
        if sig is not None:
            _send(proc, sig)
        try:
            return self._watch(proc, beat)
        finally:
            self._proc = None

    def _watch(self, proc: subprocess.Popen[bytes], beat: Path) -> _Outcome:
        opts = self.options
        last_step, last_change, seen_step = 0, time.monotonic(), False
        while True:
            try:
                code = proc.wait(timeout=opts.poll)
                return _Outcome(code, heartbeat.read(beat)[1])
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self._stopping.is_set():
                if now - self._stop_at > opts.grace:
                    logger.error("the job did not exit within %.0fs of %s: killing it", opts.grace,
                                 _signame(self._stop_signal or 0))
                    _kill_group(proc)
                    return _Outcome(proc.wait(), heartbeat.read(beat)[1], killed_after_grace=True)
                continue
            if opts.hang_timeout is None and opts.startup_timeout is None:
                continue
            step, flags = heartbeat.read(beat)
            if step != last_step:
                last_step, last_change, seen_step = step, now, True
                continue
            # A job writing its emergency checkpoint makes no steps: give it the grace period.
            limit = opts.grace if flags & heartbeat.STOPPED_FOR_NOTICE else \
                opts.hang_timeout if seen_step else opts.startup_timeout
            if limit is not None and now - last_change > limit:
                where = f"after step {last_step}" if seen_step else "since the start"
                logger.error("no step completed for %.1fs (%s): dumping the job's Python stacks, then killing it",
                             now - last_change, where)
                self._dump_stacks(proc)
                _kill_group(proc)
                return _Outcome(proc.wait(), heartbeat.read(beat)[1], hung=True, stepped=seen_step)

    def _dump_stacks(self, proc: subprocess.Popen[bytes]) -> None:
        """faulthandler in the child (registered by its Guard) writes every thread's stack to stderr."""
        try:
            os.kill(proc.pid, heartbeat.STACKS_SIGNAL)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=self.options.stack_wait)  # a child without the handler dies of the signal
        except subprocess.TimeoutExpired:
            pass

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping.is_set() and signum == self._stop_signal \
                and time.monotonic() - self._stop_at < DUPLICATE_WINDOW:
            logger.info("%s again within %.0fs: the same stop, not forwarded twice", _signame(signum), DUPLICATE_WINDOW)
            return
        if not self._stopping.is_set():
            self._stop_signal, self._stop_at = signum, time.monotonic()
            logger.warning("%s received: forwarding it to the job and waiting up to %.0fs for its checkpoint",
                           _signame(signum), self.options.grace)
            self._stopping.set()
        proc, sig = self._proc, self.options.forward_as or signum
        if proc is None:
            self._unforwarded = sig  # a child being started gets it from _run_once
        elif proc.returncode is None:
            _send(proc, sig)  # a second delivery means "now" to the child's Guard too

    def _install_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: stop signals are not forwarded")
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED}

    def _restore_handlers(self, previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _exit_code(returncode: int) -> int:
    """A child's exit as a shell reports it: 128+N for death by signal N (Popen gives -N, and
    ``sys.exit(-N)`` would wrap to 256-N)."""
    return 128 - returncode if returncode < 0 else returncode


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
