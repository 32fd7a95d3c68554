"""The options of a ``Guard``: ``GuardOptions`` extends ``CommonOptions`` (what every trainer integration
takes too, ``spotguard.coordination.options``) with the Guard's schedule, engine and metrics. Validated on
creation; an option left None that the job's environment may set is read from it here (``spotguard._env``).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from spotguard import _env
from spotguard.checkpoint.format.manifest import Reshard
from spotguard.coordination.options import CommonOptions, check_every_steps, check_flag
from spotguard.coordination.ranks import PollOn
from spotguard.errors import ConfigError


class BusyPolicy(str, enum.Enum):
    """What a due periodic checkpoint does while the previous one is still being written."""

    SKIP = "skip"  # log it and skip this one: the loop never waits
    WAIT = "wait"  # block until the previous one is committed, then snapshot


@dataclass
class GuardOptions(CommonOptions):
    """When to checkpoint, where, and what to watch: ``Guard(storage, **options)``. Validated on creation.

    ``local_dir`` (default ``$SPOTGUARD_LOCAL_DIR``) adds a fast first tier (e.g. the instance's
    NVMe) from which periodic checkpoints are uploaded in the background. ``stop_on_advisory``
    (default ``$SPOTGUARD_STOP_ON_ADVISORY``, else False) stops on an advisory notice instead of only
    checkpointing early. ``metrics_port`` / ``metrics_file`` (default ``$SPOTGUARD_METRICS_FILE``) export the measured
    figures and events (``spotguard.metrics``; the port needs ``spotguard[metrics]``) without adding
    work to ``step()``.
    The options every trainer integration takes too (``keep``, ``providers``, ``interval``,
    ``stop_on_advisory``, ``on_unloadable``, ``untracked``, ``rebatch``, ``deadline_policy``,
    ``window_margin``, ``lease_ttl``, ``takeover``) are ``CommonOptions``'.
    ``sigint``: while the ``with`` block runs, the first SIGINT (Ctrl-C) is a stop notice like
    SIGTERM and a second one raises ``KeyboardInterrupt``; False keeps Python's default.
    ``on_unloadable``: when checkpoints exist but none loads, ``resume()`` raises (``"raise"``) or starts
    from step 0 with a warning (``"fresh"``). ``rebatch``: a tracked data loader saved with another batch
    size is refused (``"refuse"``) or continued at the same sample in batches of the new size (``"accept"``).
    ``untracked``: a checkpoint that holds the state of an object nothing tracks now (saved with an
    optimizer, resumed with only the model) is refused (``"refuse"``, naming them) or resumed without
    that state (``"accept"``, with a warning).
    ``deadline_policy`` (default ``$SPOTGUARD_DEADLINE_POLICY``, else ``"stop"``): after the emergency
    checkpoint of a notice with a deadline, stop (``"stop"``) or train on and checkpoint again
    ``window_margin`` seconds plus the measured save time before the deadline (``"use-window"``;
    ``spotguard.coordination.window``).
    ``lease_ttl`` / ``takeover``: the writer lease that keeps a second job off this run's storage
    (docs/lease.md): a holder that stops renewing keeps it ``lease_ttl`` seconds; ``takeover`` (default
    ``$SPOTGUARD_TAKEOVER``) takes a live lease over, and the other job commits nothing more.
    """

    every_steps: int | None = None
    every_seconds: float | str | None = None  # seconds, or "auto" (needs mtbf_hours)
    save_on_exit: bool = True
    checkpoint_on_advisory: bool = True
    local_dir: str | None = None
    async_save: bool = True
    busy: BusyPolicy | str = BusyPolicy.SKIP
    mtbf_hours: float | None = None
    background_nice: int | None = 10  # Linux: niceness added to the background writer (None: none)
    # [metrics] spotguard.metrics: Prometheus endpoint (needs spotguard[metrics]) and JSON lines
    metrics_port: int | None = None  # 0 picks a free port; + LOCAL_RANK in a process group
    metrics_host: str = "127.0.0.1"  # "0.0.0.0" to let other machines scrape it
    metrics_file: str | None = None  # {rank}, {local_rank} are filled in; None: $SPOTGUARD_METRICS_FILE
    # [distributed] only used in an initialised process group (see spotguard.coordination.agreement)
    sync_every: int = 1
    poll_on: str = "local-rank-0"
    reshard: str = "refuse"
    # resume() pins a tracked DistributedDataParallel's gradient buckets (3+ ranks) for exact resumes:
    # None: when free (gradients within DDP's first bucket, 1 MiB); True: always, at the cost of the
    # all-reduce/backward overlap over 1 MiB; False: never (spotguard.guard.buckets)
    pin_ddp_buckets: bool | None = None
    sigint: bool = True  # while active, the first SIGINT is a stop notice (False: KeyboardInterrupt)
    # [distributed] sharded periodic saves in the background; None: as async_save
    async_sharded: bool | None = None
    # Bytes of host memory a periodic snapshot may hold (pinned with CUDA); a larger state is written
    # synchronously, streamed through a few buffers. None: half the memory available at the first save.
    staging_budget: int | None = None

    @property
    def background_sharded(self) -> bool:
        """[distributed] Whether periodic sharded saves are written in the background."""
        return self.async_save if self.async_sharded is None else self.async_sharded

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_dir is None:  # set by `spotguard run --local-dir`
            self.local_dir = _env.text(_env.LOCAL_DIR)
        if self.local_dir and "://" not in self.local_dir:  # checked now, not found out at every periodic save
            try:
                Path(self.local_dir).expanduser().mkdir(parents=True, exist_ok=True)
                if not os.access(Path(self.local_dir).expanduser(), os.W_OK | os.X_OK):
                    raise PermissionError("not writable")
            except OSError as e:
                raise ConfigError(f"local_dir {self.local_dir!r} (or ${_env.LOCAL_DIR}) cannot be used: {e}") from None
        if self.metrics_file is None:  # `spotguard rehearse` reads a job's events without changing its code
            self.metrics_file = _env.text(_env.METRICS_FILE)
        check_every_steps(self.every_steps)
        check_flag("save_on_exit", self.save_on_exit)  # as the loop integrations' (LoopOptions)
        if self.every_seconds == "auto":
            if self.mtbf_hours is None:
                raise ConfigError('every_seconds="auto" needs mtbf_hours (mean hours between preemptions)')
        elif self.every_seconds is not None and not (
            isinstance(self.every_seconds, (int, float)) and self.every_seconds > 0
        ):
            raise ConfigError(f'every_seconds must be positive, "auto" or None, got {self.every_seconds!r}')
        if self.staging_budget is not None and (
            not isinstance(self.staging_budget, int) or isinstance(self.staging_budget, bool) or self.staging_budget < 1
        ):
            raise ConfigError(f"staging_budget must be a positive number of bytes or None, got {self.staging_budget!r}")
        try:
            self.busy = BusyPolicy(self.busy)
        except ValueError:
            raise ConfigError(f"busy must be one of {[p.value for p in BusyPolicy]}, got {self.busy!r}") from None
        if self.background_nice is not None and not (
            isinstance(self.background_nice, int) and 0 <= self.background_nice <= 19
        ):
            raise ConfigError(f"background_nice must be an int from 0 to 19 or None, got {self.background_nice!r}")
        if self.metrics_port is not None and not (
            isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError(f"metrics_port must be an int from 0 to 65535 or None, got {self.metrics_port!r}")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:  # [distributed]
            raise ConfigError(f"sync_every must be an int >= 1, got {self.sync_every!r}")
        self._check_modes((self.poll_on, PollOn, "poll_on"), (self.reshard, Reshard, "reshard"))
