"""Every option of a ``Guard`` and of the trainer integrations, declared once and validated on creation.

``CommonOptions`` holds what they all take (the notices, the stop, the resume's refusals, the lease);
``GuardOptions`` extends it with the Guard's schedule, engine and metrics, and the integrations'
``WatchOptions`` (``spotguard.integrations._common``) with theirs. An option left None that the job's
environment may set (``$SPOTGUARD_STOP_ON_ADVISORY`` ...) is read from it here, through ``spotguard._env``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from spotguard import _env
from spotguard.checkpoint.format.manifest import Reshard
from spotguard.checkpoint.state.data import Rebatch
from spotguard.checkpoint.state.state import Untracked
from spotguard.errors import ConfigError
from spotguard.guard.ranks import PollOn
from spotguard.guard.window import DeadlinePolicy, WindowPolicy
from spotguard.notices.base import NoticeProvider
from spotguard.planner import DEFAULT_WINDOW_MARGIN_S

if TYPE_CHECKING:
    from typing_extensions import Self


class BusyPolicy(str, enum.Enum):
    """What a due periodic checkpoint does while the previous one is still being written."""

    SKIP = "skip"  # log it and skip this one: the loop never waits
    WAIT = "wait"  # block until the previous one is committed, then snapshot


class Unloadable(str, enum.Enum):
    """What ``resume()`` does when checkpoints exist but none of them loads (every one corrupt or refused)."""

    RAISE = "raise"  # NoLoadableCheckpointError, naming each checkpoint and why it was skipped
    FRESH = "fresh"  # a warning, and step 0: their work is redone on purpose


def _seconds(value: object) -> bool:
    """A number of seconds (not a bool): what the ``isinstance`` checks below accept."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CommonOptions:
    """What ``Guard`` and every trainer integration take alike, validated on creation; an option left
    None is read from the job's environment here (``spotguard._env``), once.

    ``keep`` checkpoints are kept. ``providers`` / ``interval``: what to watch and how often.
    ``stop_on_advisory`` (default ``$SPOTGUARD_STOP_ON_ADVISORY``, else False) stops on an advisory
    notice instead of only checkpointing early. ``on_unloadable``: when checkpoints exist but none
    loads, the resume raises (``"raise"``) or starts from step 0 with a warning (``"fresh"``).
    ``untracked``: a checkpoint that holds the state of an object nothing tracks now is refused
    (``"refuse"``, naming them) or resumed without that state (``"accept"``, with a warning).
    ``rebatch``: a data loader saved with another batch size is refused (``"refuse"``, naming both) or
    continued at the same sample in batches of the new size (``"accept"``, with a warning).
    ``deadline_policy`` (default ``$SPOTGUARD_DEADLINE_POLICY``, else ``"stop"``) / ``window_margin``:
    after the emergency checkpoint of a notice with a deadline, stop, or train on and checkpoint again
    ``window_margin`` seconds plus the measured save time before the deadline (``"use-window"``;
    ``spotguard.guard.window``). ``lease_ttl`` / ``takeover`` (default ``$SPOTGUARD_TAKEOVER``): the
    writer lease that keeps a second job off this run's storage (docs/lease.md).
    """

    #: Who takes these options, for the error that names an unknown one.
    owner: ClassVar[str] = "Guard"

    keep: int = 3
    providers: str | Iterable[str | NoticeProvider] | None = "auto"
    interval: float = 1.0
    stop_on_advisory: bool | None = None  # None: $SPOTGUARD_STOP_ON_ADVISORY, else False
    on_unloadable: Unloadable | str = Unloadable.RAISE
    untracked: Untracked | str = Untracked.REFUSE
    rebatch: Rebatch | str = Rebatch.REFUSE
    deadline_policy: DeadlinePolicy | str | None = None  # None: $SPOTGUARD_DEADLINE_POLICY, else "stop"
    window_margin: float = (
        DEFAULT_WINDOW_MARGIN_S  # "use-window": seconds kept free before the deadline beyond the save time
    )
    # The writer lease of the storage (spotguard.checkpoint.leaseholder): seconds a holder that stops
    # renewing keeps it (None: no lease, two jobs may write one run); takeover: take a live one over
    # (None: $SPOTGUARD_TAKEOVER, else False), the other job then commits nothing more.
    lease_ttl: float | None = 60.0
    takeover: bool | None = None

    @classmethod
    def from_kwargs(cls, options: dict[str, Any], owner: str | None = None) -> Self:
        """``cls(**options)``, an unknown name a ``ConfigError`` that names the close ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in options:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=2)
                raise ConfigError(
                    f"{owner or cls.owner} has no option {name!r}"
                    + (f" (did you mean {' or '.join(near)}?)" if near else f"; options: {', '.join(sorted(known))}")
                )
        return cls(**options)

    def __post_init__(self) -> None:
        if self.takeover is None:
            self.takeover = _env.flag(_env.TAKEOVER, default=False)
        if self.stop_on_advisory is None:  # not given: the job's environment decides (e.g. the terraform module)
            self.stop_on_advisory = _env.flag(_env.STOP_ON_ADVISORY, default=False)
        window = WindowPolicy(self.deadline_policy, self.window_margin)  # $SPOTGUARD_DEADLINE_POLICY, checks
        self.deadline_policy, self.window_margin = window.policy, window.margin_s
        if self.lease_ttl is not None and not (_seconds(self.lease_ttl) and 0 < self.lease_ttl < 1e7):
            raise ConfigError(f"lease_ttl must be a positive number of seconds or None, got {self.lease_ttl!r}")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {self.keep!r}")
        if not (_seconds(self.interval) and self.interval > 0):
            raise ConfigError(f"interval must be a positive number of seconds, got {self.interval!r}")
        self._check_modes(
            (self.on_unloadable, Unloadable, "on_unloadable"),
            (self.untracked, Untracked, "untracked"),
            (self.rebatch, Rebatch, "rebatch"),
        )

    @staticmethod
    def _check_modes(*modes: tuple[object, type[enum.Enum], str]) -> None:
        for value, enum_cls, name in modes:
            try:
                enum_cls(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not one of {[e.value for e in enum_cls]}") from None


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
    ``spotguard.guard.window``).
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
    # [distributed] only used in an initialised process group (see spotguard.guard.agreement)
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
        if self.metrics_file is None:  # `spotguard rehearse` reads a job's events without changing its code
            self.metrics_file = _env.text(_env.METRICS_FILE)
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ConfigError(f"every_steps must be a positive int or None, got {self.every_steps!r}")
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
