"""A Guard's metrics: its measured stats and events, as Prometheus metrics and JSON lines.

Nothing here runs in ``guard.step()``. The Prometheus collector reads ``guard.stats()`` when it is
scraped; the JSON lines are written by a background thread from the guard's events (checkpoint,
skipped, failed, notice, resume, stop, close). The time of the last step is what ``step()`` does not
measure (it reads no clock): the exporter notes when it first sees a new step, on each scrape and
every ``sample_s`` seconds, so it is exact to within that.

Seconds lost per preemption (``stop`` events, ``spotguard_preemption_lost_seconds``): the wall time of
work that the next run must redo. 0 when the emergency checkpoint committed (the stop step is the
resume point); otherwise the time from the commit of the resume point (its manifest's time, as
committed in this run or resumed from) to the stop, or from the exporter's start without one.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from spotguard import planner
from spotguard.costs import DEFAULT_START_S
from spotguard.events import Events

from .sink import Exporter

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # steps per second are measured over this much recent time


def _unix(iso: str | None) -> float | None:
    try:
        return dt.datetime.fromisoformat(iso).timestamp() if iso else None
    except ValueError:
        return None


class Watched(Protocol):
    """What the metrics read of a ``Guard``: typed here, so the metrics never import the guard package
    (the guard makes its metrics; an arrow back would close a circle)."""

    @property
    def events(self) -> Events: ...

    @property
    def last_step(self) -> int | None: ...

    @property
    def options(self) -> Any: ...  # GuardOptions: every_seconds, every_steps, mtbf_hours

    @property
    def schedule(self) -> Any: ...  # every_seconds()

    @property
    def watcher(self) -> Any: ...  # providers

    @property
    def agreement(self) -> Any: ...  # None in a single process

    def stats(self) -> Any: ...  # GuardStats

    def place(self) -> Any: ...  # ranks.Place: rank, local_rank, world_size, format()


class GuardMetrics(Exporter):
    """Exports one Guard: a Prometheus collector (``collect()`` on scrape) and a JSON lines file.

    Made by ``spotguard.metrics.export()`` (or ``Guard(metrics_port=..., metrics_file=...)``); stops
    when the guard closes (or with ``close()``), and a Guard entered again reopens its own
    (``guard.metrics``; one made by ``export()`` is reopened with ``reopen()``).
    """

    def __init__(
        self,
        guard: Watched,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        jsonl: str | None = None,
        registry: Any = None,
        sample_s: float = 1.0,
    ) -> None:
        self.guard = guard
        self._lock = threading.Lock()
        self._started = time.time()
        self._seen: tuple[int | None, float | None] = (None, None)  # (step, unix time first seen)
        self._samples: deque[tuple[float, int]] = deque()
        self._durable: tuple[int, float] | None = None  # (step, unix commit time) of the resume point
        self._stops: list[float] = []  # seconds lost per stop for a notice
        super().__init__(guard.events, port=port, host=host, jsonl=jsonl, registry=registry, tick_s=sample_s)

    def on_event(self, record: dict[str, Any]) -> None:
        """The listener: queue the record (the guard's thread goes on at once); stop with the guard."""
        super().on_event(record)
        if record["event"] == "close":
            self.close()

    # -- the background thread --------------------------------------------------------------
    def tick(self) -> None:
        """Note when a new step is first seen (``step()`` reads no clock): every ``sample_s`` and on scrape."""
        step, now = self.guard.last_step, time.time()
        with self._lock:
            if step is not None and step != self._seen[0]:
                self._seen = (step, now)
                self._samples.append((time.monotonic(), step))
                while len(self._samples) > 2 and self._samples[1][0] <= time.monotonic() - RATE_WINDOW_S:
                    self._samples.popleft()

    def handle(self, rec: dict[str, Any]) -> None:
        event = rec["event"]
        with self._lock:
            if event == "resume" and rec.get("checkpoint_time"):
                self._durable = (rec["step"], _unix(rec["checkpoint_time"]) or rec["unix"])
            elif event == "checkpoint" and rec.get("durable"):
                self._durable = (rec["step"], _unix(rec.get("checkpoint_time")) or rec["unix"])
            elif event == "stop":
                if rec.get("committed"):
                    lost = 0.0
                else:
                    since = self._durable[1] if self._durable else self._started
                    lost = max(rec["unix"] - since, 0.0)
                rec = {**rec, "lost_s": lost}
                self._stops.append(lost)
        if event == "close":  # the last line sums the run up: stats and the planner's estimate
            rec = {**rec, **self.guard.stats().as_dict(), **(self.estimate() or {})}
        super().handle(rec)

    # -- figures ---------------------------------------------------------------------------------
    def steps_per_second(self) -> float | None:
        """Steps over about the last ``RATE_WINDOW_S`` seconds, up to now: a stalled job decays to 0."""
        now = time.monotonic()
        with self._lock:
            samples = list(self._samples)
        if len(samples) < 2:
            return None
        t0, s0 = samples[0]  # tick() keeps the newest sample before the window as the anchor
        return max(samples[-1][1] - s0, 0) / (now - t0) if now > t0 else None

    def interval_seconds(self) -> float | None:
        """The periodic interval in use, in seconds (``every_steps`` through the measured step rate)."""
        g, found = self.guard, []
        if g.options.every_seconds is not None:
            found.append(g.schedule.every_seconds())
        rate = self.steps_per_second()
        if g.options.every_steps and rate:
            found.append(g.options.every_steps / rate)
        return min(found) if found else None

    def estimate(self) -> dict[str, float] | None:
        """The planner's goodput at the interval in use and at its recommendation, from measured costs.

        Needs ``Guard(mtbf_hours=...)`` and a measured checkpoint cost (the snapshot stall for
        asynchronous saves, else the write); the restart cost is the measured restore plus
        ``DEFAULT_START_S``. Notices: the shortest lead of the clouds watched, for
        ``planner.DEFAULT_NOTICE_SHARE`` of preemptions. None when something is missing.
        """
        g, st = self.guard, self.guard.stats()
        cost = st.snapshot_s if st.async_save else st.write_s
        if not g.options.mtbf_hours or not cost:
            return None
        leads = [planner.NOTICE_LEAD_S[p.name] for p in g.watcher.providers if p.name in planner.NOTICE_LEAD_S]
        notice = min(leads) if leads else None
        try:
            opts = planner.PlanOptions(
                cost, (st.restore_s or 0.0) + DEFAULT_START_S, g.options.mtbf_hours, notice_s=notice, intervals_s=()
            )
            plan = planner.plan(opts)
        except Exception as e:  # a figure out of the model's range: no estimate rather than a failed scrape
            logger.debug("no goodput estimate: %s", e)
            return None
        out = {"goodput_recommended": plan.goodput, "interval_recommended_s": plan.interval_s}
        interval = self.interval_seconds()
        if interval is not None and math.isfinite(interval):
            share = (opts.notice_share or 0.0) if opts.notice_works else 0.0
            out["interval_s"] = interval
            out["goodput"] = planner.goodput(
                interval, cost, opts.restart_s, opts.mtbf_s, notice_share=share, notice_s=opts.notice_s
            )
        return out

    # -- Prometheus ----------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        """Called by prometheus_client on each scrape: the figures as they are now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        self.tick()
        st, g = self.guard.stats(), self.guard
        step, seen = self._seen

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Any]:
            if value is not None and math.isfinite(value):
                yield GaugeMetricFamily(f"spotguard_{name}", doc, value=value)

        yield from gauge("step", "Last completed step (guard.step(n) or the resumed step).", step)
        yield from gauge(
            "step_timestamp_seconds", "Unix time the last step was first seen (within the sampling interval).", seen
        )
        yield from gauge(
            "steps_per_second", f"Steps per second over the last {RATE_WINDOW_S:.0f} s.", self.steps_per_second()
        )
        yield CounterMetricFamily(
            "spotguard_checkpoints", "Checkpoints committed to durable storage.", value=st.checkpoints
        )
        with self._lock:
            durable, stops = self._durable, list(self._stops)
        if durable:
            yield from gauge("last_checkpoint_step", "Step of the newest durable checkpoint.", durable[0])
            yield from gauge("last_checkpoint_timestamp_seconds", "Unix time it was committed.", durable[1])
        yield from gauge(
            "checkpoint_stall_seconds",
            "Training-loop stall of the last asynchronous checkpoint (the state copy).",
            st.last_stall_s,
        )
        yield from gauge("checkpoint_stall_average_seconds", "Moving average of that stall.", st.snapshot_s)
        yield from gauge(
            "checkpoint_write_seconds", "Moving average of a checkpoint write to the first tier.", st.write_s
        )
        yield from gauge("checkpoint_write_bytes_per_second", "Moving average of the write throughput.", st.write_Bps)
        yield from gauge(
            "checkpoint_upload_seconds", "Moving average of the upload local tier -> durable.", st.upload_s
        )
        yield from gauge(
            "checkpoint_upload_bytes_per_second", "Moving average of the upload throughput.", st.upload_Bps
        )
        yield from gauge("checkpoint_size_bytes", "Size of the last checkpoint's state.", st.state_bytes)
        yield from gauge("emergency_checkpoint_seconds", "Notice to committed emergency checkpoint.", st.emergency_s)
        yield from gauge("restore_seconds", "What guard.resume() took.", st.restore_s)
        yield CounterMetricFamily(
            "spotguard_saves_skipped",
            "Periodic checkpoints skipped: the previous one was still being written.",
            value=st.skipped,
        )
        yield CounterMetricFamily(
            "spotguard_saves_failed", "Checkpoints that failed (training went on).", value=st.failures
        )
        notices = CounterMetricFamily("spotguard_notices", "Distinct notices seen, by kind.", labels=["kind"])
        for kind, n in sorted(dict(st.notices).items()):
            notices.add_metric([kind], n)
        yield notices
        yield SummaryMetricFamily(
            "spotguard_preemption_lost_seconds",
            "Stops for a notice, and the seconds "
            "of work the next run redoes (0 when the emergency checkpoint committed).",
            count_value=len(stops),
            sum_value=sum(stops),
        )
        est = self.estimate() or {}
        yield from gauge(
            "checkpoint_interval_seconds",
            "Periodic checkpoint interval in use.",
            est.get("interval_s", self.interval_seconds()),
        )
        yield from gauge(
            "goodput_estimate",
            "Planner's expected goodput at the interval in use (needs mtbf_hours).",
            est.get("goodput"),
        )
        yield from gauge(
            "goodput_recommended",
            "Planner's expected goodput at its recommended interval.",
            est.get("goodput_recommended"),
        )
        yield from gauge(
            "checkpoint_interval_recommended_seconds",
            "Planner's recommended interval (Young/Daly with the measured costs).",
            est.get("interval_recommended_s"),
        )
        if g.agreement is not None:
            yield GaugeMetricFamily("spotguard_rank", "This process's rank.", value=g.place().rank)
