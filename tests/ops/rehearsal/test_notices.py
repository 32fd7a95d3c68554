"""The rehearsal's notice senders, read by spotguard's own providers (over real HTTP for the mocks)."""

from __future__ import annotations

import time

import pytest

from spotguard.notices.azure import AzureProvider
from spotguard.notices.file import FileProvider
from spotguard.ops.rehearsal.notices import make_sender


def test_azure_sends_a_preempt_event_whose_approval_the_fleet_sees(monkeypatch):
    sender = make_sender("azure", 12.0, None)  # type: ignore[arg-type]
    try:
        for name, value in sender.env.items():
            monkeypatch.setenv(name, value)
        provider = AzureProvider(vm_name="spot-trainer-1")
        try:
            assert provider.poll() is None and sender.approvals() == 0
            sender.send(None)  # type: ignore[arg-type]
            notice = provider.poll()
            assert notice is not None and notice.kind == "preempt" and not notice.advisory
            assert 10.0 <= notice.seconds_left() <= 12.0  # NotBefore is the lead ahead (whole seconds)
            provider.acknowledge(notice)  # what the Guard does once the emergency checkpoint is committed
            assert sender.approvals() == 1
            sender.clear()  # the next machine starts without the event
            assert provider.poll() is None
        finally:
            provider.close()
    finally:
        sender.close()


def test_a_notice_file_states_the_deadline_the_fleet_kills_at(tmp_path):
    sender = make_sender("file", 20.0, tmp_path)
    sent = time.time()
    sender.send(None)  # type: ignore[arg-type]
    time.sleep(0.3)  # the job reads the file a polling interval later: the deadline does not move
    notice = FileProvider(tmp_path / "notice.json").poll()
    assert notice is not None and notice.deadline is not None
    assert notice.deadline.timestamp() == pytest.approx(sent + 20.0, abs=0.1)
    sender.clear()
    assert FileProvider(tmp_path / "notice.json").poll() is None
