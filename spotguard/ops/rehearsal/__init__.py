"""``spotguard rehearse``: run a real job through real preemptions and measure what each one cost.

Order: ``Fleet`` runs the command on one "machine" after another, sending each its notice from a
mock metadata server, a signal or a notice file (``notices``), and killing it at the deadline as the
cloud would -> ``report.measure`` turns the heartbeat, the Guard's events and the manifests into
per-preemption figures, goodput and the planner's prediction for the same costs -> with a reference,
the same command runs once uninterrupted and ``compare`` checks the final checkpoints bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.errors import ConfigError

from .compare import Comparison, compare
from .fleet import Fleet, Machine
from .options import SOURCES, RehearsalOptions
from .report import Preemption, Report, measure, table

__all__ = [
    "SOURCES",
    "Comparison",
    "Fleet",
    "Machine",
    "Preemption",
    "RehearsalOptions",
    "Report",
    "Result",
    "rehearse",
    "reference_url",
    "table",
]

logger = logging.getLogger(__name__)


@dataclass
class Result:
    report: Report
    machines: list[Machine]
    comparison: Comparison | None = None
    reference_wall_s: float | None = None

    @property
    def ok(self) -> bool:
        """Every preemption committed its emergency checkpoint, the job finished, and it is exact."""
        r = self.report
        return (
            r.error is None
            and r.all_committed
            and bool(self.machines)
            and self.machines[-1].code == 0
            and (self.comparison is None or self.comparison.exact)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            **self.report.to_dict(),
            "machines_detail": [m.to_dict() for m in self.machines],
            "reference": None
            if self.comparison is None
            else {
                **dataclasses.asdict(self.comparison),
                "wall_s": self.reference_wall_s,
                "line": self.comparison.line(),
            },
        }


def reference_url(storage: str | None, given: str | None) -> str:
    """Where the uninterrupted run checkpoints: ``given``, else beside a local ``storage``."""
    if given:
        return given
    if not storage or "://" in storage and not storage.startswith("file://"):
        raise ConfigError("--reference needs --reference-storage URL unless --storage is a local folder")
    return storage.rstrip("/") + ".reference"


def rehearse(options: RehearsalOptions, work_dir: str | Path | None = None, reference: str | None = None) -> Result:
    """Run the rehearsal (and the reference run, to ``reference``); measure and compare."""
    own = work_dir is None
    wd = Path(tempfile.mkdtemp(prefix="spotguard-rehearse-")) if own else Path(work_dir)  # type: ignore[arg-type]
    wd.mkdir(parents=True, exist_ok=True)
    try:
        if reference:  # checked before anything runs: a storage in use loses nothing
            if options.storage is None:
                raise ConfigError("--reference needs --storage: the rehearsed run's checkpoints are compared")
            # STORAGE.reference by default: an earlier rehearsal's, which the next one must not resume
            Fleet(dataclasses.replace(options, storage=reference), wd)._check_storage(
                "--reference-storage, or delete the reference run's checkpoints of an earlier rehearsal"
            )
        fleet = Fleet(options, wd / "run")
        (wd / "run").mkdir(exist_ok=True)
        cpu0 = _self_cpu()
        machines = fleet.run()
        cpu = _self_cpu() - cpu0
        assert options.lead_s is not None
        report = measure(machines, options.lead_s, options.mtbf_s, bool(options.storage), fleet.error)
        report.cpu_self_s = cpu
        result = Result(report, machines)
        if reference:
            (wd / "reference").mkdir(exist_ok=True)
            ref = Fleet(
                dataclasses.replace(
                    options, storage=reference, preemptions=0, after_restart=0, during_save=0, during_eval=0
                ),
                wd / "reference",
            )
            t0 = time.time()
            done = ref.run()
            result.reference_wall_s = time.time() - t0
            if not done or done[-1].code != 0:
                raise ConfigError(f"the reference run failed: {ref.error or f'exit code {done[-1].code}'}")
            assert options.storage is not None
            result.comparison = compare(options.storage, reference)
        return result
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
