"""A flag file as a notice: handy for orchestrators, shutdown scripts and tests.

The file's appearance is the notice. Optional JSON content refines it:
``{"kind": "terminate", "deadline": "2026-01-01T00:00:00Z"}`` or ``{"deadline_in": 30}``.
Unreadable or malformed content still counts as a notice (the file is there), with a warning.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from .. import _env
from ..errors import ConfigError
from .base import Notice, NoticeProvider, utcnow

logger = logging.getLogger(__name__)

ENV_VAR = _env.NOTICE_FILE
MAX_BYTES = 64 * 1024


def parse_time(value: Any) -> dt.datetime:
    """An aware UTC datetime from ISO 8601 text (``Z`` accepted) or epoch seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.timezone.utc)
    if isinstance(value, str):
        parsed = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        return parsed.astimezone(dt.timezone.utc)
    raise ValueError(f"not a time: {value!r}")


class FileProvider(NoticeProvider):
    """Reports a notice while the flag file exists."""

    name = "file"

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        path = path or _env.text(ENV_VAR)
        if not path:
            raise ConfigError(f"the file provider needs a path: pass one or set {ENV_VAR}")
        self.path = Path(path)
        self._polled = False

    def poll(self) -> Notice | None:
        first, self._polled = not self._polled, True
        try:
            with open(self.path, "rb") as f:
                content = f.read(MAX_BYTES)
                age = utcnow().timestamp() - os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        if first:  # there before the job: a notice that came during its start, or one an earlier run left
            logger.warning(
                "the notice file %s was there when this job started (written %.0fs ago): it stops the run at "
                "its first step; if an earlier run left it, remove it (`spotguard simulate-preemption --clear "
                "--file %s`)",
                self.path,
                max(age, 0.0),
                self.path,
            )
        kind, deadline, raw = "file", None, {"path": str(self.path), "content": content.decode("utf-8", "replace")}
        text = content.strip()
        if text:
            try:
                data = json.loads(text)
                if not isinstance(data, dict):
                    raise ValueError("JSON content must be an object")
                kind = str(data.get("kind") or kind)
                if data.get("deadline") is not None:
                    deadline = parse_time(data["deadline"])
                elif data.get("deadline_in") is not None:
                    deadline = utcnow() + dt.timedelta(seconds=float(data["deadline_in"]))
            except (ValueError, TypeError, OverflowError) as e:
                logger.warning("notice file %s has unusable content (%s); treating it as a plain notice", self.path, e)
                kind, deadline = "file", None
        return Notice(self.name, kind, deadline=deadline, raw=raw)
