"""The HTTP side of the mock metadata server, its control API, and a client for that API.

Control API (JSON, under ``/_mock/``, never on a cloud's own paths):
``POST /_mock/trigger {"kind", "in", "action", ...}``, ``POST /_mock/clear``,
``POST /_mock/faults {"status": 503, "count": N, "delay": S, "drip": S, "pad": BYTES}`` (status 0:
the real answer, dripped a byte every ``drip`` seconds or followed by ``pad`` filler bytes), ``POST /_mock/storm {"on": true}``,
``GET /_mock/state``. Faults happen only when asked for: ``error_rate`` (a private random generator,
seedable), a count of upcoming failures set through the control API, or a storm: every request is
answered, in turn, by one of the failures real metadata services and the proxies in front of them
produce (``STORM``: 5xx, 429, 401, garbage bodies, connection resets, truncated answers).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from spotguard.errors import ConfigError, SpotguardError
from spotguard.notices._http import MetadataClient, MetadataHTTPError
from spotguard.ops.mockmeta.base import CloudMock, Reply, Request

logger = logging.getLogger(__name__)

CONTROL = "/_mock/"
DEFAULT_PORT = 1338  # as amazon-ec2-metadata-mock
#: A storm's answers, in turn. "garbage": 200 with random bytes (and the cloud's own headers);
#: "reset": the connection is reset without an answer; "truncated": the body stops short.
STORM = ("503", "500", "429", "401", "garbage", "reset", "502", "truncated")
_FILLER = b" " * 65536


class MockControlError(SpotguardError, ConnectionError):
    """The mock metadata server could not be reached or refused a control request."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real services
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall
    server: _Server

    def send_response(self, code: int, message: str | None = None) -> None:
        """As http.server's, with the imitated service's ``Server`` header instead of Python's."""
        self.log_request(code)
        self.send_response_only(code, message)
        if self.server.owner.mock.server_header:
            self.send_header("Server", self.server.owner.mock.server_header)
        self.send_header("Date", self.date_time_string())

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        req = Request(
            self.command,
            parts.path,
            dict(parse_qsl(parts.query, keep_blank_values=True)),
            {k.lower(): v for k, v in self.headers.items()},
            self.rfile.read(length) if length else b"",
        )
        try:
            reply = self.server.owner.dispatch(req)
        except Exception as e:  # a bug in the mock must show as a 500, not a dropped connection
            logger.exception("mock metadata server failed on %s %s", req.method, req.path)
            reply = Reply.text(500, f"mock error: {e}")
        if reply.abort == "reset":  # RST instead of an answer: linger 0, then close
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        length = len(reply.body) + reply.pad
        self.send_header("Content-Length", str(length * (2 if reply.abort == "truncated" else 1)))
        self.end_headers()
        if self.command != "HEAD":
            self._write_body(reply)
        if reply.abort == "truncated":
            self.close_connection = True

    def _write_body(self, reply: Reply) -> None:
        """The body at once, or a byte every ``reply.drip`` seconds; then ``reply.pad`` filler bytes
        in 64 KiB writes (never held in memory whole: a test may measure the client's memory)."""
        if reply.drip > 0:
            for i in range(len(reply.body)):
                if self.server.owner.mock.closed:
                    return
                self.wfile.write(reply.body[i : i + 1])
                time.sleep(reply.drip)
        else:
            self.wfile.write(reply.body)
        filler, left = memoryview(_FILLER), reply.pad
        while left > 0 and not self.server.owner.mock.closed:
            self.wfile.write(filler[: min(left, len(filler))])
            left -= len(filler)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: MockMetadataServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-answer (a watcher stopping its hanging GET) is normal here.
        logger.debug("connection from %s ended abruptly", client_address, exc_info=True)


