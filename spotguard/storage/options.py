"""What every cloud backend's options share: the retry policy, and one check of every field.

A backend's options dataclass extends ``TransferOptions`` and says the bounds of its own fields in
``bounds`` (the keywords of ``check_fields``); fields of the names every backend uses (``concurrency``,
``request_attempts``, the timeouts) are checked alike wherever they stand. A value out of range is a ``ConfigError`` naming the field when
the options are made, not a failed upload an hour into training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._common import check_fields
from .retry import RetryOptions

#: Fields by these names are checked alike in every backend's options that has them.
_COUNTS = ("concurrency", "request_attempts")  # at least 1
_SECONDS = ("timeout", "connect_timeout", "read_timeout", "urgent_timeout")  # positive


@dataclass(kw_only=True)
class TransferOptions:
    retry: RetryOptions = field(default_factory=RetryOptions)
    #: ``check_fields``'s keywords for this backend's fields (``ints``, ``positive``, ``urls``, ``strings``).
    bounds: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        ints: dict[str, int | tuple[int, int]] = {name: 1 for name in _COUNTS if hasattr(self, name)}
        seconds = tuple(name for name in _SECONDS if hasattr(self, name))
        check_fields(self, kinds={"retry": RetryOptions}, ints=ints, positive=seconds)
        check_fields(self, **self.bounds)
