"""The options every trainer integration and the ``Guard`` take alike, declared once and validated on creation.

``CommonOptions`` holds what they all take (the notices, the stop, the resume's refusals, the lease);
``GuardOptions`` (``spotguard.guard.options``) extends it with the Guard's schedule, engine and metrics,
and the integrations' ``WatchOptions`` (``spotguard.integrations._common``) with theirs. An option left
None that the job's environment may set (``$SPOTGUARD_STOP_ON_ADVISORY`` ...) is read from it here,
through ``spotguard._env``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from spotguard import _env
from spotguard.checkpoint.format import digest
from spotguard.checkpoint.state.data import Rebatch
from spotguard.checkpoint.state.state import Untracked
from spotguard.coordination.window import DeadlinePolicy, WindowPolicy
from spotguard.errors import ConfigError
from spotguard.notices.base import NoticeProvider
from spotguard.planner import DEFAULT_WINDOW_MARGIN_S

if TYPE_CHECKING:
    from typing_extensions import Self


class Unloadable(str, enum.Enum):
    """What ``resume()`` does when checkpoints exist but none of them loads (every one corrupt or refused)."""

    RAISE = "raise"  # NoLoadableCheckpointError, naming each checkpoint and why it was skipped
    FRESH = "fresh"  # a warning, and step 0: their work is redone on purpose


def _seconds(value: object) -> bool:
    """A number of seconds (not a bool): what the ``isinstance`` checks below accept."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_every_steps(value: object) -> None:
    """``every_steps``, of ``Guard`` and every loop integration alike: a positive int (not a bool) or None."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"every_steps must be a positive int or None, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """A yes/no option of ``Guard`` and the integrations alike: True or False (``"no"`` would be true)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


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
    ``spotguard.coordination.window``). ``lease_ttl`` / ``takeover`` (default ``$SPOTGUARD_TAKEOVER``): the
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
        digest.default_alg()  # a bad $SPOTGUARD_CHECKSUM refused now, not at every save, the emergency's too
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
