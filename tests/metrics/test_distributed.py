"""Metrics under torchrun: one endpoint per rank (port + local rank), one JSON lines file per rank."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import WORKERS, free_port_run, run, torchrun

pytestmark = pytest.mark.slow


def test_each_rank_serves_its_own_endpoint_and_writes_its_own_file(tmp_path):
    port = free_port_run(2)  # rank 1 takes the next one
    proc = run(torchrun(2, WORKERS / "dist_metrics.py", str(tmp_path / "ckpt"), str(port), str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        served_on, text = (tmp_path / f"out-{rank}.txt").read_text().split("\n", 1)
        assert int(served_on) == port + rank
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert got["spotguard_rank"] == rank and got["spotguard_step"] == 4
        assert got["spotguard_checkpoints_total"] == 2  # steps 2 and 4, sharded and collective
        events = [json.loads(line) for line in (tmp_path / f"metrics-{rank}.jsonl").read_text().splitlines()]
        assert [(e["event"], e.get("step")) for e in events] == [
            ("resume", 0),
            ("checkpoint", 2),
            ("checkpoint", 4),
            ("close", 4),
        ]
