"""One GCP metadata value watched with hanging GETs: its own connection, ETag and pacing.

The first read is a plain GET, which yields the value and its ETag; each later read asks the server
to hold the request until the value changes (``?wait_for_change=true&last_etag=E&timeout_sec=N``),
so a change is seen as fast as the network allows. Each ``Reading`` says since when its value can
have held: a request that waited knew the old value until it returned, one that did not only until
the previous read; a deadline counted from there is counted from the change, not from its detection.

Hostile answers cost nothing lasting: an ETag is percent-encoded into the query (a space in one made
every later request fail), an ETag that is not short printable ASCII is dropped for plain GETs once a
second, and answers that come back at once twice in a row (a value that changes on every read, a
server that ignores ``wait_for_change``) are paced to one a second, never a busy loop.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

from ._http import MetadataClient, check_status
from .base import utcnow

ROOT = "/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
#: A hanging GET that took longer than this really waited: the server held the old value until it answered.
WAITED = 0.25
#: What an ETag may be to be sent back (GCP's are 16 hex digits): printable ASCII, not too long.
_ETAG = re.compile(r"[\x20-\x7e]{1,256}")


@dataclass(frozen=True)
class Reading:
    value: str
    #: The earliest moment the value can have become what it is (if it changed).
    since: dt.datetime


class HangingGet:
    """Reads ``path`` under the GCP metadata root, then waits on it. ``wake`` set: ``read()`` returns
    None at once (the watcher stops); ``warn`` logs a rate-limited warning."""

    def __init__(
        self,
        client: MetadataClient,
        path: str,
        hang: int,
        wake: threading.Event,
        warn: Callable[..., None],
    ) -> None:
        self.client, self.path, self.hang, self.wake, self.warn = client, path, hang, wake, warn
        self.reset()

    def reset(self) -> None:
        """Start again with a plain GET (a watcher started again: the value may have changed and
        changed back since the ETag was read, and a hanging GET on that ETag would wait it out)."""
        self.etag: str | None = None
        self._read_at: dt.datetime | None = None  # when the last successful read returned
        self._next_at = 0.0  # monotonic: no request before this (pacing)
        self._quick = False  # the last hanging GET came back without waiting

    def read(self) -> Reading | None:
        """The value now (or at its next change, within ``hang`` seconds); None when woken."""
        if self.wake.wait(max(0.0, self._next_at - time.monotonic())):
            return None
        started = time.monotonic()
        sent = self.etag
        query, timeout = "", None
        if sent is not None:
            query = f"?wait_for_change=true&last_etag={quote(sent, safe='')}&timeout_sec={self.hang}"
            timeout = self.hang + self.client.timeout + 1.0
        try:
            resp = self.client.request("GET", ROOT + self.path + query, HEADERS, timeout=timeout)
        except OSError:
            if self.wake.is_set():
                return None  # interrupted by wakeup(): the watcher is stopping
            raise
        check_status(resp.status, (200,), f"GET {ROOT}{self.path}")
        if resp.headers.get("metadata-flavor") != "Google":
            raise ValueError(f"{self.client.base_url} answered without 'Metadata-Flavor: Google': not GCP")
        waited = sent is not None and time.monotonic() - started >= WAITED
        now = utcnow()
        since = now if waited or self._read_at is None else self._read_at
        etag = resp.headers.get("etag")
        if etag is not None and not _ETAG.fullmatch(etag):
            self.warn("%s: unusable ETag %r; reading once a second instead of waiting", self.path, etag[:100])
            etag = None
        # No ETag: plain GETs, once a second. Hanging GETs back at once twice in a row, or unchanged
        # without waiting: the value changes on every read, or the server does not hold requests;
        # once a second too. (One change at once costs nothing: the next read is not delayed.)
        if etag is None or (not waited and (etag == sent or self._quick)):
            self._next_at = started + 1.0
        else:
            self._next_at = 0.0
        self.etag, self._read_at, self._quick = etag, now, sent is not None and not waited
        return Reading(resp.text.strip(), since)
