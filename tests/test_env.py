"""Opt-ins from the environment: a Guard's stop_on_advisory, and bad values named clearly."""

from __future__ import annotations

import time

import pytest
import torch

import spotguard
from spotguard import ConfigError, notices
from spotguard.integrations._loop import LoopOptions
from spotguard.ops.mockmeta import endpoint_env


def test_spotguard_stop_on_advisory_makes_a_guard_stop_for_a_rebalance(mock_metadata, monkeypatch, tmp_path):
    """A Guard built without the argument (as in a job started by the terraform module's unit)."""
    server = mock_metadata("aws")
    for name, value in endpoint_env("aws", server.url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPOTGUARD_STOP_ON_ADVISORY", "1")
    guard = spotguard.Guard(str(tmp_path), providers="aws", interval=0.05).track(model=torch.nn.Linear(2, 2))
    with guard:
        for step in range(1, 400):
            if step == 3:
                server.mock.trigger("rebalance")
            time.sleep(0.01)
            if guard.step(step):
                break
    assert guard.stopped_at is not None and guard.notice.kind == "rebalance"
    assert spotguard.Guard(str(tmp_path), providers=None, stop_on_advisory=False).options.stop_on_advisory is False
    monkeypatch.delenv("SPOTGUARD_STOP_ON_ADVISORY")
    assert spotguard.Guard(str(tmp_path), providers=None).options.stop_on_advisory is False


@pytest.mark.parametrize(
    "name, value, build",
    [
        ("SPOTGUARD_AWS_ALLOW_IMDSV1", "maybe", lambda: notices.build("aws")),
        ("SPOTGUARD_AZURE_ACK", "2", lambda: notices.build("azure")),
        ("SPOTGUARD_GCP_DEADLINE", "soon", lambda: notices.build("gcp")),
        ("SPOTGUARD_GCP_DEADLINE", "-5", lambda: notices.build("gcp")),
        ("SPOTGUARD_STOP_ON_ADVISORY", "yes please", lambda: spotguard.Guard("unused", providers=None)),
        # refused where the job starts, not by every save hours later (the emergency's too)
        ("SPOTGUARD_CHECKSUM", "xxh3", lambda: spotguard.Guard("unused", providers=None)),
        ("SPOTGUARD_CHECKSUM", "xxh3", lambda: LoopOptions()),  # every trainer integration's options
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch, name, value, build):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"\\${name}:? must be"):
        build()


def test_a_provider_made_without_the_argument_reads_the_environment_and_an_argument_wins(monkeypatch):
    """Not only providers built by name: one a user's code makes (``providers=[AwsProvider()]``) in a job
    that the terraform unit or ``spotguard rehearse`` started must see the same opt-ins."""
    from spotguard.notices.aws import AwsProvider
    from spotguard.notices.azure import AzureProvider
    from spotguard.notices.gcp import GcpProvider

    monkeypatch.setenv("SPOTGUARD_AWS_ALLOW_IMDSV1", "1")
    monkeypatch.setenv("SPOTGUARD_GCP_DEADLINE", "90")
    monkeypatch.setenv("SPOTGUARD_AZURE_ACK", "0")
    monkeypatch.setenv("SPOTGUARD_AZURE_STOP_EVENTS", "Preempt")
    url = "http://127.0.0.1:9"
    assert AwsProvider(url).allow_imdsv1 is True and AwsProvider(url, allow_imdsv1=False).allow_imdsv1 is False
    assert GcpProvider(url).deadline_seconds == 90 and GcpProvider(url, deadline_seconds=5).deadline_seconds == 5
    azure, given = AzureProvider(url), AzureProvider(url, ack=True, stop_events=["Terminate"])
    assert (azure.ack, azure.stop_events, given.ack, given.stop_events) == (False, {"Preempt"}, True, {"Terminate"})
    for name in ("SPOTGUARD_AWS_ALLOW_IMDSV1", "SPOTGUARD_GCP_DEADLINE", "SPOTGUARD_AZURE_ACK"):
        monkeypatch.delenv(name)
    monkeypatch.delenv("SPOTGUARD_AZURE_STOP_EVENTS")
    assert AwsProvider(url).allow_imdsv1 is False and GcpProvider(url).deadline_seconds == 30
    assert AzureProvider(url).ack is True and AzureProvider(url).stop_events == {
        "Preempt",
        "Terminate",
        "Reboot",
        "Redeploy",
    }


def test_every_spotguard_variable_is_named_in_one_module():
    """spotguard/_env.py names every ``SPOTGUARD_*`` variable and reads them (a bad value is a
    ``ConfigError`` naming it): a name spelled out elsewhere in the package is a read that bypasses it."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "spotguard"
    spelled = {
        str(path.relative_to(package)): found
        for path in package.rglob("*.py")
        if path.name != "_env.py" and (found := re.findall(r"[\"']SPOTGUARD_[A-Z0-9_]+[\"']", path.read_text()))
    }
    assert spelled == {}


def test_docs_environment_lists_exactly_the_variables_the_code_reads():
    """docs/environment.md is the one table of every ``SPOTGUARD_*`` variable: one that the code reads and
    the table lacks (or one the table names and no code reads) is a drift a user trips on."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    read = {
        m for path in (root / "spotguard").rglob("*.py") for m in re.findall(r"SPOTGUARD_[A-Z0-9_]+", path.read_text())
    }
    table = re.findall(r"^\| `(SPOTGUARD_[A-Z0-9_]+)` \|", (root / "docs" / "environment.md").read_text(), flags=re.M)
    assert len(table) == len(set(table))  # each once
    assert set(table) == read, (sorted(read - set(table)), sorted(set(table) - read))
