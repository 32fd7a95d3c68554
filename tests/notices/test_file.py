"""The notice file: appearance is a notice; JSON content refines it; bad content still stops."""

from __future__ import annotations

import datetime as dt
import json
import os
import time

import pytest

from spotguard.errors import ConfigError
from spotguard.notices import build
from spotguard.notices.file import FileProvider


def test_absent_file_is_no_notice(tmp_path):
    assert FileProvider(tmp_path / "notice").poll() is None


def test_empty_file_is_a_plain_notice(tmp_path):
    (tmp_path / "notice").touch()
    n = FileProvider(tmp_path / "notice").poll()
    assert n is not None and n.kind == "file" and n.deadline is None and not n.advisory


def test_json_content_sets_kind_and_deadline(tmp_path):
    (tmp_path / "notice").write_text(json.dumps({"kind": "terminate", "deadline": "2030-01-02T03:04:05Z"}))
    n = FileProvider(tmp_path / "notice").poll()
    assert n.kind == "terminate"
    assert n.deadline == dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def test_relative_deadline(tmp_path):
    (tmp_path / "notice").write_text('{"deadline_in": 30}')
    left = FileProvider(tmp_path / "notice").poll().seconds_left()
    assert 25 < left <= 30


@pytest.mark.parametrize("content", ["{oops", "[1, 2]", '{"deadline": "yesterday"}', '{"deadline_in": "x"}'])
def test_malformed_content_is_still_a_notice_with_a_warning(tmp_path, content, caplog):
    (tmp_path / "notice").write_text(content)
    n = FileProvider(tmp_path / "notice").poll()
    assert n is not None and n.kind == "file" and n.deadline is None
    assert "unusable content" in caplog.text


def test_same_file_gives_the_same_event_id(tmp_path):
    (tmp_path / "notice").write_text('{"kind": "terminate"}')
    p = FileProvider(tmp_path / "notice")
    assert p.poll().event_id == p.poll().event_id
    (tmp_path / "notice").write_text('{"kind": "stop"}')
    assert p.poll().kind == "stop"


def test_path_from_environment_and_missing_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_NOTICE_FILE", str(tmp_path / "n"))
    assert [p.name for p in build("auto")] == ["signal", "file"]
    assert FileProvider().path == tmp_path / "n"
    monkeypatch.delenv("SPOTGUARD_NOTICE_FILE")
    assert [p.name for p in build("auto")] == ["signal"]
    with pytest.raises(ConfigError, match="SPOTGUARD_NOTICE_FILE"):
        FileProvider()
    with pytest.raises(ConfigError, match="unknown notice provider"):
        build(["signal", "nope"])


def test_a_file_there_at_the_first_poll_is_a_notice_with_a_warning_naming_the_way_to_clear_it(tmp_path, caplog):
    """An earlier run's (or `simulate-preemption --file`'s) notice left behind stops every later run at its
    first step: still a notice (it may have come during the start), and said once."""
    flag = tmp_path / "notice"
    flag.write_text("")
    os.utime(flag, (time.time() - 3600, time.time() - 3600))
    p = FileProvider(flag)
    assert p.poll() is not None and p.poll() is not None
    warned = [r.getMessage() for r in caplog.records if "was there when this job started" in r.getMessage()]
    assert len(warned) == 1 and "(written 3600s ago)" in warned[0] and f"--clear --file {flag}" in warned[0]


def test_a_file_that_appears_after_the_first_poll_is_no_leftover(tmp_path, caplog):
    p = FileProvider(tmp_path / "notice")
    assert p.poll() is None
    (tmp_path / "notice").write_text("")
    assert p.poll() is not None and "was there when this job started" not in caplog.text
