"""A tiny keep-alive HTTP client for metadata services (stdlib ``http.client``, no pools, no threads).

Why not ``requests``: a watcher polls every second for days, so the per-request cost matters, and a
hanging GET (GCP) must be interruptible from another thread when the watcher stops. One persistent
connection per client, reopened once when the server dropped it; ``interrupt()`` shuts the socket
down so a blocked read returns at once.

A hostile or broken answer must not hold the watcher or its memory: the timeout bounds a request's
whole time, not each read (an answer dripped a byte a second never times out per read), and an
answer larger than ``max_body`` bytes is refused after reading at most that much (metadata values
are bytes to kilobytes; a proxy's error page of 100 MB is not a notice).
"""

from __future__ import annotations

import functools
import http.client
import io
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from spotguard.errors import ConfigError
from spotguard.notices.base import NoticeProvider

__all__ = ["MetadataClient", "MetadataHTTPError", "Response", "WarnOnce", "check_status", "parse_base_url"]

#: The largest answer read (bytes): Azure's scheduled events with a dozen events are a few KiB.
MAX_BODY = 256 * 1024


class MetadataHTTPError(OSError):
    """A metadata request failed: no answer, or an HTTP status the caller did not expect."""

    def __init__(self, message: str, status: int | None = None, *, read_timeout: bool = False) -> None:
        super().__init__(message)
        self.status = status
        #: The server accepted the connection but sent no answer in time (not: nothing listening).
        self.read_timeout = read_timeout


class WarnOnce:
    """Log a warning the first time a kind of message appears, then at most once every ``every``
    seconds (debug level in between): a malformed document seen on every one-second poll must not
    write 86,400 warnings a day, yet a problem that lasts must stay visible.

    A kind is the message template and its first argument (the path or event it is about), so
    garbage that differs on every poll still counts as one kind.
    """

    def __init__(
        self, logger: logging.Logger, every: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.every = every
        self.clock = clock
        self._said: dict[tuple[str, str], float] = {}

    def __call__(self, msg: str, *args: object) -> None:
        key = (msg, str(args[0]) if args else "")
        now = self.clock()
        last = self._said.get(key)
        if last is not None and now - last < self.every:
            self.logger.debug(msg, *args)
            return
        if len(self._said) > 256:
            self._said.clear()
        self._said[key] = now
        self.logger.warning(msg, *args)


def check_status(status: int, expected: tuple[int, ...], what: str) -> None:
    """Raise ``MetadataHTTPError`` unless ``status`` is one of ``expected`` (the watcher backs off)."""
    if status not in expected:
        raise MetadataHTTPError(f"{what}: HTTP {status}", status)


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def parse_base_url(value: str, default_port: int = 80) -> tuple[str, int]:
    """``http://host:port`` or ``host:port`` -> (host, port). Only plain HTTP: metadata is link-local."""
    value = value.strip()
    if "://" not in value:
        value = "http://" + value
    parts = urlsplit(value)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"metadata endpoint must look like http://host:port, got {value!r}")
    return parts.hostname, parts.port or default_port


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read given only the time left until ``deadline`` (monotonic).

    ``hold`` is the file http.client made on the socket: kept open until this reader closes, so
    that a connection closed early (``Connection: close``) leaves the socket readable, as it does
    for http.client's own file.
    """

    def __init__(self, sock: socket.socket, deadline: float, hold: io.IOBase) -> None:
        super().__init__()
        self.sock, self.deadline, self._hold = sock, deadline, hold

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._hold.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _DeadlineResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` whose status line, headers and body must all arrive before a deadline."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline, self.fp))


class MetadataClient:
    """One keep-alive connection to a metadata server; safe to ``interrupt()`` from another thread.

    ``timeout`` bounds each request's whole time (connect, send, and every byte of the answer);
    ``max_body`` the size of an answer (a larger one is an error, its connection closed).
    """

    def __init__(self, host: str, port: int = 80, timeout: float = 2.0, max_body: int = MAX_BODY) -> None:
        self.host, self.port, self.timeout, self.max_body = host, port, timeout, max_body
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _conn against interrupt() from another thread
        self._interrupted = False

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0, max_body: int = MAX_BODY) -> MetadataClient:
        host, port = parse_base_url(url)
        return cls(host, port, timeout, max_body)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> Response:
        """Send one request; reconnect once if a reused connection turned out to be closed. The
        whole of it, the reconnection included, takes at most ``timeout`` (default: the client's)."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        for attempt in (0, 1):
            conn, fresh = self._connection(max(0.001, deadline - time.monotonic()))
            conn.response_class = functools.partial(_DeadlineResponse, deadline=deadline)  # type: ignore[assignment]
            raw: http.client.HTTPResponse | None = None
            try:
                conn.request(method, path, body=body, headers=headers or {})
                raw = conn.getresponse()
                declared = raw.length  # Content-Length, if any: a larger one is refused unread
                # Fewer bytes than asked for: the body is complete; one more: it is too large.
                data = raw.read(self.max_body + 1) if declared is None or declared <= self.max_body else None
                if data is not None and declared is not None and len(data) < declared:
                    raise http.client.IncompleteRead(data, declared - len(data))  # read(n) does not check
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                interrupted = self._interrupted
                self.close()
                if fresh or attempt or interrupted:
                    raise MetadataHTTPError(f"{method} {self.base_url}{path}: {e}") from e
                continue  # the server closed an idle keep-alive connection: try once on a new one
            except (OSError, http.client.HTTPException, ValueError) as e:
                # ValueError: a header value that cannot be sent (a garbled token). Whatever failed,
                # the connection is closed: one left half-used refuses every later request. A
                # timeout once connected, before any answer: something listens but drops our answer
                # (an IMDS hop limit); after the status line: an answer too slow to wait for.
                read_timeout = isinstance(e, socket.timeout) and conn.sock is not None and raw is None
                self.close()
                reason = "timed out" if isinstance(e, socket.timeout) else f"{type(e).__name__}: {e}"
                raise MetadataHTTPError(f"{method} {self.base_url}{path}: {reason}", read_timeout=read_timeout) from e
            if data is None or len(data) > self.max_body:
                self.close()
                size = f"{declared} bytes" if declared is not None else f"over {self.max_body} bytes"
                raise MetadataHTTPError(
                    f"{method} {self.base_url}{path}: an answer of {size} refused (at most {self.max_body})",
                    raw.status,
                )
            if raw.will_close:
                self.close()
            return Response(raw.status, {k.lower(): v for k, v in raw.getheaders()}, data)
        raise AssertionError("unreachable")  # pragma: no cover

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            fresh = self._conn is None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            conn = self._conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, fresh

    def interrupt(self) -> None:
        """Make a request blocked in another thread fail now (used to stop a hanging GET)."""
        with self._lock:
            self._interrupted = True  # no silent retry of the request we are cutting short
            sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            self._interrupted = False
        if conn is not None:
            conn.close()


class MetadataProvider(NoticeProvider):
    """A provider that polls its cloud's metadata server: one keep-alive client, and warnings that
    repeat at most every few minutes however often the server misbehaves."""

    def __init__(self, url: str, timeout: float, logger: logging.Logger) -> None:
        self.client = MetadataClient.from_url(url, timeout)
        self._warn = WarnOnce(logger)
