"""A small fault-injecting HTTP/1.1 proxy for tests, independent of spotguard.

Put it in front of a real server (moto, a GCS emulator) and point the client at ``proxy.url``.
Each request fails with probability ``rate`` in one of the chosen ways:

- ``drop``      close the connection before forwarding (the server never sees the request)
- ``500``/``503`` answer with that status before forwarding
- ``reset``     forward, then close without answering (the server did it, the client cannot know)
- ``stall``     hold the connection for ``stall`` seconds, then close (client read timeouts)
- ``truncate``  forward, then send the headers and only half the body
- ``403``       answer 403 (a permanent error, for fail-fast tests)
- ``corrupt``   forward the request with one byte of its body flipped (data damaged on the way up);
                a request without a body goes through untouched

With ``only`` set, only requests whose target contains it may fail (one operation among concurrent ones).
The proxy's randomness is its own ``random.Random(seed)``; counters tell a test what happened.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import socketserver
import threading

FAULTS = ("drop", "500", "503", "reset", "stall", "truncate")
_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
        try:
            while not proxy.stopping.is_set():
                request = self._read_request()
                if request is None:
                    return
                method, target, headers, body = request
                fault = proxy.pick(method, target)
                if fault in ("drop", "stall"):
                    if fault == "stall":
                        proxy.stopping.wait(proxy.stall)
                    return
                if fault in ("500", "503", "403"):
                    self._send_status(int(fault))
                    continue
                if fault == "corrupt" and body:
                    body = body[: len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1 :]
                upstream.request(method, target, body=body, headers=headers)
                resp = upstream.getresponse()
                data = resp.read()
                if fault == "reset":
                    return
                head = self._head(method, resp, data)
                if fault == "truncate":
                    self.wfile.write(
                        head + data[: len(data) // 2] if data else head[:5]
                    )  # no body: cut the status line
                    return
                self.wfile.write(head + data)
                self.wfile.flush()
                if (
                    resp.getheader("connection", "").lower() == "close"
                    or headers.get("connection", "").lower() == "close"
                ):
                    return
        except (OSError, http.client.HTTPException):
            return
        finally:
            upstream.close()

    def _read_request(self) -> tuple[str, str, dict[str, str], bytes] | None:
        line = self.rfile.readline(65537)
        if not line.strip():
            return None
        method, target, _version = line.decode("latin-1").split()
        headers: dict[str, str] = {}
        while (h := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = h.decode("latin-1").partition(":")
            headers[name.strip()] = value.strip()
        lower = {k.lower(): v for k, v in headers.items()}
        if lower.get("expect", "").lower() == "100-continue":  # answer it: http.client upstream cannot
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
            headers = {k: v for k, v in headers.items() if k.lower() != "expect"}
        if lower.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
            headers = {k: v for k, v in headers.items() if k.lower() != "transfer-encoding"}
            headers["Content-Length"] = str(len(body))
        else:
            body = self.rfile.read(int(lower.get("content-length", "0") or 0))
        return method, target, headers, body

    @staticmethod
    def _head(method: str, resp: http.client.HTTPResponse, data: bytes) -> bytes:
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
        for name, value in resp.getheaders():
            if name.lower() in ("transfer-encoding", "content-length"):
                continue
            lines.append(f"{name}: {value}")
        no_body = method == "HEAD" or resp.status in (204, 304)
        length = resp.getheader("content-length", "0") if no_body else str(len(data))
        if not (no_body and resp.getheader("content-length") is None):
            lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send_status(self, status: int) -> None:
        body = f"<Error><Code>Injected{status}</Code><Message>injected by faultproxy</Message></Error>".encode()
        self.wfile.write(
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class FaultProxy:
    """``with FaultProxy(port, rate=0.3) as p: client(endpoint=p.url)``; ``p.rate`` may change live."""

    def __init__(
        self,
        upstream_port: int,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        stall: float = 3.0,
        seed: int | None = None,
        upstream_host: str = "127.0.0.1",
        only: str = "",
    ) -> None:
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.set_faults(rate=rate, faults=faults, stall=stall, seed=seed, only=only)
        self.requests = 0
        self.log: list[str] = []  # "METHOD target" of every request seen
        self.injected: collections.Counter[str] = collections.Counter()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True)

    def set_faults(
        self,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        stall: float = 3.0,
        seed: int | None = None,
        only: str = "",
    ) -> None:
        """What fails from now on (the constructor's keywords), for a proxy that is already running."""
        unknown = set(faults) - set(FAULTS) - {"403", "corrupt"}
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}")
        self.rate, self.faults, self.stall, self.only = rate, tuple(faults), stall, only
        self.rng = random.Random(seed)

    def pick(self, method: str = "", target: str = "") -> str | None:
        with self._lock:
            self.requests += 1
            self.log.append(f"{method} {target}")
            if self.only not in target or self.rate <= 0 or self.rng.random() >= self.rate:
                return None
            fault = self.rng.choice(self.faults)
            self.injected[fault] += 1
            return fault

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    """Block until something listens on 127.0.0.1:port."""
    import time

    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