class MockMetadataServer:
    """Serves ``mock`` (an ``AwsMock``/``GcpMock``/``AzureMock``) on 127.0.0.1 from a background thread."""

    def __init__(
        self,
        mock: CloudMock,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        error_rate: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ConfigError(f"error_rate must be within 0..1, got {error_rate}")
        self.mock = mock
        self.error_rate = error_rate
        self._rng = random.Random(seed)  # private: the mock may share a process with training
        self._faults: dict[str, Any] = {"count": 0}
        self._storm = False
        self._storm_answers = itertools.cycle(STORM)
        #: Called with each storm answer's name (from a server thread), e.g. to end a storm in a test.
        self.on_storm: Callable[[str], None] | None = None
        self.storm_answers = 0
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port must be within 0..65535 (0: any free port), got {port!r}")
        try:
            self._httpd = _Server((host, port), _Handler)
        except OSError as e:  # in use, a host that is not ours, a name that does not resolve
            raise ConfigError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{self.port}"

    def start(self) -> MockMetadataServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name=f"spotguard-mock-{self.mock.cloud}",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.mock.close()  # wakes hanging GETs first
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> MockMetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_faults(
        self, status: int = 503, count: int = 1, delay: float = 0.0, drip: float = 0.0, pad: int = 0
    ) -> None:
        """The next ``count`` requests wait ``delay`` s, then get ``status`` (0: the real answer), its
        body dripped a byte every ``drip`` seconds and followed by ``pad`` filler bytes."""
        if drip < 0 or pad < 0:
            raise ConfigError(f"drip and pad must not be negative, got {drip}, {pad}")
        with self.mock.cond:
            self._faults = {"status": status, "count": count, "delay": delay, "drip": drip, "pad": pad}

    def set_storm(self, on: bool = True) -> None:
        """Answer every request (held hanging GETs too) with the next failure of ``STORM``, or stop."""
        with self.mock.cond:
            self._storm = on

    def _storm_reply(self) -> Reply | None:
        with self.mock.cond:
            if not self._storm:
                return None
            answer = next(self._storm_answers)
            self.storm_answers += 1
        headers = dict(self.mock.identity_headers)
        if answer == "garbage":
            reply = Reply(200, self._rng.randbytes(48), {"Content-Type": "text/plain", **headers})
        elif answer in ("reset", "truncated"):
            reply = Reply(200, b"partial answer", headers, abort=answer)
        else:
            reply = Reply(int(answer), f"error {answer}".encode(), {"Content-Type": "text/plain", **headers})
        if self.on_storm is not None:
            self.on_storm(answer)
        return reply

    def dispatch(self, req: Request) -> Reply:
        if req.path.startswith(CONTROL):
            return self._control(req)
        stormy = self._storm_reply()
        if stormy is not None:
            with self.mock.cond:
                self.mock.requests += 1
            return stormy
        with self.mock.cond:
            self.mock.requests += 1
            fault = None
            if self._faults["count"] > 0:
                self._faults["count"] -= 1
                fault = dict(self._faults)
            elif self.error_rate and self._rng.random() < self.error_rate:
                fault = {"status": 503, "delay": 0.0}
        if fault:
            if fault.get("delay"):
                time.sleep(fault["delay"])
            if fault.get("status"):
                return self._shaped(Reply.text(int(fault["status"]), "Service Unavailable"), fault)
        reply = self.mock.handle(req)
        reply = self._storm_reply() or reply  # a hanging GET held into a storm gets the storm's answer
        return self._shaped(reply, fault) if fault else reply

    @staticmethod
    def _shaped(reply: Reply, fault: dict[str, Any]) -> Reply:
        reply.drip, reply.pad = float(fault.get("drip") or 0.0), int(fault.get("pad") or 0)
        return reply

    def _control(self, req: Request) -> Reply:
        op = req.path[len(CONTROL) :].strip("/")
        try:
            body = json.loads(req.body) if req.body else {}
            if op == "state" and req.method == "GET":
                return Reply.json(200, self.mock.state())
            if req.method != "POST":
                return Reply.json(405, {"error": f"{req.method} not allowed on {req.path}"})
            if op == "trigger":
                delay = float(body.pop("in", 0) or 0)
                return Reply.json(
                    200, {"cloud": self.mock.cloud, **self.mock.trigger(body.pop("kind", None), delay, **body)}
                )
            if op == "clear":
                self.mock.clear()
                return Reply.json(200, {"cloud": self.mock.cloud, "cleared": True})
            if op == "storm":
                self.set_storm(bool(body.get("on", True)))
                return Reply.json(200, {"cloud": self.mock.cloud, "storm": self._storm})
            if op == "faults":
                self.set_faults(
                    int(body.get("status", 503)),
                    int(body.get("count", 1)),
                    float(body.get("delay", 0)),
                    float(body.get("drip", 0)),
                    int(body.get("pad", 0)),
                )
                return Reply.json(200, {"cloud": self.mock.cloud, "faults": body})
        except (ValueError, TypeError) as e:
            return Reply.json(400, {"error": str(e)})
        return Reply.json(404, {"error": f"unknown control operation {op!r}"})


def control(endpoint: str, op: str, payload: dict[str, Any] | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """Call the control API of a running mock server; clear errors when nothing is listening."""
    try:
        client = MetadataClient.from_url(endpoint, timeout)
    except ValueError as e:
        raise MockControlError(str(e)) from e
    method = "GET" if op == "state" else "POST"
    body = json.dumps(payload or {}).encode() if method == "POST" else None
    try:
        resp = client.request(method, CONTROL + op, {"Content-Type": "application/json"}, body)
    except MetadataHTTPError as e:
        raise MockControlError(
            f"no mock metadata server at {endpoint} ({e.__cause__ or e}); start one with "
            f"`spotguard mock-metadata --cloud aws|gcp|azure`"
        ) from e
    finally:
        client.close()
    try:
        answer = json.loads(resp.body) if resp.body else {}
    except ValueError as e:
        raise MockControlError(
            f"{endpoint} is not a spotguard mock metadata server (HTTP {resp.status} on {CONTROL}{op})"
        ) from e
    if resp.status != 200:
        raise MockControlError(f"mock metadata server at {endpoint}: {answer.get('error', resp.status)}")
    return dict(answer)
