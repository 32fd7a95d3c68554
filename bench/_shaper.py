"""A TCP proxy that caps each connection at ``rate`` bytes/s in each direction (a token bucket each).

Why: real S3 and GCS limit what one connection carries (tens of MB/s from one VM), and concurrent
parts beat that limit; moto and fake-gcs-server on 127.0.0.1 have no such limit and are CPU-bound
instead. This models the per-connection limit and nothing else: no latency, no loss, no cap on the
sum over connections (the local server's CPU is the only one).
"""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 64 << 10


class Shaper:
    """``Shaper(upstream_port, rate)``; point the client at ``shaper.url``; ``close()`` stops accepting."""

    def __init__(self, upstream_port: int, rate: float, burst: int = 4 * CHUNK) -> None:
        self.upstream_port, self.rate, self.burst = upstream_port, rate, burst
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name="shaper", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        tokens, last = float(self.burst), time.monotonic()
        try:
            while data := src.recv(CHUNK):
                now = time.monotonic()
                tokens = min(self.burst, tokens + (now - last) * self.rate) - len(data)
                last = now
                if tokens < 0:  # in debt: sleep until the bucket has paid for this chunk
                    time.sleep(-tokens / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # either side closing ends the connection (HTTP replies are complete by then)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._server.close()
