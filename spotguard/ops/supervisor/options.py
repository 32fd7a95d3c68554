"""What ``spotguard run`` is told: the command, its storage, the watchdog and the restart budget."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

from spotguard.errors import ConfigError


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
    takeover: bool = False  # the job takes over a live writer lease ($SPOTGUARD_TAKEOVER=1)

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
            self.forward_as = int(to_signal(self.forward_as))
        if self.prefetch and not self.local_dir:
            raise ConfigError("--prefetch needs --local-dir: the local tier to copy the checkpoint into")

    def backoff_s(self, restart: int) -> float:
        """The wait before restart number ``restart`` (1, 2, ...): doubled each time, capped."""
        return min(self.backoff_max, self.backoff * self.backoff_factor ** (restart - 1))


def to_signal(sig: str | int) -> signal.Signals:
    """A signal from a name (``TERM``, ``SIGTERM``, ``usr1``) or a number; ``ConfigError`` otherwise."""
    try:
        if isinstance(sig, str) and not sig.isdigit():
            name = sig.upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(int(sig))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"not a signal: {sig!r}") from e


def signame(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number that names none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
