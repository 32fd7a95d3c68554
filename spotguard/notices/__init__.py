"""Sources of notices, one module each, behind one interface (``NoticeProvider``).

``build("auto")`` gives signals, the flag file when ``SPOTGUARD_NOTICE_FILE`` is set, Ray's drain
inside a Ray Train worker, and the cloud providers found by ``detect_clouds()``. Providers are registered by name so that
``providers=["signal", "aws"]`` and ``--providers signal,aws`` mean the same everywhere; an option of a
cloud provider left None is read from the environment (``$SPOTGUARD_AWS_ALLOW_IMDSV1`` ...), the one
channel that reaches a job started by systemd or ``spotguard run``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from .. import _env
from ..errors import ConfigError
from .base import ADVISORY_KINDS, STOP_KINDS, Notice, NoticeProvider, stable_id

__all__ = [
    "ADVISORY_KINDS",
    "STOP_KINDS",
    "Notice",
    "NoticeProvider",
    "auto_names",
    "build",
    "detect_clouds",
    "register",
    "stable_id",
]

# name -> "module:factory" (imported lazily so that a provider's dependencies load only when used)
_REGISTRY: dict[str, str | Callable[[], NoticeProvider]] = {
    "signal": "spotguard.notices.signals:SignalProvider",
    "file": "spotguard.notices.file:FileProvider",
    "aws": "spotguard.notices.aws:AwsProvider",
    "gcp": "spotguard.notices.gcp:GcpProvider",
    "azure": "spotguard.notices.azure:AzureProvider",
    "ray": "spotguard.notices.ray:RayProvider",
}


def register(name: str, factory: str | Callable[[], NoticeProvider]) -> None:
    """Make a provider available by name (a ``"module:Class[.method]"`` path or a zero-argument factory)."""
    _REGISTRY[name] = factory


def names() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str) -> NoticeProvider:
    """A provider instance from its registered name."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown notice provider {name!r}; known: {', '.join(names())}") from None
    if isinstance(factory, str):
        module, _, path = factory.partition(":")
        found: Any = importlib.import_module(module)
        for attr in path.split("."):
            found = getattr(found, attr)
        factory = found
    return factory()


def detect_clouds(timeout: float = 0.5, *, refresh: bool = False) -> list[str]:
    """Names of the cloud providers whose metadata service answers here (none without a cloud).

    The three probes run in parallel with short timeouts, so a machine outside any cloud waits at
    most about ``timeout`` (+0.3 s); the answer is cached per set of endpoints (the endpoint
    variables included), so only the first Guard of a process pays for it.
    """
    from . import _detect

    return _detect.detect(timeout, refresh=refresh)


def auto_names() -> list[str]:
    """What ``"auto"`` means here: signals, the flag file when set, Ray's drain in a Ray Train worker,
    the clouds whose metadata answers."""
    from .ray import in_ray_train_worker

    chosen = ["signal"]
    if _env.text(_env.NOTICE_FILE):
        chosen.append("file")
    if in_ray_train_worker():
        chosen.append("ray")
    chosen.extend(detect_clouds())
    return chosen


def build(spec: str | Iterable[str | NoticeProvider] | None) -> list[NoticeProvider]:
    """Providers from ``"auto"``, a comma-separated string, or a list of names and instances."""
    if spec is None:
        return []
    if isinstance(spec, str):
        if spec == "auto":
            spec = auto_names()
        else:
            spec = [part.strip() for part in spec.split(",") if part.strip()]
            if not spec:  # e.g. an unset variable in a launch script: a job deaf to SIGTERM too
                raise ConfigError('providers is an empty string: name some ("auto", "aws,signal") or pass [] for none')
    providers: list[NoticeProvider] = []
    for item in spec:
        providers.append(item if isinstance(item, NoticeProvider) else create(item))
    return providers
