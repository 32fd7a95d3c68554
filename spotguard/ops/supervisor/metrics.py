"""``spotguard run``'s metrics: starts, exits and restarts by cause, the job's step, work lost per exit.

Read from the ``Supervisor`` on scrape (its counters, the child's heartbeat file for the step), and
written as JSON lines from its events (``start``, ``exit``, ``end``) by a background thread. An
exit's ``lost_s`` is the wall time from the newer of the newest checkpoint's commit (its manifest's
time) and the child's start to the exit: the work the next start redoes (hang time included).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spotguard import heartbeat
from spotguard.metrics.sink import Exporter
from spotguard.ops.supervisor import CAUSES, RESTARTED

if TYPE_CHECKING:
    from spotguard.ops.supervisor import Supervisor


class RunMetrics(Exporter):
    """Exports one Supervisor: an endpoint on ``host:port`` and/or JSON lines in ``jsonl``."""

    def __init__(
        self, supervisor: Supervisor, *, port: int | None = None, host: str = "127.0.0.1", jsonl: str | None = None
    ) -> None:
        self.supervisor = supervisor
        super().__init__(supervisor.events, port=port, host=host, jsonl=jsonl, name="spotguard-run-metrics")

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        sup = self.supervisor
        exits = list(sup.exits)
        yield CounterMetricFamily("spotguard_run_starts", "Times the job was started.", value=sup.starts)
        restarts = CounterMetricFamily(
            "spotguard_run_restarts", "Restarts, by the cause of the exit before.", labels=["cause"]
        )
        ended = CounterMetricFamily("spotguard_run_exits", "Job exits, by cause.", labels=["cause"])
        for cause in CAUSES:
            if cause in RESTARTED:
                restarts.add_metric([cause], sup.restart_causes.get(cause, 0))
            ended.add_metric([cause], sum(1 for e in exits if e["cause"] == cause))
        yield restarts
        yield ended
        beat = sup.beat
        yield GaugeMetricFamily(
            "spotguard_run_job_running",
            "1 while the job is running.",
            value=1 if beat is not None and sup.running is not None else 0,
        )
        if beat is not None:
            yield GaugeMetricFamily(
                "spotguard_run_job_step",
                "The job's last completed step (its heartbeat).",
                value=heartbeat.read(beat)[0],
            )
        if exits:
            yield GaugeMetricFamily(
                "spotguard_run_last_exit_code",
                "Exit code of the job's last exit (128+N for signal N).",
                value=exits[-1]["exit_code"],
            )
        lost = [e["lost_s"] for e in exits if e["lost_s"] is not None]
        yield SummaryMetricFamily(
            "spotguard_run_lost_seconds",
            "Exits that lost work (all but finished), and the seconds of work redone after each.",
            count_value=len(lost),
            sum_value=sum(lost),
        )
