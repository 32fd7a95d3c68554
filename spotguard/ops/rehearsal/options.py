"""What ``spotguard rehearse`` is told: the command, the preemptions to send, and how the fleet behaves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spotguard.errors import ConfigError
from spotguard.planner import NOTICE_LEAD_S

#: Where notices come from: a mock metadata service over HTTP, a SIGTERM, or a notice file.
SOURCES = ("aws", "gcp", "azure", "signal", "file")
#: The lead of a notice from a signal or a file when none is given (a pod's default grace period).
DEFAULT_OTHER_LEAD_S = 30.0


@dataclass
class RehearsalOptions:
    """One rehearsal. Validated on creation.

    ``mtbf_s``: mean seconds of training between preemptions (an exponential draw per notice, from a
    private generator seeded by ``seed``). ``after_restart``: how many of the ``preemptions`` come
    instead within ``restart_window_s`` of a later machine's start (before or while it resumes);
    ``during_save`` and ``during_eval`` of the others wait, after their draw, for the job's next save
    in flight or its next evaluation (the heartbeat's marks: a Guard's or a trainer integration's) and come then.
    ``lead_s``: seconds from a notice to the machine's end (None: the cloud's published lead); the
    fleet kills the job then, as the cloud would. ``replacement_s``: from a machine's end to the start
    of the next. ``storage``: given to the job as ``$SPOTGUARD_STORAGE`` and ``{storage}`` in the
    command. ``fresh_local``: every machine gets a new empty folder (``$SPOTGUARD_LOCAL_DIR``,
    ``$TMPDIR``, ``{local}`` in the command), removed when it ends: only the storage survives.
    """

    command: Sequence[str]
    preemptions: int = 5
    mtbf_s: float = 30.0
    seed: int | None = None
    source: str = "aws"
    lead_s: float | None = None
    replacement_s: float = 1.0
    after_restart: int = 0
    restart_window_s: float = 3.0
    during_save: int = 0
    during_eval: int = 0
    storage: str | None = None
    fresh_local: bool = False
    poll_s: float = 0.05
    max_crashes: int = 2  # a crashed job is restarted on the same machine this many times in all
    timeout_s: float | None = None  # the whole rehearsal; None: no limit
    stdout_to_stderr: bool = False  # the job's stdout goes to our stderr (`rehearse --json`)

    def __post_init__(self) -> None:
        self.command = list(self.command)
        if not self.command:
            raise ConfigError("no command to rehearse: put it after `--`, e.g. spotguard rehearse -- python train.py")
        if self.source not in SOURCES:
            raise ConfigError(f"unknown notice source {self.source!r}; choose one of {', '.join(SOURCES)}")
        if not isinstance(self.preemptions, int) or self.preemptions < 0:
            raise ConfigError(f"preemptions must be an int >= 0, got {self.preemptions!r}")
        for name in ("after_restart", "during_save", "during_eval"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= self.preemptions:
                raise ConfigError(f"{name} must be an int from 0 to the preemptions, got {value!r}")
        if self.after_restart and self.after_restart >= self.preemptions:
            raise ConfigError(
                f"after_restart must be less than the {self.preemptions} preemption(s): the first machine's "
                "start is no restart"
            )
        if self.after_restart + self.during_save + self.during_eval > self.preemptions:
            raise ConfigError(
                f"{self.after_restart} after a restart + {self.during_save} during a save + {self.during_eval} "
                f"during an evaluation is more than the {self.preemptions} preemption(s): raise --preemptions"
            )
        if self.lead_s is None:
            self.lead_s = NOTICE_LEAD_S.get(self.source, DEFAULT_OTHER_LEAD_S)
        for name in ("mtbf_s", "lead_s", "poll_s", "restart_window_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if not (math.isfinite(self.replacement_s) and self.replacement_s >= 0):
            raise ConfigError(f"replacement_s must be >= 0, got {self.replacement_s!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive or None, got {self.timeout_s!r}")
