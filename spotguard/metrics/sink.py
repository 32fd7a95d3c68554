"""Where metrics go: a Prometheus endpoint (collected on scrape) and a JSON lines file (one record per event).

``Exporter`` is the life both exporters share (a Guard's, ``spotguard run``'s): it listens to an
``Events``, hands the records to a ``Worker`` thread, serves an ``Endpoint`` and closes all of it once.

Both are fed off the training loop's path: the endpoint calls the collector only when scraped, and
records are written by one background thread from a queue, so a slow disk never stalls a listener.
prometheus_client is imported only when an endpoint or a registry is asked for (``spotguard[metrics]``).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MissingDependencyError
from ..events import Events, Record

logger = logging.getLogger(__name__)

_STOP = object()


def prometheus() -> Any:
    """The prometheus_client module, or a clear error naming the extra to install."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families
    except ImportError as e:
        raise MissingDependencyError(
            f"a metrics endpoint needs prometheus_client: pip install 'spotguard[metrics]' ({e})"
        ) from e
    return prometheus_client


class Endpoint:
    """An HTTP server answering ``GET /metrics`` from ``collector`` on every scrape (its own registry)."""

    def __init__(self, collector: Any, host: str, port: int) -> None:
        client = prometheus()
        self.registry = client.CollectorRegistry()
        self.registry.register(collector)
        try:
            self._server, self._thread = client.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e}") from e
        self.host, self.port = host, int(self._server.server_address[1])
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


class Worker:
    """One daemon thread: hands queued records to ``handle``, and calls ``tick`` every ``tick_s`` seconds.

    ``put()`` never blocks and never raises; ``close()`` handles what is queued, then stops.
    """

    def __init__(
        self,
        handle: Callable[[dict[str, Any]], None],
        tick: Callable[[], None] | None = None,
        tick_s: float = 1.0,
        name: str = "spotguard-metrics",
    ) -> None:
        self._handle, self._tick, self._tick_s = handle, tick, tick_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        self._queue.put(record)

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._tick_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:
                if item is not None:
                    self._handle(item)
                if self._tick is not None:
                    self._tick()
            except Exception:
                logger.exception("metrics worker failed on %r; going on", item)


class JsonLines:
    """Appends one JSON object per line and flushes it (a crash loses at most the record being written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise ConfigError(f"cannot open the metrics file {self.path}: {e}") from e
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        try:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            self._file.write(json.dumps(clean, default=str, allow_nan=False) + "\n")
            self._file.flush()
        except (OSError, ValueError) as e:
            if not self._failed:  # once: a full disk must not flood the log
                logger.warning("cannot write to the metrics file %s: %s", self.path, e)
            self._failed = True

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:
            logger.warning("closing the metrics file %s failed: %s", self.path, e)


class Exporter:
    """Exports one source of ``events``: JSON lines in ``jsonl`` (written by ``handle()`` in a worker
    thread, which also calls ``tick()`` every ``tick_s`` seconds), an endpoint on ``host:port`` (0: a
    free port) and/or a collector registered in ``registry``. Subclasses give ``collect()``.

    Set the state ``handle``, ``tick`` and ``collect`` read before calling ``__init__``: the worker
    thread starts in it. A failure to serve closes what was opened and raises. ``close()`` stops
    everything and ``reopen()`` starts it again (a Guard entered again after ``close()``).
    """

    def __init__(
        self,
        events: Events,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        jsonl: str | Path | None = None,
        registry: Any = None,
        tick_s: float = 1.0,
        name: str = "spotguard-metrics",
    ) -> None:
        self._events, self._host, self._jsonl, self._registry = events, host, jsonl, registry
        self._port, self._tick_s, self._name = port, tick_s, name
        self._served: int | None = None  # the port an endpoint was served on
        self._file: JsonLines | None = None
        self.endpoint: Endpoint | None = None
        self._closed = True
        self._open()

    def _open(self) -> None:
        self._file = JsonLines(self._jsonl) if self._jsonl else None
        self.endpoint = None
        self._closed = False
        self._worker = Worker(self.handle, self.tick, self._tick_s, name=self._name)
        self._events.add(self.on_event)
        try:
            if self._registry is not None:
                prometheus()
                self._registry.register(self)
            if self._port is not None:
                self.endpoint = self._serve()
        except Exception:
            self.close()
            raise

    def _serve(self) -> Endpoint:
        """Serve on the port asked for; reopened, on the port served before (the same URL), unless
        a free port was asked for and that one is taken since."""
        port = self._served if self._served is not None else self._port
        try:
            endpoint = Endpoint(self, self._host, port)  # type: ignore[arg-type]  # only called with a port
        except ConfigError:
            if port == self._port or self._port != 0:
                raise
            endpoint = Endpoint(self, self._host, 0)
        self._served = endpoint.port
        return endpoint

    def reopen(self) -> None:
        """Export again after ``close()``: the JSON lines appended to the same file, the endpoint on the
        same port, the same figures going on. Harmless when open."""
        if self._closed:
            self._open()

    @property
    def port(self) -> int | None:
        return self.endpoint.port if self.endpoint else None

    def on_event(self, record: Record) -> None:
        """The listener: queue the record; the emitting thread goes on at once."""
        self._worker.put(record)

    def handle(self, record: Record) -> None:
        """In the worker thread: one record to the JSON lines file."""
        if self._file is not None:
            self._file.write(record)

    def tick(self) -> None:
        """In the worker thread, every ``tick_s`` seconds."""

    def collect(self) -> Iterator[Any]:
        """Called by prometheus_client on each scrape: the figures as they are now."""
        raise NotImplementedError

    def close(self) -> None:
        """Write what is queued, stop the endpoint and the thread. Calling it twice is harmless;
        ``reopen()`` starts them again."""
        if self._closed:
            return
        self._closed = True
        self._events.remove(self.on_event)
        self._worker.close()
        if self.endpoint is not None:
            self.endpoint.close()
        if self._registry is not None:
            self._registry.unregister(self)
        if self._file is not None:
            self._file.close()
